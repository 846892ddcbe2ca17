"""Prometheus metrics, built on a registry passed in (tests use a fresh one each)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from policy.domain import Action, Source


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.decisions = Counter(
            "shopping_agent_decisions", "Decisions served, by action and source.", ["action", "source"], registry=registry
        )
        self.degraded = Counter(
            "shopping_agent_degraded_decisions",
            "Decisions the rule engine answered because inference could not (reason: overload, deadline, error).",
            ["reason"], registry=registry,
        )
        # Pre-create the label children so the request path only increments.
        self._decision_children = {
            (a, s): self.decisions.labels(action=a.key, source=s.name.lower()) for a in Action for s in Source
        }
        self._degraded_children = {r: self.degraded.labels(reason=r) for r in ("overload", "deadline", "error")}

    def decision(self, action: Action, source: Source) -> None:
        self._decision_children[(action, source)].inc()

    def degraded_by(self, reason: str) -> None:
        self._degraded_children[reason].inc()
