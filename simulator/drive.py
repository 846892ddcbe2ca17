"""Put the simulated shoppers in front of a decider and score what it served.

The loop is the same for every decider: each session shows a page, the decider answers, the
shopper reacts (``ShopperSession.respond``), the reactions are reported as outcomes, until
the shopper leaves. ``Trace`` keeps what happened (decisions and outcomes, in the log
schema's column names), and ``Trace.value`` scores it with the very code the trainer uses on
the logs: ``build_episodes`` (join + attribution rules + horizon) then ``session_returns`` /
``mean_return``. So the simulator's ``mean_return`` is the true value of the policy served,
in the units the trainer optimises and the offline estimators estimate.

With ``products`` (a ``ProductChooser``: ``by_model(ModelSet)`` serves ``RecommendProduct`` with the server's code),
every page also shows one product: the page's shelf (``ShopperSession.shelf``) goes to the chooser as the
``RecommendProduct`` request a frontend would send, the shopper reacts to the product chosen
(``ShopperSession.offer``: taken into the cart, a complaint), and those outcomes are reported against the product
decision's own id, before the page's action is served. ``run_logged`` then writes the ``products`` records too.

``run_in_process`` decides with the server's decision code (``ModelSet.run``: encode,
infer, guardrails, guard veto, sampled majority, fallback, exploration) on many sessions in
lock-step batches, with decision ids derived from (seed, session, step): the same seed and
bundle give the same decisions, bytes for bytes, in any batch size. ``run_logged``
also writes the same decision and outcome logs as the server (``ExperienceRecorder``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from core.domain import Action, Decision, DecisionRequest, EngagementReport, OutcomeReport, Source
from core.product import ProductDecision, ProductRequest
from experience.objective import BusinessObjective
from experience.recorder import ExperienceRecorder, RecorderOptions
from experience.returns import GAMMA, MeanReturn, mean_return, session_returns
from experience.sessions import EpisodeConfig, build_episodes
from policy.features import FeatureEncoder, context_of
from simulator.products import candidates
from simulator.world import OutcomeEvent, PageEngagement, ShopperSession, World


class BatchDecider(Protocol):
    """What ``ModelSet`` offers: decisions for a batch of requests with given decision ids, and its encoder."""

    encoder: FeatureEncoder  # the log records the encoder's buckets of the behaviour ids

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Any], decision_ids: Sequence[str]) -> list[Decision]: ...


class ProductDecider(Protocol):
    def decide_products(self, requests: Sequence[ProductRequest], hours: Sequence[int],
                        decision_ids: Sequence[str]) -> list[ProductDecision]: ...


ProductChooser = Callable[[Sequence[ShopperSession], Sequence[ProductRequest], Sequence[int], Sequence[str]],
                          Sequence[ProductDecision]]
"""(a round's sessions, each page's ``RecommendProduct`` request, hour feature and decision id) → one layered decision
each, in order. A server's chooser reads only the requests (``by_model``: one batch, as the server's micro-batch
decides it); a reference may read the sessions' hidden state."""

OneProductChooser = Callable[[ShopperSession, ProductRequest, int, str], ProductDecision]
"""A chooser that decides one page at a time (``one_at_a_time`` makes it a ``ProductChooser``)."""


def by_model(model: ProductDecider) -> ProductChooser:
    """The server's product decision (``ModelSet.decide_products``: the bundle's heads, or the rules without them)."""
    return lambda sessions, requests, hours, ids: model.decide_products(requests, hours, ids)


def one_at_a_time(chooser: OneProductChooser) -> ProductChooser:
    return lambda sessions, requests, hours, ids: [chooser(*page) for page in zip(sessions, requests, hours, ids, strict=True)]


def decision_id(seed: int, session: int, step: int) -> str:
    """The id of a simulated decision: fixed by (seed, session, step), so its sampling replays."""
    return hashlib.blake2b(f"sim:{seed}:{session}:{step}".encode(), digest_size=16).hexdigest()


def product_decision_id(seed: int, session: int, step: int) -> str:
    """The id of a page's product decision (its own: the layers' uniforms come from it)."""
    return hashlib.blake2b(f"sim-product:{seed}:{session}:{step}".encode(), digest_size=16).hexdigest()


def outcome_id(decision: str, k: int) -> str:
    return f"{decision}-o{k}"


def engagement_id(decision: str) -> str:
    return f"{decision}-e"


@dataclass
class Trace:
    """What the simulated sessions saw and did, column-wise (decision and outcome log columns)."""

    decision_ids: list[str] = field(default_factory=list)
    decision_sessions: list[str] = field(default_factory=list)
    decision_times: list[float] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    outcome_ids: list[str] = field(default_factory=list)
    outcome_decisions: list[str] = field(default_factory=list)
    outcome_sessions: list[str] = field(default_factory=list)
    outcomes: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    discounts: list[float] = field(default_factory=list)
    outcome_times: list[float] = field(default_factory=list)
    sessions_finished: int = 0
    engagements: int = 0
    products: int = 0
    product_sources: dict[str, int] = field(default_factory=dict)
    model_versions: set[str] = field(default_factory=set)
    logs_dropped: dict[str, int] = field(default_factory=dict)  # run_logged: records the recorder dropped, per kind

    def decided(self, session_id: str, decision_id: str, event_time_s: float, action: Action, source: Source) -> None:
        self.decision_ids.append(decision_id)
        self.decision_sessions.append(session_id)
        self.decision_times.append(event_time_s)
        self.actions.append(int(action))
        self.sources.append(int(source))

    def reported(self, report: OutcomeReport) -> None:
        self.outcome_ids.append(report.outcome_id)
        self.outcome_decisions.append(report.decision_id)
        self.outcome_sessions.append(report.session_id)
        self.outcomes.append(int(report.outcome))
        self.values.append(report.value)
        self.discounts.append(report.coupon_discount)
        self.outcome_times.append(report.event_time_s)

    def tables(self) -> tuple[pa.Table, pa.Table]:
        decisions = pa.table({
            "decision_id": pa.array(self.decision_ids, pa.string()),
            "session_id": pa.array(self.decision_sessions, pa.string()),
            "event_time_s": pa.array(self.decision_times, pa.float64()),
            "action": pa.array(self.actions, pa.int8()),
        })
        outcomes = pa.table({
            "outcome_id": pa.array(self.outcome_ids, pa.string()),
            "decision_id": pa.array(self.outcome_decisions, pa.string()),
            "session_id": pa.array(self.outcome_sessions, pa.string()),
            "outcome": pa.array(self.outcomes, pa.int8()),
            "value": pa.array(self.values, pa.float64()),
            "coupon_discount": pa.array(self.discounts, pa.float64()),
            "event_time_s": pa.array(self.outcome_times, pa.float64()),
            "received_s": pa.array(self.outcome_times, pa.float64()),
        })
        return decisions, outcomes

    def value(self, config: EpisodeConfig | None = None, gamma: float = GAMMA) -> MeanReturn:
        """mean_return of the sessions traced, scored exactly as the trainer scores logs."""
        episodes = build_episodes(*self.tables(), config)
        return mean_return(session_returns(episodes, gamma=gamma))

    def business(self, objective: BusinessObjective | None = None) -> dict[str, MeanReturn]:
        """What the shop earned from the sessions traced: net GMV, complaints, the business objective (per session)."""
        decisions, outcomes = self.tables()
        sessions = list(dict.fromkeys(decisions.column("session_id").to_pylist()))
        return (objective or BusinessObjective()).summary(sessions, outcomes)

    def summary(self, config: EpisodeConfig | None = None) -> dict[str, Any]:
        value = self.value(config)
        business = self.business() if self.decision_ids else {}
        sources: dict[str, int] = {}
        for s in self.sources:
            key = Source(s).name.lower()
            sources[key] = sources.get(key, 0) + 1
        return {
            "sessions": value.n,
            "sessions_finished": self.sessions_finished,
            "decisions": len(self.decision_ids),
            "outcomes": len(self.outcome_ids),
            "engagements": self.engagements,
            "mean_return": value.mean,
            "ci_low": value.low,
            "ci_high": value.high,
            "stderr": value.stderr,
            **{f"{name}_per_session": {"mean": m.mean, "ci_low": m.low, "ci_high": m.high} for name, m in business.items()},
            "sources": dict(sorted(sources.items())),
            **({"products": self.products, "product_sources": dict(sorted(self.product_sources.items()))} if self.products else {}),
            "model_versions": sorted(self.model_versions),
        }


def reports_for(session: ShopperSession, decision: str, events: Iterable[OutcomeEvent]) -> list[OutcomeReport]:
    return [OutcomeReport(decision, session.session_id, outcome_id(decision, k), e.outcome, e.value, e.coupon_discount,
                          e.event_time_s) for k, e in enumerate(events)]


def engagement_report_for(session: ShopperSession, decision: str, page: PageEngagement) -> EngagementReport:
    return EngagementReport(decision, session.session_id, engagement_id(decision), page.dwell_s, page.scroll_depth, page.bounced,
                            page.event_time_s)


def offer_products(world: World, pages: Sequence[tuple[int, int, ShopperSession, DecisionRequest, int]],
                   products: ProductChooser, recorder: ExperienceRecorder | None, spec: Any, trace: Trace) -> None:
    """A round's products, one for each of ``pages`` (session index, step, session, its request, hour): each page's shelf
    as a request, the chooser's decisions for all of them at once, each shopper's reaction, all reported/logged in page
    order. Every session draws from its own streams, so deciding a round together changes no session's dice."""
    if not pages:
        return
    requests, ids = [], []
    for index, step, session, request, _ in pages:
        categories, bands = candidates(world.catalogue, session.shelf())
        requests.append(ProductRequest(request, categories, bands, session.visit_count))
        ids.append(product_decision_id(world.seed, index, step))
    decisions = products([p[2] for p in pages], requests, [p[4] for p in pages], ids)
    if len(decisions) != len(pages):
        raise RuntimeError(f"the product chooser returned {len(decisions)} decisions for {len(pages)} pages")
    for (_, _, session, _, hour), product_request, did, decision in zip(pages, requests, ids, decisions, strict=True):
        trace.products += 1
        for _, choice in decision.choices():
            key = choice.source.name.lower()
            trace.product_sources[key] = trace.product_sources.get(key, 0) + 1
        if recorder is not None:
            recorder.product(product_request, hour, decision, did, spec)
        for report in reports_for(session, did, session.offer(decision.category.index, decision.sku.index,
                                                              decision.price_band.index)):
            trace.reported(report)
            if recorder is not None:
                recorder.outcome(report)


def run_in_process(world: World, model: BatchDecider, sessions: range, tz: tzinfo, recorder: ExperienceRecorder | None = None,
                   batch: int = 256, trace: Trace | None = None, on_finished: Callable[[int], None] | None = None,
                   products: ProductChooser | None = None) -> Trace:
    """Run ``sessions`` of ``world`` against ``model``, ``batch`` sessions in lock-step; ``on_finished(k)`` after each
    round in which ``k`` sessions finished (progress); with ``products``, each page also offers a product (module doc)."""
    trace = trace if trace is not None else Trace()
    pending = iter(sessions)
    active: list[tuple[int, ShopperSession]] = []
    steps: dict[int, int] = {}
    while True:
        while len(active) < batch:
            index = next(pending, None)
            if index is None:
                break
            active.append((index, world.session(index)))
            steps[index] = 0
        if not active:
            return trace
        live: list[tuple[int, ShopperSession, DecisionRequest]] = []
        for index, session in active:
            page = session.page()
            if page is not None:  # (None only for a session that ended without telling: finished all the same)
                live.append((index, session, session.request(page, request_id=f"sim-{index}-{steps[index]}")))
        ids = [decision_id(world.seed, index, steps[index]) for index, _, _ in live]
        requests = [req for _, _, req in live]
        contexts = [context_of(req, tz) for req in requests]
        if products is not None:
            offer_products(world, [(index, steps[index], session, req, ctx.hour) for (index, session, req), ctx
                                   in zip(live, contexts, strict=True)], products, recorder, model.encoder.spec, trace)
        decisions = model.run(requests, contexts, ids) if live else []
        for (index, session, req), ctx, did, decision in zip(live, contexts, ids, decisions, strict=True):
            trace.model_versions.add(decision.model_version)
            trace.decided(session.session_id, did, req.event_time_s, decision.action, decision.source)
            if recorder is not None:
                recorder.decision(req, ctx.hour, decision, did, model.encoder.spec)
            for report in reports_for(session, did, session.respond(decision.action)):
                trace.reported(report)
                if recorder is not None:
                    recorder.outcome(report)
            engaged = session.engagement()
            if engaged is not None:
                trace.engagements += 1
                if recorder is not None:
                    recorder.engagement(engagement_report_for(session, did, engaged))
            steps[index] += 1
        if recorder is not None:
            recorder.flush()  # in this thread: the queue never fills however fast we go
        done = sum(1 for _, s, _ in live if s.ended) + len(active) - len(live)
        trace.sessions_finished += done
        if on_finished is not None:
            on_finished(done)
        active = [(i, s) for i, s, _ in live if not s.ended]


CRON_INTERVAL_S = 7200.0
"""The CronJob's interval (``k8s/base/cronjob.yaml``: every second hour): what separates two simulated cycles' logs."""


def cycle_time(first_s: float, cycle: int) -> float:
    """The fixed server time of every record simulated cycle ``cycle`` (from 0) logs: ``first_s``, then one CronJob
    interval later a cycle, never the wall clock. A trained version is named by its logs' newest time
    (``trainer.train``), and a canary's sessions are a keyed hash of that name (``weights.canary``), so a fixed clock
    makes a loop of cycles a function of its code, world and config. One instant a cycle: a ``window_hours`` of a whole
    number of intervals takes the cycle that far back whole (``>=`` the newest time less the hours), where a server's
    spread-out times would take part of it; give 1.9 hours for the last cycle alone, not 2."""
    return first_s + cycle * CRON_INTERVAL_S


def run_logged(world: World, model: BatchDecider, sessions: range, tz: tzinfo, root: Path, salt: bytes, *,
               clock: Callable[[], float] = time.time, batch: int = 256,
               on_finished: Callable[[int], None] | None = None, products: ProductChooser | None = None) -> tuple[Trace, dict[str, int]]:
    """``run_in_process`` writing the server's decision and outcome logs under ``root``; returns the trace and
    the records written per kind. The recorder is flushed in this thread after each batch, so its queue
    only needs room for one batch's decisions, their outcomes and engagement reports; ``close`` finalises the segments."""
    recorder = ExperienceRecorder(root, salt, RecorderOptions(max_queue=max(8192, 32 * batch)), clock=clock)
    try:
        trace = run_in_process(world, model, sessions, tz, recorder, batch=batch, on_finished=on_finished, products=products)
    finally:
        recorder.close()
    trace.logs_dropped = {kind: n for kind, n in recorder.dropped.items() if n}
    return trace, dict(recorder.written)
