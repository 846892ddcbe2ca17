"""The simulator loop: logs from the untrained bundle → train with each advantage estimator → true values.

    .venv/bin/python -m bench.trainer_sim [--sessions 6000] [--eval-sessions 4000] [--advantages baseline,group,critic] [--json]

In one run: ``--sessions`` simulated sessions served by the untrained bundle (the one the
default is built from) are logged through the real recorder; the trainer runs on them once per
advantage estimator, same seed: ``baseline`` (G − V̂(s)), ``group`` (z-scores of G within the
page type) and ``critic`` (R_ψ(s, a) − V_φ(s), ``trainer.critic``). Then the simulator's true
mean_return of the behaviour and of every new bundle on ``--eval-sessions`` sessions of an
unseen world seed (same shoppers and dice for all), each new bundle's difference from the
``baseline`` one paired over those sessions, and each new bundle's offline DR estimate on the
held-out logs. Every loop is bounded by the flags.

A run whose training metrics equal the ``baseline`` run's is flagged ``same_as_baseline``: with
the same seed, that is what an estimator the trainer does not dispatch on (it falls through to
the value baseline) produces.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np

from bench.loop import UNTRAINED
from bench.procs import REPO
from bench.report import write_results
from experience.objective import BusinessObjective
from experience.returns import Z_95, session_returns
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from simulator.config import SimConfig
from simulator.drive import Trace, run_in_process, run_logged
from simulator.world import World
from trainer.config import TrainConfig
from trainer.data import episode_config, split
from trainer.evaluation import evaluate_bundle
from trainer.train import train
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet

ADVANTAGES = ("baseline", "group", "critic")


def per_session(trace: Trace, ids: Sequence[str]) -> dict[str, np.ndarray]:
    """Each of ``ids``'s discounted return G_0 (0 for a session without decisions) and business objective."""
    decisions, outcomes = trace.tables()
    episodes = build_episodes(decisions, outcomes)
    g0 = dict(zip(episodes.session_ids.tolist(), session_returns(episodes).tolist(), strict=True))
    return {"mean_return": np.array([g0.get(i, 0.0) for i in ids]), "objective": BusinessObjective().per_session(ids, outcomes).objective}


def paired(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Mean of a − b over the same sessions with its 95 % normal interval."""
    d = a - b
    m, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    return {"mean": m, "ci_low": m - Z_95 * se, "ci_high": m + Z_95 * se}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainer_sim", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=6000)
    p.add_argument("--eval-sessions", type=int, default=4000)
    p.add_argument("--seed", type=int, default=1130, help="world seed of the logs")
    p.add_argument("--eval-seed", type=int, default=99, help="world seed of the true values")
    p.add_argument("--advantages", default=",".join(ADVANTAGES), help="comma-separated TrainConfig.advantage values, baseline first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (100 <= args.sessions <= 200_000 and 100 <= args.eval_sessions <= 200_000):
        p.error("--sessions and --eval-sessions: 100 .. 200,000")
    advantages = [a for a in args.advantages.split(",") if a]
    if not advantages or advantages[0] != "baseline" or len(set(advantages)) != len(advantages) or not set(advantages) <= set(ADVANTAGES):
        p.error(f"--advantages: distinct values of {', '.join(ADVANTAGES)}, baseline first (the others are paired against it)")
    options = LoadOptions(device="cpu", warmup_batch=8)
    fresh = read_bundle(make_bundle(*UNTRAINED))
    behaviour = ModelSet.load(fresh, options)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        run_logged(World(SimConfig(), args.seed), behaviour, range(args.sessions), ZoneInfo("UTC"), Path(tmp), b"bench".ljust(32, b"."))
        source = DirectorySource(Path(tmp))
        decisions, outcomes = source.table("decisions"), source.table("outcomes")
    eval_world = World(SimConfig(), args.eval_seed)
    ids: list[str] = []

    def truth(model: ModelSet) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        trace = run_in_process(eval_world, model, range(args.eval_sessions), ZoneInfo("UTC"))
        if not ids:
            ids.extend(dict.fromkeys(trace.decision_sessions))
        s = trace.summary()
        row: dict[str, Any] = {"mean_return": s["mean_return"], "ci_low": s["ci_low"], "ci_high": s["ci_high"],
               **{k: s[k] for k in ("objective_per_session", "net_gmv_per_session") if k in s}}
        return row, per_session(trace, ids)

    behaviour_truth, _ = truth(behaviour)
    result: dict[str, Any] = {"logs": {"sessions": args.sessions, "decisions": decisions.num_rows, "outcomes": outcomes.num_rows},
                              "behaviour": behaviour_truth}
    print(f"logs: {decisions.num_rows:,} decisions from {args.sessions:,} sessions; behaviour true value "
          f"{behaviour_truth['mean_return']:.3f}")
    reference: dict[str, np.ndarray] = {}
    reference_metrics: dict[str, float] = {}
    for advantage in advantages:
        config = TrainConfig(advantage=advantage)
        started = time.monotonic()
        trained = train(decisions, outcomes, fresh, config, device="cpu")
        seconds = time.monotonic() - started
        model = ModelSet.load(read_bundle(trained.bundle), options)
        _, (held_d, held_o) = split(decisions, outcomes, config.heldout_fraction, config.seed)
        dr = evaluate_bundle(model, held_d, held_o, episode_config(config), n_boot=200).report.dr
        true, values = truth(model)
        row: dict[str, Any] = {"true": true, "offline_dr": dr.to_dict() if dr else None, "train_s": round(seconds, 1),
                               "kl_to_behavior": trained.metrics.get("kl_to_behavior"), "updates": trained.metrics.get("updates_accepted"),
                               **{k: v for k, v in trained.metrics.items() if k.startswith("critic_")}}
        if advantage == "baseline":
            reference, reference_metrics = values, dict(trained.metrics)
        else:
            row["vs_baseline"] = {k: paired(values[k], reference[k]) for k in values}
            row["same_as_baseline"] = trained.metrics == reference_metrics
        result[advantage] = row
        vs: dict[str, float] | None = row["vs_baseline"]["mean_return"] if "vs_baseline" in row else None
        print(f"{advantage:9s} true {true['mean_return']:.3f} [{true['ci_low']:.3f}, {true['ci_high']:.3f}]"
              + (f"  vs baseline {vs['mean']:+.3f} [{vs['ci_low']:+.3f}, {vs['ci_high']:+.3f}]" if vs else "")
              + f"  offline DR {dr.value if dr else float('nan'):.3f}  KL→behaviour {row['kl_to_behavior']:.3f}  train {seconds:.0f} s")
        if row.get("same_as_baseline"):
            print(f"  warning: advantage={advantage} trained exactly as baseline did: does trainer.train dispatch on it?")
    if args.json:
        write_results(REPO / "bench" / "results" / "trainer_sim.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
