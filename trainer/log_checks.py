"""Sessions whose logged rows no server writes are left out of a run, counted and reported, not trained or judged on.

A server logs, for every decision, an action in 1..5, the served distribution (``served_probs``: finite, in [0, 1], summing to 1) and
the propensity of the action it served, which is that distribution's entry for the action (``policy.decision``), with
the shopper's hour of the day and page type, counts of at least 0, an embedding of numbers and behaviour buckets within
the count it logs (``shopper_rows``);
and for every outcome a finite value and coupon discount of at least 0, an order's discount at most its value
(``server.validation``). A row outside that comes
from a broken or hostile writer of the logs volume, and one was enough to stop every later run (a NaN propensity), to
make every update abort while the run still published (a zero or null one), to move the gate's estimate by its weight
(a propensity that is not the served probability it claims) or by its reward (an infinite or negative value). Such a
session is dropped whole, from the decisions and the outcomes alike, so no episode loses a step. So is a session past
the ``SessionLimits`` (orders totalling more than ``MAX_SESSION_ORDER_VALUE``, more than ``MAX_SESSION_DECISIONS``
decisions or ``MAX_SESSION_COMPLAINTS`` complaints): rows a server does write, from calls a caller of the port may make,
each within the servers' checks but many of them in one session.

What this cannot see: a writer that forges a consistent row (the served distribution and its propensity changed
together) or a plausible outcome. Only the logs' provenance can rule that out: who may write the volume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import MAX_OUTCOME_VALUE, N_ACTIONS, TIMESTAMP_MAX_S, TIMESTAMP_MIN_S, Outcome, PageType
from experience.sessions import dedupe_outcomes
from policy.features import FeatureSpec
from weights.bundle import MODEL_VERSION, MODEL_VERSION_RULE

log = logging.getLogger(__name__)

MAX_SESSION_ORDER_VALUE = MAX_OUTCOME_VALUE
"""What a session's orders may total before the session is left out (``TrainConfig.max_session_order_value``): the
servers' default ``--max-outcome-value``, the most one report may carry. Each ``ReportOutcome`` is capped, but a caller
who reaches the port could send three hundred orders of that cap for one session (each with its own ``outcome_id``), and
the objective sums them: 3·10⁸ on one session (a review, 2026-12-05). Set it with the servers' cap."""
MAX_SESSION_DECISIONS = 1_000
"""The decisions one session may hold before it is left out (``TrainConfig.max_session_decisions``). A caller of the port
can make one session as long as it likes; in one of 10,000 decisions (copies of an honest session's requests) the
gate's DR estimate went from 23 to 721 and with 100,000 to 7,479 while IPS stayed at 25, since each step adds its
own control-variate term (a review, 2026-12-05). The simulator's sessions hold at most 20."""


MAX_SESSION_COMPLAINTS = 10
"""The complaints one session may hold before it is left out (``TrainConfig.max_session_complaints``). Each costs the
objective ``complaint_cost``; a caller sent 1,000 complaints on each of 62 sessions that had been served one action,
in 28 s of calls, and ``cycle`` published the bundle that avoids it where the gate had refused it on the honest logs
(a review, 2026-12-05); 20,000 on one session put −200,000 on it. The simulator's sessions hold at most 3."""


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """What one session may hold before a run leaves it out: rows a server does write, from calls a client may make."""

    max_order_value: float = MAX_SESSION_ORDER_VALUE
    max_decisions: int = MAX_SESSION_DECISIONS
    max_complaints: int = MAX_SESSION_COMPLAINTS


DEFAULT_LIMITS = SessionLimits()


SUM_TOLERANCE = 1e-6  # a served distribution sums to 1 up to float64 rounding over five terms
PROPENSITY_TOLERANCE = 1e-9  # the propensity is the served probability itself (the same float64)


@dataclass(frozen=True, slots=True)
class Dropped:
    """What ``usable`` left out."""

    sessions: int
    decisions: int
    outcomes: int
    reasons: dict[str, int]
    """Rows by what was wrong with them (a row may count under two)."""

    def to_dict(self) -> dict[str, object]:
        return {"sessions": self.sessions, "decisions": self.decisions, "outcomes": self.outcomes, "reasons": self.reasons}


def ints(values: pa.ChunkedArray | pa.Array) -> npt.NDArray[np.int64]:
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)


def owners(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Per value of a list column whose rows hold ``lengths`` values (flattened, in row order), the row it is in."""
    return np.repeat(np.arange(len(lengths)), lengths)


def any_per_row(owner: npt.NDArray[np.int64], rows: int, flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """Per row of ``rows``, whether any of its values is flagged (``flags`` and ``owner``, from ``owners``: one per
    value)."""
    return np.bincount(owner, weights=flags, minlength=rows) > 0


class Lists:
    """A list column, flat: its values, each row's length, where each row starts, and whose each value is."""

    def __init__(self, column: pa.ChunkedArray, dtype: type) -> None:
        self.lengths = ints(pc.list_value_length(column).fill_null(0))
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.values: npt.NDArray[Any] = np.asarray(pc.list_flatten(column).to_numpy(zero_copy_only=False), dtype=dtype)
        self.owner = owners(self.lengths)

    def any(self, flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Per row, whether any of its values is flagged."""
        return any_per_row(self.owner, len(self.lengths), flags)

    def beside(self, other: Lists, rows: npt.NDArray[np.bool_]) -> npt.NDArray[Any]:
        """Per value of ``self``, ``other``'s value at the same row and place, in ``rows`` (whose lists in both are as
        long); zero (False) elsewhere."""
        at = np.arange(len(self.values)) - self.starts[self.owner] + other.starts[self.owner]
        mine = rows[self.owner] & (at >= 0) & (at < len(other.values))
        found = np.zeros(len(self.values), dtype=other.values.dtype)
        found[mine] = other.values[at[mine]]
        return found

    def at(self, index: npt.NDArray[np.int64], rows: npt.NDArray[np.bool_]) -> npt.NDArray[Any]:
        """Per row, its value at ``index`` where ``rows`` (which must have it), else the first value anywhere."""
        if not len(self.values):
            return np.zeros(len(index), dtype=self.values.dtype)
        return self.values[np.where(rows, self.starts + index, 0)]


def bad_decisions(decisions: pa.Table) -> dict[str, npt.NDArray[np.bool_]]:
    """Per reason, the decision rows no server writes."""
    n = decisions.num_rows
    propensity = np.asarray(decisions.column("propensity").to_numpy(zero_copy_only=False), dtype=np.float64)
    served_column = decisions.column("served_probs").combine_chunks()  # fixed-size lists of N_ACTIONS (the schema)
    slots = served_column.values.slice(served_column.offset * N_ACTIONS, n * N_ACTIONS)  # a null row's slots included
    served = np.asarray(slots.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(n, N_ACTIONS)
    present = ~np.asarray(served_column.is_null().to_numpy(zero_copy_only=False), dtype=np.bool_)
    actions = ints(pc.fill_null(decisions.column("action"), 0)) - 1
    valid_action = (actions >= 0) & (actions < N_ACTIONS)
    finite = present & np.isfinite(served).all(axis=1)
    with np.errstate(invalid="ignore"):
        distribution = finite & (served >= 0).all(axis=1) & (served <= 1).all(axis=1) & \
            (np.abs(served.sum(axis=1) - 1.0) <= SUM_TOLERANCE)
        in_range = np.isfinite(propensity) & (propensity > 0) & (propensity <= 1)
        claimed = served[np.arange(n), np.where(valid_action, actions, 0)]
        consistent = ~valid_action | (np.abs(propensity - claimed) <= PROPENSITY_TOLERANCE)
    return {"action outside 1..5": ~valid_action, "served_probs not a distribution": ~distribution,
            "propensity outside (0, 1]": ~in_range, "propensity not the served probability of the action": ~consistent,
            **shopper_rows(decisions), **unnamed_versions(decisions)}


def unnamed_versions(table: pa.Table) -> dict[str, npt.NDArray[np.bool_]]:
    """The rows whose ``model_version`` no server writes: a bundle's version (``weights.bundle.MODEL_VERSION``, at most
    200 characters) or ``""`` (no model: the rule engine). One session's 1.1 MB version went into the new bundle's
    manifest (the window's versions) and past its size limit: every ``train`` and ``cycle`` failed (a review,
    2026-12-07). Matched once per distinct version."""
    column = table.column("model_version")
    distinct = pc.unique(column)
    named = pa.array([v is not None and (v == "" or MODEL_VERSION.fullmatch(v) is not None) for v in distinct.to_pylist()],
                     type=pa.bool_())
    bad = pc.filter(distinct, pc.invert(named))
    rows = np.asarray(pc.is_in(column, value_set=bad, skip_nulls=False).to_numpy(zero_copy_only=False), dtype=np.bool_)
    return {f"model_version not a bundle's ({MODEL_VERSION_RULE}) or empty": rows}


def shopper_rows(table: pa.Table) -> dict[str, npt.NDArray[np.bool_]]:
    """Per reason, the rows of ``table`` (decisions or product records: both log the shopper) whose shopper no server
    logs: an hour outside 0..23 (99 stopped ``evaluate``; −5 was read as 19), a NaN in the item embedding (a server
    refuses a request with one; a row with one moved the product gate's estimate, and stopped ``evaluate``), a
    behaviour bucket outside the bucket count the row was logged with, an event time outside the years a request's
    Timestamp may carry (a server refuses others; one infinite time stopped ``train`` and ``evaluate`` on every run),
    or a server time outside them (no clock writes one; year 11476 stopped ``train`` and ``cycle``), a page type
    outside the five (9 stopped ``train``, ``evaluate`` and ``cycle`` on every run, naming no file), and a negative cart
    or behaviour count (a server refuses one; the replayed guardrails and rules would read it)."""
    hours, count = ints(table.column("hour")), ints(table.column("behavior_bucket_count"))
    pages = ints(table.column("page_type"))
    negative = (ints(table.column("cart_item_count")) < 0) | (ints(table.column("n_recent_behaviors")) < 0)
    buckets = Lists(table.column("behavior_bucket_indices"), np.int64)
    outside = buckets.any((buckets.values < 0) | (buckets.values >= count[buckets.owner]))
    return {"hour outside 0..23": (hours < 0) | (hours > 23), "item_embedding NaN": rows_with_nan(table.column("item_embedding")),
            "behavior_bucket_indices outside the logged bucket count": outside,
            f"page_type outside {min(PageType)}..{max(PageType)}": (pages < min(PageType)) | (pages > max(PageType)),
            "cart_item_count or n_recent_behaviors negative": negative,
            **not_times(table, "event_time_s", "time_s")}


def not_times(table: pa.Table, *columns: str) -> dict[str, npt.NDArray[np.bool_]]:
    """Per time column, the rows whose value is NaN, infinite or outside the range of a protobuf Timestamp (years
    1-9999, ``server.validation``)."""
    out = {}
    for column in columns:
        values = np.asarray(table.column(column).to_numpy(zero_copy_only=False), dtype=np.float64)
        with np.errstate(invalid="ignore"):
            out[f"{column} not a time of years 1-9999"] = ~((values >= TIMESTAMP_MIN_S) & (values <= TIMESTAMP_MAX_S))
    return out


def rows_with_nan(column: pa.ChunkedArray) -> npt.NDArray[np.bool_]:
    """Per row of a column of float16 lists (at any depth), whether one of its values is NaN: every exponent bit set and
    a mantissa (±inf is an older server's saturated value, read as ±65504). On the bits, a chunk at a time: converting
    the float16 costs far more, and these columns are most of a log's bytes."""
    found = np.zeros(len(column), dtype=np.bool_)
    first = 0
    for chunk in column.chunks:
        ends, values = [], chunk  # each list level's row ends, relative to its flattened values
        while isinstance(values, pa.ListArray | pa.LargeListArray):
            offsets = values.offsets.to_numpy(zero_copy_only=False)
            ends.append(offsets[1:] - offsets[0])
            values = values.flatten()
        at = np.flatnonzero((values.view(pa.uint16()).to_numpy(zero_copy_only=False) & 0x7FFF) > 0x7C00)
        for level in reversed(ends):
            at = np.searchsorted(level, at, side="right")
        found[first + at] = True
        first += len(chunk)
    return found


def bad_outcomes(outcomes: pa.Table, limits: SessionLimits = DEFAULT_LIMITS) -> dict[str, npt.NDArray[np.bool_]]:
    """Per reason, the outcome rows no server writes, and the orders or complaints of a session past ``limits`` (each
    report within the servers' checks, but many of them: ``MAX_SESSION_ORDER_VALUE``, ``MAX_SESSION_COMPLAINTS``)."""
    out = {}
    amounts = {}
    for column in ("value", "coupon_discount"):
        values = amounts[column] = np.asarray(outcomes.column(column).to_numpy(zero_copy_only=False), dtype=np.float64)
        with np.errstate(invalid="ignore"):
            out[f"{column} not a finite amount >= 0"] = ~(np.isfinite(values) & (values >= 0))
    out.update(not_times(outcomes, "event_time_s"))
    kinds = ints(outcomes.column("outcome"))
    out[f"outcome outside {min(Outcome)}..{max(Outcome)}"] = ~np.isin(kinds, [int(o) for o in Outcome])  # was ignored, uncounted
    order, complaint = kinds == int(Outcome.ORDER), kinds == int(Outcome.COMPLAINT)
    value = amounts["value"]
    with np.errstate(invalid="ignore"):
        out["coupon_discount above its order's value"] = order & (amounts["coupon_discount"] > value)
    distinct = np.zeros(outcomes.num_rows, dtype=np.bool_)
    distinct[dedupe_outcomes(outcomes)] = True  # (a resent report counts once, as in the objective)
    counted = distinct & order & np.isfinite(value) & (value >= 0)
    _, session = np.unique(outcomes.column("session_id").to_numpy(zero_copy_only=False), return_inverse=True)
    sessions = int(session.max(initial=-1)) + 1
    totals = np.bincount(session[counted], weights=value[counted], minlength=sessions)
    out[f"orders of a session totalling more than {limits.max_order_value:g}"] = order & (totals[session] > limits.max_order_value)
    complaints = np.bincount(session[distinct & complaint], minlength=sessions)
    out[f"complaints of a session past {limits.max_complaints}"] = complaint & (complaints[session] > limits.max_complaints)
    return out


def _sessions_of(table: pa.Table, found: dict[str, npt.NDArray[np.bool_]], reasons: dict[str, int]) -> pa.Array:
    """The distinct session ids of ``table``'s rows that ``found`` marks; each reason's row count added to ``reasons``."""
    rows = np.zeros(table.num_rows, dtype=np.bool_)
    for reason, mask in found.items():
        if mask.any():
            reasons[reason] = reasons.get(reason, 0) + int(mask.sum())
            rows |= mask
    return pc.unique(table.column("session_id").filter(pa.array(rows)))


def outside(values: pa.ChunkedArray | pa.Array, ids: pa.Array) -> pa.ChunkedArray | pa.Array:
    """Per value, whether it is none of ``ids`` (a filter that leaves those sessions out)."""
    return pc.invert(pc.is_in(values, value_set=ids))


def sessions_with_bad_outcomes(outcomes: pa.Table, limits: SessionLimits = DEFAULT_LIMITS) -> pa.Array:
    """The session ids of ``outcomes`` that hold a row no server writes, or orders or complaints past ``limits`` (the
    canary's look, which reads no decisions)."""
    return _sessions_of(outcomes, bad_outcomes(outcomes, limits), {})


def usable(decisions: pa.Table, outcomes: pa.Table, spec: FeatureSpec | None = None,
           limits: SessionLimits = DEFAULT_LIMITS) -> tuple[pa.Table, pa.Table, Dropped]:
    """``decisions`` and ``outcomes`` without the sessions that hold a row no server writes (module doc) or more than
    ``limits`` allow, or, with the ``spec`` of the bundle they are read for, a row it cannot rebuild a state from
    (``spec_rows``)."""
    return without_bad_sessions(decisions, {**bad_decisions(decisions), **(spec_rows(decisions, spec) if spec else {})},
                                outcomes, limits)


def long_sessions(decisions: pa.Table, max_decisions: int) -> npt.NDArray[np.bool_]:
    """Per decision row, whether its session holds more than ``max_decisions`` rows (``MAX_SESSION_DECISIONS``)."""
    _, session, counts = np.unique(decisions.column("session_id").to_numpy(zero_copy_only=False), return_inverse=True,
                                   return_counts=True)
    return np.asarray(counts[session] > max_decisions, dtype=np.bool_)


def spec_rows(table: pa.Table, spec: FeatureSpec) -> dict[str, npt.NDArray[np.bool_]]:
    """Per reason, the rows of ``table`` (decisions or product records) that a bundle of ``spec`` cannot rebuild a state
    from: an item embedding of another length, another bucket count, fewer behaviour buckets than its window reads.
    Logged by a server of another spec (the embedding model changed) or by no server: one such row stopped every run
    whose window held it, however many rows of the bundle's own spec were there."""
    lengths, count = ints(pc.list_value_length(table.column("item_embedding"))), ints(table.column("behavior_bucket_count"))
    held, recent = ints(pc.list_value_length(table.column("behavior_bucket_indices"))), ints(table.column("n_recent_behaviors"))
    return {f"item_embedding not the bundle's {spec.item_dim} values": lengths != spec.item_dim,
            f"behavior_bucket_count not the bundle's {spec.behavior_buckets}": count != spec.behavior_buckets,
            "behavior_bucket_indices fewer than the bundle's window reads": held < np.minimum(recent, spec.behavior_window)}


def without_bad_sessions(decisions: pa.Table, found: dict[str, npt.NDArray[np.bool_]], outcomes: pa.Table,
                         limits: SessionLimits = DEFAULT_LIMITS) -> tuple[pa.Table, pa.Table, Dropped]:
    """``decisions`` and ``outcomes`` without the sessions of the rows ``found`` marks (per reason), of the outcome rows
    ``bad_outcomes`` marks, and of more decisions than ``limits`` allow (``long_sessions``; product rows count as
    decisions); ``Dropped.decisions`` counts the rows of ``decisions`` left out, whatever kind they are."""
    found = {**found, f"decisions of a session past {limits.max_decisions}": long_sessions(decisions, limits.max_decisions)}
    reasons: dict[str, int] = {}
    ids = pc.unique(pa.concat_arrays([_sessions_of(decisions, found, reasons),
                                      _sessions_of(outcomes, bad_outcomes(outcomes, limits), reasons)]))
    if not len(ids):
        return decisions, outcomes, Dropped(0, 0, 0, {})
    kept_d = decisions.filter(outside(decisions.column("session_id"), ids))
    kept_o = outcomes.filter(outside(outcomes.column("session_id"), ids))
    dropped = Dropped(len(ids), decisions.num_rows - kept_d.num_rows, outcomes.num_rows - kept_o.num_rows, reasons)
    log.warning("sessions with log rows no server writes, or past the session limits, are left out of this run",
                extra={"fields": dropped.to_dict()})
    return kept_d, kept_o, dropped
