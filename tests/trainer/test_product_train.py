"""Training RecommendProduct's heads on their own logged decisions: the rows, the per-layer trust regions, the
gradient stop between layers, the export, the command line. Real logs: simulated shoppers served by the server's
product decision through the real recorder."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from core.domain import Outcome
from experience.schema import OUTCOMES as SCHEMAS_OUTCOMES
from experience.segments import DirectorySource
from policy.features import FeatureSpec
from policy.plurality import PluralityDecoder
from simulator.config import SimConfig
from simulator.drive import by_model, run_logged
from simulator.world import World
from tests.harness import ROOT, trainer_in_process
from tests.log_tables import copies, with_column, with_value
from trainer import product_data
from trainer.product_checks import usable_products
from trainer.product_data import HEAD_OF, LAYERS, layer_rows, product_rows
from trainer.product_gate import judge, served_probability
from trainer.product_train import ProductTrainConfig, sample_rows, train_products
from trainer.product_update import DELTAS, Head, _kl, _log_q, update_heads
from weights import mlp
from weights.bundle import PARTS, Bundle, read_bundle
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet, ProductLayers
from weights.product_guard import manifest_section as guard_section
from weights.product_heads import PART, init_params, with_heads

OPTIONS = LoadOptions(device="cpu", warmup_batch=1)


@pytest.fixture(scope="module")
def start() -> Bundle:
    base = default_bundle()
    spec = FeatureSpec.parse(base.manifest["feature_spec"])
    return read_bundle(with_heads(base, init_params(np.random.default_rng([3, 1]), spec), spec, {"model_version": "heads-3"}))


@pytest.fixture(scope="module")
def product_logs(tmp_path_factory: pytest.TempPathFactory, start: Bundle) -> Path:
    root = tmp_path_factory.mktemp("product-logs")
    model = ModelSet.load(start, OPTIONS)
    trace, written = run_logged(World(SimConfig(), 7), model, range(300), ZoneInfo("UTC"), root, b"salt" * 8,
                                products=by_model(model))
    assert written["products"] == trace.products == written["decisions"] > 0  # one offer a page
    return root


@pytest.fixture(scope="module")
def rows(product_logs: Path, start: Bundle):  # type: ignore[no-untyped-def]
    source = DirectorySource(product_logs)
    return product_rows(source.table("products"), source.table("outcomes"), ModelSet.load(start, OPTIONS))


def _params(bundle: Bundle) -> dict[str, mlp.Params]:
    return {name: mlp.policy_params_from_onnx(bundle.parts[part]) for name, part in PART.items()}


def test_rows_carry_each_layers_candidates_and_a_reward_the_orders_back(rows, product_logs: Path) -> None:  # type: ignore[no-untyped-def]
    n = len(rows)
    for layer in LAYERS:
        data = rows.layers[layer]
        assert data.features.shape[0] == n and data.permitted.shape == data.valid.shape == data.served.shape
        assert data.permitted[np.arange(n), data.index].all()  # every logged choice was permitted
        np.testing.assert_allclose(data.served[np.arange(n), data.index], data.propensity)
        np.testing.assert_allclose(data.served.sum(axis=1), 1.0, atol=1e-9)
    assert rows.taken.any() and (rows.rewards > 0).any()
    assert (rows.rewards[~rows.taken] <= 0).all()  # only a taken product earns
    # A product's reward is part of the order that carried it: per session, never more than its orders' value.
    outcomes = DirectorySource(product_logs).table("outcomes").to_pylist()
    orders: dict[str, float] = {}
    for o in outcomes:
        if o["outcome"] == 2:
            orders[o["session_id"]] = orders.get(o["session_id"], 0.0) + o["value"]
    earned: dict[str, float] = {}
    for s, r in zip(rows.sessions.tolist(), rows.rewards.tolist(), strict=True):
        earned[s] = earned.get(s, 0.0) + max(r, 0.0)
    assert all(v <= orders.get(s, 0.0) * 1.002 + 1e-6 for s, v in earned.items())
    assert any(v > 0 for v in earned.values())


def test_a_category_step_leaves_the_other_heads_and_the_encoder_untouched(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    params = _params(start)
    new, steps = update_heads(params, rows, layers=("category",))
    assert [s.layer for s in steps] == ["category"] and steps[0].accepted
    assert any(not np.array_equal(new["category"][k], params["category"][k]) for k in params["category"])
    for name in ("encoder", "sku", "band"):
        for k in params[name]:
            assert np.array_equal(new[name][k], params[name][k]), (name, k)


def test_changing_only_the_categorys_advantages_reaches_the_sku_layer_only_through_the_encoder(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    from trainer.product_update import advantages

    rows = rows.take(np.arange(len(rows)) < len(rows) // 3)  # what flows where holds on any rows: a third of the run's time
    params = _params(start)
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    own = {layer: advantages(rows, h, layer) for layer in LAYERS}
    logged, _ = update_heads(params, rows, advantage=own)
    assert all(np.array_equal(logged[n][k], v) for n, p in update_heads(params, rows)[0].items() for k, v in p.items())
    reversed_category = {**own, "category": -own["category"]}
    fixed, _ = update_heads(params, rows, advantage=reversed_category)
    assert any(not np.array_equal(fixed["category"][k], logged["category"][k]) for k in params["category"])
    for name in ("encoder", "sku", "band"):  # the encoder held: the SKU and band heads are the logged run's, bit for bit
        assert all(np.array_equal(fixed[name][k], logged[name][k]) for k in params[name]), name
    with_encoder, _ = update_heads(params, rows, encoder_delta=0.02, advantage=reversed_category)
    logged_encoder, _ = update_heads(params, rows, encoder_delta=0.02, advantage=own)
    assert all(np.array_equal(with_encoder["sku"][k], logged["sku"][k]) for k in params["sku"])
    assert any(not np.array_equal(with_encoder["encoder"][k], logged_encoder["encoder"][k]) for k in params["encoder"])
    with pytest.raises(ValueError, match=r"advantage\['sku'\]"):
        update_heads(params, rows, advantage={**own, "sku": own["sku"][:-1]})

    # The encoder taught by the SKU's and the band's data only: the category's data no longer reaches it, so the SKU
    # layer (head and encoder) is the same whatever the category's data says, and the category's KL still bounds it.
    untaught = ("sku", "price_band")
    a, a_steps = update_heads(params, rows, encoder_delta=0.02, advantage=own, encoder_layers=untaught)
    b, _ = update_heads(params, rows, encoder_delta=0.02, advantage=reversed_category, encoder_layers=untaught)
    assert any(not np.array_equal(a["category"][k], b["category"][k]) for k in params["category"])
    for name in ("encoder", "sku", "band"):
        assert all(np.array_equal(a[name][k], b[name][k]) for k in params[name]), name
    assert any(not np.array_equal(a["encoder"][k], params["encoder"][k]) for k in params["encoder"])
    assert a_steps[-1].accepted and a_steps[-1].kl <= 0.02 * (1 + 1e-5) and a_steps[-1].taught == untaught

    def layer_kl(layer: str, head: mlp.Params, head_before: mlp.Params | None = None) -> float:
        """The layer's KL from the arrays as the encoder moved, under ``head`` (from ``head_before``, default the same)."""
        data = rows.layers[layer]
        n, c = data.features.shape[:2]
        permitted = torch.from_numpy(data.permitted)

        def log_q(encoder: mlp.Params, under: mlp.Params) -> torch.Tensor:
            h = mlp.policy_forward(encoder, rows.states).astype(np.float32)
            x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
            with torch.no_grad():
                return _log_q(Head(under), x, permitted)
        return float(_kl(log_q(params["encoder"], head if head_before is None else head_before), log_q(a["encoder"], head),
                         permitted))

    # The region holds all three layers' KL, the untaught category's under its starting head.
    region = layer_kl("category", params["category"]) + layer_kl("sku", a["sku"]) + layer_kl("price_band", a["band"])
    assert region == pytest.approx(a_steps[-1].kl, rel=1e-3, abs=1e-6) and layer_kl("category", params["category"]) > 0
    # The category reads the moved h too: its whole move (its new head on the moved encoder, from its start) is what is
    # reported, not its head's step alone. (How far the two differ depends on the machine's float order: 2.6e-4 apart,
    # relative, on an Intel Xeon with AMX, so only the whole move's own figure is pinned.)
    assert a_steps[0].kl_from_start == pytest.approx(layer_kl("category", a["category"], params["category"]), rel=1e-4)
    for layers, taught in ((("sku",), ("category",)), (LAYERS, ())):
        with pytest.raises(ValueError, match="encoder_layers"):
            update_heads(params, rows, layers=layers, encoder_delta=0.02, encoder_layers=taught)
    with pytest.raises(ValueError, match="advantage: expected one per layer"):
        update_heads(params, rows, advantage={"sku": own["sku"]})
    with pytest.raises(ValueError, match="encoder_layers"):
        ProductTrainConfig(layers=("sku",), encoder_layers=("category",))


def test_each_layer_moves_within_its_own_trust_region_and_improves_its_surrogate(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    params = _params(start)
    new, steps = update_heads(params, rows)
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    for step in steps:
        assert step.accepted and step.improvement > 0 and 0 < step.kl <= DELTAS[step.layer] * (1 + 1e-5), step
        data = rows.layers[step.layer]
        n, c = data.features.shape[:2]
        x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
        permitted = torch.from_numpy(data.permitted)
        with torch.no_grad():  # recomputed from the exported arrays, not the trainer's own bookkeeping
            kl = float(_kl(_log_q(Head(params[HEAD_OF[step.layer]]), x, permitted),
                           _log_q(Head(new[HEAD_OF[step.layer]]), x, permitted), permitted))
        assert kl == pytest.approx(step.kl, rel=1e-3, abs=1e-6)
    tight, _ = update_heads(params, rows, deltas={**DELTAS, "sku": 0.001})
    moved = {k: (np.abs(tight["sku"][k] - params["sku"][k]).max(), np.abs(new["sku"][k] - params["sku"][k]).max()) for k in params["sku"]}
    assert moved.pop("b3")[1] < 1e-5  # the last bias adds the same to every candidate's logit: no gradient, only rounding
    assert all(t < d for t, d in moved.values()), moved
    with pytest.raises(ValueError, match="unknown layer"):
        update_heads(params, rows, layers=("colour",))
    with pytest.raises(ValueError, match="deltas"):
        update_heads(params, rows, deltas={**DELTAS, "category": 0.0})


def test_the_encoder_moves_within_the_summed_region_under_the_new_heads(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    params = _params(start)
    heads_only, _ = update_heads(params, rows)
    new, steps = update_heads(params, rows, encoder_delta=0.02)
    assert [s.layer for s in steps] == [*LAYERS, "encoder"]
    for name in ("category", "sku", "band"):  # the heads' steps are the same with or without the encoder's after them
        for k in params[name]:
            assert np.array_equal(new[name][k], heads_only[name][k]), (name, k)
    step = steps[-1]
    assert step.accepted and step.improvement > 0 and 0 < step.kl <= 0.02 * (1 + 1e-5), step
    assert any(not np.array_equal(new["encoder"][k], params["encoder"][k]) for k in params["encoder"])

    def log_q(encoder: mlp.Params, heads: dict[str, mlp.Params], layer: str) -> torch.Tensor:  # from the exported arrays
        h = mlp.policy_forward(encoder, rows.states).astype(np.float32)
        data = rows.layers[layer]
        n, c = data.features.shape[:2]
        x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
        with torch.no_grad():
            return _log_q(Head(heads[HEAD_OF[layer]]), x, torch.from_numpy(data.permitted))

    def kl(a: torch.Tensor, b: torch.Tensor, layer: str) -> float:
        return float(_kl(a, b, torch.from_numpy(rows.layers[layer].permitted)))

    summed = sum(kl(log_q(params["encoder"], new, layer), log_q(new["encoder"], new, layer), layer) for layer in LAYERS)
    assert summed == pytest.approx(step.kl, rel=1e-3, abs=1e-6)
    for moved in steps[:-1]:  # each layer's whole move, both steps, from its starting policy: measured, reported
        whole = kl(log_q(params["encoder"], params, moved.layer), log_q(new["encoder"], new, moved.layer), moved.layer)
        assert moved.kl_from_start == pytest.approx(whole, rel=1e-3, abs=1e-6) and whole > 0
    with pytest.raises(ValueError, match="encoder_delta"):
        update_heads(params, rows, encoder_delta=-1.0)


def test_the_exported_bundle_keeps_the_flat_decision_and_serves_the_new_heads(product_logs: Path, start: Bundle) -> None:
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    result = train_products(products, outcomes, start, "products-1", "2026-12-03T00:00:00Z")
    backwards = [t.take(pa.array(np.arange(t.num_rows)[::-1])) for t in (products, outcomes)]  # as `logs compact` reorders
    again = train_products(*backwards, start, "products-1", "2026-12-03T00:00:00Z")
    assert result.bundle == again.bundle  # same logs, same seed: the same bytes, in whatever order the files hold them
    trained = read_bundle(result.bundle)
    assert all(trained.parts[p] == start.parts[p] for p in PARTS)  # the flat decision, byte for byte
    assert all(trained.parts[p] != start.parts[p] for p in ("product_category.onnx", "product_sku.onnx", "product_band.onnx",
                                                            "product_encoder.onnx"))  # the encoder in its own region too
    m = trained.manifest
    assert m["model_version"] == "products-1" and m["provenance"]["from"] == "heads-3"
    assert m["product"] == {**start.manifest["product"], "guard": guard_section()} and m["format_version"] == 3  # guards too
    assert set(m["product_training"]["layers"]) == {*LAYERS, "encoder"}
    assert all(m["product_training"]["layers"][layer]["kl_from_start"] > 0 for layer in LAYERS)
    fixed = read_bundle(train_products(products, outcomes, start, "products-3", "2026-12-03T00:00:00Z",
                                       ProductTrainConfig(encoder_delta=0.0, guard=None)).bundle)
    assert fixed.parts["product_encoder.onnx"] == start.parts["product_encoder.onnx"]  # held fixed when asked
    unguarded = read_bundle(train_products(products, outcomes, start, "products-4", "2026-12-03T00:00:00Z",
                                           ProductTrainConfig(guard=None)).bundle)
    assert unguarded.manifest["format_version"] == 2 and "guard" not in unguarded.manifest["product"]
    model = ModelSet.load(trained, OPTIONS)  # the golden self-test of the new heads passes as the server runs it
    assert model.product is not None
    # Fewer rows: whole sessions by a keyed hash, the same on a rerun.
    few = sample_rows(products, 100, 0)
    assert 0 < few.num_rows <= 100 and few.equals(sample_rows(products, 100, 0))
    everywhere = Counter(products.column("session_id").to_pylist())
    assert all(everywhere[s] == n for s, n in Counter(few.column("session_id").to_pylist()).items())  # whole sessions
    small = train_products(products, outcomes, start, "products-2", "2026-12-03T00:00:00Z", ProductTrainConfig(max_rows=100))
    assert small.metrics["product_rows"] <= 100 < small.metrics["product_rows_logged"]
    gate = result.metrics["gate"]  # judged on sessions it never trained on
    assert gate["offers"] == result.metrics["gate_rows"] > 0 and gate["publish"] == result.publish
    assert result.metrics["product_rows"] + result.metrics["gate_rows"] == products.num_rows
    assert trained.manifest["product_training"]["gate"] == gate


def test_the_gate_replays_the_logged_propensities_and_pairs_the_two_bundles(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    model = ModelSet.load(start, OPTIONS)
    assert model.product is not None
    pair = model.product
    logged = np.prod([rows.layers[layer].propensity for layer in LAYERS], axis=0)
    np.testing.assert_allclose(served_probability(pair, rows), logged, rtol=0.02, atol=1e-3)  # float16 features
    same = judge(pair, pair, rows)
    assert same.difference.value == 0 and same.difference.ci_low == 0 and same.publish
    assert same.sessions == len(set(rows.sessions.tolist())) and same.offers == len(rows)
    # Another band head, judged against the logging one: a paired difference, published only on its lower bound.
    params = _params(start)
    worse = {**params, "band": {**params["band"], "w3": params["band"]["w3"] * 0}}
    bad = ModelSet.load(read_bundle(with_heads(start, worse, FeatureSpec.parse(start.manifest["feature_spec"]), {})), OPTIONS)
    assert bad.product is not None
    verdict = judge(bad.product, pair, rows)
    d = verdict.difference
    assert d.value == pytest.approx(verdict.new.value - verdict.current.value) and d.ci_low <= d.value <= d.ci_high
    assert verdict.current.value == same.current.value != verdict.new.value
    assert verdict.publish == (d.ci_low >= 0 and verdict.pareto_k <= 0.7)
    with pytest.raises(ValueError, match="no held-out"):
        judge(pair, pair, rows.take(np.zeros(len(rows), dtype=np.bool_)))
    few = judge(pair, pair, rows.take(np.isin(rows.sessions, rows.sessions[:40])))  # a handful of sessions: no verdict
    assert not few.publish and "too few held-out sessions" in few.reason
    assert judge(pair, pair, rows, current_version="heads-3").publish  # its replay gives back what it logged
    # A reward that is not a number (an infinite price made one, before the logs' checks left such rows out) made every
    # figure NaN, and NaN < −tolerance is false: the gate published. It refuses, saying why.
    poisoned = dataclasses.replace(rows, rewards=np.where(np.arange(len(rows)) == 3, np.inf, rows.rewards))
    refused = judge(bad.product, pair, poisoned)
    assert not refused.publish and "the difference could not be estimated" in refused.reason, refused.reason
    other = PluralityDecoder(samples=3, min_votes=2)  # not what served the logs
    with pytest.raises(ValueError, match="does not replay its own logged propensities"):
        judge(pair, ProductLayers(model.product.heads, other), rows, current_version="heads-3")


def test_retried_reports_count_once_and_foreign_features_are_named(product_logs: Path, start: Bundle, rows) -> None:  # type: ignore[no-untyped-def]
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    model = ModelSet.load(start, OPTIONS)
    twice = product_rows(products, pa.concat_tables([outcomes, outcomes]), model)  # every report sent again
    np.testing.assert_array_equal(twice.rewards, rows.rewards)
    with pytest.raises(ValueError, match=r"sku_features: candidates of .* features where the bundle's head reads 5"):
        layer_rows(products, "sku", 5)


def test_a_copy_of_a_decision_in_another_session_takes_none_of_its_outcomes(product_logs: Path, rows) -> None:  # type: ignore[no-untyped-def]
    """Outcomes match a product decision by its session and its id: a row copied into another session under the same
    decision id gets nothing (its session reported nothing), and the real row keeps what it earned. (Matched by the id
    alone, the copy, later in the table, took the real row's outcomes.)"""
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    i = int(np.flatnonzero(rows.taken & (rows.rewards > 0))[0])  # rows are in the table's order
    copy = with_value(products.slice(i, 1), "session_id", 0, "f" * 32)
    paid = np.full(products.num_rows + 1, 5.0)
    reward, taken, complaints = product_data.rewards(pa.concat_tables([products, copy]), outcomes, paid, 10.0)
    np.testing.assert_array_equal(taken[:-1], rows.taken)
    np.testing.assert_array_equal(complaints[:-1], rows.complaints)
    assert taken[i] and reward[i] == 5.0 and not taken[-1] and reward[-1] == 0.0 and complaints[-1] == 0


def test_a_sessions_offers_earn_in_all_at_most_what_it_ordered(product_logs: Path, rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    """A caller sent 377 ADD_TO_CARTs a session against offers of 900 and one order of 1.00: each offer earned its
    price, and 20 such sessions moved the product gate's estimate from 28.7 to 6,120 (a review, 2026-12-05). Now a
    session's credited offers are scaled down to its orders' value (1 % of slack for the float16 prices); the logged
    sessions, whose offers stay within 0.2 % of their orders, earn exactly what they earn unscaled."""
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    i = int(np.flatnonzero(rows.taken & (rows.rewards > 0))[0])
    n, session = 300, "a" * 32
    offers = copies(products.slice(i, 1), n, session)
    time = products.column("event_time_s")[i].as_py()
    carts = copies(outcomes.slice(0, 1), n, session)  # each names one of the offers: the same ids, in order
    for column, values in {"outcome_id": [f"atc{k}" for k in range(n)], "outcome": [int(Outcome.ADD_TO_CART)] * n,
                           "event_time_s": [time] * n}.items():
        carts = with_column(carts, column, values)
    order = with_column(with_column(with_column(with_column(carts.slice(0, 1), "outcome", [int(Outcome.ORDER)]), "value", [1.0]),
                                    "outcome_id", ["order"]), "event_time_s", [time + 1.0])
    paid = np.full(products.num_rows + n, 900.0)
    reward, taken, _ = product_data.rewards(pa.concat_tables([products, offers]), pa.concat_tables([outcomes, carts, order]),
                                            paid, 10.0)
    assert taken[-n:].all() and 0 < reward[-n:].sum() <= product_data.ORDER_SLACK * 1.0 + 1e-9
    unscaled = product_rows(products, outcomes, ModelSet.load(start, OPTIONS), slack=math.inf)
    assert (unscaled.rewards > 0).any()
    np.testing.assert_array_equal(unscaled.rewards, rows.rewards)


def test_a_session_of_more_product_decisions_than_the_limit_is_left_out(product_logs: Path) -> None:
    """The decision limit of the flat logs (1,000 a session) holds for product rows too: it did not reach this path."""
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    many = copies(products.slice(0, 1), 1_001, "b" * 32)
    kept, _, dropped = usable_products(pa.concat_tables([products, many]), outcomes)
    assert dropped.sessions == 1 and dropped.reasons == {"decisions of a session past 1000": 1_001}
    assert kept.num_rows == products.num_rows
    assert usable_products(pa.concat_tables([products, many.slice(1)]), outcomes)[2].sessions == 0


def test_a_bundle_without_heads_or_logs_without_products_are_refused(product_logs: Path) -> None:
    source = DirectorySource(product_logs)
    with pytest.raises(ValueError, match="no product heads"):
        train_products(source.table("products"), source.table("outcomes"), default_bundle(), "x", "2026-12-03T00:00:00Z")
    with pytest.raises(ValueError, match="no product decisions"):
        train_products(source.table("products").slice(0, 0), source.table("outcomes"), default_bundle(), "x", "2026-12-03T00:00:00Z")
    with pytest.raises(ValueError, match="max_rows"):
        train_products(source.table("products"), source.table("outcomes"), default_bundle(), "x", "t", ProductTrainConfig(max_rows=0))


def test_the_command_trains_and_names_what_is_wrong(tmp_path: Path, product_logs: Path, start: Bundle) -> None:
    init = tmp_path / "init.bundle"
    init.write_bytes(with_heads(start, _params(start), FeatureSpec.parse(start.manifest["feature_spec"]), {}))
    cli = [sys.executable, "-m", "server", "train-products"]
    run = subprocess.run([*cli, "--logs", str(product_logs), "--init", str(init), "--out", str(tmp_path / "out.bundle"),
                          "--version", "p1", "--max-rows", "500", "--delta-encoder", "0.01", "--guard-max-complaint", "0.2",
                          "--encoder-layers", "sku, price-band"],
                         capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    report = json.loads(run.stdout.splitlines()[-1])
    assert run.returncode == (0 if report["publish"] else 3), run.stderr  # written either way; 3: the gate refused it
    assert report["model_version"] == "p1" and report["metrics"]["product_rows"] <= 500
    assert report["metrics"]["config"]["encoder_delta"] == 0.01 and 0 < report["metrics"]["layers"]["encoder"]["kl"] <= 0.01
    assert report["metrics"]["config"]["encoder_layers"] == ["sku", "price_band"]
    assert report["metrics"]["layers"]["encoder"]["taught"] == ["sku", "price_band"]  # what the step really used
    assert read_bundle(tmp_path / "out.bundle").model_version == "p1"
    assert read_bundle(tmp_path / "out.bundle").manifest["product"]["guard"]["max_complaint"]["sku"] == 0.2
    assert report["metrics"]["config"]["guard"]["max_complaint"] == 0.2 and set(report["metrics"]["guard"]["layers"]) == set(LAYERS)
    empty = tmp_path / "no-products"
    (empty / "decisions").mkdir(parents=True)
    for args, message in ((["--logs", str(empty)], "no products/ directory"),
                          (["--logs", str(product_logs), "--delta-sku", "0"], "--delta-sku"),
                          (["--logs", str(product_logs), "--delta-sku", "inf"], "--delta-sku"),  # (was exit 1, a traceback)
                          (["--logs", str(product_logs), "--delta-encoder", "-0.1"], "--delta-encoder: expected >= 0"),
                          (["--logs", str(product_logs), "--encoder-layers", "sku,colour"], "--encoder-layers: expected distinct"),
                          (["--logs", str(product_logs), "--encoder-layers", "sku,sku"], "--encoder-layers: expected distinct"),
                          (["--logs", str(product_logs), "--encoder-layers", " , "], "--encoder-layers: expected distinct"),
                          (["--logs", str(product_logs), "--encoder-layers", "sku", "--delta-encoder", "0"], "held fixed"),
                          (["--logs", str(product_logs), "--guard-max-complaint", "0"], "--guard-max-complaint"),
                          (["--logs", str(product_logs), "--guard-max-complaint", "0.2", "--no-guard"], "--guard-max-complaint")):
        code, _, err = trainer_in_process("train-products", *args, "--init", str(init), "--out", str(tmp_path / "x.bundle"))
        assert code == 2 and message in err, err


POISONS = {  # a product row no server writes, as the reviews found them (its value from the row's own), and the reason
    "sku_index": (lambda v: 999, "sku_index outside its candidates, or not permitted"),
    "category_propensity": (lambda v: float("nan"), "category_propensity outside (0, 1]"),
    "price_band_propensity": (lambda v: 1e-12, "price_band_propensity not the served probability of the choice"),
    "sku_served_probs": (lambda v: [0.5] * 3, "sku_served_probs not a distribution over its permitted candidates"),
    "sku_permitted": (lambda v: [False] * len(v), "sku_index outside its candidates, or not permitted"),
    "category_permitted": (lambda v: [*v, True], "category: a per-candidate list of another length than its candidates"),
    "category_fallback": (lambda v: -1, "category_fallback outside its candidates, or not permitted"),
    "hour": (lambda v: 99, "hour outside 0..23"),
    "page_type": (lambda v: 9, "page_type outside 0..4"),
    "sku_features": (lambda v: [[float("nan")] * len(x) for x in v], "sku_features NaN"),
    # an infinite price (read as float16's 65,504) made the reward infinite and the product gate publish on NaN
    "price_band_features": (lambda v: [[*x[:3], 65504.0, *x[4:]] for x in v], "price_band_features: a price no request can ask"),
    "price_band_rule_rank": (lambda v: [0] * len(v), "price_band_rule_rank not each candidate once"),
    "sku_guardrail": (lambda v: [False] * len(v), "sku_permitted where sku_guardrail bans"),
    "sku_ids": (lambda v: [*v, *(f"extra-{i}" for i in range(65 - len(v)))], "sku: more candidates than a request may offer"),
    "item_embedding": (lambda v: [float("nan"), *v[1:]], "item_embedding NaN"),
    "behavior_bucket_indices": (lambda v: [5000], "behavior_bucket_indices outside the logged bucket count"),
}


@pytest.mark.parametrize("column", sorted(POISONS))
def test_the_sessions_of_product_rows_no_server_writes_are_left_out(product_logs: Path, column: str) -> None:
    """Each stopped ``train-products`` (a choice outside its candidates, an hour of 99, lists of another length) or moved
    the product gate's estimate (a NaN propensity or feature, a choice that was not permitted)."""
    source = DirectorySource(product_logs)
    products, outcomes = source.table("products"), source.table("outcomes")
    assert usable_products(products, outcomes)[2].sessions == 0  # real logs pass untouched
    poison, reason = POISONS[column]
    row = 5
    session = products.column("session_id")[row].as_py()
    value = poison(products.column(column)[row].as_py())
    kept_p, kept_o, dropped = usable_products(with_value(products, column, row, value), outcomes)
    assert dropped.sessions == 1 and reason in dropped.reasons
    assert session not in set(kept_p.column("session_id").to_pylist()) | set(kept_o.column("session_id").to_pylist())
    assert kept_p.num_rows == products.num_rows - dropped.decisions and kept_o.num_rows == outcomes.num_rows - dropped.outcomes


def test_train_products_trains_on_the_rest_once_and_says_what_it_left_out(product_logs: Path, start: Bundle,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied products segment logged every decision twice, and only the later copy got its outcomes. The run's seed
    reaches the layers' steps (their baselines' folds): the real ``update_heads`` runs, wrapped to record its seed."""
    from trainer import product_train

    seeds: list[int] = []

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        seeds.append(kwargs.get("seed", 0))
        return update_heads(*args, **kwargs)

    monkeypatch.setattr(product_train, "update_heads", recorded)
    source = DirectorySource(product_logs)
    products = with_value(source.table("products"), "sku_index", 5, 999)
    copied = pa.concat_tables([products, products.slice(100, 50)])
    result = train_products(copied, source.table("outcomes"), start, "products-5", "2026-12-03T00:00:00Z",
                            ProductTrainConfig(seed=3))
    assert seeds == [3]
    left_out = result.metrics["left_out"]
    assert left_out["sessions"] == 1 and left_out["reasons"] == {"sku_index outside its candidates, or not permitted": 1}
    assert result.metrics["duplicate_rows"] == 50
    assert result.metrics["product_rows"] + result.metrics["gate_rows"] == products.num_rows - left_out["decisions"]


def test_a_rules_choice_the_row_does_not_permit_is_a_bad_row(product_logs: Path) -> None:
    """The gate replays a row without rule ranks with its logged ``fallback``: a server logs one it permits."""
    products = DirectorySource(product_logs).table("products")
    row = next(i for i, n in enumerate(pc.list_value_length(products.column("category_ids")).to_pylist()) if n > 1)
    index = products.column("category_index")[row].as_py()
    other = next(k for k in range(len(products.column("category_ids")[row].as_py())) if k != index)
    products = with_value(products, "category_fallback", row, other)
    permitted = products.column("category_permitted")[row].as_py()
    permitted[other] = False
    _, _, dropped = usable_products(with_value(products, "category_permitted", row, permitted), SCHEMAS_OUTCOMES.empty_table())
    assert dropped.sessions == 1 and "category_fallback outside its candidates, or not permitted" in dropped.reasons


def test_a_null_inside_a_guardrail_mask_ends_the_segments_read(product_logs: Path, tmp_path: Path) -> None:
    """The mask may be null (rows written before the column was), its elements not: one was read as False."""
    segment = sorted((product_logs / "products").glob("*.arrows"))[0]
    table = pa.ipc.open_stream(pa.memory_map(str(segment))).read_all()
    mask = table.column("sku_guardrail")[0].as_py()
    table = with_value(table, "sku_guardrail", 0, [None, *mask[1:]])
    (tmp_path / "products").mkdir()
    with pa.OSFile(str(tmp_path / "products" / segment.name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert DirectorySource(tmp_path).table("products").num_rows == 0  # (one batch: the whole segment)


def test_rows_the_bundle_cannot_rebuild_are_left_out_of_train_products(product_logs: Path, start: Bundle) -> None:
    """One row of another embedding length, or one candidate of another feature width, stopped the run (exit 2)."""
    source = DirectorySource(product_logs)
    products = with_value(source.table("products"), "item_embedding", 5, [0.5] * 3)
    features = products.column("sku_features")[9].as_py()
    products = with_value(products, "sku_features", 9, [features[0][:-1], *features[1:]])
    result = train_products(products, source.table("outcomes"), start, "products-6", "2026-12-03T00:00:00Z")
    width = ModelSet.load(start, OPTIONS).product.heads.widths["sku"]  # type: ignore[union-attr]
    assert result.metrics["left_out"]["reasons"] == {"item_embedding not the bundle's 768 values": 1,
                                                     f"sku_features of another width than the bundle's {width}": 1}


def test_the_runs_seed_keys_the_baselines_folds(rows, start: Bundle) -> None:  # type: ignore[no-untyped-def]
    """Each layer's cross-fitted baseline splits the sessions by the run's seed (``train_products`` passes its own), so
    another seed is another split, as the value baseline of the flat policy's (``baseline_folds``) is."""
    from trainer.product_update import advantages

    rows = rows.take(np.arange(len(rows)) < len(rows) // 4)
    params = _params(start)
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    seeded = {layer: advantages(rows, h, layer, seed=5) for layer in LAYERS}
    assert not np.allclose(seeded["sku"], advantages(rows, h, "sku"))  # another split, another baseline
    new, steps = update_heads(params, rows, layers=("sku",), seed=5)
    told, _ = update_heads(params, rows, layers=("sku",), advantage=seeded)
    assert all(np.array_equal(new["sku"][k], told["sku"][k]) for k in params["sku"])
    assert steps[0].advantage_sd == pytest.approx(float(seeded["sku"].std()))


def test_a_product_rows_baseline_never_saw_its_sessions_other_offers() -> None:
    """A session's offers share its orders, so their rewards move together: the cross-fit's halves are sessions, not
    alternate rows (with those, an offer's sibling in the other half, alike in what the layer knows, taught the
    baseline the offer's own reward)."""
    from trainer.product_update import cross_fitted_advantage

    rng = np.random.default_rng(0)
    sessions = np.repeat(np.arange(300), 2)
    x = np.concatenate([rng.normal(size=(300, 400))[sessions], np.ones((600, 1))], axis=1)  # what the layer knows: the session's
    r = rng.normal(size=300)[sessions]  # its orders: nothing x can predict
    baseline = r - cross_fitted_advantage(x, r, sessions)
    assert abs(np.corrcoef(baseline, r)[0, 1]) < 0.2
