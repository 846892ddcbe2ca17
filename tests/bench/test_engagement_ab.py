"""bench.engagement_ab's arithmetic and bench.loop's add-to-cart conversion, on small closed-form inputs."""

from __future__ import annotations

import numpy as np
import pytest

from bench.engagement_ab import compare
from bench.loop import constant, per_session, play
from core.domain import Action, Outcome
from simulator.config import SimConfig
from simulator.world import World


def test_each_cycle_is_compared_paired_over_the_shared_sessions() -> None:
    plain = {f"cycle{c}.{m}": np.array([1.0, 2.0, 3.0, 4.0]) + c for c in range(2)
             for m in ("objective", "net_gmv", "add_to_cart_conversion")}
    weighted = {k: v + np.array([0.5, 0.5, 0.5, 0.5]) if k.startswith("cycle1") else v.copy() for k, v in plain.items()}
    rows = compare(plain, weighted, 1)
    assert [r["cycle"] for r in rows] == [0, 1]
    zero, half = rows[0]["objective"]["weighted_minus_plain"], rows[1]["objective"]["weighted_minus_plain"]
    assert (zero["mean"], zero["ci_low"], zero["ci_high"]) == (0.0, 0.0, 0.0)
    assert half["mean"] == pytest.approx(0.5) and half["ci_low"] == pytest.approx(0.5)  # the same shift on every session
    assert rows[1]["net_gmv"]["plain"]["mean"] == pytest.approx(3.5) and rows[1]["net_gmv"]["weighted"]["mean"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="different truth sessions"):
        compare(plain, {**weighted, "cycle0.objective": np.zeros(3)}, 1)


def test_add_to_cart_conversion_is_the_share_of_sessions_that_carted() -> None:
    world, sessions = World(SimConfig(), 7), range(300)
    conversion = per_session(play(world, sessions, constant(Action.ADD_TO_CART)), world, sessions)["add_to_cart_conversion"]
    carted = []  # the same shoppers asked to add to cart on every page, straight from the world
    for i in sessions:
        shopper, events = world.session(i), []
        while shopper.page() is not None:
            events += shopper.respond(Action.ADD_TO_CART)
        carted.append(float(any(e.outcome is Outcome.ADD_TO_CART for e in events)))
    assert conversion.tolist() == carted
    assert 0.2 < conversion.mean() < 0.95  # a real mix of sessions that carted and that did not
    never = per_session(play(world, sessions, constant(Action.VIEW_DETAIL)), world, sessions)["add_to_cart_conversion"]
    assert never.sum() == 0.0  # nobody is asked to add to cart
