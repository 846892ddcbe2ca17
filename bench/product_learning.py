"""Does ``RecommendProduct`` learn from what it served? The layered heads over cycles, against the rules and a reference.

    .venv/bin/python -m bench.product_learning [--cycles 4] [--sessions 6000] [--truth-sessions 4000] [--seed 7] [--json]

In one world (``--seed``), every page offers one product (``simulator.drive``: ``products``) beside the page's action,
which the embedded default's action policy serves throughout. The served bundle starts as the embedded default with
untrained product heads (``weights.product_heads.init_params``, seed 3). Each cycle k:

1. the bundle then served plays sessions ``[k·S, (k+1)·S)`` with the real recorder (``run_logged``): decisions,
   outcomes and ``products`` records, as a server with ``--log-dir`` writes them;
2. ``trainer.product_train.train_products`` trains its heads on those logs only (one trust region per layer);
3. the new bundle is served from then on, whatever the product gate said (``trainer.product_gate``, on the 20 % of
   the cycle's sessions held out of training): its verdict and paired interval are recorded beside the truth's paired
   difference of the objective per session (the gate estimates the offers' reward per session, the part of the
   objective the heads change), to see whether it would have let each step through.

The truth: every bundle (and each baseline) plays the same sessions ``[10⁶, 10⁶ + T)``, same dice, scored by the
business objective (net GMV − 10 per complaint, per session); differences are paired per session. Baselines on those
sessions: the server's per-layer **rules** (a bundle without heads), the **untrained heads**, and
``simulator.reference.product_oracle``, which reads each shopper's hidden intent and favourite category (a reference,
not a bound). Also per bundle: the share of offers taken, and how far each layer's served distribution moved from the
bundle before on the truth sessions' product requests (mean total variation, the layers given the same choices above).

**The flat peer** (``bench.flat_product``): one policy over the joint (category, SKU, band) candidates, same encoder,
features, guardrails, decoding, reward and learning (its trust region the layers' sum, 0.10), runs the same cycles on
the same session ranges from its own served traffic (kept in memory: it has no serving path), and plays the same truth
sessions; ``layered_vs_flat`` is paired per session. ``--no-flat`` skips it.

**The shared encoder** (``--encoder-delta``, ``--compare-encoder D``): the layered cycles run again with the encoder's
summed-KL region D (``trainer.product_update``; 0 holds it fixed), each arm from its own served traffic on the same
session ranges, and each cycle's bundle is compared with the first arm's on the same truth sessions (``minus_first``,
paired). ``--compare-encoder-layers`` names the layers whose data that arm's encoder learns from (``bench.product_stability``:
leaving the category's out keeps its data from reaching the SKU layer through the encoder).

Writes ``bench/results/product_learning.json`` with ``--json`` (``product_learning-encoder.json`` with
``--compare-encoder``, ``product_learning-encoder-layers.json`` with ``--compare-encoder-layers`` too).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import numpy as np

from core.product import ProductDecision, ProductRequest
from policy.features import FeatureSpec
from simulator.config import SimConfig
from simulator.drive import ProductChooser, Trace, by_model, one_at_a_time, run_in_process, run_logged
from simulator.products import candidates
from simulator.reference import product_oracle
from simulator.world import ShopperSession, World
from weights.bundle import Bundle, read_bundle
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.product_heads import init_params, with_heads

if TYPE_CHECKING:
    from trainer.product_data import ProductRows  # torch: imported at run time only where it is needed

UTC = ZoneInfo("UTC")
TRUTH_FIRST = 1_000_000
OPTIONS = LoadOptions(device="cpu", warmup_batch=1)
RESULTS = Path(__file__).resolve().parent / "results"


def start_bundle() -> Bundle:
    base = default_bundle()
    spec = FeatureSpec.parse(base.manifest["feature_spec"])
    return read_bundle(with_heads(base, init_params(np.random.default_rng([3, 1]), spec), spec,
                                  {"model_version": "default+untrained-heads"}))


def logged_rows(world: World, model: ModelSet, sessions: range, salt: bytes) -> ProductRows:
    """The offers ``model`` serves in ``sessions``, through the real recorder, as the trainer reads them."""
    from experience.segments import DirectorySource
    from trainer.product_data import product_rows  # the trainer's: imported where it is needed

    with tempfile.TemporaryDirectory(prefix="product-rows-") as root:
        run_logged(world, model, sessions, UTC, Path(root), salt, products=by_model(model))
        source = DirectorySource(Path(root))
        return product_rows(source.table("products"), source.table("outcomes"), model)


def oracle_chooser(model: ModelSet) -> ProductChooser:
    """The hidden-state reference's offer, as a decision (propensity 1 per layer)."""
    from core.domain import Source
    from core.product import LayerChoice

    def choose(session: ShopperSession, request: ProductRequest, hour: int, did: str) -> ProductDecision:
        c, s, b = product_oracle(session, session.shelf())
        return ProductDecision(LayerChoice(c, 1.0, Source.POLICY), LayerChoice(s, 1.0, Source.POLICY),
                               LayerChoice(b, 1.0, Source.POLICY), "oracle")
    return one_at_a_time(choose)


def per_session(trace: Trace) -> np.ndarray:
    """The business objective of each traced session, in session order."""
    decisions, outcomes = trace.tables()
    sessions = list(dict.fromkeys(decisions.column("session_id").to_pylist()))
    value = {s: 0.0 for s in sessions}
    for s, kind, v, d in zip(outcomes.column("session_id").to_pylist(), outcomes.column("outcome").to_pylist(),
                             outcomes.column("value").to_pylist(), outcomes.column("coupon_discount").to_pylist(), strict=True):
        if kind == 2:  # ORDER
            value[s] += v - d
        elif kind == 6:  # COMPLAINT
            value[s] -= 10.0
    return np.array([value[s] for s in sessions])


def mean_ci(x: np.ndarray) -> dict[str, float]:
    half = 1.96 * float(x.std(ddof=1)) / math.sqrt(len(x))
    return {"mean": float(x.mean()), "ci_low": float(x.mean()) - half, "ci_high": float(x.mean()) + half}


def truth(world: World, model: ModelSet, chooser: ProductChooser, sessions: range) -> tuple[np.ndarray, dict[str, Any]]:
    trace = run_in_process(world, model, sessions, UTC, products=chooser)
    values = per_session(trace)
    taken = sum(1 for k in trace.outcomes if k == 1)  # ADD_TO_CART: offers taken and add-to-cart prompts taken, both
    return values, {"objective": mean_ci(values), "products": trace.products, "add_to_cart_outcomes": taken,
                    "product_sources": trace.product_sources}


def first_request(world: World, index: int) -> ProductRequest | None:
    """Session ``index``'s first page as a ``RecommendProduct`` request (its shelf), or None if it has no page."""

    session = world.session(index)
    page = session.page()
    if page is None:
        return None
    categories, bands = candidates(world.catalogue, session.shelf())
    return ProductRequest(session.request(page), categories, bands, session.visit_count)


def movement(before: ModelSet, after: ModelSet, world: World, sessions: range) -> dict[str, float]:
    """Mean total variation between two bundles' per-layer served distributions on the same product requests, each
    layer given the *before* bundle's choices above it (so a layer's movement is its own)."""
    from policy import product_rules as rules
    from policy.product_features import band_features, category_features, sku_features
    from policy.product_policy import masked_softmax

    moved: dict[str, list[float]] = {"category": [], "sku": [], "price_band": []}
    for i in sessions:
        pr = first_request(world, i)
        if pr is None:
            continue
        categories, bands, request = pr.categories, pr.price_bands, pr.shopper
        did = f"movement-{i}"
        chosen = before.decide_product(pr, 12, did)
        cat = categories[chosen.category.index]
        permitted = rules.category_permitted(pr)
        rows = {"category": (category_features(categories), permitted, rules.rule_category(pr, permitted)),
                "sku": (sku_features(cat.skus), rules.sku_permitted(cat), rules.rule_sku(cat, rules.sku_permitted(cat))),
                "price_band": (band_features(bands, cat.skus[chosen.sku.index], pr.visit_count == 1), rules.band_permitted(pr),
                               rules.rule_band(bands, rules.band_permitted(pr)))}
        served = {}
        for name, model in (("before", before), ("after", after)):
            assert model.product is not None
            heads, decoder = model.product.heads, model.product.decoder
            h = heads.encode(model.encoder.encode_batch([request], [12]))
            served[name] = {layer: decoder.served(masked_softmax(heads.score({"price_band": "band"}.get(layer, layer), h, f), p), fb)
                            for layer, (f, p, fb) in rows.items()}
        for layer in moved:
            moved[layer].append(0.5 * float(np.abs(served["before"][layer] - served["after"][layer]).sum()))
    return {layer: float(np.mean(v)) for layer, v in moved.items()}


def flat_cycles(world: World, args: argparse.Namespace, start: Bundle, truth_sessions: range, moved_on: range,
                values: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The flat peer through the same cycles (module doc); per cycle its truth, paired against the layers' and the rules'."""
    from bench.flat_product import FlatChooser, init_flat, joint_inputs, layer_views, served_joint, train_flat

    model = ModelSet.load(start, OPTIONS)  # the action policy and the shared encoder, as the layers have them
    assert model.product is not None
    heads, decoder = model.product.heads, model.product.decoder

    def encode(request: ProductRequest, hour: int) -> np.ndarray:
        return heads.encode(model.encoder.encode_batch([request.shopper], [hour]))[0]

    settings = world.config.products
    shape = (settings.categories, settings.skus, len(settings.bands))
    params = init_flat(np.random.default_rng([3, 2]), model.encoder.spec.item_dim)
    rows = []
    for k in range(args.cycles + 1):
        judge = FlatChooser(params, encode, world.catalogue, decoder, shape, record=False)
        v = per_session(run_in_process(world, model, truth_sessions, UTC, products=one_at_a_time(judge)))
        row: dict[str, Any] = {"cycle": k, "objective": mean_ci(v), "vs_rules": mean_ci(v - values["rules"]),
                               "layered_vs_flat": mean_ci(values[f"cycle{k}"] - v)}
        if k < args.cycles:
            chooser = FlatChooser(params, encode, world.catalogue, decoder, shape)
            trace = run_in_process(world, model, range(k * args.sessions, (k + 1) * args.sessions), UTC,
                                   products=one_at_a_time(chooser))
            new, row["training"] = train_flat(params, chooser.rows, trace.tables()[1], world.catalogue.embeddings)
            moved: dict[str, list[float]] = {"category": [], "sku": [], "price_band": []}
            for i in moved_on:
                request = first_request(world, i)
                if request is None:
                    continue
                x, h = joint_inputs(request, world.catalogue, shape), encode(request, 12)
                before = served_joint(params, h, x, world.catalogue.embeddings, decoder)
                drawn = np.random.default_rng([args.seed, i]).choice(before.size, p=before.reshape(-1) / before.sum())
                c, s, _ = np.unravel_index(int(drawn), shape)  # the layers' view given a choice the flat policy serves
                views = [layer_views(p, int(c), int(s)) for p in (before, served_joint(new, h, x, world.catalogue.embeddings, decoder))]
                for layer in moved:
                    moved[layer].append(0.5 * float(np.abs(views[0][layer] - views[1][layer]).sum()))
            row["movement_next"] = {layer: float(np.mean(m)) for layer, m in moved.items()}
            params = new
        rows.append(row)
        print(json.dumps({"flat": row}), file=sys.stderr)
    return rows


def layered_cycles(world: World, args: argparse.Namespace, encoder_delta: float, truth_sessions: range, moved_on: range,
                   values: dict[str, np.ndarray], arm: str, encoder_layers: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The layered heads' cycles with the shared encoder's region ``encoder_delta`` (0: held fixed), learning from
    ``encoder_layers`` (default all); each bundle's per-session truth goes into ``values`` as ``{arm}cycle{k}``."""
    from experience.segments import DirectorySource
    from trainer.product_train import ProductTrainConfig, train_products  # torch: imported where it is needed

    config = ProductTrainConfig(encoder_delta=encoder_delta, encoder_layers=encoder_layers)
    bundle = start_bundle()
    cycles: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="product-learning-") as tmp:
        for k in range(args.cycles + 1):
            model = ModelSet.load(bundle, OPTIONS)
            v, row = truth(world, model, by_model(model), truth_sessions)
            values[f"{arm}cycle{k}"] = v
            row.update({"cycle": k, "model_version": bundle.model_version, "encoder_delta": encoder_delta,
                        "encoder_layers": list(config.encoder_layers or config.layers),
                        "vs_rules": mean_ci(v - values["rules"]), "vs_untrained": mean_ci(v - values[f"{arm}cycle0"]),
                        "share_of_oracle_over_rules": float((v.mean() - values["rules"].mean())
                                                            / (values["oracle"].mean() - values["rules"].mean()))})
            if k == args.cycles:
                cycles.append(row)
                print(json.dumps(row), file=sys.stderr)
                break
            logs = Path(tmp) / f"cycle{k}"
            run_logged(world, model, range(k * args.sessions, (k + 1) * args.sessions), UTC, logs, b"bench-salt" * 4,
                       products=by_model(model))
            source = DirectorySource(logs)
            trained = train_products(source.table("products"), source.table("outcomes"), bundle, f"products-cycle{k + 1}",
                                     "2026-12-03T00:00:00Z", config)
            row["training"] = trained.metrics["layers"]
            row["gate"] = trained.metrics["gate"]
            after = read_bundle(trained.bundle)
            row["movement_next"] = movement(model, ModelSet.load(after, OPTIONS), world, moved_on)
            cycles.append(row)
            print(json.dumps(row), file=sys.stderr)
            bundle = after
    for k, row in enumerate(cycles[:-1]):  # the gate's paired interval against the truth's paired difference
        row["gate"]["truth_difference"] = mean_ci(values[f"{arm}cycle{k + 1}"] - values[f"{arm}cycle{k}"])
    return cycles


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.product_learning", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=4)
    p.add_argument("--sessions", type=int, default=6000, help="S: logged sessions per cycle")
    p.add_argument("--truth-sessions", type=int, default=4000)
    p.add_argument("--movement-sessions", type=int, default=500, help="product requests the layers' movement is measured on")
    p.add_argument("--seed", type=int, default=7, help="the world")
    p.add_argument("--no-flat", action="store_true", help="skip the flat peer")
    p.add_argument("--encoder-delta", type=float, default=None,
                   help="the shared encoder's region (summed KL) of the layered heads; default the trainer's")
    p.add_argument("--compare-encoder", type=float, default=None, metavar="D",
                   help="also run the layered cycles with the encoder's region D, paired per session against the first")
    p.add_argument("--compare-encoder-layers", default=None, metavar="LAYERS",
                   help="with --compare-encoder: the layers (comma-separated) whose data its encoder learns from (default all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from trainer.product_data import parse_layers
    from trainer.product_train import ProductTrainConfig

    if args.compare_encoder_layers is not None:
        if args.compare_encoder is None:
            p.error("--compare-encoder-layers: only with --compare-encoder D")
        try:
            parse_layers(args.compare_encoder_layers)
        except ValueError as exc:
            p.error(f"--compare-encoder-layers: {exc}")

    started = time.monotonic()
    world = World(SimConfig(), args.seed)
    truth_sessions = range(TRUTH_FIRST, TRUTH_FIRST + args.truth_sessions)
    moved_on = range(TRUTH_FIRST, TRUTH_FIRST + args.movement_sessions)
    rules_model = ModelSet.load(default_bundle(), OPTIONS)
    baselines = {}
    values: dict[str, np.ndarray] = {}
    for name, model, chooser in (("rules", rules_model, by_model(rules_model)), ("oracle", rules_model, oracle_chooser(rules_model))):
        values[name], baselines[name] = truth(world, model, chooser, truth_sessions)
        print(f"{name}: {baselines[name]['objective']}", file=sys.stderr)
    encoder_delta = ProductTrainConfig().encoder_delta if args.encoder_delta is None else args.encoder_delta
    cycles = layered_cycles(world, args, encoder_delta, truth_sessions, moved_on, values, "")
    result: dict[str, Any] = {"seed": args.seed, "sessions_per_cycle": args.sessions,
                              "truth_sessions": [truth_sessions.start, truth_sessions.stop], "baselines": baselines,
                              "cycles": cycles}
    if args.compare_encoder is not None:
        taught = None if args.compare_encoder_layers is None else parse_layers(args.compare_encoder_layers)
        other = layered_cycles(world, args, args.compare_encoder, truth_sessions, moved_on, values, "other-", taught)
        for k, row in enumerate(other):  # the same truth sessions: paired per session
            row["minus_first"] = mean_ci(values[f"other-cycle{k}"] - values[f"cycle{k}"])
        result["compared"] = other
    if not args.no_flat:
        flat_rows = flat_cycles(world, args, start_bundle(), truth_sessions, moved_on, values)
        for layered, flat in zip(cycles, flat_rows, strict=True):
            layered["flat"] = flat
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        RESULTS.mkdir(exist_ok=True)
        name = "product_learning.json"
        if args.compare_encoder is not None:
            name = "product_learning-encoder.json" if args.compare_encoder_layers is None else "product_learning-encoder-layers.json"
        (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
