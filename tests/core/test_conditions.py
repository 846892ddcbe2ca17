"""Declarative request conditions: parsing (errors name the path) and matching."""

from __future__ import annotations

from typing import Any

import pytest

from core.conditions import Condition, SchemaError
from core.domain import Context, PageType


def ctx(page: PageType = PageType.SEARCH, cart: int = 0, hour: int = 12, recent: int = 0) -> Context:
    return Context(page_type=page, cart_item_count=cart, hour=hour, n_recent_behaviors=recent)


def test_missing_or_empty_condition_matches_every_request() -> None:
    for cond in (Condition.parse(None, "w"), Condition.parse({}, "w")):
        assert cond == Condition()
        for page in PageType:
            assert cond.matches(ctx(page=page, cart=7, hour=3, recent=2))


def test_hour_range_wrapping_midnight() -> None:
    cond = Condition.parse({"hour_min": 22, "hour_max": 5}, "w")
    matching = {h for h in range(24) if cond.matches(ctx(hour=h))}
    assert matching == {22, 23, 0, 1, 2, 3, 4, 5}


def test_hour_range_within_a_day_is_inclusive() -> None:
    cond = Condition.parse({"hour_min": 9, "hour_max": 17}, "w")
    assert {h for h in range(24) if cond.matches(ctx(hour=h))} == set(range(9, 18))
    single = Condition.parse({"hour_min": 12, "hour_max": 12}, "w")
    assert {h for h in range(24) if single.matches(ctx(hour=h))} == {12}


def test_cart_bounds_are_inclusive() -> None:
    cond = Condition.parse({"cart_item_count_min": 3, "cart_item_count_max": 5}, "w")
    assert [c for c in range(10) if cond.matches(ctx(cart=c))] == [3, 4, 5]
    at_least = Condition.parse({"cart_item_count_min": 3}, "w")
    assert not at_least.matches(ctx(cart=2))
    assert at_least.matches(ctx(cart=3))
    assert at_least.matches(ctx(cart=10_000))
    at_most = Condition.parse({"cart_item_count_max": 0}, "w")
    assert [c for c in range(5) if at_most.matches(ctx(cart=c))] == [0]


def test_page_types() -> None:
    cond = Condition.parse({"page_type": ["cart", "DETAIL"]}, "w")
    assert cond.page_types == frozenset({PageType.CART, PageType.DETAIL})
    assert {p for p in PageType if cond.matches(ctx(page=p))} == {PageType.CART, PageType.DETAIL}


@pytest.mark.parametrize(("flag", "matches_none", "matches_some"), [(True, False, True), (False, True, False)])
def test_has_recent_behavior(flag: bool, matches_none: bool, matches_some: bool) -> None:
    cond = Condition.parse({"has_recent_behavior": flag}, "w")
    assert cond.matches(ctx(recent=0)) is matches_none
    assert cond.matches(ctx(recent=1)) is matches_some
    assert cond.matches(ctx(recent=3)) is matches_some


def test_every_key_must_hold() -> None:
    cond = Condition.parse({"page_type": ["cart"], "cart_item_count_min": 1, "hour_min": 20, "hour_max": 2,
                            "has_recent_behavior": True}, "w")
    good = ctx(page=PageType.CART, cart=1, hour=23, recent=1)
    assert cond.matches(good)
    assert not cond.matches(ctx(page=PageType.SEARCH, cart=1, hour=23, recent=1))
    assert not cond.matches(ctx(page=PageType.CART, cart=0, hour=23, recent=1))
    assert not cond.matches(ctx(page=PageType.CART, cart=1, hour=12, recent=1))
    assert not cond.matches(ctx(page=PageType.CART, cart=1, hour=23, recent=0))


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"page_type": ["search", "recommend"]},
        {"cart_item_count_min": 1, "cart_item_count_max": 4},
        {"hour_min": 22, "hour_max": 5},
        {"has_recent_behavior": False},
        {"page_type": ["cart"], "cart_item_count_min": 3, "hour_min": 0, "hour_max": 23, "has_recent_behavior": True},
    ],
)
def test_to_json_round_trips(spec: dict[str, Any]) -> None:
    cond = Condition.parse(spec, "w")
    assert cond.to_json() == {k: sorted(v) if k == "page_type" else v for k, v in spec.items()}
    assert Condition.parse(cond.to_json(), "w") == cond


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], r"^r\.when: expected an object, got list$"),
        ({"weekday": 1}, r"^r\.when: unknown key\(s\) \['weekday'\]"),
        ({"page_type": []}, r"^r\.when\.page_type: expected a non-empty list"),
        ({"page_type": "cart"}, r"^r\.when\.page_type: expected a non-empty list"),
        ({"page_type": ["checkout"]}, r"^r\.when\.page_type: unknown page type 'checkout'"),
        ({"hour_min": 24, "hour_max": 2}, r"^r\.when\.hour_min: expected an integer in \[0, 23\], got 24"),
        ({"hour_min": 1, "hour_max": -1}, r"^r\.when\.hour_max: expected an integer in \[0, 23\], got -1"),
        ({"hour_min": 1.0, "hour_max": 2}, r"^r\.when\.hour_min: expected an integer"),
        ({"hour_min": 3}, r"^r\.when: hour_min and hour_max go together"),
        ({"hour_max": 3}, r"^r\.when: hour_min and hour_max go together"),
        ({"cart_item_count_min": True}, r"^r\.when\.cart_item_count_min: expected an integer"),
        ({"cart_item_count_min": -1}, r"^r\.when\.cart_item_count_min: expected an integer"),
        ({"cart_item_count_max": "3"}, r"^r\.when\.cart_item_count_max: expected an integer"),
        ({"cart_item_count_min": 5, "cart_item_count_max": 4}, r"^r\.when: cart_item_count_min > cart_item_count_max"),
        ({"has_recent_behavior": 1}, r"^r\.when\.has_recent_behavior: expected true or false"),
    ],
)
def test_parse_errors_name_the_path(spec: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Condition.parse(spec, "r.when")
