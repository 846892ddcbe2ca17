"""``bench.loop``'s accounting and its VW peer: a canary look set against the right truth, the trainer window VW reads,
the keyed held-out split, the off-policy value VW's setting is chosen by, the choice itself on small logs, and the
fixed log clock that makes a run repeat."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from bench import loop
from bench.config_ab import reusable, wanted
from experience.segments import DirectorySource
from simulator.config import SERVABLE, SimConfig
from simulator.drive import run_logged
from simulator.world import World
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


def truth(values: list[float]) -> dict[str, Any]:
    return {"_per_session": {"objective": np.array(values)}}


def test_a_promoted_canary_is_judged_against_its_own_truth_even_when_a_successor_published() -> None:
    active, canary, successor = truth([10.0, 12.0, 14.0]), truth([12.0, 14.0, 16.0]), truth([20.0, 22.0, 24.0])
    previous = {"truth": active, "canary_bundle": {**canary, "vs_served": loop.paired(canary, active)}}  # +2 on every session
    look = {"action": "promote", "look": 2, "estimate": 2.5, "ci_low": 1.0, "ci_high": 4.0}
    # the canary promoted, then this cycle's own candidate published on top of it: the entry's truth is the successor's
    entry = {"canary": look, "gate": {"published": "v3"}, "truth": successor}
    got = loop.canary_against_truth(entry, previous)
    assert got is not None and got["truth"] == pytest.approx(2.0) and got["held"]  # not successor − active (+10)
    # without the successor the active bundle after the cycle is the promoted canary: the same +2 either way
    alone = loop.canary_against_truth({"canary": look, "truth": canary}, {"truth": active})
    assert alone is not None and alone["truth"] == pytest.approx(2.0)
    # a successor published and no record of the canary's truth: nothing to set the look against
    assert loop.canary_against_truth(entry, {"truth": active}) is None


def test_the_held_out_split_is_keyed_by_session_and_near_its_share() -> None:
    sessions = np.array([f"s{i // 3}" for i in range(6000)], dtype=object)  # three rows a session
    held = loop.heldout_sessions(sessions)
    assert (held.reshape(-1, 3) == held.reshape(-1, 3)[:, :1]).all()  # a session is held out whole
    assert 0.17 < held.mean() < 0.23
    assert (loop.heldout_sessions(sessions[::-1]) == held[::-1]).all()  # by the id, not the order
    assert not (loop.heldout_sessions(sessions, key=b"another key") == held).all()


def test_the_off_policy_value_weights_the_matching_rows_by_their_propensity() -> None:
    rows = loop.VWRows(shared=["x"] * 4, slot=np.array([0, 1, 0, 2]), propensity=np.array([0.5, 0.25, 0.5, 1.0]),
                       togo=np.array([4.0, 8.0, 2.0, 1.0]), session=np.array(["a", "b", "c", "d"], dtype=object))
    which = np.arange(4)
    got = loop.offpolicy_value(rows, which, np.array([0, 0, 0, 2]))  # matches rows 0, 2, 3
    weights = np.array([2.0, 0.0, 2.0, 1.0])
    assert got["ips"] == pytest.approx((weights * rows.togo).mean())
    assert got["snips"] == pytest.approx((weights * rows.togo).sum() / weights.sum())
    assert got["match_rate"] == 0.75 and got["rows"] == 4 and got["behaviour"] == pytest.approx(3.75)


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[pa.Table, pa.Table, list[str]]:
    """300 sessions served by one untrained bundle, then 300 by another, into one log directory."""
    root = tmp_path_factory.mktemp("logs")
    world, versions = World(SimConfig(), 7), []
    for k, sessions in enumerate((range(0, 300), range(300, 600))):
        model = ModelSet.load(read_bundle(make_bundle(100 + k, f"v{k}", "2026-12-01T00:00:00Z")), LoadOptions(device="cpu"))
        def clock(start: float = 1.8e9 + 1000.0 * k) -> float:  # the second version logged after the first
            return start

        run_logged(world, model, sessions, ZoneInfo("UTC"), root, loop.SALT, clock=clock)
        versions.append(model.version)
    source = DirectorySource(root)
    return source.table("decisions"), source.table("outcomes"), versions


def test_vw_reads_the_trainer_windows_sessions(two_versions: tuple[pa.Table, pa.Table, list[str]]) -> None:
    decisions, outcomes, (old, new) = two_versions

    def window(**settings: Any) -> tuple[set[str], int]:
        d, o = loop.trainer_window(decisions, outcomes, {"hours": None, "max_sessions": None, "sample_key": 0, **settings})
        assert set(pc.unique(o.column("session_id")).to_pylist()) <= set(pc.unique(d.column("session_id")).to_pylist())
        return set(d.column("model_version").to_pylist()), len(pc.unique(d.column("session_id")))

    assert window(versions=1, serving=[]) == ({new}, 300)  # the last version only
    assert window(versions=1, serving=[old]) == ({old, new}, 600)  # and the versions served now
    assert window(versions=1, serving=[new], max_sessions=120)[1] == 120  # the window's sample
    assert window(versions=None)[1] == 600


def test_vw_s_setting_is_chosen_on_held_out_logs_and_recorded(two_versions: tuple[pa.Table, pa.Table, list[str]]) -> None:
    """The rows need no VW and are checked everywhere; the choice needs the bench extra's vowpalwabbit (not in CI's)."""
    from policy.features import FeatureSpec

    decisions, outcomes, _ = two_versions
    rows = loop.vw_rows(decisions, outcomes, loop.VWFeatures(FeatureSpec()))
    assert len(rows) > 0 and (rows.slot >= 0).all() and (rows.propensity > 0).all()
    pytest.importorskip("vowpalwabbit")
    grid = {"dr, default": "--cb_type dr", "mtr, -l 0.01": "--cb_type mtr --power_t 0 -l 0.01"}
    vw, record = loop.tuned_vw(rows, grid)
    try:
        estimates = record["heldout_estimates"]
        assert set(estimates) == set(grid)
        assert record["chosen"] == max(estimates, key=lambda k: estimates[k]["snips"])
        assert record["setting"] == f"{loop.VW_BASE} {grid[record['chosen']]}"
        assert record["heldout_rows"] == int(loop.heldout_sessions(rows.session).sum()) and 0 < record["heldout_rows"] < len(rows)
        assert len(vw.predict([rows.shared[0], *loop._actions_lines()])) == len(SERVABLE)
    finally:
        vw.finish()


def test_a_run_logs_each_cycle_at_its_fixed_clock_so_versions_and_canary_draws_repeat(tmp_path: Path) -> None:
    """The versions' names come from the logged time, and the canary's sessions from the names: the wall clock made every
    run of the bench draw other canary sessions. Each cycle logs at its own instant, two hours after the one before."""
    work, config = tmp_path / "work", tmp_path / "config.json"
    config.write_text(json.dumps({"window_versions": 2}))
    assert loop.main(["--cycles", "2", "--sessions", "500", "--eval-sessions", "500", "--no-vw", "--workdir", str(work),
                      "--config", str(config), "--out", str(tmp_path / "loop.json")]) == 0
    result = json.loads((tmp_path / "loop.json").read_text())
    # what it ran with, read once (the cycles train on the run's own copy), and its per-session file is the same run's
    assert result["config_fields"] == {"window_versions": 2} and result["config_resolved"]["window_versions"] == 2
    assert result["config_resolved"]["advantage"] in ("baseline", "group", "critic") and result["first_session"] == 0
    assert json.loads((work / "train-config.json").read_text()) == {"window_versions": 2}
    with np.load(loop.per_session_path(tmp_path / "loop.json")) as per_session:
        assert str(per_session["_run_id"]) == result["run_id"] and len(result["run_id"]) == 32
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".partial")]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", result["code"]), result["code"]
    # and it is the run bench.config_ab would ask for with these settings (what a real JSON records, not a hand-made one)
    asked = argparse.Namespace(sessions=500, canary=0.0, eval_sessions=500, cycles=2)
    assert reusable(tmp_path / "loop.json", wanted(7, asked, {"window_versions": 2}))
    assert not reusable(tmp_path / "loop.json", wanted(7, asked, {"window_versions": 1}))
    logged = [c["logs"]["decisions_logged_this_cycle"] for c in result["cycles"][1:]]
    times = pc.value_counts(DirectorySource(work / "logs").table("decisions").column("time_s")).to_pylist()
    assert sorted((t["values"], t["counts"]) for t in times) == [(loop.LOG_CLOCK_S, logged[0]),
                                                                  (loop.LOG_CLOCK_S + 7200.0, logged[1])]
    trained = result["cycles"][1]["gate"]["model_version"]
    assert trained.startswith("trained-20261130T000000Z-"), trained
    # what the gate measured of the bundle it judged is kept with its interval, so a miss can be read against the tail
    checks = result["cycles"][1]["gate"]["checks"]
    assert checks["ess"] > 0 and checks["ess_floor"] > 0, checks
    judged = result["cycles"][1]["gate_vs_truth"]  # cycle 1 trained a candidate: the gate judged it
    assert judged is not None and (judged["pareto_k"], judged["ess"]) == (checks["pareto_k"], checks["ess"])
    assert result["log_clock"] == {"cycle_1_s": loop.LOG_CLOCK_S, "interval_s": 7200.0}
    targets = result["targets"]  # the last cycle's, and each cycle's against the best constant (the are by cycle 5)
    assert targets["after_cycle"] == 2 and len(targets["vs_best_constant_by_cycle"]) == 3
    assert targets["vs_best_constant_by_cycle"][2] == targets["vs_best_constant"]
