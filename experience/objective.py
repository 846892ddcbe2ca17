"""The business objective: what the shop earns from a session, as the gate and the simulator judge it.

Per session: **net GMV** = Σ over its orders of (order value − coupon discount), minus
``complaint_cost`` per complaint. It is computed from the outcome records alone (de-duplicated
by session and ``outcome_id``, as the episodes are), with no attribution, no discounting and no reward
normalisation: no training aid (who gets the credit, confidence weights, clipping) can make a
policy look better by this figure than the orders it brought in. A coupon for every shopper
raises ``mean_return`` while the discounts it gives away lower net GMV: this figure sees that.

``complaint_cost`` (default 10 currency units, about a support contact; the simulator's order
values have medians of 8 to 200) is a business choice: set it to what a complaint costs.

**As rewards.** ``rules(window_s)`` are attribution rules that place the objective where it is
observed: each order's net value and each complaint's cost go to the latest decision at or
before it (``experience.attribution``; they are its ``DEFAULT_RULES``). ``episode_config()``
turns them into episodes; summed over a session's steps with γ = 1 those rewards are the
session's objective, for every outcome within the episode horizon (72 h from the session's
first decision: the logs cannot judge later ones, and ``per_session`` here counts them all —
in the simulator, a late order after 72 h is about one in 400 of the late ones). The gate
(``trainer.evaluation``) estimates exactly that sum; per-decision importance weights are valid
for it because no reward depends on a later action.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from core.domain import FloatArray, Outcome
from experience.attribution import AttributionConfig, AttributionRule
from experience.returns import MeanReturn, mean_return
from experience.sessions import HORIZON_S, EpisodeConfig, dedupe_outcomes

GAMMA = 1.0
"""The objective is per session, undiscounted: the γ to sum its rewards with (``session_returns(..., gamma=GAMMA)``)."""


@dataclass(frozen=True)
class SessionBusiness:
    """Per session, in the order asked for: orders' value, coupon discounts, complaints, and the objective."""

    gmv: FloatArray
    discounts: FloatArray
    complaints: FloatArray
    objective: FloatArray

    @property
    def net_gmv(self) -> FloatArray:
        return self.gmv - self.discounts


@dataclass(frozen=True)
class BusinessObjective:
    complaint_cost: float = 10.0
    """What one complaint costs the shop, in the currency of order values."""

    def __post_init__(self) -> None:
        if not (self.complaint_cost >= 0 and math.isfinite(self.complaint_cost)):
            raise ValueError(f"complaint_cost: expected a finite number >= 0, got {self.complaint_cost!r}")

    def rules(self, window_s: float = HORIZON_S) -> tuple[AttributionRule, ...]:
        """The objective as attribution rules: ORDER → the latest decision, net value; COMPLAINT → it, −complaint_cost each."""
        return (
            AttributionRule(None, Outcome.ORDER, window_s=window_s, field="net_value", weight=1.0),
            AttributionRule(None, Outcome.COMPLAINT, window_s=window_s, field="count", weight=-self.complaint_cost),
        )

    def episode_config(self, horizon_s: float = HORIZON_S) -> EpisodeConfig:
        """Episodes whose rewards sum (γ = ``GAMMA``) to the objective: these rules over the whole horizon, no terminal adjustment."""
        return EpisodeConfig(horizon_s=horizon_s, open_terminal_reward=0.0, attribution=AttributionConfig(self.rules(horizon_s)))

    def per_session(self, sessions: Sequence[str] | np.ndarray, outcomes: pa.Table) -> SessionBusiness:
        """The objective of each of ``sessions`` (ids as in the outcome records); a session without outcomes earns 0."""
        index = {s: i for i, s in enumerate(sessions)}
        n = len(index)
        kept = outcomes.take(pa.array(dedupe_outcomes(outcomes))) if outcomes.num_rows else outcomes
        rows = np.array([index.get(s, -1) for s in kept.column("session_id").to_pylist()], dtype=np.int64)
        known = rows >= 0
        kind = np.asarray(kept.column("outcome").to_numpy(zero_copy_only=False), dtype=np.int64)[known]
        value = np.asarray(kept.column("value").to_numpy(zero_copy_only=False), dtype=np.float64)[known]
        discount = np.asarray(kept.column("coupon_discount").to_numpy(zero_copy_only=False), dtype=np.float64)[known]
        rows = rows[known]
        order, complaint = kind == int(Outcome.ORDER), kind == int(Outcome.COMPLAINT)
        gmv = np.bincount(rows[order], weights=value[order], minlength=n).astype(np.float64)
        discounts = np.bincount(rows[order], weights=discount[order], minlength=n).astype(np.float64)
        complaints = np.bincount(rows[complaint], minlength=n).astype(np.float64)
        return SessionBusiness(gmv, discounts, complaints, gmv - discounts - self.complaint_cost * complaints)

    def summary(self, sessions: Sequence[str] | np.ndarray, outcomes: pa.Table) -> dict[str, MeanReturn]:
        """Per-session means with 95 % intervals: net GMV, complaints and the objective."""
        b = self.per_session(sessions, outcomes)
        return {"net_gmv": mean_return(b.net_gmv), "complaints": mean_return(b.complaints), "objective": mean_return(b.objective)}
