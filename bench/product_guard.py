"""Does the learned product guard earn its place? The same heads served with and without it, on the same sessions.

    .venv/bin/python -m bench.product_guard [--cycles 2] [--sessions 3000] [--truth-sessions 4000] [--seed 7]
        [--sold-out-complaint P] [--json]

In one world (``--seed``) every page offers one product beside its action (the embedded default's action policy). Two
arms start from the same bundle, the embedded default with untrained product heads (``bench.product_learning``), and
run the same cycles on the same session ranges, each from its own served traffic: every cycle k, the arm's bundle
plays sessions ``[k·S, (k+1)·S)`` with the real recorder, and ``train_products`` trains the next bundle on those logs,

- **guarded**: with the per-layer guards (the default: ``trainer.product_guard``, vetoing a candidate above a
  complaint probability of 0.1),
- **unguarded**: ``guard=None`` (format version 2, heads only).

After each cycle both arms' new bundles play the same truth sessions ``[10⁶, 10⁶ + T)`` (same dice), and so does the
guarded arm's bundle with its guards removed (``heads only``: the same heads, to isolate the veto from the heads'
learning). Per bundle: the business objective per session (net GMV − 10 per complaint), complaints per session, and
the share of offers that are overpriced (the simulator's price-gouging cause, ``simulator.products``); differences are
paired per session. Context on the same sessions: the per-layer rules and ``simulator.reference.product_oracle``.

``--sold-out-complaint P`` plays a world with a third complaint cause, a fact of the category (``simulator.products``:
a pushed category with at most half its offered items in stock draws a complaint with P), for the category guard to
learn; off (0) in the default world. Writes ``bench/results/product_guard.json`` with ``--json``
(``product_guard-sold-out-P.json`` with the cause on at P).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.product_learning import OPTIONS, RESULTS, TRUTH_FIRST, UTC, mean_ci, oracle_chooser, per_session, start_bundle
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import Trace, by_model, run_in_process, run_logged
from simulator.products import in_stock_share, overpriced
from simulator.world import World
from weights.bundle import Bundle, read_bundle
from weights.embedded import default_bundle
from weights.model_set import ModelSet
from weights.product_guard import without_guard


class Offers:
    """Counts, as a ``ProductChooser`` wrapper, how many offers were of an overpriced SKU, and how many pushed a mostly
    sold-out category (the sessions' shelves know)."""

    def __init__(self, model: ModelSet, world: World) -> None:
        self.inner, self.world, self.offers, self.overpriced, self.sold_out = by_model(model), world, 0, 0, 0

    def __call__(self, sessions, requests, hours, ids):  # type: ignore[no-untyped-def]
        decisions = self.inner(sessions, requests, hours, ids)
        settings = self.world.config.products
        for session, decision in zip(sessions, decisions, strict=True):
            here = session.shelf()
            item = here.items[decision.category.index][decision.sku.index]
            self.offers += 1
            self.overpriced += overpriced(settings, float(self.world.catalogue.price[item]),
                                          here.competitor[decision.category.index][decision.sku.index])
            self.sold_out += in_stock_share(here, decision.category.index) <= settings.sold_out_share
        return decisions


def complaints_per_session(trace: Trace) -> np.ndarray:
    decisions, outcomes = trace.tables()
    sessions = list(dict.fromkeys(decisions.column("session_id").to_pylist()))
    count = dict.fromkeys(sessions, 0.0)
    for s, kind in zip(outcomes.column("session_id").to_pylist(), outcomes.column("outcome").to_pylist(), strict=True):
        if kind == 6:  # COMPLAINT
            count[s] += 1.0
    return np.array([count[s] for s in sessions])


def play(world: World, model: ModelSet, sessions: range) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    chooser = Offers(model, world)
    trace = run_in_process(world, model, sessions, UTC, products=chooser)
    value, complaints = per_session(trace), complaints_per_session(trace)
    return value, complaints, {"objective": mean_ci(value), "complaints_per_session": mean_ci(complaints),
                               "overpriced_share": chooser.overpriced / max(chooser.offers, 1),
                               "sold_out_offer_share": chooser.sold_out / max(chooser.offers, 1), "offers": chooser.offers,
                               "product_sources": trace.product_sources}


def cycle(world: World, bundle: Bundle, sessions: range, version: str, guarded: bool, seed: int,
          salt: bytes = b"product-guard-bench!" * 2) -> tuple[Bundle, dict[str, Any]]:
    """``bundle`` serves ``sessions`` with the real recorder and ``train_products`` (with guards, or without) trains the
    next bundle on those logs: it, and whether its own gate passed it and its guards' figures."""
    from trainer.product_train import ProductTrainConfig, train_products

    model = ModelSet.load(bundle, OPTIONS)
    with tempfile.TemporaryDirectory() as root:
        run_logged(world, model, sessions, UTC, Path(root), salt, products=by_model(model))
        source = DirectorySource(Path(root))
        config = ProductTrainConfig(seed=seed) if guarded else ProductTrainConfig(seed=seed, guard=None)
        result = train_products(source.table("products"), source.table("outcomes"), bundle, version,
                                "2026-12-03T00:00:00Z", config)
    return read_bundle(result.bundle), {"gate": result.metrics["gate"]["publish"], "guard": result.metrics.get("guard")}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--sessions", type=int, default=3000, help="logged sessions per cycle and arm")
    p.add_argument("--truth-sessions", type=int, default=4000)
    p.add_argument("--seed", type=int, default=7, help="the world")
    p.add_argument("--sold-out-complaint", type=float, default=0.0,
                   help="P(a complaint) when the pushed category is mostly sold out: a cause for the category guard (0: off)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    started = time.monotonic()
    world = World(SimConfig(products=replace(SimConfig().products, sold_out_complaint=args.sold_out_complaint)), args.seed)
    truth = range(TRUTH_FIRST, TRUTH_FIRST + args.truth_sessions)
    rules = ModelSet.load(default_bundle(), OPTIONS)
    baselines = {}
    for name, chooser in (("rules", by_model(rules)), ("oracle", oracle_chooser(rules))):
        trace = run_in_process(world, rules, truth, UTC, products=chooser)
        baselines[name] = {"objective": mean_ci(per_session(trace)), "complaints_per_session": mean_ci(complaints_per_session(trace))}
        print(f"{name}: {baselines[name]}", file=sys.stderr)
    bundles = {"guarded": start_bundle(), "unguarded": start_bundle()}
    rows = []
    for k in range(args.cycles):
        logged = range(k * args.sessions, (k + 1) * args.sessions)
        row: dict[str, Any] = {"cycle": k + 1, "arms": {}}
        played = {}
        for arm in ("guarded", "unguarded"):
            bundles[arm], training = cycle(world, bundles[arm], logged, f"{arm}-{k + 1}", arm == "guarded", args.seed)
            value, complaints, figures = play(world, ModelSet.load(bundles[arm], OPTIONS), truth)
            played[arm] = (value, complaints)
            row["arms"][arm] = {**figures, "training": training}
            print(f"cycle {k + 1} {arm}: {figures['objective']} complaints {figures['complaints_per_session']} "
                  f"overpriced {figures['overpriced_share']:.4f} sold out {figures['sold_out_offer_share']:.4f}", file=sys.stderr)
        value, complaints, figures = play(world, ModelSet.load(read_bundle(without_guard(bundles["guarded"])), OPTIONS), truth)
        played["heads only"] = (value, complaints)
        row["arms"]["guarded, heads only"] = figures
        row["guard_vs_heads_only"] = {"objective": mean_ci(played["guarded"][0] - value),
                                      "complaints_per_session": mean_ci(played["guarded"][1] - complaints)}
        row["guarded_vs_unguarded"] = {"objective": mean_ci(played["guarded"][0] - played["unguarded"][0]),
                                       "complaints_per_session": mean_ci(played["guarded"][1] - played["unguarded"][1])}
        print(f"cycle {k + 1}: guard vs heads only {row['guard_vs_heads_only']}", file=sys.stderr)
        rows.append(row)
    result = {"seed": args.seed, "sold_out_complaint": args.sold_out_complaint, "sessions_per_cycle": args.sessions,
              "truth_sessions": [truth.start, truth.stop],
              "baselines": baselines, "cycles": rows, "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        RESULTS.mkdir(exist_ok=True)
        name = f"product_guard-sold-out-{args.sold_out_complaint:g}.json" if args.sold_out_complaint else "product_guard.json"
        (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
