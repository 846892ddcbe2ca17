"""Reward attribution: which decision an outcome credits, and how much. The rules are data.

A rule ``AttributionRule(action, outcome, window_s, field, weight)`` reads: every outcome of
kind ``outcome`` credits ``weight × outcome[field]`` to the *latest* decision ``d`` of the same
session whose served action is ``action`` (any served action when ``action`` is None, ``"any"``
in JSON) and whose time window holds the outcome:

    d.event_time_s  ≤  o.event_time_s  ≤  d.event_time_s + window_s        (both edges inclusive)

"Latest" is in episode order, (event_time_s, decision_id) within the session: last touch, so
one rule never credits one outcome twice. Each rule is applied on its own: an outcome may feed
several rules (each credits its own latest decision), and one decision may collect credit from
several outcomes (two orders within 24 h of one add_to_cart both count). Steps that no rule
credits get 0. The window's end is ``event_time_s + window_s`` computed in float64.

The fields (``FIELDS``) are the outcome's ``value`` and ``coupon_discount`` columns,
``net_value`` = value − coupon_discount, and ``count`` = 1 per outcome (a complaint rule of
weight −10 costs 10 per complaint).

The outcome is matched by session and event time, **not** by its ``decision_id``: the frontend
reports an order against whatever decision it saw last, which is rarely the one that caused it.

**Defaults** (``DEFAULT_RULES``): the business objective (``experience.objective``), each
outcome placed at the step where it is observed — an ORDER credits its ``net_value`` to the
latest decision at or before it, whatever that decision served; a COMPLAINT credits −10 (the
objective's ``complaint_cost``) the same way; the window is the default episode horizon, 72 h,
so a late order still counts. Summed over a session (γ = 1) these rewards are exactly the
session's objective, for two reasons that matter:

- *Not gameable by coupons.* A coupon's discount is subtracted from the order it rides on, so
  a coupon pays only where it brings orders worth more than it gives away; under the old
  last-touch rules below a coupon for every shopper *earned* 0.7 × its discount.
- *Valid for per-decision importance weights.* A step's reward depends only on what happened
  up to the moment it is observed, that is on the actions at or before it, never on later
  ones; so the per-decision weight w₀..t (``trainer.offline``) is the correct weight for it.
  Under last touch, an add_to_cart's credit depended on whether a *later* step served
  add_to_cart too, whose ratios w₀..t leaves out: the gate came out biased.

The credit to "the decision the shopper saw last" is no claim about which decision caused the
order: the learner (returns, advantages) spreads it back over the earlier steps.

``LAST_TOUCH_RULES`` are the former defaults, still a valid config: add_to_cart then an ORDER
within 24 h ⇒ 0.3 × GMV (``value``); apply_coupon then an ORDER within 1 h ⇒ 0.7 ×
``coupon_discount``.

A config is a plain dict in bundles and trainer configs (``AttributionConfig.to_dict``)::

    {"rules": [{"action": "any", "outcome": "order", "window_s": 259200.0, "field": "net_value", "weight": 1.0}, ...]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.domain import Action, FloatArray, Outcome

IntArray = npt.NDArray[np.int64]

COLUMNS: tuple[str, ...] = ("value", "coupon_discount")
"""The outcome columns the fields are computed from (``attribute`` takes them)."""
FIELDS: tuple[str, ...] = (*COLUMNS, "net_value", "count")
"""What a rule can credit: the columns, ``net_value`` = value − coupon_discount, ``count`` = 1 per outcome."""
ANY = "any"
"""``action`` in JSON for a rule that credits the latest decision whatever it served (None in the dataclass)."""

_RULE_KEYS = ("action", "outcome", "window_s", "field", "weight")


class ConfigError(ValueError):
    """An experience config (attribution rules, episode settings) is malformed; the message names the key."""


def config_object(spec: Any, allowed: Sequence[str], where: str) -> Mapping[str, Any]:
    """``spec`` as a JSON object with only ``allowed`` keys, or ``ConfigError`` naming ``where``."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(allowed)}")
    return spec


@dataclass(frozen=True, slots=True)
class AttributionRule:
    """``outcome`` within ``window_s`` after a step that served ``action`` (None: any) ⇒ ``weight × outcome[field]``."""

    action: Action | None
    """The served action of the credited decision; None credits the latest decision whatever it served."""
    outcome: Outcome
    window_s: float
    """Inclusive window after the decision's event time, in seconds (≥ 0)."""
    field: str
    """The outcome column credited: one of ``FIELDS``."""
    weight: float

    def __post_init__(self) -> None:
        if self.action is not None and not isinstance(self.action, Action):
            raise ConfigError(f"action: expected an Action or None (any), got {self.action!r}")
        if not isinstance(self.outcome, Outcome):
            raise ConfigError(f"outcome: expected an Outcome, got {self.outcome!r}")
        if not math.isfinite(self.window_s) or self.window_s < 0:
            raise ConfigError(f"window_s: expected a finite number >= 0, got {self.window_s!r}")
        if self.field not in FIELDS:
            raise ConfigError(f"field: expected one of {list(FIELDS)}, got {self.field!r}")
        if not math.isfinite(self.weight):
            raise ConfigError(f"weight: expected a finite number, got {self.weight!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": ANY if self.action is None else self.action.key,
            "outcome": self.outcome.key,
            "window_s": self.window_s,
            "field": self.field,
            "weight": self.weight,
        }

    @classmethod
    def from_dict(cls, spec: Any, where: str = "rule") -> AttributionRule:
        """Build from JSON data; raise ``ConfigError`` naming ``where.key`` on anything unexpected."""
        spec = config_object(spec, _RULE_KEYS, where)
        missing = [k for k in _RULE_KEYS if k not in spec]
        if missing:
            raise ConfigError(f"{where}: missing key(s) {missing}")
        try:
            key = _str(spec["action"])
            action = None if key == ANY else Action.from_key(key)
        except ValueError as exc:
            raise ConfigError(f"{where}.action: {exc}, or {ANY!r}") from None
        try:
            outcome = Outcome.from_key(_str(spec["outcome"]))
        except ValueError as exc:
            raise ConfigError(f"{where}.outcome: {exc}") from None
        try:
            return cls(
                action=action,
                outcome=outcome,
                window_s=_number(spec["window_s"], "window_s"),
                field=_str(spec["field"]),
                weight=_number(spec["weight"], "weight"),
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return float(value)


DEFAULT_RULES: tuple[AttributionRule, ...] = (
    AttributionRule(None, Outcome.ORDER, window_s=72 * 3600.0, field="net_value", weight=1.0),
    AttributionRule(None, Outcome.COMPLAINT, window_s=72 * 3600.0, field="count", weight=-10.0),
)
"""The business objective where it is observed (see the module doc): ``BusinessObjective().rules(HORIZON_S)``."""

LAST_TOUCH_RULES: tuple[AttributionRule, ...] = (
    AttributionRule(Action.ADD_TO_CART, Outcome.ORDER, window_s=24 * 3600.0, field="value", weight=0.3),
    AttributionRule(Action.APPLY_COUPON, Outcome.ORDER, window_s=3600.0, field="coupon_discount", weight=0.7),
)
"""The defaults before the business objective: last-touch credit to add_to_cart and apply_coupon (gameable, see above)."""


@dataclass(frozen=True, slots=True)
class AttributionConfig:
    """The attribution rules, applied independently and summed per step."""

    rules: tuple[AttributionRule, ...] = DEFAULT_RULES

    def to_dict(self) -> dict[str, Any]:
        return {"rules": [rule.to_dict() for rule in self.rules]}

    @classmethod
    def from_dict(cls, spec: Any, where: str = "attribution") -> AttributionConfig:
        """The inverse of ``to_dict``; a missing ``rules`` key means the defaults, ``[]`` means no rewards."""
        spec = config_object(spec, ("rules",), where)
        if "rules" not in spec:
            return cls()
        rules = spec["rules"]
        if not isinstance(rules, list | tuple):
            raise ConfigError(f"{where}.rules: expected a list, got {type(rules).__name__}")
        return cls(tuple(AttributionRule.from_dict(r, f"{where}.rules[{i}]") for i, r in enumerate(rules)))


def attribute(
    step_session: IntArray,
    step_time: FloatArray,
    step_action: npt.NDArray[np.integer[Any]],
    out_session: IntArray,
    out_time: FloatArray,
    out_kind: npt.NDArray[np.integer[Any]],
    out_fields: Mapping[str, FloatArray],
    rules: tuple[AttributionRule, ...],
) -> FloatArray:
    """Per-step rewards ``r[i] = Σ_rules Σ_{o credited to step i} weight × o[field]`` (see the module doc).

    Steps must be in episode order: sorted by (session code, event time, decision id). Outcomes
    may be in any order; they should already be de-duplicated and restricted to the sessions'
    horizons. Session codes are integers shared by steps and outcomes. ``out_fields`` holds the
    outcome ``COLUMNS``; ``net_value`` and ``count`` are computed from them.

    Per rule, vectorised: merge the rule's candidate steps and outcomes in one order by
    (session, time, steps before outcomes at equal time), carry the last candidate forward
    (a running maximum of step indices), then keep the matches in the same session whose
    window holds the outcome. O((steps + outcomes) log) per rule.
    """
    n = len(step_session)
    rewards = np.zeros(n, dtype=np.float64)
    for rule in rules:
        cand = np.arange(n, dtype=np.int64) if rule.action is None else np.flatnonzero(step_action == int(rule.action))
        outs = np.flatnonzero(out_kind == int(rule.outcome))
        if len(cand) == 0 or len(outs) == 0:
            continue
        session = np.concatenate([step_session[cand], out_session[outs]])
        time = np.concatenate([step_time[cand], out_time[outs]])
        is_out = np.concatenate([np.zeros(len(cand), dtype=np.int8), np.ones(len(outs), dtype=np.int8)])
        order = np.lexsort((is_out, time, session))  # stable: equal candidates keep episode order
        merged_is_out = order >= len(cand)
        carried = np.concatenate([cand, np.full(len(outs), -1, dtype=np.int64)])[order]
        last = np.maximum.accumulate(carried)[merged_is_out]  # the latest candidate at or before each outcome
        o = outs[order[merged_is_out] - len(cand)]
        found = last >= 0
        step = np.where(found, last, 0)
        hit = found & (step_session[step] == out_session[o]) & (out_time[o] <= step_time[step] + rule.window_s)
        credit = rule.weight * outcome_field(out_fields, rule.field, o[hit])
        rewards += np.bincount(step[hit], weights=credit, minlength=n)
    return rewards


def outcome_field(columns: Mapping[str, FloatArray], field: str, rows: IntArray) -> FloatArray:
    """``field`` (one of ``FIELDS``) of the outcomes ``rows``, from the outcome ``COLUMNS``."""
    if field == "net_value":
        return np.asarray(columns["value"][rows] - columns["coupon_discount"][rows], dtype=np.float64)
    if field == "count":
        return np.ones(len(rows), dtype=np.float64)
    return np.asarray(columns[field][rows], dtype=np.float64)
