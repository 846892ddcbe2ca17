"""bench.config_ab's arithmetic and its reuse of earlier runs, on small closed-form inputs and real files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.config_ab import compare_world, recorded_config, reusable, run_path, verdict
from bench.loop import per_session_path


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


def loop_json(path: Path, seed: int = 9, fields: object = None, **extra: object) -> Path:
    record = {"world_seed": seed, "sessions_per_cycle": 100, "cycles": [{}, {}], "canary": 0.5, "truth_sessions": [1000, 1050],
              "config": "default", **extra}
    if fields is not None:
        record["config_fields"] = fields
    path.write_text(json.dumps(record))
    np.savez_compressed(per_session_path(path), **arrays(0.0))
    return path


WANT = {"seed": 9, "sessions": 100, "cycles": 1, "canary": 0.5, "eval_sessions": 50, "config": {"advantage": "critic"}}


def test_a_run_is_reused_only_when_it_is_the_same_run(tmp_path: Path) -> None:
    path = run_path(tmp_path / "ab.json", "b", 9)
    assert path.name == "ab-b-s9.json"
    assert not reusable(path, WANT)  # nothing there yet
    loop_json(path, fields={"advantage": "critic"})
    assert reusable(path, WANT)
    for key, other in (("seed", 8), ("sessions", 200), ("cycles", 2), ("canary", 0.0), ("eval_sessions", 60),
                       ("config", {"advantage": "baseline"}), ("config", {})):
        assert not reusable(path, {**WANT, key: other}), key
    per_session_path(path).unlink()
    assert not reusable(path, WANT)  # no per-session truth, nothing to pair


def test_an_older_run_is_matched_by_its_config_files_contents(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"advantage": "critic"}))
    older = loop_json(tmp_path / "old.json", config=str(config))
    assert recorded_config(json.loads(older.read_text())) == {"advantage": "critic"}
    assert reusable(older, WANT)
    config.write_text(json.dumps({"advantage": "group"}))  # the file changed since: not the same run any more
    assert not reusable(older, WANT)
    config.unlink()
    assert recorded_config(json.loads(older.read_text())) is None and not reusable(older, WANT)
    assert recorded_config(json.loads(loop_json(tmp_path / "d.json").read_text())) == {}  # "default": the trainer's
