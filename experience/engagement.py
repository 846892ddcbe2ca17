"""Confidence weights from engagement signals: how much to trust a step's reward, from what the shopper did on its page.

The frontend reports, per decision, the page's active dwell time ``d`` (seconds), its scroll
depth ``s`` (0–1) and whether the shopper bounced ``b`` (``ReportEngagement``; the
``engagements`` log kind). A step's weight is, over the signals its report carries::

    w = clip(1 + α_d · (min(d / d_ref, 1) − ½) + α_s · (s − ½) − α_b · [b], w_low, w_high)

and ``w = 1`` for a step without a report (a signal left unmeasured adds nothing). The
defaults, ``α_d = α_s = ½``, ``d_ref = 30 s``, ``α_b = ½``, ``[w_low, w_high] = [¼, 1½]``:

- a page of average engagement (half the reference dwell, half-way down, no bounce) weighs 1,
  as a page nobody measured: reporting signals does not by itself rescale what a policy earns;
- full engagement (``d ≥ d_ref``, ``s = 1``, no bounce) weighs 1 + ¼ + ¼ = 1½, the upper
  bound: no report can make a step's reward count more than one and a half times;
- a bounce is the strongest single signal (−½: a shopper who went straight back did not
  act on that page); nothing at all (``d = 0``, ``s = 0``, bounced) gives 0, clipped to ¼:
  an order is money the shop received whatever the page's signals said, so a weight
  discounts a step's credit, never erases it;
- 30 s is about the median page view of the simulator (40 s) and of the product pages the
  reference design measured: past it, a longer dwell says nothing more.

The weights multiply each step's attributed reward *before* the Monte Carlo returns
(``trainer.data``), as the reference design does. They are a training aid only: the gate
estimates the business objective from the unweighted outcomes (``experience.objective``), so
a weighting cannot make a bundle look better than the orders it brought in.

The join (``step_weights``): reports are de-duplicated by session and ``engagement_id`` (the
first received copy, ties broken by every other column, as outcomes are); a report counts for
the step whose ``decision_id`` and session it names, when its event time is at or after that
decision's and within the session's horizon; of several distinct reports for one decision,
each signal takes its latest measured value (by event time, then arrival), so a later report
that carries only a bounce does not erase an earlier dwell and scroll. A report naming a
decision that is not a step of the logs read (never logged, another session's, or cut by the
horizon), or timed outside that range, is left out and counted in ``EngagementJoin``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import FloatArray
from experience.attribution import ConfigError, IntArray, config_object
from experience.sessions import Episodes, first_received

ENGAGEMENT_COLUMNS = ("engagement_id", "decision_id", "session_id", "dwell_s", "scroll_depth", "bounced", "event_time_s",
                      "received_s")
_KEYS = ("dwell", "dwell_ref_s", "scroll", "bounce", "low", "high")


def _finite(value: float) -> bool:
    """Whether ``value`` is a finite float, or an integer a float can hold (``math.isfinite(10**400)`` raises)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True, slots=True)
class EngagementWeights:
    """The weight function's parameters (the module doc has the formula and the defaults' reasons)."""

    dwell: float = 0.5
    """α_d: weight added at a dwell of ``dwell_ref_s`` or more, relative to half of it (−α_d/2 at 0 s)."""
    dwell_ref_s: float = 30.0
    """d_ref: the dwell in seconds past which a longer one says nothing more."""
    scroll: float = 0.5
    """α_s: weight per unit of scroll depth, centred at half-way."""
    bounce: float = 0.5
    """α_b: weight taken off for a bounce."""
    low: float = 0.25
    """w_low: the smallest weight (> 0: a weight discounts a reward, never erases it)."""
    high: float = 1.5
    """w_high: the largest weight."""

    def __post_init__(self) -> None:
        for name in _KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
                raise ConfigError(f"{name}: expected a finite number, got {value!r:.40}")
        for name in ("dwell", "scroll", "bounce"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected >= 0 (more engagement never weighs less), got {getattr(self, name)!r}")
        if self.dwell_ref_s <= 0:
            raise ConfigError(f"dwell_ref_s: expected > 0, got {self.dwell_ref_s!r}")
        if not 0 < self.low <= 1 <= self.high:
            raise ConfigError(f"low, high: expected 0 < low <= 1 <= high (a step without signals weighs 1), got {self.low!r}, "
                              f"{self.high!r}")
        for name in _KEYS:  # JSON's 1 and 1.0 are one weight (a config's JSON names the versions it trains)
            object.__setattr__(self, name, float(getattr(self, name)))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, spec: Any, where: str = "engagement_weights") -> EngagementWeights:
        """From a plain JSON object of these fields (missing ones take their defaults); errors name ``where.field``."""
        spec = config_object(spec, _KEYS, where)
        try:
            return cls(**spec)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None

    def of(self, dwell_s: FloatArray, scroll_depth: FloatArray, bounced: FloatArray) -> FloatArray:
        """Weights of reports, column-wise; NaN marks a signal not measured (``bounced``: 1.0, 0.0 or NaN)."""
        d = np.asarray(dwell_s, dtype=np.float64)
        s = np.asarray(scroll_depth, dtype=np.float64)
        b = np.asarray(bounced, dtype=np.float64)
        w = 1.0 + np.where(np.isnan(d), 0.0, self.dwell * (np.minimum(d / self.dwell_ref_s, 1.0) - 0.5))
        w += np.where(np.isnan(s), 0.0, self.scroll * (s - 0.5))
        w -= np.where(np.isnan(b), 0.0, self.bounce * b)
        return np.clip(w, self.low, self.high)


@dataclass(frozen=True, slots=True)
class EngagementJoin:
    """What the join used and left out; counts of report rows."""

    n_reports: int
    n_duplicates: int
    """Copies of an earlier-received report with the same ``engagement_id``."""
    n_unknown_decision: int
    """Distinct reports naming no step of their session (not in the logs read, another session's, or cut by the horizon)."""
    n_outside_horizon: int
    """Distinct reports of a known step timed before its decision or after the session's horizon."""
    n_superseded: int
    """Distinct reports merged into a later one for the same step (each signal's latest value counts)."""
    n_steps_weighted: int
    n_steps: int
    mean_weight: float
    """Over every step, 1 for those without a report."""

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _nullable(table: pa.Table, name: str) -> FloatArray:
    column = table.column(name)
    if pa.types.is_boolean(column.type):
        column = pc.cast(column, pa.float64())
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)  # nulls become NaN


SIGNALS = ("dwell_s", "scroll_depth", "bounced")


def _distinct(engagements: pa.Table) -> pa.Table:
    """One row per report, as outcomes are de-duplicated: per (session, ``engagement_id``) the first received copy, ties
    broken by every other column (unmeasured signals, nulls, sort last)."""
    return engagements.take(pa.array(first_received(engagements, "engagement_id", ("event_time_s", "decision_id", *SIGNALS))))


def _last_of_each(step: IntArray, values: FloatArray) -> tuple[IntArray, FloatArray]:
    """For rows sorted by step (then time): each step's last non-NaN value, and the steps that have one."""
    known = ~np.isnan(values)
    step, values = step[known], values[known]
    last = np.ones(len(step), dtype=np.bool_)
    last[:-1] = step[1:] != step[:-1]
    return step[last], values[last]


def step_weights(steps: pa.Table, episodes: Episodes, engagements: pa.Table, weights: EngagementWeights,
                 horizon_s: float) -> tuple[FloatArray, EngagementJoin]:
    """Per step of ``episodes`` (``steps``: its decision rows in episode order, with ``decision_id``, ``session_id`` and
    ``event_time_s``), the confidence weight from ``engagements`` (the log kind's columns); see the module doc."""
    n_steps = steps.num_rows
    w = np.ones(n_steps, dtype=np.float64)
    n_reports = engagements.num_rows
    if n_reports == 0:
        return w, EngagementJoin(0, 0, 0, 0, 0, 0, n_steps, 1.0)
    missing = [c for c in ENGAGEMENT_COLUMNS if c not in engagements.column_names]
    if missing:
        raise ValueError(f"engagements table lacks column(s) {missing}")
    distinct = _distinct(engagements)

    # The step each report names: its decision id, in its own session (a decision the horizon cut is no step).
    step_keys = pc.binary_join_element_wise(steps.column("session_id"), steps.column("decision_id"), "\x00")
    report_keys = pc.binary_join_element_wise(distinct.column("session_id"), distinct.column("decision_id"), "\x00")
    step = np.asarray(pc.index_in(report_keys, value_set=step_keys.combine_chunks()).fill_null(-1).to_numpy(), dtype=np.int64)
    known = step >= 0
    time = _nullable(distinct, "event_time_s")
    step_time = _nullable(steps, "event_time_s")
    t0 = step_time[episodes.starts][episodes.episode_index()]  # per step: its session's first decision
    at, ends = np.full(len(step), np.nan), np.full(len(step), np.nan)
    at[known], ends[known] = step_time[step[known]], t0[step[known]] + horizon_s
    inside = known & (time >= at) & (time <= ends)  # after the decision it names, within its session's horizon

    # Several reports for one step: each signal's latest measured value (by event time, then arrival), so a later
    # report that carries only some signals does not erase the others.
    used = np.flatnonzero(inside)
    ranked = pa.table({"step": step[used], "time": time[used], "received": _nullable(distinct, "received_s")[used], "row": used})
    ranked = ranked.take(pc.sort_indices(ranked, sort_keys=[("step", "ascending"), ("time", "ascending"), ("received", "ascending"),
                                                            ("row", "ascending")]))
    ranked_step, rows = ranked.column("step").to_numpy(), ranked.column("row").to_numpy()
    signals = {}
    for name in SIGNALS:
        values = np.full(n_steps, np.nan)
        where, last = _last_of_each(ranked_step, _nullable(distinct, name)[rows])
        values[where] = last
        signals[name] = values
    weighted = np.unique(ranked_step)
    w[weighted] = weights.of(*(signals[name][weighted] for name in SIGNALS))
    return w, EngagementJoin(
        n_reports=n_reports,
        n_duplicates=n_reports - distinct.num_rows,
        n_unknown_decision=int((~known).sum()),
        n_outside_horizon=int((known & ~inside).sum()),
        n_superseded=len(used) - len(weighted),
        n_steps_weighted=len(weighted),
        n_steps=n_steps,
        mean_weight=float(w.mean()) if n_steps else 1.0,
    )
