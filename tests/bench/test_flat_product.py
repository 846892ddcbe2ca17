"""The flat product peer (bench.flat_product): its joint candidates respect every layer's guardrails, its serving
forward and its training forward agree, it samples with exact propensities, and its steps stay in their region."""

from __future__ import annotations

import zlib
from zoneinfo import ZoneInfo

import numpy as np
import pytest
import torch

from bench.flat_product import DELTA, FlatChooser, init_flat, joint_inputs, layer_views, logits_np, served_joint, train_flat
from core.product import ProductRequest
from policy import product_rules as rules
from policy.plurality import PluralityDecoder
from simulator.config import SimConfig
from simulator.drive import one_at_a_time, run_in_process
from simulator.products import candidates
from simulator.world import World
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet

WORLD = World(SimConfig(), 7)
SHAPE = (WORLD.config.products.categories, WORLD.config.products.skus, len(WORLD.config.products.bands))
ITEM_DIM = WORLD.catalogue.embeddings.shape[1]


def _request(index: int) -> ProductRequest:
    session = WORLD.session(index)
    page = session.page()
    assert page is not None
    categories, bands = candidates(WORLD.catalogue, session.shelf())
    return ProductRequest(session.request(page), categories, bands, session.visit_count)


def _encode(request: ProductRequest, hour: int) -> np.ndarray:
    """A stand-in shopper encoding, fixed per session (the flat policy reads h; which h does not matter here)."""
    return np.random.default_rng(zlib.crc32(request.shopper.session_id.encode())).standard_normal(32).astype(np.float32)


def test_joint_candidates_are_what_every_layer_permits() -> None:
    for i in range(40):
        request = _request(i)
        x = joint_inputs(request, WORLD.catalogue, SHAPE)
        cat_ok, band_ok = rules.category_permitted(request), rules.band_permitted(request)
        for c, category in enumerate(request.categories):
            sku_ok = rules.sku_permitted(category)
            for s in range(SHAPE[1]):
                for b in range(SHAPE[2]):
                    expected = s < len(category.skus) and bool(cat_ok[c] and sku_ok[s] and band_ok[b])
                    assert x.permitted[c, s, b] == expected
        assert x.permitted.reshape(-1)[x.rule]  # the rules' joint choice is one the guardrails allow


def test_served_draws_match_their_propensities_and_views_are_distributions() -> None:
    decoder = PluralityDecoder()
    params = init_flat(np.random.default_rng(0), ITEM_DIM)
    params["w3"] *= np.float32(300.0)  # a confident policy: the vote reaches its 4 votes
    chooser = FlatChooser(params, _encode, WORLD.catalogue, decoder, SHAPE)
    request = _request(3)
    x = joint_inputs(request, WORLD.catalogue, SHAPE)
    served = served_joint(params, _encode(request, 12), x, WORLD.catalogue.embeddings, decoder)
    assert served.sum() == pytest.approx(1.0) and (served[~x.permitted] == 0).all()
    counts = np.zeros(served.size)
    for k in range(600):
        d = chooser(WORLD.session(3), request, 12, f"d{k}")
        counts[np.ravel_multi_index((d.category.index, d.sku.index, d.price_band.index), SHAPE)] += 1
    assert np.abs(counts / 600 - served.reshape(-1)).max() < 0.07
    assert all(r["propensity"] == pytest.approx(served.reshape(-1)[r["index"]]) for r in chooser.rows)
    for view in layer_views(served, chooser.rows[0]["index"] // (SHAPE[1] * SHAPE[2]), 0).values():
        assert view.sum() == pytest.approx(1.0)


def test_training_moves_the_flat_policy_within_its_region_and_the_forwards_agree() -> None:
    model = ModelSet.load(default_bundle(), LoadOptions(warmup_batch=1))
    params = init_flat(np.random.default_rng(1), ITEM_DIM)
    chooser = FlatChooser(params, _encode, WORLD.catalogue, PluralityDecoder(), SHAPE)
    trace = run_in_process(WORLD, model, range(120), ZoneInfo("UTC"), products=one_at_a_time(chooser))
    torch.manual_seed(0)
    new, report = train_flat(params, chooser.rows, trace.tables()[1], WORLD.catalogue.embeddings)
    assert report["rows"] == len(chooser.rows) == trace.products and 0 < report["kl"] <= DELTA * (1 + 1e-5)
    assert report["steps"] >= 1 and report["improvement"] > 0
    # The KL the trainer reports is the one the serving forward (numpy) computes between the two policies.
    kls = []
    for r in chooser.rows:
        allowed = r["x"].permitted.reshape(-1)
        p, q = (np.where(allowed, np.exp(z - z[allowed].max()), 0.0) for z in
                (logits_np(w, r["h"], r["x"], WORLD.catalogue.embeddings).astype(np.float64) for w in (params, new)))
        p, q = p / p.sum(), q / q.sum()
        kls.append(float(np.sum(np.where(allowed, p * np.log(np.where(allowed, p, 1) / np.where(allowed, q, 1)), 0.0))))
    assert float(np.mean(kls)) == pytest.approx(report["kl"], rel=1e-3)
