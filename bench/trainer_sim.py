"""The simulator loop: logs from the untrained bundle → train with each advantage estimator → true values.

    .venv/bin/python -m bench.trainer_sim [--sessions 6000] [--eval-sessions 4000] [--advantages baseline,group,critic] [--json]

In one run: ``--sessions`` simulated sessions served by the untrained bundle (the one the
default is built from) are logged through the real recorder; the trainer runs on them once per
advantage estimator, same seed: ``baseline`` (G − V̂(s)), ``group`` (z-scores of G within the
page type) and ``critic`` (R_ψ(s, a) − V_φ(s), ``trainer.critic``). One world (``--seed``): the logs are its
sessions ``[0, --sessions)``, the truth its sessions ``[10⁶, 10⁶ + --eval-sessions)`` (disjoint, the same shoppers
and dice for every bundle). Per bundle, two comparable figures of the business objective per session (net GMV −
10 per complaint, undiscounted: γ = 1): the truth on the truth sessions, and the gate's offline DR estimate
(``evaluate_bundle`` at its defaults) on the held-out side of the logs; and, apart, the training return G₀
(the trainer's reward, γ = ``TrainConfig.gamma`` = 0.85), which is not the objective. Each new bundle's
difference from the ``baseline`` one is paired over the truth sessions. Every loop is bounded by the flags.

A run whose training metrics equal the ``baseline`` run's is flagged ``same_as_baseline``: with
the same seed, that is what an estimator the trainer does not dispatch on (it falls through to
the value baseline) produces.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np

from bench.loop import TRUTH_FIRST, UNTRAINED, interval
from bench.procs import REPO
from bench.report import write_results
from experience.objective import BusinessObjective
from experience.returns import session_returns
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from simulator.config import SimConfig
from simulator.drive import Trace, run_in_process, run_logged
from simulator.world import World
from trainer.config import TrainConfig
from trainer.data import split
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
    return interval(a - b)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainer_sim", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=6000)
    p.add_argument("--eval-sessions", type=int, default=4000)
    p.add_argument("--seed", type=int, default=1130, help="the world: its sessions [0, --sessions) are logged, "
                   "[10⁶, 10⁶ + --eval-sessions) are the truth")
    p.add_argument("--advantages", default=",".join(ADVANTAGES), help="comma-separated TrainConfig.advantage values, baseline first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (100 <= args.sessions <= 200_000 and 100 <= args.eval_sessions <= 200_000) or args.sessions > TRUTH_FIRST:
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
    world = World(SimConfig(), args.seed)
    truth_sessions = range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions)
    ids = [f"sim{world.seed}-s{i}" for i in truth_sessions]

    def truth(model: ModelSet) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """On the truth sessions: the business objective per session (γ = 1) and the training return G₀ (γ = 0.85)."""
        values = per_session(run_in_process(world, model, truth_sessions, ZoneInfo("UTC")), ids)
        return {"objective_per_session": interval(values["objective"]),
                "training_return_g0_gamma_0.85": interval(values["mean_return"])}, values

    behaviour_dr = evaluate_bundle(behaviour, *split(decisions, outcomes, TrainConfig().heldout_fraction, TrainConfig().seed)[1],
                                     n_boot=200).report.dr
    behaviour_truth, _ = truth(behaviour)
    behaviour_truth["offline_dr_objective"] = behaviour_dr.to_dict() if behaviour_dr else None
    result: dict[str, Any] = {"world_seed": args.seed, "logs": {"sessions": [0, args.sessions], "decisions": decisions.num_rows,
                                                                 "outcomes": outcomes.num_rows},
                              "truth_sessions": [truth_sessions.start, truth_sessions.stop], "behaviour": behaviour_truth}
    o = behaviour_truth["objective_per_session"]
    print(f"world {args.seed}: logs {decisions.num_rows:,} decisions from sessions [0, {args.sessions:,}); truth on sessions "
          f"[{truth_sessions.start:,}, {truth_sessions.stop:,})\nobjective per session (γ = 1): the true value on the truth "
          f"sessions, the offline DR on the held-out logs; G₀ = the training return (γ = 0.85), the truth sessions\n"
          f"behaviour  true objective {o['mean']:.3f} [{o['ci_low']:.3f}, {o['ci_high']:.3f}]  offline DR objective "
          f"{behaviour_dr.value if behaviour_dr else float('nan'):.3f}  "
          f"G₀ {behaviour_truth['training_return_g0_gamma_0.85']['mean']:.3f}")
    reference: dict[str, np.ndarray] = {}
    reference_metrics: dict[str, float] = {}
    for advantage in advantages:
        config = TrainConfig(advantage=advantage)
        started = time.monotonic()
        trained = train(decisions, outcomes, fresh, config, device="cpu")
        seconds = time.monotonic() - started
        model = ModelSet.load(read_bundle(trained.bundle), options)
        _, (held_d, held_o) = split(decisions, outcomes, config.heldout_fraction, config.seed)
        dr = evaluate_bundle(model, held_d, held_o, n_boot=200).report.dr  # the gate's view: the objective, γ = 1
        true, values = truth(model)
        row: dict[str, Any] = {"true": true, "offline_dr_objective": dr.to_dict() if dr else None, "train_s": round(seconds, 1),
                               "kl_to_behavior": trained.metrics.get("kl_to_behavior"), "updates": trained.metrics.get("updates_accepted"),
                               **{k: v for k, v in trained.metrics.items() if k.startswith("critic_")}}
        if advantage == "baseline":
            reference, reference_metrics = values, dict(trained.metrics)
        else:
            row["vs_baseline"] = {k: paired(values[k], reference[k]) for k in values}
            row["same_as_baseline"] = trained.metrics == reference_metrics
        result[advantage] = row
        vs: dict[str, float] | None = row["vs_baseline"]["objective"] if "vs_baseline" in row else None
        o = true["objective_per_session"]
        print(f"{advantage:9s}  true objective {o['mean']:.3f} [{o['ci_low']:.3f}, {o['ci_high']:.3f}]"
              + f"  offline DR objective {dr.value if dr else float('nan'):.3f}"
              + (f"  objective vs baseline {vs['mean']:+.3f} [{vs['ci_low']:+.3f}, {vs['ci_high']:+.3f}]" if vs else "")
              + f"  G₀ {true['training_return_g0_gamma_0.85']['mean']:.3f}  KL→behaviour {row['kl_to_behavior']:.3f}"
              + f"  train {seconds:.0f} s")
        if row.get("same_as_baseline"):
            print(f"  warning: advantage={advantage} trained exactly as baseline did: does trainer.train dispatch on it?")
    if args.json:
        write_results(REPO / "bench" / "results" / "trainer_sim.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
