"""bench.loop's scoring: the action mix per hidden intent shows what each kind of shopper was served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import loop
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
    published = {"exit": 0, "gate": {"published": "published", "difference": {"value": 2.0, "ci_low": 1.0, "ci_high": 4.0},
                                     "checks": {"pareto_k": 0.62, "ess": 810.5, "tolerance": 0.0}},
                 "truth": after}
    assert gate_against_truth(published, {"truth": before}) == {"dr": 2.0, "ci_low": 1.0, "ci_high": 4.0, "truth": 3.0,
                                                                 "held": True, "pareto_k": 0.62, "ess": 810.5}
    # a canary promoted first, then its successor published: the gate judged the successor against the canary
    canary = truth([12.0, 14.0, 16.0])
    after_promotion = {**published, "canary": {"action": "promote"}}
    assert gate_against_truth(after_promotion, {"truth": before, "canary_bundle": canary})["truth"] == 1.0
    # a canary promoted and its successor refused: exit 0, yet the gate's interval is the refused candidate's
    promoted_refused = {"exit": 0, "gate": {"difference": {"value": -1.0, "ci_low": -4.0, "ci_high": 0.5}}, "truth": canary,
                        "canary": {"action": "promote"}, "refused_candidate": {"vs_served": {"mean": 0.2}}}
    assert gate_against_truth(promoted_refused, {"truth": before})["truth"] == 0.2
    assert gate_against_truth(promoted_refused, {"truth": before})["pareto_k"] is None  # a report without checks
    refused = {"exit": 3, "gate": {"difference": {"value": -1.0, "ci_low": -4.0, "ci_high": 0.5}}, "truth": before,
               "refused_candidate": {"vs_served": {"mean": 4.3}}}
    assert gate_against_truth(refused, {"truth": before})["held"] is False  # an interval below the candidate's true gain
    assert gate_against_truth({"exit": 3, "gate": {}, "truth": before}, {"truth": before}) is None
    assert gate_against_truth({"exit": 3, "gate": {"difference": published["gate"]["difference"]}, "truth": before},
                              {"truth": before}) is None  # refused without a kept candidate to score: nothing to hold


def test_a_canary_look_is_held_against_the_truth_of_the_two_bundles_it_compared() -> None:
    import numpy as np

    from bench.loop import canary_against_truth

    def truth(values: list[float]) -> dict[str, object]:
        return {"_per_session": {"objective": np.array(values)}}

    served, canary = truth([10.0, 12.0, 14.0]), truth([12.0, 14.0, 16.0])  # the canary is +2 on every session
    look = {"action": "wait", "look": 1, "estimate": 4.0, "ci_low": -1.0, "ci_high": 9.0}
    waiting = {"canary": look, "truth": served}
    assert canary_against_truth(waiting, {"truth": served, "canary_bundle": {"vs_served": {"mean": 2.0}}}) == {
        "action": "wait", "estimate": 4.0, "ci_low": -1.0, "ci_high": 9.0, "truth": 2.0, "held": True}
    promoted = {"canary": {**look, "action": "promote", "ci_low": 2.5}, "truth": canary}  # the active one after it
    assert canary_against_truth(promoted, {"truth": served})["held"] is False  # its lower bound above the true +2
    assert canary_against_truth({"canary": {**look, "look": 0}, "truth": served}, {"truth": served}) is None
    assert canary_against_truth({"truth": served}, {"truth": served}) is None
    # a look on too few sessions: null in the cycle's strict JSON (a review found the bench's float(None) after the change)
    from core.json_lines import json_line
    from trainer.canary import Verdict

    too_few = {"canary": {**json.loads(json_line(Verdict("wait", "too few sessions", 3, 2).to_dict())), "look": 1}, "truth": served}
    assert too_few["canary"]["estimate"] is None and canary_against_truth(too_few, {"truth": served}) is None


@pytest.mark.parametrize("argv", [["--canary-level", "0.95"], ["--canary", "0.5", "--canary-level", "1"],
                                  ["--canary", "0.5", "--canary-level", "0.2"], ["--canary", "0.7"]])
def test_the_canary_level_is_refused_by_name_without_a_canary_or_outside_its_range(argv: list[str],
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        loop.main(argv)
    assert exit_info.value.code == 2
    assert "--canary-level" in capsys.readouterr().err


def test_a_bad_config_is_refused_by_name_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"advantage": "q"}))
    with pytest.raises(SystemExit) as exit_info:
        loop.main(["--config", str(config), "--out", str(tmp_path / "loop.json")])
    assert exit_info.value.code == 2
    assert "--config" in (err := capsys.readouterr().err) and "advantage" in err
    assert not (tmp_path / "loop.json").exists()


def test_the_report_names_the_canary_level_the_looks_used() -> None:
    assert loop.canary_settings(0.0, None) is None
    chosen = loop.canary_settings(0.5, 0.95)
    assert chosen is not None and (chosen.fraction, chosen.level) == (0.5, 0.95)
    default = loop.canary_settings(0.5, None)
    assert default is not None and default.level == 0.99  # the trainer's default (trainer.canary.CanarySettings)
