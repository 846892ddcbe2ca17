"""How often the gate's interval holds the truth for one candidate, over independent draws of its judge's logs.

    .venv/bin/python -m bench.gate_draws --active A.bundle --candidate C.bundle [--seed 7] [--draws 10]
                                         [--sessions 4000] [--first-session 300000] [--eval-sessions 20000] [--out F]

``bench.gate_calibration`` asks the question over worlds, at cycle 1 from the untrained bundle; ``bench.loop`` meets
each later candidate once, on one held-out set. This bench holds the pair fixed (a trained active bundle and the
candidate its cycle judged: ``bench.loop --workdir W`` keeps both, ``W/weights/history/`` and ``W/candidate-<c>.bundle``)
and draws the judge's logs again and again: each draw is ``--sessions`` fresh sessions of world ``--seed`` served by
the active bundle (the size of a cycle's held-out set when the active bundle served one cycle of 20,000 alone; a
window of several versions or a canary's share holds out more), logged as a server logs them, on which the
gate's own evaluation (``trainer.cycle.judged`` at the trainer's defaults) estimates candidate − active by DR, IPS,
SNIPS and trajectory-wise IS, each with its interval. The truth is the paired difference of the two bundles served in
the simulator on ``--eval-sessions`` other sessions (``bench.loop``'s truth sessions, the same dice for both).

Per estimator: how many draws' intervals held the truth, how many lay below it and how many above, and the mean and
median error. Per draw, besides the new bundle's weights' tail k̂ (the gate's check), the tail k̂ of the per-session DR
terms of new − current (``dr_terms_k``: the tail of what the gate's estimate averages, ``trainer.pareto.upper_tail_k``).
Not the gate's whole path: the draws skip ``read_gate``'s session limits and the unsupported-mass check.
Writes ``bench/results/gate_draws.json``.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.loop import LOG_CLOCK_S, SALT, TRUTH_FIRST, UTC, interval, per_session
from bench.procs import REPO
from bench.report import write_results
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from trainer.config import TrainConfig
from trainer.pareto import upper_tail_k
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

ESTIMATORS = ("dr", "ips", "snips", "tis")


def truth(world: World, active: ModelSet, candidate: ModelSet, sessions: range) -> dict[str, float]:
    """candidate − active, paired over ``sessions`` served in the simulator (the business objective per session)."""
    a, c = (per_session(run_in_process(world, m, sessions, UTC), world, sessions)["objective"] for m in (active, candidate))
    return interval(c - a)


def draw(world: World, active: ModelSet, candidate: ModelSet, sessions: range) -> dict[str, Any]:
    """One judge: ``sessions`` served and logged by ``active``, candidate − active as the gate estimates it."""
    from trainer.cycle import judged
    from trainer.offline import difference

    config = TrainConfig()
    with tempfile.TemporaryDirectory(prefix="bench-gate-draws-") as tmp:
        run_logged(world, active, sessions, UTC, Path(tmp), SALT, clock=functools.partial(float, LOG_CLOCK_S))
        source = DirectorySource(Path(tmp))
        decisions, outcomes = source.table("decisions"), source.table("outcomes")
        new, current = judged(config, candidate, decisions, outcomes), judged(config, active, decisions, outcomes)
    terms_k = upper_tail_k(new.report.episode_terms["dr"] - current.report.episode_terms["dr"])  # the same logs' episodes
    row: dict[str, Any] = {"sessions": [sessions.start, sessions.stop], "ess": new.report.ess,
                           "pareto_k": new.report.pareto_k if np.isfinite(new.report.pareto_k) else None,
                           "dr_terms_k": terms_k if np.isfinite(terms_k) else None,
                           "behaviour": current.report.behavior_value.value}
    for name in ESTIMATORS:
        d = difference(new.report, current.report, name)
        row[name] = {"value": d.value, "ci_low": d.ci_low, "ci_high": d.ci_high}
    return row


def coverage(draws: Sequence[dict[str, Any]], true_value: float) -> dict[str, dict[str, Any]]:
    """Per estimator: draws whose interval held ``true_value``, lay below it or above it; the mean and median error."""
    out = {}
    for name in ESTIMATORS:
        errors = np.array([d[name]["value"] - true_value for d in draws])
        out[name] = {"held": sum(d[name]["ci_low"] <= true_value <= d[name]["ci_high"] for d in draws),
                     "below": sum(d[name]["ci_high"] < true_value for d in draws),
                     "above": sum(d[name]["ci_low"] > true_value for d in draws),
                     "draws": len(draws), "mean_error": float(errors.mean()), "median_error": float(np.median(errors))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_draws", description=__doc__.splitlines()[0])
    p.add_argument("--active", type=Path, required=True, help="the bundle that serves the judge's logs")
    p.add_argument("--candidate", type=Path, required=True, help="the bundle judged against it")
    p.add_argument("--seed", type=int, default=7, help="the world")
    p.add_argument("--draws", type=int, default=10)
    p.add_argument("--sessions", type=int, default=4_000, help="sessions a draw (a cycle's held-out fifth of 20,000)")
    p.add_argument("--first-session", type=int, default=300_000, help="the first draw's first session; draws follow on")
    p.add_argument("--eval-sessions", type=int, default=20_000, help="truth sessions (bench.loop's)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gate_draws.json")
    args = p.parse_args(argv)
    if not (1 <= args.draws <= 100 and 100 <= args.sessions <= 200_000 and 100 <= args.eval_sessions <= 200_000):
        p.error("--draws 1..100, --sessions and --eval-sessions 100..200,000")
    if args.first_session < 0 or args.first_session + args.draws * args.sessions > TRUTH_FIRST:
        p.error(f"--first-session: the draws' sessions must lie in [0, {TRUTH_FIRST:,}), before the truth sessions")
    started = time.monotonic()
    options = LoadOptions(device="cpu", warmup_batch=8)
    active, candidate = (ModelSet.load(read_bundle(path.read_bytes()), options) for path in (args.active, args.candidate))
    world = World(SimConfig(), args.seed)
    true = truth(world, active, candidate, range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions))
    print(f"truth: candidate − active {true['mean']:+.2f} [{true['ci_low']:+.2f}, {true['ci_high']:+.2f}]", flush=True)
    draws = []
    for k in range(args.draws):
        lo = args.first_session + k * args.sessions
        draws.append(draw(world, active, candidate, range(lo, lo + args.sessions)))
        cells = " ".join(f"{n} {draws[-1][n]['value']:+.2f} [{draws[-1][n]['ci_low']:+.2f}, {draws[-1][n]['ci_high']:+.2f}]"
                         for n in ESTIMATORS)
        tails = " ".join(f"{name} {draws[-1][key]:.2f}" for name, key in (("k̂", "pareto_k"), ("terms' k̂", "dr_terms_k"))
                         if draws[-1][key] is not None)
        print(f"draw {k + 1}: ESS {draws[-1]['ess']:.0f}, {tails}, {cells}", flush=True)
    held = coverage(draws, true["mean"])
    result = {"world_seed": args.seed, "active": active.version, "candidate": candidate.version, "sessions_per_draw": args.sessions,
              "truth": true, "coverage": held, "draws": draws, "seconds": time.monotonic() - started}
    write_results(args.out, result)
    for name, c in held.items():
        print(f"{name}: held {c['held']}/{c['draws']} (below {c['below']}, above {c['above']}), error mean {c['mean_error']:+.2f}, "
              f"median {c['median_error']:+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
