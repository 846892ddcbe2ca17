"""The rule engine: the fallback that answers when the policy cannot.

Rules are data in the bundle, validated at load (errors name the rule), first match wins::

    [{"name": "cart_page", "when": {"page_type": ["cart"]}, "actions": ["apply_coupon", "view_detail"]},
     {"name": "default", "actions": ["view_detail", "add_to_cart", "apply_coupon", "share_social"]}]

A rule lists actions in order of preference; it answers with the first one that is allowed
for this request (not banned by a guardrail, not vetoed by the guard). A rule none of whose
actions is allowed is skipped. The last rule is the default: it has no ``when`` and lists
every action the static guardrails allow, so whenever any action is allowed the engine
serves an allowed one. Only when the guard has vetoed every permitted action does the engine
relax the veto (see ``decide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.conditions import Condition, SchemaError, rule_name
from core.domain import Action, Context, FloatArray

BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    when: Condition
    actions: tuple[Action, ...]

    @property
    def indexed(self) -> tuple[tuple[Action, int], ...]:
        return tuple((a, a.index) for a in self.actions)


@dataclass(frozen=True, slots=True)
class RuleAnswer:
    action: Action
    rule: str


class RuleEngine:
    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        # (condition, name, ((action, index), ...)) per rule: the hot loop reads no enum properties
        self._plan = tuple((r.when, r.name, r.indexed) for r in self.rules)

    @classmethod
    def parse(cls, spec: Any, static_weights: FloatArray, where: str = "fallback_rules") -> RuleEngine:
        """Validate rule data; ``static_weights`` are the guardrails' per-action weights."""
        if not isinstance(spec, list) or not spec:
            raise SchemaError(f"{where}: expected a non-empty list of rules")
        rules: list[Rule] = []
        for i, raw in enumerate(spec):
            at = f"{where}[{i}]"
            if not isinstance(raw, dict):
                raise SchemaError(f"{at}: expected an object")
            name = rule_name(raw.get("name"), at)
            at = f"{where}[{i}] ({name})"
            unknown = sorted(set(raw) - {"name", "when", "actions"})
            if unknown:
                raise SchemaError(f"{at}: unknown key(s) {unknown}")
            if any(r.name == name for r in rules):
                raise SchemaError(f"{at}: duplicate rule name")
            keys = raw.get("actions")
            if not isinstance(keys, list) or not keys:
                raise SchemaError(f"{at}.actions: expected a non-empty list of actions")
            try:
                actions = tuple(Action.from_key(str(k)) for k in keys)
            except ValueError as exc:
                raise SchemaError(f"{at}.actions: {exc}") from None
            if len(set(actions)) != len(actions):
                raise SchemaError(f"{at}.actions: an action is listed twice")
            rules.append(Rule(name, Condition.parse(raw.get("when"), f"{at}.when"), actions))
        default = rules[-1]
        if default.when != Condition():
            raise SchemaError(f"{where}: the last rule ({default.name}) is the default and must have no 'when'")
        permitted = {a for a in Action if static_weights[a.index] > 0}
        missing = sorted(a.key for a in permitted - set(default.actions))
        if missing:
            raise SchemaError(f"{where}: the default rule ({default.name}) must list every permitted action; missing {missing}")
        return cls(rules)

    def to_json(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for r in self.rules:
            item: dict[str, Any] = {"name": r.name}
            if r.when != Condition():
                item["when"] = r.when.to_json()
            item["actions"] = [a.key for a in r.actions]
            out.append(item)
        return out

    def decide(self, ctx: Context, allowed: BoolArray, permitted: BoolArray,
               allow_probs: FloatArray | None = None) -> RuleAnswer:
        """The fallback action for this request.

        ``allowed``: not banned and not vetoed. ``permitted``: not banned (guardrails only).
        First matching rule with an allowed action wins. If the guard vetoed every permitted
        action, the veto is relaxed to the permitted action the guard finds least risky
        (highest allow-probability; rule name ``<default>:least_risky``). If the guardrails
        ban everything for this request, the default rule's first action is served.
        """
        for when, name, actions in self._plan:
            if when.matches(ctx):
                for action, index in actions:
                    if allowed[index]:
                        return RuleAnswer(action, name)
        default = self.rules[-1]
        candidates = [a for a in default.actions if permitted[a.index]]
        if candidates:
            if allow_probs is not None:
                best = max(candidates, key=lambda a: (allow_probs[a.index], -default.actions.index(a)))
            else:
                best = candidates[0]
            return RuleAnswer(best, f"{default.name}:least_risky")
        return RuleAnswer(default.actions[0], f"{default.name}:all_banned")
