"""Domain types shared by the policy, the guard and the server: actions, pages, requests, results.

Action and page numbers equal the proto enum numbers, so the server converts with a plain
``int()``. Internally actions are indexed 0..4 (``action.index``) in the order of ``ACTIONS``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class Action(enum.IntEnum):
    ADD_TO_CART = 1
    VIEW_DETAIL = 2
    APPLY_COUPON = 3
    SHARE_SOCIAL = 4
    EXIT = 5

    @property
    def index(self) -> int:
        """Position in ``ACTIONS`` and in every per-action vector."""
        return self.value - 1

    @property
    def key(self) -> str:
        """The lower-case name used in bundles and rules (``add_to_cart``)."""
        return self.name.lower()

    @classmethod
    def from_key(cls, key: str) -> Action:
        try:
            return cls[key.upper()]
        except KeyError:
            raise ValueError(f"unknown action {key!r}; expected one of {[a.key for a in cls]}") from None


ACTIONS: tuple[Action, ...] = tuple(Action)
N_ACTIONS = len(ACTIONS)


class PageType(enum.IntEnum):
    UNSPECIFIED = 0
    SEARCH = 1
    RECOMMEND = 2
    DETAIL = 3
    CART = 4

    @property
    def key(self) -> str:
        return self.name.lower()


class Source(enum.IntEnum):
    """Which part of the procedure produced the served action (proto ``DecisionSource``)."""

    POLICY = 1
    FALLBACK_LOW_CONSENSUS = 2
    FALLBACK_GUARD = 3
    FALLBACK_NO_MODEL = 4
    FALLBACK_DEGRADED = 5
    EXPLORATION = 6


class Outcome(enum.IntEnum):
    """What the frontend observed after a decision (proto ``Outcome``, same numbers)."""

    ADD_TO_CART = 1
    ORDER = 2
    COUPON_USED = 3
    SHARE = 4
    EXIT = 5
    COMPLAINT = 6

    @property
    def key(self) -> str:
        return self.name.lower()

    @classmethod
    def from_key(cls, key: str) -> Outcome:
        try:
            return cls[key.upper()]
        except KeyError:
            raise ValueError(f"unknown outcome {key!r}; expected one of {[o.key for o in cls]}") from None


# The per-request records below are plain slotted dataclasses, not frozen ones: a frozen
# dataclass's __init__ costs about 6x more, and these are built several times per request.
# Treat them as immutable all the same.


@dataclass(slots=True)
class Context:
    """The request features that guardrail and fallback rules can look at."""

    page_type: PageType
    cart_item_count: int
    hour: int
    n_recent_behaviors: int


# What the decision log can hold, and so what a request may carry (the server refuses more, naming the field): the
# log stores embeddings as float16, whose largest finite value this is (beyond it a logged state would be inf, which
# no trainer can rebuild), and counts (``cart_item_count``, ``visit_count``) as int32.
LOGGED_EMBEDDING_MAX = 65504.0
LOGGED_COUNT_MAX = 2**31 - 1
MAX_OUTCOME_VALUE = 1_000_000.0  # the servers' default cap on a ReportOutcome's value and coupon_discount
# A protobuf Timestamp's range, 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z: the event times a request may carry, and
# the times the compactor can place in an hour.
TIMESTAMP_MIN_S = -62_135_596_800
TIMESTAMP_MAX_S = 253_402_300_799


@dataclass(slots=True)
class DecisionRequest:
    """A validated request, ready to encode. ``item_embedding`` is float32 and finite."""

    user_id: str
    session_id: str
    item_id: str
    item_embedding: npt.NDArray[np.float32]
    recent_behavior_ids: tuple[str, ...]
    page_type: PageType
    event_time_s: float
    cart_item_count: int
    request_id: str = ""


@dataclass(slots=True)
class Decision:
    """What the decision procedure served, and with which probability.

    ``served_probs`` is the probability of every action under the whole procedure
    (guardrails, veto, sampled majority, fallback, exploration); ``propensity`` is its
    entry for ``action``. ``policy_probs`` are after guardrails, before the veto.
    """

    action: Action
    source: Source
    propensity: float
    votes: int
    samples: int
    served_probs: FloatArray
    policy_probs: FloatArray
    allow_probs: FloatArray
    blocked: npt.NDArray[np.bool_]
    model_version: str
    rule: str = ""
    counts: tuple[int, ...] = field(default=())
    vetoed: tuple[bool, ...] = field(default=())  # per action: the Action Guard vetoed it (a permitted action)
    guardrail_hits: tuple[str, ...] = field(default=())  # guardrail request rules that fired


@dataclass(slots=True)
class OutcomeReport:
    """A validated ReportOutcome: what happened after ``decision_id`` (which may not be logged yet)."""

    decision_id: str
    session_id: str
    outcome_id: str
    outcome: Outcome
    value: float
    coupon_discount: float
    event_time_s: float


@dataclass(slots=True)
class EngagementReport:
    """A validated ReportEngagement: how the shopper engaged with the page ``decision_id`` was served on.

    Each signal is ``None`` when the frontend did not measure it; at least one is present.
    """

    decision_id: str
    session_id: str
    engagement_id: str
    dwell_s: float | None
    """Active (visible, foreground) seconds on the page."""
    scroll_depth: float | None
    """0 (no scroll) to 1 (the end of the page)."""
    bounced: bool | None
    """Left within a few seconds, or went straight back."""
    event_time_s: float
