"""The learning loop with and without engagement weights: the same cycles, the same shoppers, paired per cycle.

    .venv/bin/python -m bench.engagement_ab [--cycles 5] [--sessions 20000] [--eval-sessions 20000] [--seed 7]
                                            [--weights W.json] [--config C.json]

Runs ``bench.loop`` twice in one world (``--seed``), from the untrained bundle, on the same logged session ranges
and the same truth sessions: once with the trainer's default config (no weights, or ``--config``), once with
``engagement_weights`` added (``--weights``: the weight function's fields, default ``{}``, its defaults). The
simulator reports every page's engagement (``simulator.world``: dwell, scroll and bounce from the page's hidden
reaction), so both runs log the same kind of data and differ only in whether the trainer weighs the rewards.

Per cycle, for the served policy after the cycle: the business objective (net GMV − 10 per complaint), net GMV and
add-to-cart conversion (share of sessions with an item added to the cart), each with its 95 % interval in both runs,
and the paired difference weighted − plain over the shared truth sessions. The baseline is the plain run in the same
world, on the same sessions, with the same dice. Writes ``bench/results/engagement_ab.json`` (and each run's own
``loop`` JSON beside it). Slow: two loops, about 2 × 8 minutes at the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.loop import main as loop_main
from bench.loop import paired_runs, per_session_path
from bench.procs import REPO
from bench.report import write_results

METRICS = ("objective", "net_gmv", "add_to_cart_conversion")


def compare(plain: dict[str, np.ndarray], weighted: dict[str, np.ndarray], cycles: int) -> list[dict[str, Any]]:
    """Per cycle and metric: each run's mean with its interval, and the paired difference weighted − plain."""
    return paired_runs(plain, weighted, cycles, METRICS, ("plain", "weighted"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engagement_ab", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--sessions", type=int, default=20_000)
    p.add_argument("--eval-sessions", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--config", type=Path, help="a TrainConfig JSON for both runs (without engagement_weights)")
    p.add_argument("--weights", type=Path, help="the weight function's fields as JSON (default: {}, its defaults)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engagement_ab.json")
    args = p.parse_args(argv)
    started = time.monotonic()
    base: dict[str, Any] = json.loads(args.config.read_text()) if args.config else {}
    if "engagement_weights" in base:
        p.error("--config: leave engagement_weights out (the bench sets it)")
    weights = json.loads(args.weights.read_text()) if args.weights else {}
    common = ["--no-vw", "--cycles", str(args.cycles), "--sessions", str(args.sessions), "--eval-sessions", str(args.eval_sessions),
              "--seed", str(args.seed)]
    outs = {}
    with tempfile.TemporaryDirectory(prefix="bench-engagement-") as tmp:
        for name, config in (("plain", {**base, "engagement_weights": None}), ("weighted", {**base, "engagement_weights": weights})):
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(config))
            outs[name] = args.out.with_name(f"{args.out.stem}-{name}.json")
            print(f"--- {name}: {json.dumps(config)}", flush=True)
            loop_main([*common, "--config", str(path), "--out", str(outs[name])])
    runs = {name: dict(np.load(per_session_path(out))) for name, out in outs.items()}
    loops = {name: json.loads(out.read_text()) for name, out in outs.items()}
    rows = compare(runs["plain"], runs["weighted"], args.cycles)
    manifests = {name: [c.get("manifest", {}) for c in loop["cycles"][1:]] for name, loop in loops.items()}
    result = {"world_seed": args.seed, "sessions_per_cycle": args.sessions, "cycles": rows, "config": base, "weights": weights,
              "gates": {name: [c.get("gate", {}).get("published") is not None for c in loop["cycles"][1:]] for name, loop in loops.items()},
              "intent_policy": loops["plain"]["intent_policy"]["objective"]["mean"],
              "best_constant": {"name": loops["plain"]["best_constant"],
                                "objective": next(b["objective"]["mean"] for b in loops["plain"]["constants"]
                                                  if b["name"] == loops["plain"]["best_constant"])},
              "manifests": manifests, "runs": {name: str(out) for name, out in outs.items()}, "seconds": time.monotonic() - started}
    write_results(args.out, result)
    for row in rows:
        cells = []
        for m in METRICS:
            d = row[m]
            cells.append(f"{m} {d['plain']['mean']:.3f} → {d['weighted']['mean']:.3f} "
                         f"(Δ {d['weighted_minus_plain']['mean']:+.3f} [{d['weighted_minus_plain']['ci_low']:+.3f}, "
                         f"{d['weighted_minus_plain']['ci_high']:+.3f}])")
        print(f"cycle {row['cycle']}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
