"""``bench.offline_learners``' own logs: the untrained bundle with the exploration asked for serves them, and its logged
behaviour is that exploration (broad logs are what the bench's claim about exploration rests on)."""

from pathlib import Path

import numpy as np
import pytest

from bench.offline_learners import exploration_of, explored_logs
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.world import World
from weights.bundle import read_bundle
from weights.validate import verify


def test_exploration_settings_are_read_and_refused_by_name() -> None:
    assert exploration_of("0.5,100") == (0.5, 100.0)
    for bad in ("0.5", "1.5,3", "0.5,0", "0.5,inf", "a,b"):
        with pytest.raises(ValueError):
            exploration_of(bad)


def test_the_untrained_bundle_serves_the_logs_with_the_exploration_asked_for(tmp_path: Path) -> None:
    world = World(SimConfig(), 7)
    narrow = explored_logs(world, None, 0.05, 1.2, 300, tmp_path / "narrow")
    broad = explored_logs(world, None, 1.0, 1e6, 300, tmp_path / "broad")  # every page explores, uniformly over the allowed
    for path, (epsilon, temperature) in ((narrow, (0.05, 1.2)), (broad, (1.0, 1e6))):
        verify(path.read_bytes())  # a valid bundle: checksums and parts as the servers check them
        decoder = read_bundle(path).manifest["decoder"]
        assert (decoder["exploration_epsilon"], decoder["exploration_temperature"]) == (epsilon, temperature)
    served = {}
    for name in ("narrow", "broad"):
        decisions = DirectorySource(tmp_path / name / "logs").table("decisions")
        assert decisions.num_rows > 300  # every session logged, several pages each
        served[name] = np.array(decisions.column("served_probs").to_pylist())
    allowed = served["broad"] > 0  # what the guardrails permit on each page (the default guardrails ban exit everywhere)
    assert allowed.sum(axis=1).min() >= 2
    uniform = np.where(allowed, 1.0 / allowed.sum(axis=1, keepdims=True), 0.0)
    assert np.allclose(served["broad"], uniform, atol=1e-3)  # uniform over the allowed actions, page by page
    assert served["narrow"].max(axis=1).mean() > 0.6  # the untrained policy's own preference (view_detail), sharpened by the vote


def test_a_given_behaviour_serves_the_logs_with_its_own_parts(tmp_path: Path) -> None:
    world = World(SimConfig(), 7)
    untrained = explored_logs(world, None, 0.05, 1.2, 50, tmp_path / "untrained")
    again = explored_logs(world, untrained, 0.3, 7.0, 50, tmp_path / "again")  # the bundle just written, re-explored
    before, after = read_bundle(untrained), read_bundle(again)
    assert after.parts == before.parts  # the behaviour's own networks: only the decoder's exploration differs
    decoder = after.manifest["decoder"]
    assert (decoder["exploration_epsilon"], decoder["exploration_temperature"]) == (0.3, 7.0)
    assert {k: v for k, v in decoder.items() if not k.startswith("exploration_")} == {
        k: v for k, v in before.manifest["decoder"].items() if not k.startswith("exploration_")}
