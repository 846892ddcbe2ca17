"""Which sessions a canary bundle serves: a keyed hash of the session id, the same on every replica.

A canary is a candidate the offline gate could not certify, served on a small share of the
sessions next to the active bundle so that the next trainer run can compare the two on what
shoppers really did (``trainer.canary``). Its share is in its own manifest (``canary.fraction``,
written by the trainer that started it) and capped by each server's ``max_canary_fraction``.

A session is the canary's when ``blake2b(session_id, key=canary model version)`` read as a
64-bit number falls below ``fraction · 2⁶⁴``: every replica (and the simulator) draws the same
sessions without sharing a secret, a whole session stays on one bundle, and each canary draws
a fresh set of shoppers (so no shopper is always the guinea pig). A caller who controls its
session ids and knows the canary's version can choose its side; the judge only compares the
two sides' objective, so such a caller can skew a verdict only by the sessions it sends.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.domain import Decision, DecisionRequest

_SPAN = 1 << 64
MAX_FRACTION = 0.5
"""A canary serves at most half of the sessions: past that it is the bundle served, not a canary."""


def fraction_of(manifest: Mapping[str, Any]) -> float:
    """The share of sessions the bundle asks for as a canary (``canary.fraction``); 0.0 when it asks for none.

    Raises ``ValueError`` naming the field for a value that is not a number in [0, ``MAX_FRACTION``].
    """
    section = manifest.get("canary")
    if section is None:
        return 0.0
    value = section.get("fraction") if isinstance(section, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= MAX_FRACTION:
        raise ValueError(f"canary.fraction: expected a number in [0, {MAX_FRACTION}], got {value!r}")
    return float(value)


def requested_fraction(manifest: Mapping[str, Any]) -> float:
    """The share a canary's manifest asks for; ``ValueError`` naming ``canary.fraction`` unless it is in (0, ``MAX_FRACTION``]."""
    fraction = fraction_of(manifest)
    if fraction <= 0.0:
        raise ValueError("canary.fraction: a canary must ask for a share of the sessions above 0")
    return fraction


def takes(version: str, session_id: str, fraction: float) -> bool:
    """Whether the canary ``version`` serves ``session_id`` at ``fraction`` of the sessions."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(session_id.encode(), key=version.encode()[:64], digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * _SPAN


class Served(Protocol):
    version: str
    item_dim: int


@dataclass(frozen=True, slots=True)
class CanaryRoute:
    """A loaded canary and the share of sessions it serves (already capped)."""

    model: Any  # a ModelSet; typed loosely so the server and the simulator share this
    fraction: float

    def takes(self, session_id: str) -> bool:
        return takes(self.model.version, session_id, self.fraction)

    def serves_beside(self, current: Served) -> bool:
        """Whether it answers any session beside ``current``: not when it is the active version, nor when it cannot read
        the active one's requests."""
        return bool(self.model.item_dim == current.item_dim and self.model.version != current.version)

    def choose(self, current: Served, session_id: str) -> Any:
        """The model set that answers ``session_id``: the canary's share, unless it cannot read the active one's requests."""
        if self.serves_beside(current) and self.takes(session_id):
            return self.model
        return current


class BatchModel(Protocol):
    version: str
    item_dim: int
    encoder: Any

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Any], decision_ids: Sequence[str]) -> list[Decision]: ...


class Routed:
    """The active bundle and a canary as one decider, for the simulator: each request goes to its session's side.

    The server routes per request before batching (``server.servicer``); this is the same choice
    for ``simulator.drive``, which runs whole batches through one decider.
    """

    def __init__(self, current: BatchModel, route: CanaryRoute | None) -> None:
        self.current, self.route = current, route
        self.encoder = current.encoder  # the recorder logs the behaviour buckets by the active bundle's spec

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Any], decision_ids: Sequence[str]) -> list[Decision]:
        route = self.route
        if route is None:
            return self.current.run(requests, contexts, decision_ids)
        sides = [route.choose(self.current, r.session_id) is not self.current for r in requests]
        out: list[Decision | None] = [None] * len(requests)
        for model, side in ((self.current, False), (route.model, True)):
            rows = [i for i, s in enumerate(sides) if s is side]
            if rows:
                got = model.run([requests[i] for i in rows], [contexts[i] for i in rows], [decision_ids[i] for i in rows])
                for i, decision in zip(rows, got, strict=True):
                    out[i] = decision
        return [d for d in out if d is not None]
