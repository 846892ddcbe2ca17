"""Do category updates disturb the SKU layer? Its served distribution when only the category's data changes.

    .venv/bin/python -m bench.product_stability [--sessions 3000] [--movement-sessions 500] [--seed 7] [--json [PATH]]

The reference design split its layers so that "category updates stopped disturbing SKU stability". In the layered
heads a category step cannot move the SKU *head* (its parameters are untouched, tested bit for bit); but the trainer
also moves the shared *encoder* (``trainer.product_update``, a region of ``ENCODER_DELTA`` on the layers' summed KL)
on the sum of every layer's surrogate, so the category's data can reach the SKU layer through the encoding it reads.
This bench measures how far.

In one world (``--seed``), the embedded default with untrained product heads (``bench.product_learning.start_bundle``)
serves sessions ``[0, S)`` with the real recorder; their product records are the training rows (all of them: there is
no gate here). From the same starting parameters, ``update_heads`` runs once per *counterfactual* and per encoder
setting (below), every layer stepping each time:

- **logged**: every layer's own advantage (what ``train-products`` does at its default seed, 0, which keys the baselines' folds);
- **category shuffled**: the category's advantages permuted across rows (its data carries no signal), the SKU's and
  the band's as logged;
- **category reversed**: the category's advantages negated (its data says the opposite), the others as logged;
- **SKU reversed** (the scale): the SKU's advantages negated, the others as logged: how far the SKU layer moves when its
  *own* data changes.

Three encoder settings are run: the encoder held fixed (0), moved by every layer's data (the trainer's default region and
teachers), and moved in the same region by the SKU's and the band's data only (``--encoder-layers sku,price_band``,
``UNTAUGHT_BY_CATEGORY``: the category's advantages are zero in the encoder's step, its KL still in the region).

Each result is compared with *logged*'s on the product requests of sessions ``[10⁶, 10⁶ + M)`` (each session's first
page): the mean total variation of each layer's *served* distribution (the vote's exact propensities, as served), each
layer given the same choices above it (``bench.product_learning.movement``). So the SKU column of "category reversed"
is how much the SKU layer's served distribution moves when only category data changes; with the encoder held fixed it
is 0 by construction (the control that the measure is sound). Also each layer's step from the start (logged), and the
layers' KL from their starting softmax (``kl_from_start``).

Writes ``bench/results/product_stability.json`` (or PATH) with ``--json``, with the run's header (``bench.report``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.product_learning import OPTIONS, TRUTH_FIRST, logged_rows, movement, start_bundle
from bench.report import add_json_flag, header, write_results
from policy.features import FeatureSpec
from simulator.config import SimConfig
from simulator.world import World
from weights import mlp
from weights.bundle import Bundle, read_bundle
from weights.model_set import ModelSet
from weights.product_heads import PART, with_heads

UNTAUGHT_BY_CATEGORY = ("sku", "price_band")
"""The encoder's teachers in the third region (``update_heads``' ``encoder_layers``): the category's data left out."""


def counterfactuals(own: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Each run's advantages per layer: the logged ones, and those with one layer's data changed (module doc)."""
    return {"logged": dict(own),
            "category shuffled": {**own, "category": rng.permutation(own["category"])},
            "category reversed": {**own, "category": -own["category"]},
            "sku reversed": {**own, "sku": -own["sku"]}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.product_stability", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=3000, help="S: logged sessions the heads are trained on")
    p.add_argument("--movement-sessions", type=int, default=500, help="M: product requests the movement is measured on")
    p.add_argument("--seed", type=int, default=7, help="the world")
    add_json_flag(p, "product_stability.json")
    args = p.parse_args(argv)
    from trainer.product_data import LAYERS  # torch: the trainer's, imported where it is needed
    from trainer.product_update import ENCODER_DELTA, advantages, update_heads

    started = time.time()
    world = World(SimConfig(), args.seed)
    start = start_bundle()
    model = ModelSet.load(start, OPTIONS)
    rows = logged_rows(world, model, range(args.sessions), b"bench-salt" * 4)
    params = {name: mlp.policy_params_from_onnx(start.parts[part]) for name, part in PART.items()}
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    runs = counterfactuals({layer: advantages(rows, h, layer) for layer in LAYERS}, np.random.default_rng([args.seed, 5]))
    spec = FeatureSpec.parse(start.manifest["feature_spec"])
    moved_on = range(TRUTH_FIRST, TRUTH_FIRST + args.movement_sessions)
    result: dict[str, Any] = {"seed": args.seed, "rows": len(rows), "sessions": args.sessions,
                              "movement_sessions": [moved_on.start, moved_on.stop], "regions": {}}
    for encoder_delta, taught in ((0.0, LAYERS), (ENCODER_DELTA, LAYERS), (ENCODER_DELTA, UNTAUGHT_BY_CATEGORY)):
        bundles: dict[str, Bundle] = {}
        region: dict[str, Any] = {"encoder_delta": encoder_delta, "encoder_layers": list(taught)}
        for name, gains in runs.items():
            new, steps = update_heads(params, rows, encoder_delta=encoder_delta, advantage=gains, encoder_layers=taught)
            bundles[name] = read_bundle(with_heads(start, new, spec, {"model_version": f"stability-{name}-{encoder_delta:g}"}))
            region[name] = {"steps": {s.layer: s.to_dict() for s in steps}}
        logged = ModelSet.load(bundles["logged"], OPTIONS)
        region["logged"]["moved_from_start"] = movement(model, logged, world, moved_on)
        for name in runs:
            if name != "logged":
                region[name]["moved_from_logged"] = movement(logged, ModelSet.load(bundles[name], OPTIONS), world, moved_on)
        key = f"{encoder_delta:g}" if taught == LAYERS else f"{encoder_delta:g} from {','.join(taught)}"
        result["regions"][key] = region
        print(json.dumps({key: {k: v.get("moved_from_logged", v.get("moved_from_start")) for k, v in region.items()
                                if isinstance(v, dict)}}), file=sys.stderr)
    print(json.dumps(result, indent=1))
    if args.json:
        write_results(args.json, {**header("bench.product_stability", started, argv), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
