"""Does the product gate judge a new bundle's guard as it will serve? Its estimate against the truth, with and without
replaying the guard.

    .venv/bin/python -m bench.product_gate_guard [--cycles 2] [--sessions 3000] [--seed 7] [--json]

In one world (``--seed``) the guarded product loop of ``bench.product_guard`` runs from the embedded default with
untrained heads and no guard. In cycle k the behaviour bundle B (the start, then the bundle cycle k−1 trained, whatever
its gate said) plays sessions ``[2(k−1)·S, (2k−1)·S)`` with the real recorder and ``train_products`` (guards on, the
default) trains the candidate C on those logs. B then plays ``H = [(2k−1)·S, 2k·S)``, fresh held-out logs, on which
the gate judges C against B twice:

- **replaying each guard** (``trainer.product_gate`` today: each bundle's guard vetoes among what the guardrails
  permitted, and its rule takes the first of the rest in the logged order);
- **as before**: the logs' guardrail and rule-order columns hidden, so every offer is replayed under the serving
  bundle's permitted set and rule choice (the gate before it read those columns; on the start's unguarded logs that is
  C's heads without C's guard).

The truth is the gate's estimand, the product reward per session (``trainer.product_data``: the price paid for a
taken offer whose session ordered, minus 10 per complaint against it), on the same sessions H, same dice: C, and C
without its guard, each play H with the recorder; B's truth is its own held-out logs. Differences are paired per
session. An interval "holds" when it contains the truth's mean on H.

Writes ``bench/results/product_gate_guard.json`` with ``--json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from bench.product_guard import cycle as train_on_served
from bench.product_learning import OPTIONS, logged_rows, mean_ci, start_bundle
from bench.report import add_json_flag, header, write_results
from simulator.config import SimConfig
from simulator.world import World
from trainer.bootstrap import bootstrap_counts, interval
from trainer.product_data import LAYERS, ProductRows
from trainer.product_gate import MAX_WEIGHT, N_BOOT, judge, served_probability
from weights.bundle import Bundle, read_bundle
from weights.model_set import ModelSet, ProductLayers
from weights.product_guard import without_guard

SALT = b"product-gate-guard-bench" * 2


def reward_per_session(rows: ProductRows) -> dict[str, float]:
    """Per session (sorted by id), the sum of its offers' rewards."""
    sessions, which = np.unique(rows.sessions.astype(str), return_inverse=True)
    return dict(zip(sessions.tolist(), np.bincount(which, weights=rows.rewards).tolist(), strict=True))


def as_before(rows: ProductRows) -> ProductRows:
    """``rows`` as the gate read them before the guardrail and rule-order columns: every row on the logged mask."""
    return replace(rows, layers={name: replace(d, guardrails_logged=np.zeros_like(d.guardrails_logged))
                                 for name, d in rows.layers.items()})


def variance(new: ProductLayers, current: ProductLayers, rows: ProductRows, seed: int) -> dict[str, Any]:
    """Where the paired difference's variance comes from: the share of offers taken, the share of Σ ((w_new − w_cur)·r)²
    that taken offers carry, and the difference's interval with the mean reward subtracted as a baseline (unbiased:
    each weight's mean under the behaviour is 1), beside the gate's own."""
    behaviour = np.prod([rows.layers[layer].propensity for layer in LAYERS], axis=0)
    dw = (np.minimum(served_probability(new, rows) / behaviour, MAX_WEIGHT)
          - np.minimum(served_probability(current, rows) / behaviour, MAX_WEIGHT))
    sessions, which = np.unique(rows.sessions.astype(str), return_inverse=True)

    def paired(per_offer: np.ndarray) -> dict[str, float]:
        terms = np.bincount(which, weights=per_offer, minlength=len(sessions))
        samples = np.concatenate([counts @ terms[:, None] / len(sessions) for counts in bootstrap_counts(len(sessions), N_BOOT, seed)])
        return interval(samples.ravel(), float(terms.mean()), 0.95).to_dict()

    r, taken = rows.rewards, rows.rewards > 0
    second = (dw * r) ** 2
    return {"taken_share": float(taken.mean()), "taken_share_of_second_moment": float(second[taken].sum() / second.sum()),
            "difference": paired(dw * r), "difference_with_mean_reward_baseline": paired(dw * (r - r.mean()))}


def _holds(estimate: dict[str, Any], truth: float) -> bool:
    return bool(estimate["ci_low"] <= truth <= estimate["ci_high"])


def cycle(world: World, behaviour: Bundle, k: int, args: argparse.Namespace) -> tuple[Bundle, dict[str, Any]]:
    s = args.sessions
    model = ModelSet.load(behaviour, OPTIONS)
    candidate, training = train_on_served(world, behaviour, range(2 * (k - 1) * s, (2 * k - 1) * s), f"guarded-{k}", True,
                                          args.seed, SALT)
    new = ModelSet.load(candidate, OPTIONS)
    assert new.product is not None and model.product is not None and new.product.guard is not None
    held_out = range((2 * k - 1) * s, 2 * k * s)
    held = logged_rows(world, model, held_out, SALT)
    gates = {"replaying each guard": judge(new.product, model.product, held, seed=args.seed, current_version=model.version),
             "as before": judge(new.product, model.product, as_before(held), seed=args.seed)}
    played = {"behaviour": reward_per_session(held)} | {name: reward_per_session(logged_rows(world, m, held_out, SALT)) for name, m in (
        ("candidate", new), ("candidate without its guard", ModelSet.load(read_bundle(without_guard(candidate)), OPTIONS)))}
    ids = sorted(played["behaviour"])  # the sessions the gate averages over
    value = {name: np.array([p.get(i, 0.0) for i in ids]) for name, p in played.items()}
    truths = {name: mean_ci(v) for name, v in value.items()}
    truths["candidate − behaviour"] = mean_ci(value["candidate"] - value["behaviour"])
    truths["guard's effect"] = mean_ci(value["candidate"] - value["candidate without its guard"])
    row: dict[str, Any] = {"cycle": k, "behaviour": model.version, "held_out_sessions": [held_out.start, held_out.stop],
                           "held_out_offers": len(held), "truth": truths, "train_gate_published": training["gate"],
                           "guard": training["guard"], "gates": {},
                           "variance": variance(new.product, model.product, held, args.seed)}
    for name, verdict in gates.items():
        g = verdict.to_dict()
        row["gates"][name] = {**{key: g[key] for key in ("new", "current", "difference", "publish", "pareto_k",
                                                         "offers_on_logged_mask")},
                              "new_holds_truth": _holds(g["new"], truths["candidate"]["mean"]),
                              "difference_holds_truth": _holds(g["difference"], truths["candidate − behaviour"]["mean"])}
        print(f"cycle {k} gate {name}: new {g['new']} (truth {truths['candidate']['mean']:.3f}, without its guard "
              f"{truths['candidate without its guard']['mean']:.3f}); current {g['current']['value']:.3f} (truth "
              f"{truths['behaviour']['mean']:.3f}); difference {g['difference']} (truth "
              f"{truths['candidate − behaviour']['mean']:.3f})", file=sys.stderr)
    return candidate, row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--sessions", type=int, default=3000, help="sessions of training logs, and of held-out logs, per cycle")
    p.add_argument("--seed", type=int, default=7, help="the world")
    add_json_flag(p, "product_gate_guard.json")
    args = p.parse_args(argv)
    started = time.time()
    world = World(SimConfig(), args.seed)
    behaviour, rows = start_bundle(), []
    for k in range(1, args.cycles + 1):
        behaviour, row = cycle(world, behaviour, k, args)  # the next cycle's behaviour: this one's candidate
        rows.append(row)
    result = {**header("bench.product_gate_guard", started, argv), "seed": args.seed, "sessions": args.sessions, "cycles": rows}
    if args.json:
        write_results(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
