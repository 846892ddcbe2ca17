"""bench.loop's scoring: the action mix per hidden intent shows what each kind of shopper was served."""

from __future__ import annotations

import pytest

from bench.loop import play, scored
from simulator.config import SimConfig
from simulator.reference import intent_policy
from simulator.world import World


def test_the_mix_per_intent_shows_what_each_shopper_was_served() -> None:
    world = World(SimConfig(), 7)
    sessions = range(0, 300)
    oracle = scored("intent policy", play(world, sessions, intent_policy), world, sessions)["action_mix_by_intent"]
    assert set(oracle) == {"buyer", "browser", "bargain_hunter", "social_sharer"}
    assert oracle["buyer"]["add_to_cart"] == 1.0  # buyers are asked to add to cart, nothing else
    assert oracle["bargain_hunter"]["apply_coupon"] > 0.2 and oracle["buyer"]["apply_coupon"] == 0.0
    assert oracle["social_sharer"]["share_social"] > 0.2 and oracle["browser"]["share_social"] == 0.0
    assert oracle["browser"]["view_detail"] > 0.5
    for mix in oracle.values():
        assert sum(mix.values()) == pytest.approx(1.0)
