"""Two trainer configurations through the whole learning loop, in several worlds: which one to make the default.

    .venv/bin/python -m bench.config_ab --b B.json [--a A.json] [--seeds 7 8 9 10] [--cycles 5] [--sessions 20000]
                                        [--eval-sessions 20000] [--canary 0.5] [--reuse] [--out F]

For each world (``--seeds``) runs ``bench.loop --no-vw`` twice from the untrained bundle, on the same logged session
ranges and the same truth sessions: once with configuration A (``--a``; default: the trainer's defaults) and once with
B. A world is one draw of everything the loop meets (catalogue, shoppers, the canary's sessions), so one world's
paired difference says little about the next: the verdict counts the worlds where B ended above A beyond its paired
interval, and where below, and gives the mean of the per-world differences with its t-interval over the worlds (for the
mean over worlds; one new world's own difference scatters wider). The pooled interval (every world's sessions at
once) is reported too; it treats the worlds as fixed, so it is narrower. With four worlds, a spurious win (or loss)
beyond a 95 % interval turns up in about one comparison in ten: read the count with that in mind.

Each run's loop JSON (and its ``.per-session.npz``) is written next to ``--out`` as ``{stem}-{a|b}-s{seed}.json``.
With ``--reuse`` a run whose JSON is already there is read instead of run, if it records the same world, cycles,
sessions and first session, truth sessions, canary fraction and level, configuration fields and every field they
resolve to (a run made before a default changed is not the same run), and its per-session file carries the JSON's
``run_id``: two invocations with different ``--seeds`` can share the machine's cores, and a last one with every seed
and ``--reuse`` gathers them. Each run records the commit it ran from (``code``); reuse does not require the same one.
Slow: 8–12 minutes a run on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.loop import TRUTH_FIRST, canary_settings, interval, paired_runs, per_session_path, resolved_config, resolved_fields
from bench.loop import main as loop_main
from bench.procs import REPO
from bench.report import write_results
from trainer.cli import UsageError

METRICS = ("objective", "net_gmv")
ARMS = ("a", "b")
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120,
         2.110, 2.101, 2.093, 2.086)
"""Student's t, 97.5 % quantile, for 1..20 degrees of freedom (the 95 % interval over the worlds' differences)."""


def t_975(df: int) -> float:
    """Student's t 97.5 % quantile: the table to 20 degrees of freedom, beyond it the Cornish–Fisher expansion about
    the normal's 1.96 (within 1e-4 of the exact value past 20), never the normal itself."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def across_worlds(differences: Sequence[float]) -> dict[str, float] | None:
    """The 95 % t-interval of the mean of the per-world differences, worlds drawn at random (None below 2 worlds)."""
    k = len(differences)
    if k < 2:
        return None
    m, sd = float(np.mean(differences)), float(np.std(differences, ddof=1))
    half = t_975(k - 1) * sd / math.sqrt(k)
    return {"mean": m, "ci_low": m - half, "ci_high": m + half}


def run_path(out: Path, arm: str, seed: int) -> Path:
    return out.with_name(f"{out.stem}-{arm}-s{seed}.json")


def reusable(path: Path, want: dict[str, Any]) -> bool:
    """Whether the run at ``path`` is the one ``want`` describes: its world, cycles, sessions (and the first one), truth
    sessions, canary fraction and level, the configuration's fields and every field it resolved to (so a run made
    before a default changed is not taken for one after), and a per-session file of the same run (its ``run_id``)."""
    if not path.exists() or not per_session_path(path).exists():
        return False
    loop = json.loads(path.read_text())
    with np.load(per_session_path(path)) as arrays:
        same_run = "_run_id" in arrays.files and str(arrays["_run_id"]) == loop.get("run_id")
    return bool(same_run and len(loop.get("cycles", [])) == want["cycles"] + 1
                and all(loop.get(key) == value for key, value in want.items() if key != "cycles"))


def wanted(seed: int, args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """What a loop JSON records for the run this invocation asks for (``reusable``'s terms)."""
    canary = canary_settings(args.canary, None)
    return {"world_seed": seed, "sessions_per_cycle": args.sessions, "first_session": 0,
            "truth_sessions": [TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions], "canary": args.canary,
            "canary_level": canary.level if canary is not None else None, "config_fields": config,
            "config_resolved": resolved_fields(config), "cycles": args.cycles}


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
        "across_worlds": across_worlds([d["mean"] for d in diffs.values()]),
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
    configs = {}
    for arm, path in (("a", args.a), ("b", args.b)):  # both checked before the first run starts (each is ten minutes)
        try:
            configs[arm] = resolved_config(path)[0]
        except UsageError as exc:
            p.error(f"--{arm}: {str(exc).removeprefix('--config: ')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    worlds: dict[int, dict[str, Any]] = {}
    finals: dict[int, dict[str, np.ndarray]] = {}
    for seed in args.seeds:
        runs, loops = {}, {}
        for arm in ARMS:
            path = run_path(args.out, arm, seed)
            want = wanted(seed, args, configs[arm])
            if args.reuse and reusable(path, want):
                print(f"--- world {seed}, {arm}: reusing {path}", flush=True)
            else:
                config_file = path.with_suffix(".config.json")
                config_file.write_text(json.dumps(configs[arm]))
                print(f"--- world {seed}, {arm}: {json.dumps(configs[arm])}", flush=True)
                loop_main(["--no-vw", "--seed", str(seed), "--cycles", str(args.cycles), "--sessions", str(args.sessions),
                           "--eval-sessions", str(args.eval_sessions), "--canary", str(args.canary),
                           "--config", str(config_file), "--out", str(path)])
            with np.load(per_session_path(path)) as arrays:
                runs[arm] = dict(arrays)
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
          f"mean of the world differences {v['mean_of_world_differences']:+.2f}"
          + (f" [{v['across_worlds']['ci_low']:+.2f}, {v['across_worlds']['ci_high']:+.2f}]" if v["across_worlds"] else "")
          + f"; pooled {v['pooled']['mean']:+.2f} "
          f"[{v['pooled']['ci_low']:+.2f}, {v['pooled']['ci_high']:+.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
