"""Business guardrails: per-action weights applied to the policy in log space.

``weights[a]`` multiplies the policy probability of action ``a``; 0 bans it (exit is never
served by default). Request rules multiply further when their condition holds
(``cart_item_count >= 3`` ⇒ add_to_cart × 0.3). Both come from the bundle, so the trainer
and the server apply the same masks. Bundle JSON::

    {"static": {"add_to_cart": 1.0, ..., "exit": 0.0},
     "rules": [{"name": "full_cart", "when": {"cart_item_count_min": 3},
                "action": "add_to_cart", "multiplier": 0.3}]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.conditions import Condition, SchemaError, rule_name
from core.domain import ACTIONS, Action, Context, FloatArray


@dataclass(frozen=True, slots=True)
class GuardrailRule:
    name: str
    when: Condition
    action: Action
    multiplier: float


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SchemaError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Guardrails:
    static: FloatArray  # (N_ACTIONS,) weights >= 0
    rules: tuple[GuardrailRule, ...] = ()

    @classmethod
    def parse(cls, spec: Any, where: str = "guardrails") -> Guardrails:
        if not isinstance(spec, dict):
            raise SchemaError(f"{where}: expected an object")
        static_spec = spec.get("static")
        if not isinstance(static_spec, dict):
            raise SchemaError(f"{where}.static: expected an object of action -> weight")
        missing = sorted({a.key for a in ACTIONS} - set(static_spec))
        extra = sorted(set(static_spec) - {a.key for a in ACTIONS})
        if missing or extra:
            raise SchemaError(f"{where}.static: missing {missing}, unknown {extra}")
        static = np.array([_weight(static_spec[a.key], f"{where}.static.{a.key}") for a in ACTIONS])
        if not (static > 0).any():
            raise SchemaError(f"{where}.static: every action is banned")
        rules = []
        names: set[str] = set()
        rule_specs = spec.get("rules", [])
        if not isinstance(rule_specs, list):
            raise SchemaError(f"{where}.rules: expected a list")
        for i, rule in enumerate(rule_specs):
            at = f"{where}.rules[{i}]"
            if not isinstance(rule, dict) or set(rule) - {"name", "when", "action", "multiplier"}:
                raise SchemaError(f"{at}: expected an object with name, when, action, multiplier")
            name = rule_name(rule.get("name"), at, taken=names)
            names.add(name)
            try:
                action = Action.from_key(str(rule.get("action")))
            except ValueError as exc:
                raise SchemaError(f"{at}.action ({name}): {exc}") from None
            rules.append(
                GuardrailRule(name, Condition.parse(rule.get("when"), f"{at}.when"), action,
                              _weight(rule.get("multiplier"), f"{at}.multiplier ({name})"))
            )
        static.setflags(write=False)
        return cls(static=static, rules=tuple(rules))

    def to_json(self) -> dict[str, Any]:
        return {
            "static": {a.key: float(self.static[a.index]) for a in ACTIONS},
            "rules": [
                {"name": r.name, "when": r.when.to_json(), "action": r.action.key, "multiplier": r.multiplier}
                for r in self.rules
            ],
        }

    def weights(self, ctx: Context) -> tuple[FloatArray, tuple[str, ...]]:
        """Per-action weights for this request and the names of the rules that fired."""
        if not self.rules:
            return self.static, ()
        w = self.static.copy()
        fired = []
        for rule in self.rules:
            if rule.when.matches(ctx):
                w[rule.action.index] *= rule.multiplier
                fired.append(rule.name)
        return w, tuple(fired)


_LEAST = np.finfo(np.float64).min
_TINY = np.finfo(np.float64).tiny


def apply_batch(logits: npt.NDArray[np.floating[Any]], weights: FloatArray) -> FloatArray:
    """Masked policy per row: ``softmax(logits + log weights)``; banned actions get exactly 0.

    A row where every action is banned comes back all zeros. The logits must be finite (``ModelSet.infer`` refuses
    others): a NaN gives NaN.
    """
    permitted = weights > 0
    z = np.where(permitted, logits + np.log(np.where(permitted, weights, 1.0), dtype=np.float64), -np.inf)
    # a row's largest z, or the least float where all are banned: exp(−inf − that) = 0, not NaN
    e = np.exp(z - np.maximum(z.max(axis=-1, keepdims=True), _LEAST))
    e /= np.maximum(e.sum(axis=-1, keepdims=True), _TINY)  # a permitted row's sum is at least 1 (its largest term)
    return e


def apply(logits: npt.NDArray[np.floating[Any]], weights: FloatArray) -> FloatArray:
    """``apply_batch`` for one request."""
    return apply_batch(logits[None, :], weights[None, :])[0]
