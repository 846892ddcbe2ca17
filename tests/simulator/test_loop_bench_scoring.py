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


def test_the_gate_is_held_against_the_truth_of_what_it_judged() -> None:
    import numpy as np

    from bench.loop import gate_against_truth

    def truth(values: list[float]) -> dict[str, object]:
        return {"_per_session": {"objective": np.array(values)}}

    before, after = truth([10.0, 12.0, 14.0]), truth([13.0, 15.0, 17.0])  # +3 on every shared session
    published = {"exit": 0, "gate": {"difference": {"value": 2.0, "ci_low": 1.0, "ci_high": 4.0}}, "truth": after}
    assert gate_against_truth(published, {"truth": before}) == {"dr": 2.0, "ci_low": 1.0, "ci_high": 4.0, "truth": 3.0,
                                                                 "held": True}
    refused = {"exit": 3, "gate": {"difference": {"value": -1.0, "ci_low": -4.0, "ci_high": 0.5}}, "truth": before,
               "refused_candidate": {"vs_served": {"mean": 4.3}}}
    assert gate_against_truth(refused, {"truth": before})["held"] is False  # an interval below the candidate's true gain
    assert gate_against_truth({"exit": 3, "gate": {}, "truth": before}, {"truth": before}) is None
    assert gate_against_truth({"exit": 3, "gate": {"difference": published["gate"]["difference"]}, "truth": before},
                              {"truth": before}) is None  # refused without a kept candidate to score: nothing to hold
