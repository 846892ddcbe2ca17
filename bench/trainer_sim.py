"""The simulator loop: logs from the untrained bundle → train (value baseline vs group-relative) → true values.

    .venv/bin/python -m bench.trainer_sim [--sessions 6000] [--eval-sessions 4000] [--json]

In one run: ``--sessions`` simulated sessions served by the untrained bundle (the one the
default is built from) are logged through the real recorder; the trainer runs on them twice,
with ``advantage=baseline`` and ``advantage=group``, same seed; then the simulator's true
mean_return of the behaviour and of both new bundles on ``--eval-sessions`` sessions of an
unseen world seed (same shoppers and dice for all three), and each new bundle's offline
DR estimate on the held-out logs. Every loop is bounded by the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from zoneinfo import ZoneInfo

from bench.procs import REPO
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from trainer.config import TrainConfig
from trainer.data import episode_config, split
from trainer.evaluation import evaluate_bundle
from trainer.train import train
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainer_sim", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=6000)
    p.add_argument("--eval-sessions", type=int, default=4000)
    p.add_argument("--seed", type=int, default=1130, help="world seed of the logs")
    p.add_argument("--eval-seed", type=int, default=99, help="world seed of the true values")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (100 <= args.sessions <= 200_000 and 100 <= args.eval_sessions <= 200_000):
        p.error("--sessions and --eval-sessions: 100 .. 200,000")
    options = LoadOptions(device="cpu", warmup_batch=8)
    fresh = read_bundle(make_bundle(20261130, "default-init-20261130", "2026-11-30T00:00:00Z"))
    behaviour = ModelSet.load(fresh, options)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        run_logged(World(SimConfig(), args.seed), behaviour, range(args.sessions), ZoneInfo("UTC"), Path(tmp), b"bench".ljust(32, b"."))
        source = DirectorySource(Path(tmp))
        decisions, outcomes = source.table("decisions"), source.table("outcomes")
    eval_world = World(SimConfig(), args.eval_seed)

    def truth(model: ModelSet) -> dict[str, float]:
        s = run_in_process(eval_world, model, range(args.eval_sessions), ZoneInfo("UTC")).summary()
        return {"mean_return": s["mean_return"], "ci_low": s["ci_low"], "ci_high": s["ci_high"]}

    result: dict[str, object] = {"logs": {"sessions": args.sessions, "decisions": decisions.num_rows, "outcomes": outcomes.num_rows},
                                 "behaviour": truth(behaviour)}
    print(f"logs: {decisions.num_rows:,} decisions from {args.sessions:,} sessions; behaviour true value "
          f"{result['behaviour']['mean_return']:.3f}")  # type: ignore[index]
    for advantage in ("baseline", "group"):
        config = TrainConfig(advantage=advantage)
        started = time.monotonic()
        trained = train(decisions, outcomes, fresh, config, device="cpu")
        seconds = time.monotonic() - started
        model = ModelSet.load(read_bundle(trained.bundle), options)
        _, (held_d, held_o) = split(decisions, outcomes, config.heldout_fraction, config.seed)
        dr = evaluate_bundle(model, held_d, held_o, episode_config(config), n_boot=200).report.dr
        row = {"true": truth(model), "offline_dr": dr.to_dict() if dr else None, "train_s": round(seconds, 1),
               "kl_to_behavior": trained.metrics.get("kl_to_behavior"), "updates": trained.metrics.get("updates_accepted")}
        result[advantage] = row
        print(f"{advantage:9s} true {row['true']['mean_return']:.3f} [{row['true']['ci_low']:.3f}, {row['true']['ci_high']:.3f}]"
              f"  offline DR {dr.value if dr else float('nan'):.3f}  KL→behaviour {row['kl_to_behavior']:.3f}  train {seconds:.0f} s")
    if args.json:
        out = REPO / "bench" / "results" / "trainer_sim.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
