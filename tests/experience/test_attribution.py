"""Attribution rules as data; last-touch and any-decision crediting against hand-computed rewards."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Action, Outcome
from experience.attribution import (
    DEFAULT_RULES,
    LAST_TOUCH_RULES,
    AttributionConfig,
    AttributionRule,
    ConfigError,
    attribute,
)
from experience.objective import BusinessObjective
from experience.sessions import HORIZON_S, EpisodeConfig, build_episodes
from tests.log_tables import decisions, outcome_table

T0 = 1_700_000_000.25  # a realistic epoch time with a fractional part
DAY, HOUR = 86_400.0, 3_600.0
CART, COUPON, VIEW = int(Action.ADD_TO_CART), int(Action.APPLY_COUPON), int(Action.VIEW_DETAIL)
ORDER, COMPLAINT = int(Outcome.ORDER), int(Outcome.COMPLAINT)
LAST_TOUCH = EpisodeConfig(attribution=AttributionConfig(LAST_TOUCH_RULES))


def outcomes(*rows: tuple[str, str, int, float, float, float]) -> pa.Table:
    """Rows of (outcome_id, session_id, outcome, event_time_s, value, coupon_discount); received 1 s later."""
    keys = ("outcome_id", "session_id", "outcome", "event_time_s", "value", "coupon_discount")
    return outcome_table(dict(zip(keys, r, strict=True)) for r in rows)

def rewards_by_decision(d: pa.Table, o: pa.Table, config: EpisodeConfig | None = None) -> dict[str, float]:
    episodes = build_episodes(d, o, config)
    ids = d["decision_id"].to_pylist()
    return {ids[row]: float(r) for row, r in zip(episodes.rows, episodes.rewards, strict=True)}


def order(oid: str, t: float, value: float = 100.0, discount: float = 0.0, session: str = "s") -> tuple[str, str, int, float, float, float]:
    return (oid, session, ORDER, t, value, discount)


# --- the rules as data -----------------------------------------------------------------------------------------------


def test_default_rules_are_the_business_objective() -> None:
    assert AttributionConfig().rules == DEFAULT_RULES == BusinessObjective().rules(HORIZON_S)
    order_rule, complaint = DEFAULT_RULES
    assert (order_rule.action, order_rule.outcome, order_rule.window_s, order_rule.field, order_rule.weight) == (
        None, Outcome.ORDER, HORIZON_S, "net_value", 1.0)
    assert (complaint.action, complaint.outcome, complaint.window_s, complaint.field, complaint.weight) == (
        None, Outcome.COMPLAINT, HORIZON_S, "count", -10.0)


def test_last_touch_rules() -> None:
    cart, coupon = LAST_TOUCH_RULES
    assert (cart.action, cart.outcome, cart.window_s, cart.field, cart.weight) == (Action.ADD_TO_CART, Outcome.ORDER, DAY, "value", 0.3)
    assert (coupon.action, coupon.outcome, coupon.window_s, coupon.field, coupon.weight) == (
        Action.APPLY_COUPON,
        Outcome.ORDER,
        HOUR,
        "coupon_discount",
        0.7,
    )


def test_config_round_trips_through_json() -> None:
    config = AttributionConfig()
    data = json.loads(json.dumps(config.to_dict()))
    assert data["rules"][0] == {"action": "any", "outcome": "order", "window_s": HORIZON_S, "field": "net_value", "weight": 1.0}
    assert data["rules"][1] == {"action": "any", "outcome": "complaint", "window_s": HORIZON_S, "field": "count", "weight": -10.0}
    assert AttributionConfig.from_dict(data) == config
    assert AttributionConfig.from_dict({}) == config
    assert AttributionConfig.from_dict({"rules": []}).rules == ()
    last_touch = AttributionConfig(LAST_TOUCH_RULES)
    data = json.loads(json.dumps(last_touch.to_dict()))
    assert data["rules"][0] == {"action": "add_to_cart", "outcome": "order", "window_s": DAY, "field": "value", "weight": 0.3}
    assert AttributionConfig.from_dict(data) == last_touch


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], "attribution: expected an object"),
        ({"rule": []}, "attribution: unknown key(s) ['rule']"),
        ({"rules": {}}, "attribution.rules: expected a list"),
        ({"rules": ["x"]}, "attribution.rules[0]: expected an object"),
        ({"rules": [{"action": "add_to_cart"}]}, "attribution.rules[0]: missing key(s) ['outcome', 'window_s', 'field', 'weight']"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "gmv": 1}]}, "attribution.rules[0]: unknown key(s) ['gmv']"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "action": "add_to_kart"}]}, "attribution.rules[0].action: unknown action"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "action": 1}]}, "attribution.rules[0].action: expected a string"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "outcome": "purchase"}]}, "attribution.rules[0].outcome: unknown outcome"),
        (
            {"rules": [DEFAULT_RULES[0].to_dict(), {**DEFAULT_RULES[1].to_dict(), "window_s": "1h"}]},
            "attribution.rules[1].window_s: expected a number",
        ),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "window_s": -1}]}, "attribution.rules[0].window_s: expected a finite number >= 0"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "window_s": float("inf")}]}, "attribution.rules[0].window_s"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "weight": True}]}, "attribution.rules[0].weight: expected a number"),
        ({"rules": [{**DEFAULT_RULES[0].to_dict(), "field": "gmv"}]}, "attribution.rules[0].field: expected one of"),
        ({"rules": [{**DEFAULT_RULES[1].to_dict(), "action": "all"}]}, "attribution.rules[0].action: unknown action 'all'"),
        ({"rules": [{**DEFAULT_RULES[1].to_dict(), "action": None}]}, "attribution.rules[0].action: expected a string"),
        ({"rules": [{**DEFAULT_RULES[1].to_dict(), "field": "net"}]}, "attribution.rules[0].field: expected one of"),
    ],
)
def test_bad_config_names_the_key(spec: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AttributionConfig.from_dict(spec)
    assert str(info.value).startswith(message), str(info.value)


# --- windows and last touch ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("delay", "credited"), [(0.0, True), (1.0, True), (DAY - 1, True), (DAY, True), (DAY + 1, False)])
def test_add_to_cart_window_is_24h_inclusive(delay: float, credited: bool) -> None:
    d = decisions(("a", "s", T0, CART))
    r = rewards_by_decision(d, outcomes(order("o", T0 + delay, value=200.0)), LAST_TOUCH)
    assert r == {"a": 60.0 if credited else 0.0}


def test_order_before_the_decision_is_not_credited_to_it() -> None:
    d = decisions(("a", "s", T0, CART))
    assert rewards_by_decision(d, outcomes(order("o", T0 - 1))) == {"a": 0.0}
    assert rewards_by_decision(d, outcomes(order("o", T0 - 1)), LAST_TOUCH) == {"a": 0.0}


@pytest.mark.parametrize(("delay", "credited"), [(0.0, True), (HOUR, True), (HOUR + 1, False), (2 * HOUR, False)])
def test_coupon_window_is_1h_inclusive(delay: float, credited: bool) -> None:
    d = decisions(("c", "s", T0, COUPON))
    r = rewards_by_decision(d, outcomes(order("o", T0 + delay, value=500.0, discount=10.0)), LAST_TOUCH)
    assert r == {"c": pytest.approx(7.0) if credited else 0.0}


def test_only_the_latest_add_to_cart_is_credited() -> None:
    d = decisions(("a1", "s", T0, CART), ("v", "s", T0 + 10, VIEW), ("a2", "s", T0 + 20, CART), ("a3", "s", T0 + 99, CART))
    r = rewards_by_decision(d, outcomes(order("o", T0 + 50, value=100.0)), LAST_TOUCH)
    assert r == {"a1": 0.0, "v": 0.0, "a2": 30.0, "a3": 0.0}  # a3 came after the order


def test_latest_touch_out_of_window_credits_nobody() -> None:
    d = decisions(("c1", "s", T0, COUPON), ("c2", "s", T0 + 10, COUPON))
    r = rewards_by_decision(d, outcomes(order("o", T0 + 10 + HOUR + 1, discount=10.0)), LAST_TOUCH)
    assert r == {"c1": 0.0, "c2": 0.0}


def test_equal_times_credit_the_last_decision_id() -> None:
    d = decisions(("b", "s", T0, CART), ("a", "s", T0, CART))
    assert rewards_by_decision(d, outcomes(order("o", T0, value=10.0)), LAST_TOUCH) == {"a": 0.0, "b": 3.0}


def test_one_order_feeds_both_rules() -> None:
    d = decisions(("a", "s", T0, CART), ("c", "s", T0 + 60, COUPON), ("v", "s", T0 + 120, VIEW))
    r = rewards_by_decision(d, outcomes(order("o", T0 + 600, value=100.0, discount=20.0)), LAST_TOUCH)
    assert r == {"a": 30.0, "c": pytest.approx(14.0), "v": 0.0}


def test_multiple_orders() -> None:
    d = decisions(("a1", "s", T0, CART), ("a2", "s", T0 + 2 * DAY, CART))
    o = outcomes(
        order("o1", T0 + 10, value=100.0),
        order("o2", T0 + HOUR, value=50.0),  # both credit a1
        order("o3", T0 + 2 * DAY + 5, value=10.0),  # a2
        order("o4", T0 + 1.5 * DAY, value=1000.0),
    )  # a1 is 36 h old, a2 not yet served: nobody
    assert rewards_by_decision(d, o, LAST_TOUCH) == {"a1": pytest.approx(45.0), "a2": 3.0}


def test_orders_join_by_session_and_time_not_decision_id() -> None:
    d = decisions(("a", "s", T0, CART), ("x", "other", T0, CART), ("v", "s", T0 + 5, VIEW))
    o = outcomes(order("o", T0 + 10, value=100.0))
    o = o.set_column(o.column_names.index("decision_id"), "decision_id", pa.array(["x"]))  # reported against another decision
    assert rewards_by_decision(d, o, LAST_TOUCH) == {"a": 30.0, "x": 0.0, "v": 0.0}
    assert rewards_by_decision(d, o) == {"a": 0.0, "x": 0.0, "v": 100.0}  # any decision: the latest in the session


def test_other_outcomes_do_not_credit_order_rules() -> None:
    d = decisions(("a", "s", T0, CART), ("c", "s", T0 + 1, COUPON))
    kinds = [int(k) for k in Outcome if k is not Outcome.ORDER]
    o = outcomes(*[(f"o{k}", "s", k, T0 + 5, 100.0, 10.0) for k in kinds])
    assert rewards_by_decision(d, o, LAST_TOUCH) == {"a": 0.0, "c": 0.0}
    # The defaults: of those, only the complaint costs (10, whatever its value and discount columns say).
    assert rewards_by_decision(d, o) == {"a": 0.0, "c": -10.0}


def test_custom_rules_from_data() -> None:
    config = EpisodeConfig.from_dict(
        {
            "attribution": {
                "rules": [
                    {"action": "share_social", "outcome": "complaint", "window_s": 60, "field": "value", "weight": -1},
                    {"action": "view_detail", "outcome": "order", "window_s": 10, "field": "value", "weight": 0.5},
                ]
            }
        }
    )
    d = decisions(("s1", "s", T0, int(Action.SHARE_SOCIAL)), ("v", "s", T0 + 1, VIEW), ("a", "s", T0 + 2, CART))
    o = outcomes(("c", "s", int(Outcome.COMPLAINT), T0 + 60, 2.0, 0.0), order("o", T0 + 11, value=100.0))
    assert rewards_by_decision(d, o, config) == {"s1": -2.0, "v": 50.0, "a": 0.0}


# --- any decision, net value, count: the objective where it is observed ------------------------------------------------


def test_an_order_credits_the_last_decision_at_or_before_it_whatever_it_served() -> None:
    d = decisions(("v", "s", T0, VIEW), ("c", "s", T0 + 10, COUPON), ("a", "s", T0 + 20, CART), ("late", "s", T0 + 99, VIEW))
    r = rewards_by_decision(d, outcomes(order("o", T0 + 50, value=100.0, discount=15.0)))
    assert r == {"v": 0.0, "c": 0.0, "a": 85.0, "late": 0.0}  # net value, to a; "late" came after the order
    # At equal times the decision counts as before the order, and the later decision id is the latest.
    d = decisions(("v", "s", T0, VIEW), ("b", "s", T0 + 5, COUPON), ("a", "s", T0 + 5, VIEW))
    assert rewards_by_decision(d, outcomes(order("o", T0 + 5, value=40.0))) == {"v": 0.0, "a": 0.0, "b": 40.0}


def test_complaints_cost_their_count_and_orders_their_net_value() -> None:
    """Closed form: r = Σ orders (value − discount) − 10 · complaints, each at the latest decision before it."""
    d = decisions(("d0", "s", T0, COUPON), ("d1", "s", T0 + 60, CART), ("d2", "s", T0 + 120, VIEW), ("u0", "u", T0, VIEW))
    o = outcomes(
        ("k1", "s", COMPLAINT, T0 + 30, 7.0, 3.0),  # d0: −10 (its value and discount columns are not read)
        ("k2", "s", COMPLAINT, T0 + 31, 0.0, 0.0),  # d0: −10
        order("o1", T0 + 90, value=200.0, discount=30.0),  # d1: +170
        order("o2", T0 + 2 * DAY, value=50.0, discount=0.0),  # d2, two days on (the window is the 72 h horizon): +50
        order("o3", T0 + 1, value=10.0, discount=10.0, session="u"),  # u0: 0 (all of it given away)
    )
    assert rewards_by_decision(d, o) == {"d0": -20.0, "d1": 170.0, "d2": 50.0, "u0": 0.0}


def test_any_rules_keep_their_window() -> None:
    rules = (AttributionRule(None, Outcome.ORDER, 60.0, "net_value", 1.0), AttributionRule(None, Outcome.ORDER, 60.0, "count", 2.0))
    config = EpisodeConfig(attribution=AttributionConfig(rules))
    d = decisions(("a", "s", T0, CART), ("b", "s", T0 + 100, VIEW))
    o = outcomes(order("o1", T0 + 60, value=10.0, discount=1.0), order("o2", T0 + 161, value=10.0))
    # o1 at a's window edge credits a (9 net, 2 for the count); o2 61 s after b credits nobody, not even the older a.
    assert rewards_by_decision(d, o, config) == {"a": 11.0, "b": 0.0}


def test_attribute_kernel_without_matches_is_zero() -> None:
    session = np.array([0, 0, 1], dtype=np.int64)
    time = np.array([0.0, 1.0, 0.0])
    action = np.array([CART, CART, VIEW])
    fields = {"value": np.array([100.0]), "coupon_discount": np.array([0.0])}
    out = attribute(session, time, action, np.array([1]), np.array([0.5]), np.array([ORDER]), fields, LAST_TOUCH_RULES)
    assert out.tolist() == [0.0, 0.0, 0.0]  # the order is in session 1, which has no add_to_cart
    out = attribute(session, time, action, np.array([0]), np.array([0.5]), np.array([ORDER]), fields, LAST_TOUCH_RULES)
    assert out.tolist() == [30.0, 0.0, 0.0]
    out = attribute(session, time, action, np.array([1]), np.array([0.5]), np.array([ORDER]), fields, DEFAULT_RULES)
    assert out.tolist() == [0.0, 0.0, 100.0]  # any decision: session 1's view_detail
    assert attribute(session, time, action, np.array([0]), np.array([0.5]), np.array([ORDER]), fields, ()).tolist() == [0.0] * 3


def test_rule_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="field"):
        AttributionRule(Action.ADD_TO_CART, Outcome.ORDER, 1.0, "gmv", 1.0)
    with pytest.raises(ConfigError, match="weight"):
        AttributionRule(Action.ADD_TO_CART, Outcome.ORDER, 1.0, "value", float("nan"))


MIXED_RULES = (
    AttributionRule(Action.ADD_TO_CART, Outcome.ORDER, 600.0, "value", 0.3),
    AttributionRule(Action.APPLY_COUPON, Outcome.ORDER, 60.0, "coupon_discount", 0.7),
    AttributionRule(None, Outcome.ORDER, 900.0, "net_value", 1.0),
    AttributionRule(None, Outcome.EXIT, 300.0, "count", -2.0),
    AttributionRule(Action.VIEW_DETAIL, Outcome.EXIT, 120.0, "net_value", 0.5),
)


@pytest.mark.parametrize("rules", [MIXED_RULES[:2], MIXED_RULES], ids=["last-touch", "mixed"])
def test_random_logs_match_a_plain_loop(rules: tuple[AttributionRule, ...]) -> None:
    """The vectorised join against the module doc's rule, written out per outcome (small integer times: many ties and edges)."""
    rng = np.random.default_rng(11)
    n_dec, n_out = 400, 300
    d_rows = [
        (f"d{i:03d}", f"s{rng.integers(8)}", T0 + float(rng.integers(0, 4000)), int(rng.choice([CART, COUPON, VIEW]))) for i in range(n_dec)
    ]
    o_rows = [
        (
            f"o{i}",
            f"s{rng.integers(9)}",
            int(rng.choice([ORDER, int(Outcome.EXIT)])),
            T0 + float(rng.integers(0, 4000)),
            float(rng.integers(1, 100)),
            float(rng.integers(0, 10)),
        )
        for i in range(n_out)
    ]
    config = EpisodeConfig(attribution=AttributionConfig(rules))
    got = rewards_by_decision(decisions(*d_rows), outcomes(*o_rows), config)

    expected = {d[0]: 0.0 for d in d_rows}
    first = {s: min(t for _, s2, t, _ in d_rows if s2 == s) for _, s, _, _ in d_rows}
    for _, session, kind, t, value, discount in o_rows:
        if session not in first or t < first[session]:
            continue
        field = {"value": value, "coupon_discount": discount, "net_value": value - discount, "count": 1.0}
        for rule in rules:
            if kind != int(rule.outcome):
                continue
            touches = sorted(
                (dt, did) for did, ds, dt, da in d_rows if ds == session and rule.action in (None, da) and dt <= t
            )
            if touches and t <= touches[-1][0] + rule.window_s:
                expected[touches[-1][1]] += rule.weight * field[rule.field]
    assert sum(v != 0 for v in expected.values()) > 20  # the check has teeth
    assert got == pytest.approx(expected)
