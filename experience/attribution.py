"""Reward attribution: which decision an outcome credits, and how much. The rules are data.

A rule ``AttributionRule(action, outcome, window_s, field, weight)`` reads: every outcome of
kind ``outcome`` credits ``weight × outcome[field]`` to the *latest* decision ``d`` of the same
session whose served action is ``action`` and whose time window holds the outcome:

    d.event_time_s  ≤  o.event_time_s  ≤  d.event_time_s + window_s        (both edges inclusive)

"Latest" is in episode order, (event_time_s, decision_id) within the session: last touch, so
one rule never credits one outcome twice. Each rule is applied on its own: an outcome may feed
several rules (each credits its own latest decision), and one decision may collect credit from
several outcomes (two orders within 24 h of one add_to_cart both count). Steps that no rule
credits get 0. The window's end is ``event_time_s + window_s`` computed in float64.

The outcome is matched by session and event time, **not** by its ``decision_id``: the frontend
reports an order against whatever decision it saw last, which is rarely the one that caused it.

Defaults (``DEFAULT_RULES``): add_to_cart then an ORDER within 24 h ⇒ 0.3 × GMV (``value``);
apply_coupon then an ORDER within 1 h ⇒ 0.7 × ``coupon_discount``.

A config is a plain dict in bundles and trainer configs (``AttributionConfig.to_dict``)::

    {"rules": [{"action": "add_to_cart", "outcome": "order", "window_s": 86400.0, "field": "value", "weight": 0.3}, ...]}
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

FIELDS: tuple[str, ...] = ("value", "coupon_discount")
"""The outcome columns a rule can credit."""

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
    """``outcome`` within ``window_s`` after a step that served ``action`` ⇒ ``weight × outcome[field]``."""

    action: Action
    outcome: Outcome
    window_s: float
    """Inclusive window after the decision's event time, in seconds (≥ 0)."""
    field: str
    """The outcome column credited: one of ``FIELDS``."""
    weight: float

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise ConfigError(f"action: expected an Action, got {self.action!r}")
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
            "action": self.action.key,
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
            action = Action.from_key(_str(spec["action"]))
        except ValueError as exc:
            raise ConfigError(f"{where}.action: {exc}") from None
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
    AttributionRule(Action.ADD_TO_CART, Outcome.ORDER, window_s=24 * 3600.0, field="value", weight=0.3),
    AttributionRule(Action.APPLY_COUPON, Outcome.ORDER, window_s=3600.0, field="coupon_discount", weight=0.7),
)


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
    horizons. Session codes are integers shared by steps and outcomes.

    Per rule, vectorised: merge the rule's candidate steps and outcomes in one order by
    (session, time, steps before outcomes at equal time), carry the last candidate forward
    (a running maximum of step indices), then keep the matches in the same session whose
    window holds the outcome. O((steps + outcomes) log) per rule.
    """
    n = len(step_session)
    rewards = np.zeros(n, dtype=np.float64)
    for rule in rules:
        cand = np.flatnonzero(step_action == int(rule.action))
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
        credit = rule.weight * out_fields[rule.field][o[hit]]
        rewards += np.bincount(step[hit], weights=credit, minlength=n)
    return rewards
