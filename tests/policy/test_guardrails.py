"""Guardrails: parsing, per-request weights, and the masked softmax."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest

from core.conditions import SchemaError
from core.domain import ACTIONS, Action, Context, PageType
from policy import guardrails as gr

SPEC: dict[str, Any] = {
    "static": {"add_to_cart": 1.0, "view_detail": 1.0, "apply_coupon": 0.8, "share_social": 0.5, "exit": 0.0},
    "rules": [
        {"name": "full_cart_damp_add", "when": {"cart_item_count_min": 3}, "action": "add_to_cart", "multiplier": 0.3},
    ],
}


def ctx(cart: int = 0, page: PageType = PageType.SEARCH, hour: int = 12, recent: int = 0) -> Context:
    return Context(page_type=page, cart_item_count=cart, hour=hour, n_recent_behaviors=recent)


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec.update(changes)
    return spec


def test_full_cart_rule_damps_add_to_cart_and_reports_itself() -> None:
    rails = gr.Guardrails.parse(SPEC)
    w, fired = rails.weights(ctx(cart=3))
    assert w.tolist() == pytest.approx([0.3, 1.0, 0.8, 0.5, 0.0], abs=1e-15)
    assert fired == ("full_cart_damp_add",)
    w, fired = rails.weights(ctx(cart=2))
    assert w.tolist() == [1.0, 1.0, 0.8, 0.5, 0.0]
    assert fired == ()
    # the static weights are untouched by a request that fired a rule
    assert rails.static.tolist() == [1.0, 1.0, 0.8, 0.5, 0.0]


def test_rules_multiply_in_order_and_all_fired_rules_are_reported() -> None:
    rails = gr.Guardrails.parse(spec_with(rules=[
        {"name": "night", "when": {"hour_min": 22, "hour_max": 5}, "action": "share_social", "multiplier": 0.5},
        {"name": "full_cart", "when": {"cart_item_count_min": 3}, "action": "add_to_cart", "multiplier": 0.3},
        {"name": "night_again", "when": {"hour_min": 23, "hour_max": 1}, "action": "share_social", "multiplier": 0.0},
        {"name": "always", "action": "view_detail", "multiplier": 2.0},
    ]))
    w, fired = rails.weights(ctx(cart=4, hour=23))
    assert w.tolist() == pytest.approx([0.3, 2.0, 0.8, 0.0, 0.0], abs=1e-15)
    assert fired == ("night", "full_cart", "night_again", "always")
    w, fired = rails.weights(ctx(cart=0, hour=3))
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.8, 0.25, 0.0], abs=1e-15)
    assert fired == ("night", "always")


def test_without_rules_weights_are_the_static_ones() -> None:
    rails = gr.Guardrails.parse(spec_with(rules=[]))
    w, fired = rails.weights(ctx(cart=10))
    assert w.tolist() == [1.0, 1.0, 0.8, 0.5, 0.0]
    assert fired == ()


def test_apply_is_the_softmax_of_logits_plus_log_weights() -> None:
    logits = np.array([0.5, 1.5, -0.25, 2.0, 3.0])
    weights = np.array([0.3, 1.0, 0.8, 0.5, 0.0])
    got = gr.apply(logits, weights)
    unnorm = [w * math.exp(x) for x, w in zip(logits.tolist(), weights.tolist(), strict=True)]
    expected = [u / sum(unnorm) for u in unnorm]
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
    assert got[4] == 0.0
    assert got.sum() == pytest.approx(1.0, abs=1e-15)


def test_apply_is_stable_for_huge_logits_and_bans_stay_exactly_zero() -> None:
    logits = np.array([1000.0, 999.0, -1000.0, 5000.0, 0.0])
    weights = np.array([1.0, 1.0, 1.0, 0.0, 1.0])  # the huge logit is banned
    got = gr.apply(logits, weights)
    assert np.isfinite(got).all()
    assert got[3] == 0.0
    e = math.exp(-1.0)
    np.testing.assert_allclose(got[:2], [1 / (1 + e), e / (1 + e)], rtol=1e-13)
    assert got[2] == 0.0 and got[4] == 0.0  # underflow, not a ban, but still 0


def test_apply_with_every_action_banned_gives_zeros() -> None:
    got = gr.apply(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.zeros(5))
    assert got.tolist() == [0.0] * 5


def test_to_json_round_trips() -> None:
    rails = gr.Guardrails.parse(spec_with(rules=[
        *SPEC["rules"],
        {"name": "night_cart", "when": {"page_type": ["cart"], "hour_min": 22, "hour_max": 5},
         "action": "apply_coupon", "multiplier": 1.5},
    ]))
    data = rails.to_json()
    assert data["static"] == SPEC["static"]
    again = gr.Guardrails.parse(data)
    assert again.static.tolist() == rails.static.tolist()
    assert again.rules == rails.rules
    assert again.to_json() == data
    assert rails.rules[1].action is Action.APPLY_COUPON


def test_parsed_static_weights_are_read_only() -> None:
    rails = gr.Guardrails.parse(SPEC)
    with pytest.raises(ValueError, match="read-only"):
        rails.static[0] = 5.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], r"^guardrails: expected an object"),
        ({"rules": []}, r"^guardrails\.static: expected an object"),
        (spec_with(static={"add_to_cart": 1.0}),
         r"^guardrails\.static: missing \['apply_coupon', 'exit', 'share_social', 'view_detail'\], unknown \[\]"),
        (spec_with(static={**SPEC["static"], "buy_now": 1.0}), r"^guardrails\.static: missing \[\], unknown \['buy_now'\]"),
        (spec_with(static={**SPEC["static"], "exit": -0.5}), r"^guardrails\.static\.exit: expected a finite number >= 0"),
        (spec_with(static={**SPEC["static"], "share_social": float("nan")}), r"^guardrails\.static\.share_social: expected a finite"),
        (spec_with(static={**SPEC["static"], "view_detail": True}), r"^guardrails\.static\.view_detail: expected a finite"),
        (spec_with(static={a.key: 0 for a in ACTIONS}), r"^guardrails\.static: every action is banned"),
        (spec_with(rules=[{**SPEC["rules"][0], "multiplier": -1}]),
         r"^guardrails\.rules\[0\]\.multiplier \(full_cart_damp_add\): expected a finite number >= 0, got -1"),
        (spec_with(rules=[{**SPEC["rules"][0], "multiplier": "0.3"}]), r"^guardrails\.rules\[0\]\.multiplier \(full_cart_damp_add\)"),
        (spec_with(rules=[{**SPEC["rules"][0], "multiplier": float("inf")}]), r"^guardrails\.rules\[0\]\.multiplier"),
        (spec_with(rules=[SPEC["rules"][0], {**SPEC["rules"][0], "action": "buy_now"}]),
         r"^guardrails\.rules\[1\]\.name: expected a unique non-empty string of at most 100 printable characters, "
         r"got 'full_cart_damp_add'"),
        (spec_with(rules=[SPEC["rules"][0], {**SPEC["rules"][0], "name": "other", "action": "buy_now"}]),
         r"^guardrails\.rules\[1\]\.action \(other\): unknown action 'buy_now'"),
        (spec_with(rules=[{**SPEC["rules"][0], "name": ""}]), r"^guardrails\.rules\[0\]\.name"),
        # a metric label and every log record carry it: no lone surrogate, no control character, bounded
        (spec_with(rules=[{**SPEC["rules"][0], "name": "\ud800"}]), r"^guardrails\.rules\[0\]\.name: .* got '\\ud800'"),
        (spec_with(rules=[{**SPEC["rules"][0], "name": "a\nb"}]), r"^guardrails\.rules\[0\]\.name"),
        (spec_with(rules=[{**SPEC["rules"][0], "name": "r" * 101}]), r"^guardrails\.rules\[0\]\.name"),
        (spec_with(rules=[{**SPEC["rules"][0], "when": {"hour_min": 30, "hour_max": 2}}]),
         r"^guardrails\.rules\[0\]\.when\.hour_min: expected an integer in \[0, 23\]"),
        (spec_with(rules=[{**SPEC["rules"][0], "priority": 1}]), r"^guardrails\.rules\[0\]: expected an object with"),
        (spec_with(rules=["full_cart"]), r"^guardrails\.rules\[0\]: expected an object with"),
    ],
)
def test_parse_errors_name_the_path(spec: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        gr.Guardrails.parse(spec)


@pytest.mark.parametrize("rules", [None, 5, {"name": "x"}])
def test_rules_that_are_not_a_list_are_a_schema_error(rules: Any) -> None:
    """A bundle with ``"rules": null`` (or any non-list) must be rejected as bad data, not crash."""
    with pytest.raises(SchemaError, match=r"^guardrails\.rules"):
        gr.Guardrails.parse(spec_with(rules=rules))
