"""The rule engine: validation (errors name the rule), first match, and the veto relaxation."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np
import pytest

from core.conditions import SchemaError
from core.domain import ACTIONS, Action, Context, PageType
from guard.rules import RuleEngine

RULES: list[dict[str, Any]] = [
    {"name": "cart_page_coupon", "when": {"page_type": ["cart"]}, "actions": ["apply_coupon", "view_detail"]},
    {"name": "full_cart_coupon", "when": {"cart_item_count_min": 3}, "actions": ["apply_coupon", "view_detail"]},
    {"name": "detail_page_add", "when": {"page_type": ["detail"]}, "actions": ["add_to_cart", "view_detail"]},
    {"name": "default", "actions": ["view_detail", "add_to_cart", "apply_coupon", "share_social"]},
]
STATIC = np.array([1.0, 1.0, 0.8, 0.5, 0.0])  # exit banned
PERMITTED = STATIC > 0
A, V, C, S, X = ACTIONS  # add_to_cart, view_detail, apply_coupon, share_social, exit

CONTEXTS = [
    Context(PageType.SEARCH, 0, 12, 0),
    Context(PageType.CART, 0, 3, 2),
    Context(PageType.CART, 5, 23, 1),
    Context(PageType.DETAIL, 0, 9, 0),
    Context(PageType.DETAIL, 4, 9, 3),
    Context(PageType.RECOMMEND, 3, 18, 0),
    Context(PageType.UNSPECIFIED, 1, 0, 0),
]


@pytest.fixture(scope="module")
def engine() -> RuleEngine:
    return RuleEngine.parse(RULES, STATIC)


def mask(*actions: Action) -> np.ndarray:
    m = np.zeros(5, dtype=bool)
    for a in actions:
        m[a.index] = True
    return m


def test_first_matching_rule_wins(engine: RuleEngine) -> None:
    everything = mask(A, V, C, S)
    # a cart page with a full cart matches both cart rules: the first one answers
    answer = engine.decide(Context(PageType.CART, 5, 12, 0), everything, PERMITTED)
    assert (answer.action, answer.rule) == (C, "cart_page_coupon")
    answer = engine.decide(Context(PageType.DETAIL, 4, 12, 0), everything, PERMITTED)
    assert (answer.action, answer.rule) == (C, "full_cart_coupon")
    answer = engine.decide(Context(PageType.DETAIL, 0, 12, 0), everything, PERMITTED)
    assert (answer.action, answer.rule) == (A, "detail_page_add")
    answer = engine.decide(Context(PageType.SEARCH, 0, 12, 0), everything, PERMITTED)
    assert (answer.action, answer.rule) == (V, "default")


def test_a_rule_answers_with_its_first_allowed_action(engine: RuleEngine) -> None:
    answer = engine.decide(Context(PageType.CART, 0, 12, 0), mask(A, V, S), PERMITTED)
    assert (answer.action, answer.rule) == (V, "cart_page_coupon")
    answer = engine.decide(Context(PageType.SEARCH, 0, 12, 0), mask(C, S), PERMITTED)
    assert (answer.action, answer.rule) == (C, "default")


def test_rules_with_no_allowed_action_are_skipped(engine: RuleEngine) -> None:
    # cart page, full cart: both cart rules list only coupon and view, both disallowed
    answer = engine.decide(Context(PageType.CART, 5, 12, 0), mask(A, S), PERMITTED)
    assert (answer.action, answer.rule) == (A, "default")
    answer = engine.decide(Context(PageType.DETAIL, 0, 12, 0), mask(C, S), PERMITTED)
    assert (answer.action, answer.rule) == (C, "default")
    answer = engine.decide(Context(PageType.CART, 0, 12, 0), mask(S), PERMITTED)
    assert (answer.action, answer.rule) == (S, "default")


@pytest.mark.parametrize("context", CONTEXTS)
def test_never_serves_a_disallowed_action_when_one_is_allowed(engine: RuleEngine, context: Context) -> None:
    allow_probs = np.array([0.15, 0.05, 0.1, 0.01, 0.99])
    for bits in itertools.product([False, True], repeat=5):
        allowed = np.array(bits) & PERMITTED  # a banned action is never allowed
        answer = engine.decide(context, allowed, PERMITTED, allow_probs)
        if allowed.any():
            assert allowed[answer.action.index], (bits, answer)
            assert not answer.rule.endswith(":least_risky")
            matching = [r for r in engine.rules if r.when.matches(context) and any(allowed[a.index] for a in r.actions)]
            assert answer.rule == matching[0].name
        else:
            # every permitted action vetoed: the least risky permitted one (exit is riskless but banned)
            assert (answer.action, answer.rule) == (A, "default:least_risky")


def test_all_vetoed_serves_the_least_risky_permitted_action(engine: RuleEngine) -> None:
    nothing = np.zeros(5, dtype=bool)
    ctx = Context(PageType.CART, 5, 12, 0)
    answer = engine.decide(ctx, nothing, PERMITTED, np.array([0.1, 0.12, 0.05, 0.19, 0.9]))
    assert (answer.action, answer.rule) == (S, "default:least_risky")
    # a tie in allow-probability goes to the earlier action in the default rule (view before add)
    answer = engine.decide(ctx, nothing, PERMITTED, np.array([0.1, 0.1, 0.05, 0.05, 0.9]))
    assert (answer.action, answer.rule) == (V, "default:least_risky")
    # only permitted actions are candidates
    answer = engine.decide(ctx, nothing, mask(C, S), np.array([0.19, 0.18, 0.05, 0.01, 0.9]))
    assert (answer.action, answer.rule) == (C, "default:least_risky")
    # without allow-probabilities, the default rule's first permitted action
    answer = engine.decide(ctx, nothing, mask(A, C))
    assert (answer.action, answer.rule) == (A, "default:least_risky")


def test_everything_banned_serves_the_default_rules_first_action(engine: RuleEngine) -> None:
    nothing = np.zeros(5, dtype=bool)
    answer = engine.decide(Context(PageType.SEARCH, 0, 12, 0), nothing, nothing, np.full(5, 0.5))
    assert (answer.action, answer.rule) == (V, "default:all_banned")


def test_to_json_round_trips(engine: RuleEngine) -> None:
    assert engine.to_json() == RULES
    again = RuleEngine.parse(engine.to_json(), STATIC)
    assert again.rules == engine.rules


def test_default_may_leave_out_banned_actions_but_an_empty_when_is_no_when() -> None:
    rules = copy.deepcopy(RULES)
    rules[-1]["when"] = {}
    engine = RuleEngine.parse(rules, STATIC)
    assert [a.key for a in engine.rules[-1].actions] == ["view_detail", "add_to_cart", "apply_coupon", "share_social"]
    # with share_social banned statically the default need not list it
    RuleEngine.parse([{"name": "d", "actions": ["view_detail", "add_to_cart", "apply_coupon"]}],
                     np.array([1.0, 1.0, 1.0, 0.0, 0.0]))


def with_rule(i: int, **changes: Any) -> list[dict[str, Any]]:
    rules = copy.deepcopy(RULES)
    rules[i].update(changes)
    return rules


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], r"^fallback_rules: expected a non-empty list of rules"),
        ({"name": "default"}, r"^fallback_rules: expected a non-empty list of rules"),
        (["default"], r"^fallback_rules\[0\]: expected an object"),
        (with_rule(1, name=""), r"^fallback_rules\[1\]\.name: expected a non-empty string"),
        # every answer the rule gives carries its name: no lone surrogate (unencodable), no control character, bounded
        (with_rule(1, name="\udfff"), r"^fallback_rules\[1\]\.name: expected a non-empty string of at most 100 printable"),
        (with_rule(1, name="a\x00b"), r"^fallback_rules\[1\]\.name: expected a non-empty string"),
        (with_rule(1, name="r" * 101), r"^fallback_rules\[1\]\.name: expected a non-empty string"),
        (with_rule(1, priority=2), r"^fallback_rules\[1\] \(full_cart_coupon\): unknown key\(s\) \['priority'\]"),
        (with_rule(2, name="cart_page_coupon"), r"^fallback_rules\[2\] \(cart_page_coupon\): duplicate rule name"),
        (with_rule(0, actions=["apply_coupon", "buy_now"]),
         r"^fallback_rules\[0\] \(cart_page_coupon\)\.actions: unknown action 'buy_now'"),
        (with_rule(0, actions=[]), r"^fallback_rules\[0\] \(cart_page_coupon\)\.actions: expected a non-empty list"),
        (with_rule(0, actions="apply_coupon"), r"^fallback_rules\[0\] \(cart_page_coupon\)\.actions: expected a non-empty list"),
        (with_rule(0, actions=["view_detail", "view_detail"]),
         r"^fallback_rules\[0\] \(cart_page_coupon\)\.actions: an action is listed twice"),
        (with_rule(1, when={"cart_item_count_min": -3}),
         r"^fallback_rules\[1\] \(full_cart_coupon\)\.when\.cart_item_count_min: expected an integer"),
        (with_rule(3, when={"page_type": ["search"]}),
         r"^fallback_rules: the last rule \(default\) is the default and must have no 'when'"),
        (with_rule(3, actions=["view_detail", "add_to_cart", "apply_coupon"]),
         r"^fallback_rules: the default rule \(default\) must list every permitted action; missing \['share_social'\]"),
        (RULES[:3], r"^fallback_rules: the last rule \(detail_page_add\) is the default and must have no 'when'"),
    ],
)
def test_parse_errors_name_the_rule(spec: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        RuleEngine.parse(spec, STATIC)


def test_default_must_cover_exit_when_exit_is_permitted() -> None:
    with pytest.raises(SchemaError, match=r"default rule \(default\) must list every permitted action; missing \['exit'\]"):
        RuleEngine.parse(RULES, np.ones(5))
