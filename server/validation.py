"""Request validation: a wire message becomes a ``DecisionRequest`` or an ``InvalidRequest``.

Every error names the field (``item_embedding[12]``, ``recent_behavior_ids``) and says
what was expected; ``server.errors`` maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.domain import (
    LOGGED_COUNT_MAX,
    LOGGED_EMBEDDING_MAX,
    MAX_OUTCOME_VALUE,
    TIMESTAMP_MAX_S,
    TIMESTAMP_MIN_S,
    DecisionRequest,
    EngagementReport,
    Outcome,
    OutcomeReport,
    PageType,
)
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.wire_view import float32_of

_PAGE_TYPES = {int(p) for p in PageType}
_OUTCOMES = {int(o) for o in Outcome}
_SCREEN = np.float32(2.0**30)  # embedding_of's screen
MAX_DWELL_S = 86_400.0  # one page view visible for a whole day is a broken timer, not a shopper


class InvalidRequest(ValueError):
    """A malformed request; ``field`` is the offending field's path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Limits:
    item_dim: int
    max_recent_behavior_ids: int
    max_id_length: int
    max_outcome_value: float = MAX_OUTCOME_VALUE  # an order's value and a coupon's discount: what training may be told


def required_id(value: str, name: str, limits: Limits) -> str:
    if not value:
        raise InvalidRequest(name, "required, must not be empty")
    if len(value) > limits.max_id_length:
        raise InvalidRequest(name, f"longer than {limits.max_id_length} characters")
    return value


def _event_time(msg: pb.RecommendActionRequest | pb.ReportOutcomeRequest | pb.ReportEngagementRequest, now_s: float) -> float:
    if not msg.HasField("event_time"):
        return now_s
    ts = msg.event_time
    if not TIMESTAMP_MIN_S <= ts.seconds <= TIMESTAMP_MAX_S or not 0 <= ts.nanos < 1_000_000_000:
        raise InvalidRequest("event_time", "outside the range of a protobuf Timestamp")
    t = ts.seconds + ts.nanos * 1e-9  # a double holds about 30 µs at year 9999: the sum may round up to the next second
    return t if t < ts.seconds + 1 else math.nextafter(ts.seconds + 1.0, -math.inf)  # (year 10000 at the last one)


def _amount(value: float, name: str, limit: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(name, f"must be a finite amount >= 0, got {value}")
    if value > limit:
        raise InvalidRequest(name, f"must be at most {limit:g} (the server's max_outcome_value), got {value!r}")
    return value


def parse_outcome(msg: pb.ReportOutcomeRequest, limits: Limits, now_s: float) -> OutcomeReport:
    """Check every field of a ReportOutcomeRequest; ``now_s`` stands in for a missing event_time."""
    decision_id = required_id(msg.decision_id, "decision_id", limits)
    session_id = required_id(msg.session_id, "session_id", limits)
    outcome_id = required_id(msg.outcome_id, "outcome_id", limits)
    if msg.outcome not in _OUTCOMES:
        raise InvalidRequest("outcome", f"unknown value {msg.outcome}" if msg.outcome else "required (OUTCOME_UNSPECIFIED)")
    value = _amount(msg.value, "value", limits.max_outcome_value)
    discount = _amount(msg.coupon_discount, "coupon_discount", limits.max_outcome_value)
    if msg.outcome == pb.OUTCOME_ORDER and discount > value:  # the objective counts an order as value − discount
        raise InvalidRequest("coupon_discount", f"an order's discount must be at most its value ({value!r}), got {discount!r}")
    return OutcomeReport(
        decision_id=decision_id,
        session_id=session_id,
        outcome_id=outcome_id,
        outcome=Outcome(msg.outcome),
        value=value,
        coupon_discount=discount,
        event_time_s=_event_time(msg, now_s),
    )


def parse_engagement(msg: pb.ReportEngagementRequest, limits: Limits, now_s: float) -> EngagementReport:
    """Check every field of a ReportEngagementRequest; ``now_s`` stands in for a missing event_time.

    Each signal is optional (presence, not a zero default, says whether it was measured); a report
    that carries none of them says nothing and is refused.
    """
    decision_id = required_id(msg.decision_id, "decision_id", limits)
    session_id = required_id(msg.session_id, "session_id", limits)
    engagement_id = required_id(msg.engagement_id, "engagement_id", limits)
    dwell = scroll = None
    if msg.HasField("dwell_seconds"):
        dwell = msg.dwell_seconds
        if not (math.isfinite(dwell) and 0.0 <= dwell <= MAX_DWELL_S):
            raise InvalidRequest("dwell_seconds", f"must be a finite number of seconds in [0, {MAX_DWELL_S:g}], got {dwell}")
    if msg.HasField("scroll_depth"):
        scroll = msg.scroll_depth
        if not (math.isfinite(scroll) and 0.0 <= scroll <= 1.0):
            raise InvalidRequest("scroll_depth", f"must be a finite fraction in [0, 1], got {scroll}")
    bounced = msg.bounced if msg.HasField("bounced") else None
    if dwell is None and scroll is None and bounced is None:
        raise InvalidRequest("dwell_seconds, scroll_depth, bounced", "at least one is required")
    return EngagementReport(decision_id=decision_id, session_id=session_id, engagement_id=engagement_id, dwell_s=dwell,
                            scroll_depth=scroll, bounced=bounced, event_time_s=_event_time(msg, now_s))


def embedding_of(container: Sequence[float], name: str, item_dim: int, raw: bytes = b"") -> npt.NDArray[np.float32]:
    """A repeated float field as float32: exactly ``item_dim`` finite values, none beyond what the decision log's float16
    holds (``LOGGED_EMBEDDING_MAX``). ``raw``: the field in the request's wire view (``server.wire_view``), read instead
    of the container when it holds the whole field."""
    if len(container) != item_dim:
        raise InvalidRequest(name, f"expected exactly {item_dim} values, got {len(container)}")
    embedding = float32_of(container, raw)
    # One dot product screens both checks: NaN or inf when a value is, and at most 2^30 only when every value is within
    # ±32,768, half the bound (so rounding cannot let a value past it); a vector it stops is looked at value by value.
    # vdot, unlike @ and np.dot, raises no overflow warning for such a vector (an errstate around @ cost 0.4 µs more;
    # the suite turns warnings into errors, so a numpy that began to warn here would fail test_bad_input).
    if not np.vdot(embedding, embedding) <= _SCREEN:
        finite = np.isfinite(embedding)
        if not finite.all():
            bad = int(np.argmin(finite))
            raise InvalidRequest(f"{name}[{bad}]", f"must be finite, got {embedding[bad]}")
        too_large = np.abs(embedding) > LOGGED_EMBEDDING_MAX
        if too_large.any():
            bad = int(np.argmax(too_large))
            raise InvalidRequest(f"{name}[{bad}]", f"must be within ±{LOGGED_EMBEDDING_MAX:g} (the decision log stores "
                                 f"float16), got {embedding[bad]}")
    return embedding


def count_of(value: int, name: str) -> int:
    """A ``uint32`` count the decision log stores as int32."""
    if value > LOGGED_COUNT_MAX:
        raise InvalidRequest(name, f"at most {LOGGED_COUNT_MAX}, got {value}")
    return value


def parse_request(msg: pb.RecommendActionRequest, limits: Limits, now_s: float, view: Any = None) -> DecisionRequest:
    """Check every field of a RecommendActionRequest; ``now_s`` stands in for a missing event_time. ``view``: the same
    bytes parsed as its wire view (``server.wire_view``), whose embedding bytes spare a Python float per value."""
    if len(msg.request_id) > limits.max_id_length:
        raise InvalidRequest("request_id", f"longer than {limits.max_id_length} characters")
    user_id = required_id(msg.user_id, "user_id", limits)
    session_id = required_id(msg.session_id, "session_id", limits)
    item_id = required_id(msg.item_id, "item_id", limits)

    embedding = embedding_of(msg.item_embedding, "item_embedding", limits.item_dim,
                             view.item_embedding if view is not None else b"")

    ids = tuple(msg.recent_behavior_ids)
    if len(ids) > limits.max_recent_behavior_ids:
        raise InvalidRequest("recent_behavior_ids", f"at most {limits.max_recent_behavior_ids} ids allowed, got {len(ids)}")
    for i, behavior_id in enumerate(ids):
        if not behavior_id:
            raise InvalidRequest(f"recent_behavior_ids[{i}]", "must not be empty")
        if len(behavior_id) > limits.max_id_length:
            raise InvalidRequest(f"recent_behavior_ids[{i}]", f"longer than {limits.max_id_length} characters")

    if msg.page_type not in _PAGE_TYPES:
        raise InvalidRequest("page_type", f"unknown value {msg.page_type}")

    event_time_s = _event_time(msg, now_s)
    return DecisionRequest(
        user_id=user_id,
        session_id=session_id,
        item_id=item_id,
        item_embedding=embedding,
        recent_behavior_ids=ids,
        page_type=PageType(msg.page_type),
        event_time_s=event_time_s,
        cart_item_count=count_of(msg.cart_item_count, "cart_item_count"),
        request_id=msg.request_id,
    )
