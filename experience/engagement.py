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

The join (``step_weights``): reports are de-duplicated by ``engagement_id`` (the first
received copy, as outcomes are); a report counts for the step whose ``decision_id`` and
session it names, when its event time lies within that session's horizon; of several
distinct reports for one decision the latest by event time counts (the most complete view of
the page). A report naming a decision that is not in the logs read, or another session's, or
arriving past the horizon, is left out and counted in ``EngagementJoin``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import FloatArray
from experience.attribution import ConfigError, config_object
from experience.sessions import Episodes

ENGAGEMENT_COLUMNS = ("engagement_id", "decision_id", "session_id", "dwell_s", "scroll_depth", "bounced", "event_time_s",
                      "received_s")
_KEYS = ("dwell", "dwell_ref_s", "scroll", "bounce", "low", "high")


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
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        for name in ("dwell", "scroll", "bounce"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected >= 0 (more engagement never weighs less), got {getattr(self, name)!r}")
        if self.dwell_ref_s <= 0:
            raise ConfigError(f"dwell_ref_s: expected > 0, got {self.dwell_ref_s!r}")
        if not 0 < self.low <= 1 <= self.high:
            raise ConfigError(f"low, high: expected 0 < low <= 1 <= high (a step without signals weighs 1), got {self.low!r}, "
                              f"{self.high!r}")

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
    """Distinct reports naming no logged step of their session (not in the logs read, or another session's)."""
    n_outside_horizon: int
    """Distinct reports of a known step whose event time is before the session's first decision or after its horizon."""
    n_superseded: int
    """Distinct reports of a step that has a later one."""
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
    order = pc.sort_indices(engagements, sort_keys=[("engagement_id", "ascending"), ("received_s", "ascending"),
                                                     ("event_time_s", "ascending")])
    sorted_ids = engagements.column("engagement_id").take(order).to_numpy(zero_copy_only=False)
    first = np.ones(len(sorted_ids), dtype=np.bool_)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    distinct = engagements.take(pa.array(np.asarray(order)[first]))

    # The step each report names: its decision id, in its own session.
    step_keys = pc.binary_join_element_wise(steps.column("session_id"), steps.column("decision_id"), "\x00")
    report_keys = pc.binary_join_element_wise(distinct.column("session_id"), distinct.column("decision_id"), "\x00")
    step = np.asarray(pc.index_in(report_keys, value_set=step_keys.combine_chunks()).fill_null(-1).to_numpy(), dtype=np.int64)
    known = step >= 0
    time = _nullable(distinct, "event_time_s")
    t0 = _nullable(steps, "event_time_s")[episodes.starts]
    start = np.full(len(step), np.nan)
    start[known] = t0[episodes.episode_index()[step[known]]]
    inside = known & (time >= start) & (time <= start + horizon_s)

    # Of several reports for one step, the latest (then the largest id) counts: the last of each step's run.
    used = np.flatnonzero(inside)
    ranked = pa.table({"step": step[used], "time": time[used], "id": distinct.column("engagement_id").take(pa.array(used)),
                       "row": used})
    ranked = ranked.take(pc.sort_indices(ranked, sort_keys=[("step", "ascending"), ("time", "ascending"), ("id", "ascending")]))
    ranked_step = ranked.column("step").to_numpy()
    last = np.ones(len(ranked_step), dtype=np.bool_)
    last[:-1] = ranked_step[1:] != ranked_step[:-1]
    chosen = ranked.column("row").to_numpy()[last]
    w[ranked_step[last]] = weights.of(_nullable(distinct, "dwell_s")[chosen], _nullable(distinct, "scroll_depth")[chosen],
                                      _nullable(distinct, "bounced")[chosen])
    return w, EngagementJoin(
        n_reports=n_reports,
        n_duplicates=n_reports - int(first.sum()),
        n_unknown_decision=int((~known).sum()),
        n_outside_horizon=int((known & ~inside).sum()),
        n_superseded=len(used) - len(chosen),
        n_steps_weighted=len(chosen),
        n_steps=n_steps,
        mean_weight=float(w.mean()) if n_steps else 1.0,
    )
