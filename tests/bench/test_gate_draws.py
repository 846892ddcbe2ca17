"""bench.gate_draws: its coverage counts on closed-form draws, and a small real run (two draws, the real gate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gate_draws
from bench.loop import TRUTH_FIRST, UNTRAINED, UTC, per_session
from simulator.config import SimConfig
from simulator.drive import run_in_process
from simulator.world import World
from tests.harness import ROOT
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


def estimate(value: float, low: float, high: float) -> dict[str, float]:
    return {"value": value, "ci_low": low, "ci_high": high}


def test_each_draw_counts_as_held_below_or_above_the_truth() -> None:
    draws = [{name: estimate(v, v - 1.0, v + 1.0) for name in gate_draws.ESTIMATORS} for v in (-3.0, 0.5, 1.5, 9.0)]
    c = gate_draws.coverage(draws, 1.0)["dr"]
    assert (c["held"], c["below"], c["above"], c["draws"]) == (2, 1, 1, 4)  # [-4,-2] below; [-0.5,1.5], [0.5,2.5] hold
    assert c["mean_error"] == pytest.approx((-4.0 - 0.5 + 0.5 + 8.0) / 4)
    assert c["median_error"] == pytest.approx(0.0)  # a heavy right tail: the mean is pulled up, the median is not


def test_two_draws_of_the_real_gate_against_the_simulators_truth(tmp_path: Path) -> None:
    active, candidate, out = ROOT / "weights" / "data" / "default.bundle", tmp_path / "untrained.bundle", tmp_path / "g.json"
    candidate.write_bytes(make_bundle(*UNTRAINED))
    assert gate_draws.main(["--active", str(active), "--candidate", str(candidate), "--draws", "2", "--sessions", "150",
                            "--eval-sessions", "150", "--first-session", "1000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [d["sessions"] for d in result["draws"]] == [[1000, 1150], [1150, 1300]]  # fresh sessions each
    # the truth is candidate − active, paired over bench.loop's truth sessions, each served in the simulator
    options, world, sessions = LoadOptions(device="cpu", warmup_batch=8), World(SimConfig(), 7), range(TRUTH_FIRST, TRUTH_FIRST + 150)
    a, c = (per_session(run_in_process(world, ModelSet.load(read_bundle(path.read_bytes()), options), sessions, UTC), world,
                        sessions)["objective"] for path in (active, candidate))
    assert result["truth"]["mean"] == pytest.approx(float((c - a).mean()))
    assert result["truth"]["mean"] < -5  # the untrained candidate far below the trained default: candidate − active
    # and so are the gate's weighted estimates (DR, this far from the logs, leans on its Q̂ and swings either way)
    assert all(d[name]["value"] < -5 for d in result["draws"] for name in ("ips", "snips", "tis"))
    assert result["draws"][0]["dr"] != result["draws"][1]["dr"]
    # the tail of the terms the gate's DR difference averages, per draw (150 sessions: a 30-session tail to fit)
    assert all(isinstance(d["dr_terms_k"], float) and d["dr_terms_k"] != d["pareto_k"] for d in result["draws"])
    # ... of the difference, not of one bundle's terms: a bundle judged against itself has every term 0, and no tail
    default = ModelSet.load(read_bundle(active.read_bytes()), options)
    itself = gate_draws.draw(world, default, default, range(1000, 1150))
    assert itself["dr"]["value"] == 0.0 and itself["dr_terms_k"] is None
    truth = result["truth"]["mean"]
    for name in gate_draws.ESTIMATORS:
        c = result["coverage"][name]
        assert c["held"] + c["below"] + c["above"] == 2
        assert c["mean_error"] == pytest.approx(sum(d[name]["value"] for d in result["draws"]) / 2 - truth)
    assert result["candidate"] == UNTRAINED[1] and result["candidate"] != result["active"]


def test_draws_that_would_reach_the_truth_sessions_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gate_draws.main(["--active", "a", "--candidate", "c", "--first-session", "999000", "--sessions", "1000", "--draws", "2"])
    assert exit_info.value.code == 2 and "--first-session" in capsys.readouterr().err
