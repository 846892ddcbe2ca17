"""The product gate replays each bundle's own guard: its vetoes among what the guardrails permitted, its rule's choice
among what is left (from the logged rule order), and FALLBACK_GUARD's certainty when it vetoes everything, so a new
bundle's guard is judged as it will serve, on logs that a bundle with another guard, or none, served. Rows logged before
the guardrail mask and the rule order were fall back on the serving bundle's mask, and the verdict counts them."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest

from experience.segments import DirectorySource
from policy.features import FeatureSpec
from simulator.config import SimConfig
from simulator.drive import by_model, run_logged
from simulator.world import World
from tests.trainer.test_product_train import OPTIONS, product_logs, rows, start  # noqa: F401  (fixtures)
from tests.weights.test_product_guard import overpriced_guard
from trainer.product_data import LAYERS, ProductRows, product_rows
from trainer.product_gate import judge, layer_probabilities, served_probability
from weights.bundle import Bundle, read_bundle
from weights.model_set import ModelSet, ProductLayers
from weights.product_guard import with_guard
from weights.product_heads import HIDDEN

LIMIT = math.log(1.1)


def _product(bundle: Bundle) -> ProductLayers:
    product = ModelSet.load(bundle, OPTIONS).product
    assert product is not None
    return product


def _guarded(start: Bundle, limit: float = LIMIT, vetoes_every_band: bool = False) -> ProductLayers:  # noqa: F811
    spec = FeatureSpec.parse(start.manifest["feature_spec"])
    return _product(read_bundle(with_guard(start, overpriced_guard(limit, vetoes_every_band, spec))))


def _overpriced(rows: ProductRows, start: Bundle) -> np.ndarray:  # noqa: F811
    """Per SKU candidate, whether the hand-made guard vetoes it: log(price / competitor) past its limit."""
    item_dim = FeatureSpec.parse(start.manifest["feature_spec"]).item_dim
    return (rows.layers["sku"].features[:, :, item_dim + 2] > LIMIT + 0.005) & rows.layers["sku"].valid


def _with_guardrail(rows: ProductRows, layer: str, guardrail: np.ndarray) -> ProductRows:  # noqa: F811
    return replace(rows, layers={**rows.layers, layer: replace(rows.layers[layer], guardrail=guardrail)})


def test_a_new_guards_vetoes_are_replayed_on_logs_served_without_one(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    heads = _product(start)
    assert heads.guard is None and rows.layers["sku"].guardrails_logged.all()
    plain = layer_probabilities(heads, rows)
    assert all(np.array_equal(p, q) for p, q in zip(layer_probabilities(_guarded(start, limit=50.0), rows).values(),
                                                     plain.values(), strict=True))  # a guard that vetoes nothing: no change
    guarded = layer_probabilities(_guarded(start), rows)
    vetoed = _overpriced(rows, start) & rows.layers["sku"].guardrail
    n, sku = len(rows), rows.layers["sku"]
    touched, chosen = vetoed.any(axis=1), vetoed[np.arange(n), sku.index]
    assert 0 < chosen.sum() < touched.sum() < n  # the logs offer both: shelves with an overpriced SKU, and without
    assert (guarded["sku"][chosen] == 0).all()  # an overpriced SKU the unguarded heads served: never by the new bundle
    assert np.array_equal(guarded["sku"][~touched], plain["sku"][~touched])  # nothing to veto: the heads' own
    assert not np.allclose(guarded["sku"][touched & ~chosen], plain["sku"][touched & ~chosen])  # the rest renormalised
    for layer in ("category", "price_band"):  # the guard vetoes no category and no band
        assert np.array_equal(guarded[layer], plain[layer])
    # The guard's vetoes are exactly a narrower guardrail for the heads alone, rule choice included.
    narrower = layer_probabilities(heads, _with_guardrail(rows, "sku", sku.guardrail & ~vetoed))
    np.testing.assert_array_equal(guarded["sku"], narrower["sku"])
    joint = served_probability(_guarded(start), rows)
    np.testing.assert_array_equal(joint, guarded["category"] * guarded["sku"] * guarded["price_band"])


def test_a_guard_that_vetoes_every_candidate_leaves_the_rule_among_the_guardrails_with_certainty(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    spec = FeatureSpec.parse(start.manifest["feature_spec"])
    params = overpriced_guard(LIMIT, True, spec)  # every band vetoed
    params["sku"]["w3"][:], params["sku"]["b3"][:] = 0.0, 10.0  # and every SKU
    replayed = layer_probabilities(_product(read_bundle(with_guard(start, params))), rows)
    for layer in ("sku", "price_band"):
        data = rows.layers[layer]
        # the unguarded logs' rule choice is the rule's among the guardrails: what the new bundle serves, always
        np.testing.assert_array_equal(replayed[layer], (data.index == data.fallback).astype(np.float64))
        assert 0 < replayed[layer].sum() < len(rows)
    # and among the guardrails, not among every candidate: shelves whose out-of-stock SKU the rule ranks first
    sku = rows.layers["sku"]
    assert (sku.valid & ~sku.guardrail & (sku.rule_rank == 0)).any()


def test_a_guard_that_vetoes_the_rules_choice_leaves_the_rule_its_next(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The rule serves the best deal; a guard that vetoes deals too good (log(price / competitor) below −0.03) often
    vetoes the rule's own choice, and the replay's rule then takes the next in its logged order, never a vetoed SKU."""
    spec = FeatureSpec.parse(start.manifest["feature_spec"])
    params = overpriced_guard(LIMIT, False, spec)
    column = HIDDEN + spec.item_dim + 2
    params["sku"]["w1"][column, 0], params["sku"]["b1"][0] = -1.0, -0.03 - 0.005  # relu(−x − 0.035): x below −0.035
    cheap = layer_probabilities(_product(read_bundle(with_guard(start, params))), rows)["sku"]
    sku = rows.layers["sku"]
    vetoed = (sku.features[:, :, spec.item_dim + 2] < -0.035) & sku.guardrail
    n = len(rows)
    rule_vetoed = vetoed[np.arange(n), sku.fallback]  # the unguarded logs' rule choice, which the new guard vetoes
    assert rule_vetoed.any() and (~vetoed.all(axis=1) & rule_vetoed).any()
    chosen = vetoed[np.arange(n), sku.index]
    assert (chosen & (sku.index == sku.fallback)).any()  # some of them the rule's choice the logs served
    assert (cheap[chosen] == 0).all()  # no share of a vetoed SKU, not even the low-consensus one of the rule


@pytest.fixture(scope="module")
def guarded_logs(tmp_path_factory: pytest.TempPathFactory, start: Bundle) -> tuple[ProductRows, str]:  # noqa: F811
    """Offers the guarded bundle (overpriced SKUs and every band vetoed) served itself (the first 300 sessions of the
    unguarded logs' world)."""
    root = tmp_path_factory.mktemp("guarded-logs")
    data = with_guard(start, overpriced_guard(LIMIT, True, FeatureSpec.parse(start.manifest["feature_spec"])))
    model = ModelSet.load(read_bundle(data), OPTIONS)
    run_logged(World(SimConfig(), 7), model, range(300), ZoneInfo("UTC"), root, b"salt" * 8, products=by_model(model))
    source = DirectorySource(root)
    return product_rows(source.table("products"), source.table("outcomes"), model), model.version


def test_logs_served_with_a_guard_replay_through_it_and_the_heads_alone_replay_without_it(guarded_logs, start: Bundle) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    served, version = guarded_logs
    sku = served.layers["sku"]
    held_back = sku.guardrail & ~sku.permitted  # what the guardrails permitted and the guard vetoed, as logged
    assert held_back.any() and (held_back <= _overpriced(served, start)).all()
    logged = np.prod([served.layers[layer].propensity for layer in LAYERS], axis=0)
    guarded, heads = _guarded(start, vetoes_every_band=True), _product(start)
    band = served.layers["price_band"]
    assert (band.propensity == 1.0).all() and (~band.permitted & band.guardrail).any()  # every band the rule's, certain
    replayed = served_probability(guarded, served)  # through its guard
    off = ~np.isclose(replayed, logged, rtol=0.02, atol=1e-3)
    # the logs keep features in float16: a SKU within its rounding of the guard's sharp limit may flip, nothing else
    item_dim = FeatureSpec.parse(start.manifest["feature_spec"]).item_dim
    near = (np.abs(sku.features[:, :, item_dim + 2] - (LIMIT + 0.005)) < 1e-3).any(axis=1)
    assert off.sum() <= 0.005 * len(served) and (near[off]).all()
    # The heads alone would also serve what the guard held back: on those shelves the chosen SKU's share is another.
    alone = layer_probabilities(heads, served)["sku"]
    shelves = held_back.any(axis=1)
    assert (~np.isclose(alone[shelves], sku.propensity[shelves], rtol=0.02, atol=1e-3)).mean() > 0.9
    np.testing.assert_allclose(alone[~shelves], sku.propensity[~shelves], rtol=0.02, atol=1e-3)
    verdict = judge(heads, guarded, served, current_version=version)  # the current bundle's replay holds through its guard
    assert verdict.offers_on_logged_mask == 0 and verdict.offers == len(served)


def test_rows_logged_before_the_guardrail_columns_replay_on_the_logged_mask(product_logs: Path, rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    source = DirectorySource(product_logs)
    products = source.table("products")
    for layer in LAYERS:
        for name in (f"{layer}_guardrail", f"{layer}_rule_rank"):
            i = products.schema.get_field_index(name)
            products = products.set_column(i, products.schema.field(i), pa.nulls(products.num_rows, products.schema.field(i).type))
    old = product_rows(products, source.table("outcomes"), ModelSet.load(start, OPTIONS))
    assert not any(old.layers[layer].guardrails_logged.any() for layer in LAYERS)
    heads = _product(start)
    np.testing.assert_array_equal(served_probability(heads, old), served_probability(heads, rows))
    np.testing.assert_array_equal(served_probability(_guarded(start), old), served_probability(heads, old))  # as before
    assert judge(heads, heads, old).offers_on_logged_mask == len(old)
    half = products.slice(0, products.num_rows // 2)
    mixed = product_rows(pa.concat_tables([half, source.table("products").slice(half.num_rows)]), source.table("outcomes"),
                         ModelSet.load(start, OPTIONS))
    assert judge(heads, heads, mixed).offers_on_logged_mask == half.num_rows
    bad = source.table("products")
    i = bad.schema.get_field_index("sku_rule_rank")
    bad = bad.set_column(i, bad.schema.field(i), pa.array([[0]] * bad.num_rows, type=bad.schema.field(i).type))
    with pytest.raises(ValueError, match="sku_rule_rank: a row whose list is not one entry per candidate"):
        product_rows(bad, source.table("outcomes"), ModelSet.load(start, OPTIONS))
    good = source.table("products")
    for name, values, message in (
            ("sku_rule_rank", lambda n: [0] * n, "sku_rule_rank: a row whose places are not 0 to"),
            ("sku_guardrail", lambda n: [False] * n, "sku_permitted: a candidate permitted that the row's sku_guardrail bans")):
        i = good.schema.get_field_index(name)
        counts = [len(ids) for ids in good.column("sku_ids").to_pylist()]
        wrong = good.set_column(i, good.schema.field(i), pa.array([values(n) for n in counts], type=good.schema.field(i).type))
        with pytest.raises(ValueError, match=message):
            product_rows(wrong, source.table("outcomes"), ModelSet.load(start, OPTIONS))

