"""Two trainer configurations through the whole learning loop, in several worlds: which one to make the default.

    .venv/bin/python -m bench.config_ab --b B.json [--a A.json] [--seeds 7 8 9 10] [--cycles 5] [--sessions 20000]
                                        [--eval-sessions 20000] [--canary 0.5] [--reuse] [--out F]

For each world (``--seeds``) runs ``bench.loop --no-vw`` twice from the untrained bundle, on the same logged session
ranges and the same truth sessions: once with configuration A (``--a``; default: the trainer's defaults) and once with
B. A world is one draw of everything the loop meets (catalogue, shoppers, the canary's sessions), so one world's
paired difference says little about the next: the verdict is the count of worlds where B ended above A beyond its
paired interval, and where below, next to the mean of the per-world differences. The pooled interval (every world's
sessions at once) is reported too; it treats the worlds as fixed, so it is narrower than what a new world would show.

Each run's loop JSON (and its ``.per-session.npz``) is written next to ``--out`` as ``{stem}-{a|b}-s{seed}.json``.
With ``--reuse`` a run whose JSON is already there is read instead of run, if it was made in the same world with the
same cycles, sessions, truth sessions, canary and configuration (its ``config_fields``, or the contents of its
``config`` file for runs that predate them): two invocations with different ``--seeds`` can share the machine's
cores, and a last one with every seed and ``--reuse`` gathers them. Slow: 8–12 minutes a run on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.loop import interval, paired_runs, per_session_path
from bench.loop import main as loop_main
from bench.procs import REPO
from bench.report import write_results

METRICS = ("objective", "net_gmv")
ARMS = ("a", "b")


def run_path(out: Path, arm: str, seed: int) -> Path:
    return out.with_name(f"{out.stem}-{arm}-s{seed}.json")


def recorded_config(loop: dict[str, Any]) -> dict[str, Any] | None:
    """The configuration a loop JSON ran with: its ``config_fields``, else its config file's contents (``{}`` for the
    defaults); None when neither can be read."""
    if "config_fields" in loop:
        return dict(loop["config_fields"])
    if loop.get("config") == "default":
        return {}
    try:
        return dict(json.loads(Path(loop["config"]).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def reusable(path: Path, want: dict[str, Any]) -> bool:
    """Whether the run at ``path`` is the one ``want`` describes (world, cycles, sessions, truth, canary, config)."""
    if not path.exists() or not per_session_path(path).exists():
        return False
    loop = json.loads(path.read_text())
    same = (loop.get("world_seed") == want["seed"] and loop.get("sessions_per_cycle") == want["sessions"]
            and len(loop.get("cycles", [])) == want["cycles"] + 1 and loop.get("canary") == want["canary"]
            and loop.get("truth_sessions", [0, 0])[1] - loop.get("truth_sessions", [0, 0])[0] == want["eval_sessions"])
    return same and recorded_config(loop) == want["config"]


def compare_world(a: dict[str, np.ndarray], b: dict[str, np.ndarray], cycles: int) -> dict[str, Any]:
    """One world: per cycle and metric each arm's mean with its interval and the paired difference b − a."""
    rows = paired_runs(a, b, cycles, METRICS)
    return {"cycles": rows, "final": rows[-1]}


def verdict(worlds: dict[int, dict[str, Any]], finals: dict[int, dict[str, np.ndarray]], cycles: int) -> dict[str, Any]:
    """Across worlds, on the last cycle's objective: wins and losses beyond each world's paired interval, the mean of
    the per-world differences, and the pooled interval over every world's sessions."""
    diffs = {s: w["final"]["objective"]["b_minus_a"] for s, w in worlds.items()}
    pooled = np.concatenate([finals[s]["b"] - finals[s]["a"] for s in sorted(finals)])
    return {
        "cycle": cycles,
        "worlds": len(worlds),
        "b_above_beyond_ci": sorted(s for s, d in diffs.items() if d["ci_low"] > 0),
        "b_below_beyond_ci": sorted(s for s, d in diffs.items() if d["ci_high"] < 0),
        "mean_of_world_differences": float(np.mean([d["mean"] for d in diffs.values()])),
        "pooled": interval(pooled),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.config_ab", description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, help="configuration A, a TrainConfig JSON (default: the trainer's defaults)")
    p.add_argument("--b", type=Path, required=True, help="configuration B, a TrainConfig JSON")
    p.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9, 10], help="the worlds")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--sessions", type=int, default=20_000)
    p.add_argument("--eval-sessions", type=int, default=20_000)
    p.add_argument("--canary", type=float, default=0.5, metavar="FRACTION", help="bench.loop --canary (default 0.5)")
    p.add_argument("--reuse", action="store_true", help="read a matching run's JSON instead of running it again")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "config_ab.json")
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds: each world once")
    started = time.monotonic()
    configs = {"a": json.loads(args.a.read_text()) if args.a else {}, "b": json.loads(args.b.read_text())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    worlds: dict[int, dict[str, Any]] = {}
    finals: dict[int, dict[str, np.ndarray]] = {}
    for seed in args.seeds:
        runs, loops = {}, {}
        for arm in ARMS:
            path = run_path(args.out, arm, seed)
            want = {"seed": seed, "sessions": args.sessions, "cycles": args.cycles, "canary": args.canary,
                    "eval_sessions": args.eval_sessions, "config": configs[arm]}
            if args.reuse and reusable(path, want):
                print(f"--- world {seed}, {arm}: reusing {path}", flush=True)
            else:
                config_file = path.with_suffix(".config.json")
                config_file.write_text(json.dumps(configs[arm]))
                print(f"--- world {seed}, {arm}: {json.dumps(configs[arm])}", flush=True)
                loop_main(["--no-vw", "--seed", str(seed), "--cycles", str(args.cycles), "--sessions", str(args.sessions),
                           "--eval-sessions", str(args.eval_sessions), "--canary", str(args.canary),
                           "--config", str(config_file), "--out", str(path)])
            runs[arm] = dict(np.load(per_session_path(path)))
            loops[arm] = json.loads(path.read_text())
        worlds[seed] = compare_world(runs["a"], runs["b"], args.cycles)
        worlds[seed]["targets"] = {arm: {k: loops[arm]["targets"].get(k) for k in
                                         ("vs_best_constant", "share_of_intent_policy", "gate_intervals_held",
                                          "canary_intervals_held", "no_cycle_worse_beyond_ci")} for arm in ARMS}
        worlds[seed]["runs"] = {arm: str(run_path(args.out, arm, seed)) for arm in ARMS}
        finals[seed] = {arm: runs[arm][f"cycle{args.cycles}.objective"] for arm in ARMS}
    result = {"configs": configs, "cycles": args.cycles, "sessions_per_cycle": args.sessions, "canary": args.canary,
              "verdict": verdict(worlds, finals, args.cycles), "worlds": {str(s): w for s, w in worlds.items()},
              "seconds": time.monotonic() - started}
    write_results(args.out, result)
    for seed, w in worlds.items():
        f = w["final"]["objective"]
        print(f"world {seed}: a {f['a']['mean']:.2f}, b {f['b']['mean']:.2f}, b − a {f['b_minus_a']['mean']:+.2f} "
              f"[{f['b_minus_a']['ci_low']:+.2f}, {f['b_minus_a']['ci_high']:+.2f}]")
    v = result["verdict"]
    print(f"b above a beyond its interval in worlds {v['b_above_beyond_ci']}, below in {v['b_below_beyond_ci']}; "
          f"mean of the world differences {v['mean_of_world_differences']:+.2f}; pooled {v['pooled']['mean']:+.2f} "
          f"[{v['pooled']['ci_low']:+.2f}, {v['pooled']['ci_high']:+.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
