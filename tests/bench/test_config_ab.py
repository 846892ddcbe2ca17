"""bench.config_ab's arithmetic and its reuse of earlier runs, on small closed-form inputs and real files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from bench.config_ab import across_worlds, compare_world, main, reusable, run_path, t_975, verdict, wanted
from bench.loop import per_session_path
from bench.report import write_results, written


def arrays(shift: float, cycles: int = 1) -> dict[str, np.ndarray]:
    return {f"cycle{c}.{m}": np.array([1.0, 2.0, 3.0, 5.0]) + (shift if c == cycles else 0.0)
            for c in range(cycles + 1) for m in ("objective", "net_gmv")}


def test_a_world_is_compared_paired_cycle_by_cycle() -> None:
    world = compare_world(arrays(0.0), arrays(0.5), 1)
    first, last = (row["objective"]["b_minus_a"] for row in world["cycles"])
    assert (first["mean"], first["ci_low"], first["ci_high"]) == (0.0, 0.0, 0.0)
    assert last["mean"] == pytest.approx(0.5) and last["ci_low"] == pytest.approx(0.5)  # the same shift on every session
    assert world["final"] is world["cycles"][-1]
    with pytest.raises(ValueError, match="different truth sessions"):
        compare_world(arrays(0.0), {**arrays(0.5), "cycle1.objective": np.zeros(3)}, 1)


def test_the_verdict_counts_worlds_not_sessions() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(10.0, 3.0, 400)
    finals = {7: {"a": base, "b": base + 1.0},  # above in every session
              8: {"a": base, "b": base - 0.5 + rng.normal(0.0, 0.01, 400)},  # below, beyond its interval
              9: {"a": base, "b": base + rng.normal(0.0, 3.0, 400)}}  # noise: neither
    worlds = {s: compare_world({"cycle0.objective": f["a"], "cycle0.net_gmv": f["a"]},
                               {"cycle0.objective": f["b"], "cycle0.net_gmv": f["b"]}, 0) for s, f in finals.items()}
    v = verdict(worlds, finals, 0)
    assert v["b_above_beyond_ci"] == [7] and v["b_below_beyond_ci"] == [8] and v["worlds"] == 3
    per_world = [float(np.mean(f["b"] - f["a"])) for f in finals.values()]
    assert v["mean_of_world_differences"] == pytest.approx(np.mean(per_world))
    assert v["pooled"]["mean"] == pytest.approx(np.mean(np.concatenate([f["b"] - f["a"] for f in finals.values()])))


def loop_json(path: Path, run_id: str = "r1", **changes: object) -> Path:
    """A loop JSON as bench.loop writes it for WANT's run, and its per-session file with the same run id."""
    record = {key: value for key, value in WANT.items() if key != "cycles"}
    record.update({"cycles": [{}, {}], "run_id": run_id, "code": "abc", **changes})
    path.write_text(json.dumps(record))
    np.savez_compressed(per_session_path(path), _run_id=np.array(run_id), **arrays(0.0))
    return path


def want(config: dict[str, object]) -> dict[str, object]:
    args = argparse.Namespace(sessions=100, canary=0.5, eval_sessions=50, cycles=1)
    return wanted(9, args, config)


WANT = want({"advantage": "critic"})


def test_a_run_is_reused_only_when_it_is_the_same_run(tmp_path: Path) -> None:
    path = run_path(tmp_path / "ab.json", "b", 9)
    assert path.name == "ab-b-s9.json"
    assert not reusable(path, WANT)  # nothing there yet
    loop_json(path)
    assert reusable(path, WANT)
    assert WANT["config_resolved"]["advantage"] == "critic" and WANT["canary_level"] == 0.99  # the trainer's, resolved
    for key, other in (("world_seed", 8), ("sessions_per_cycle", 200), ("first_session", 20_000), ("canary", 0.25),
                       ("canary_level", 0.95), ("truth_sessions", [1_000_050, 1_000_100]),
                       ("config_fields", {"advantage": "baseline"}), ("config_fields", {}),
                       ("config_resolved", {**WANT["config_resolved"], "critic_weight_cap": 20.0})):
        loop_json(path, **{key: other})
        assert not reusable(path, WANT), key
    loop_json(path, cycles=[{}, {}, {}])
    assert not reusable(path, WANT)  # two cycles, not one
    loop_json(path)
    assert reusable(path, WANT)
    per_session_path(path).unlink()
    assert not reusable(path, WANT)  # no per-session truth, nothing to pair


def test_a_json_is_not_paired_with_another_runs_per_session_file(tmp_path: Path) -> None:
    path = loop_json(tmp_path / "ab-b-s9.json", run_id="new")
    np.savez_compressed(per_session_path(path), _run_id=np.array("old"), **arrays(0.0))  # a run that stopped between files
    assert not reusable(path, WANT)
    np.savez_compressed(per_session_path(path), **arrays(0.0))  # one from before run ids
    assert not reusable(path, WANT)


def test_a_default_that_changed_since_is_not_the_same_run(tmp_path: Path) -> None:
    """A = {} (the trainer's defaults) names another configuration once a default changes: its resolved fields differ."""
    defaults = want({})
    now = defaults["config_resolved"]["advantage"]
    assert defaults["config_fields"] == {} and now in ("baseline", "group", "critic")
    path = loop_json(tmp_path / "ab-a-s9.json", config_fields={}, config_resolved=defaults["config_resolved"])
    assert reusable(path, defaults)
    before = "group" if now != "group" else "baseline"
    loop_json(path, config_fields={}, config_resolved={**defaults["config_resolved"], "advantage": before})
    assert not reusable(path, defaults)


def test_the_interval_over_worlds_is_students_t() -> None:
    assert across_worlds([1.0]) is None
    got = across_worlds([1.0, 2.0, 3.0])
    assert got is not None and got["mean"] == 2.0
    assert got["ci_high"] - 2.0 == pytest.approx(4.303 * 1.0 / np.sqrt(3))  # t(2 df) · sd / √k
    assert t_975(20) == 2.086  # the table's last entry, and past it the expansion, not the normal's 1.96
    for df, exact in ((21, 2.0796), (30, 2.0423), (60, 2.0003), (120, 1.9799)):
        assert t_975(df) == pytest.approx(exact, abs=1e-4), df


def test_a_bad_configuration_is_refused_by_name_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"advantage": "q"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--b", str(bad), "--seeds", "9", "--out", str(tmp_path / "ab.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--b: " in err and "advantage" in err
    assert list(tmp_path.iterdir()) == [bad]  # nothing ran, nothing written
    broken = tmp_path / "broken.json"
    broken.write_text("{advantage: critic")
    for path, says in ((broken, "Expecting property name"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--b", str(path), "--seeds", "9", "--out", str(tmp_path / "ab.json")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--b: " in err and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "broken.json"]


def test_a_results_file_is_whole_or_absent_and_no_partial_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_results(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}

    def fails(f: BinaryIO) -> None:
        f.write(b'{"half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        written(path, fails)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file stands
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # and its partial one is gone
