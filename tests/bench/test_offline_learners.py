"""``bench.offline_learners``' own logs: the untrained bundle with the exploration asked for serves them, and its logged
behaviour is that exploration (broad logs are what the bench's claim about exploration rests on). Its VW peer reads the
rows of the first run's trainer window, not the whole directory."""

from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest

from bench.loop import SALT, TRUTH_FIRST
from bench.offline_learners import exploration_of, explored_logs, vw_on_window
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from weights.bundle import read_bundle, write_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet
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


def test_vw_learns_from_the_rows_of_the_first_runs_window_alone(tmp_path: Path) -> None:
    """Two versions log into one directory; a bundle whose ``trainer.window`` is the last version's gives VW that
    version's rows and no others. A bundle without the record is refused before VW is needed."""
    world, logs, versions = World(SimConfig(), 7), tmp_path / "logs", []
    for k, sessions in enumerate((range(0, 120), range(120, 240))):
        model = ModelSet.load(read_bundle(make_bundle(100 + k, f"v{k}", "2026-12-01T00:00:00Z")), LoadOptions(device="cpu"))
        run_logged(world, model, sessions, ZoneInfo("UTC"), logs, SALT, clock=lambda k=k: 1.8e9 + 1000.0 * k)
        versions.append(model.version)
    untrained = tmp_path / "untrained.bundle"
    untrained.write_bytes(make_bundle(101, "v1", "2026-12-01T00:00:00Z"))
    with pytest.raises(SystemExit, match="records no trainer window"):
        vw_on_window(world, logs, untrained, range(TRUTH_FIRST, TRUTH_FIRST + 20))
    pytest.importorskip("vowpalwabbit")  # the bench extra's, not in CI's
    bundle = read_bundle(untrained)
    manifest = {k: v for k, v in bundle.manifest.items() if k != "parts"}
    manifest["trainer"] = {"window": {"hours": None, "versions": 1, "max_sessions": None, "sample_key": 0}}
    windowed = tmp_path / "windowed.bundle"
    write_bundle(windowed, manifest, bundle.parts)
    got = vw_on_window(world, logs, windowed, range(TRUTH_FIRST, TRUTH_FIRST + 20))
    decisions = DirectorySource(logs).table("decisions")
    assert got["trained_on"]["versions"] == [versions[1]]
    assert got["trained_on"]["decisions"] == sum(v == versions[1] for v in decisions.column("model_version").to_pylist())
    assert got["tuning"]["rows"] <= got["trained_on"]["decisions"]  # the rows that served a servable action
    assert len(got["_per_session"]["objective"]) == 20  # played on the truth sessions asked for
