"""RecommendProduct served by a bundle's product networks: each layer sampled by the seeded majority vote with exact
propensities (checked against what is served, over the wire), guardrails on every layer, replay from the decision id,
and a hot swap from a bundle without heads to one with them."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from core.domain import Source
from policy.plurality import PluralityDecoder
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.product_validation import parse_product
from server.validation import Limits
from tests.harness import ServerThread, request, running_server, stub
from tests.server.test_hot_swap import publish
from tests.server.test_recommend_product import product, sku
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet

HEADS = make_bundle(5, "heads-v1", "2026-12-03T00:00:00Z", product_heads=True)
POLICY_SOURCES = {pb.DECISION_SOURCE_POLICY, pb.DECISION_SOURCE_EXPLORATION, pb.DECISION_SOURCE_FALLBACK_LOW_CONSENSUS}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    directory = tmp_path_factory.mktemp("weights")
    publish(directory, HEADS)
    with running_server(weights_dir=directory, weights_poll_seconds=0.1, weights_debounce_ms=20) as thread:
        yield thread


def test_each_layer_is_sampled_by_the_networks_with_its_propensity(channel: grpc.Channel) -> None:
    answer = stub(channel).RecommendProduct(product(), timeout=5)
    assert answer.model_version == "heads-v1"
    layers = (answer.category, answer.sku, answer.price_band)
    assert all(layer.source in POLICY_SOURCES for layer in layers)
    assert all(0.0 < layer.propensity <= 1.0 for layer in layers)
    assert answer.joint_propensity == pytest.approx(np.prod([layer.propensity for layer in layers]), rel=1e-12)
    for layer in layers:
        assert (layer.votes >= 4) == (layer.source == pb.DECISION_SOURCE_POLICY)
        assert bool(layer.rule) == (layer.source == pb.DECISION_SOURCE_FALLBACK_LOW_CONSENSUS)


def test_served_frequencies_over_the_wire_match_the_propensities(channel: grpc.Channel) -> None:
    """The same request 500 times: each category is served as often as the propensity the server returns with it says
    (the category layer's distribution does not depend on the draw), by a chi-square bound; the rest of the
    probability is on categories never served, so the returned propensities of the served ones sum to at most 1."""
    call = stub(channel).RecommendProduct
    n = 500
    answers = [call(product(), timeout=5) for _ in range(n)]
    counts = Counter(a.category.index for a in answers)
    propensity: dict[int, float] = {}
    for a in answers:
        assert propensity.setdefault(a.category.index, a.category.propensity) == pytest.approx(a.category.propensity, abs=1e-12)
    assert sum(propensity.values()) <= 1.0 + 1e-9
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in propensity.items())
    unseen = 1.0 - sum(propensity.values())
    assert chi2 < 25.0 and unseen < 0.02, (counts, propensity)


def test_guardrails_bind_the_networks_too(channel: grpc.Channel) -> None:
    call = stub(channel).RecommendProduct
    offered = product(categories=[pb.ProductCategory(category_id="empty", skus=[sku("e1", 10.0, stock=0)]),
                                  pb.ProductCategory(category_id="shoes", skus=[sku("s1", 70.0, stock=0), sku("s2", 99.0),
                                                                                sku("s3", 30.0, stock=0), sku("s4", 45.0)])],
                      visit_count=1)
    for _ in range(60):
        answer = call(offered, timeout=5)
        assert answer.category.id == "shoes" and answer.sku.id in {"s2", "s4"}  # never empty, never out of stock
        assert answer.price_band.id != "high"  # the top band, on a first visit


def test_a_logged_decision_replays_from_its_id() -> None:
    model = ModelSet.load(read_bundle(HEADS), LoadOptions(warmup_batch=1))
    parsed = parse_product(product(), Limits(768, 16, 256), now_s=1_790_000_000.0)
    first = [model.decide_product(parsed, 12, f"replay-{i}") for i in range(30)]
    again = [model.decide_product(parsed, 12, f"replay-{i}") for i in range(30)]
    assert first == again
    assert len({(d.category.index, d.sku.index, d.price_band.index) for d in first}) > 1  # really sampled
    assert {d.category.source for d in first} <= {Source.POLICY, Source.EXPLORATION, Source.FALLBACK_LOW_CONSENSUS}


def _shelf(seed: int) -> pb.RecommendProductRequest:
    """A request of its own shape: 1-12 categories of 1-9 SKUs, some out of stock, 1-5 bands, any visit count."""
    rng = np.random.default_rng(seed)
    categories = [pb.ProductCategory(category_id=f"c{c}", skus=[
        sku(f"c{c}-{k}", float(rng.uniform(5, 300)), stock=int(rng.integers(0, 3)) if k else 1, seed=seed * 100 + k,
            competitor=float(rng.uniform(5, 300)) if rng.random() < 0.5 else None)
        for k in range(int(rng.integers(1, 10)))]) for c in range(int(rng.integers(1, 13)))]
    bands = [pb.PriceBand(band_id=f"b{b}", price_multiplier=float(m))
             for b, m in enumerate(rng.uniform(0.7, 1.4, size=int(rng.integers(1, 6))))]
    return product(categories=categories, price_bands=bands, visit_count=int(rng.integers(0, 4)))


def test_a_batch_decides_each_request_as_it_decides_it_alone() -> None:
    """The micro-batch decides requests of different shapes in one encoder call and one call per head: each request
    gets the choices, sources and votes it gets alone, and the same propensities to the graphs' rounding (a batched
    matrix product may round differently from a one-row one, as for RecommendAction)."""
    model = ModelSet.load(read_bundle(HEADS), LoadOptions(warmup_batch=1))
    limits = Limits(768, 16, 256)
    requests = [parse_product(_shelf(seed), limits, now_s=1_790_000_000.0) for seed in range(24)]
    hours = [(5 * i) % 24 for i in range(len(requests))]
    ids = [f"batch-{i}" for i in range(len(requests))]
    batch = model.decide_products(requests, hours, ids)
    assert len(batch) == len(requests)
    for decision, req, hour, did in zip(batch, requests, hours, ids, strict=True):
        alone = model.decide_product(req, hour, did)
        for (_, got), (_, want) in zip(decision.choices(), alone.choices(), strict=True):
            assert (got.index, got.source, got.votes, got.rule, got.permitted, got.fallback) == \
                (want.index, want.source, want.votes, want.rule, want.permitted, want.fallback)
            np.testing.assert_allclose(got.served, want.served, rtol=0, atol=1e-6)
            assert got.propensity == pytest.approx(want.propensity, abs=1e-6)
    sizes = {len(d.category.served) for d in batch} | {len(d.sku.served) for d in batch}
    assert len(sizes) > 3  # really of different shapes


def test_a_deadline_too_short_for_the_networks_is_answered_by_the_rules_as_degraded(tmp_path: Path) -> None:
    """As RecommendAction: with less time left than the inference budget, every layer's rule, FALLBACK_DEGRADED, counted
    by its layers' source (not in degraded_decisions_total, whose alert divides by RecommendAction's decisions)."""
    publish(tmp_path, HEADS)
    with running_server(weights_dir=tmp_path, min_inference_budget_ms=10_000) as slow, grpc.insecure_channel(slow.target) as ch:
        answer = stub(ch).RecommendProduct(product(), timeout=5)
        value = slow.registry.get_sample_value
    assert answer.model_version == "heads-v1"
    assert {answer.category.source, answer.sku.source, answer.price_band.source} == {pb.DECISION_SOURCE_FALLBACK_DEGRADED}
    assert (answer.category.id, answer.sku.id, answer.price_band.id) == ("bags", "b2", "list") and answer.joint_propensity == 1.0
    assert value("shopping_agent_product_layer_decisions_total", {"layer": "sku", "source": "fallback_degraded"}) == 1
    assert not value("shopping_agent_degraded_decisions_total", {"reason": "deadline"})


def test_a_bundle_without_heads_is_swapped_for_one_with_them(tmp_path: Path) -> None:
    from tests.server.test_hot_swap import bundle_bytes

    publish(tmp_path, bundle_bytes("flat-v1"))
    with running_server(weights_dir=tmp_path, weights_poll_seconds=0.1, weights_debounce_ms=20) as live_swap, \
            grpc.insecure_channel(live_swap.target) as ch:
        call = stub(ch).RecommendProduct
        before = call(product(), timeout=5)
        assert before.model_version == "flat-v1" and before.category.source == pb.DECISION_SOURCE_FALLBACK_NO_MODEL
        publish(tmp_path, HEADS)
        deadline = time.monotonic() + 10
        while call(product(), timeout=5).model_version != "heads-v1":
            assert time.monotonic() < deadline, "the bundle with heads was not swapped in"
            time.sleep(0.05)
        after = call(product(), timeout=5)
        assert after.category.source in POLICY_SOURCES
        assert stub(ch).RecommendAction(request(), timeout=5).model_version == "heads-v1"  # the flat decision too


def test_product_decisions_are_logged_with_each_layers_candidates_and_distribution(tmp_path: Path) -> None:
    """The products log: what each layer chose among (ids hashed, the features the heads read) and its whole served
    distribution, whose entry at the choice is the propensity answered; nothing personal in clear; sampled by the
    session with the shopper's decisions."""
    from experience.recorder import resolve_salt
    from experience.records import CATEGORY, SESSION, hash_id
    from experience.segments import DirectorySource

    weights, logs = tmp_path / "weights", tmp_path / "logs"
    weights.mkdir()
    publish(weights, HEADS)
    sessions = [f"alice-{i}" for i in range(40)]
    answers = {}
    with running_server(weights_dir=weights, log_dir=logs, log_sample_rate=0.5) as live_logged, \
            grpc.insecure_channel(live_logged.target) as ch:
        for s in sessions:
            stub(ch).RecommendAction(request(session_id=s), timeout=5)
            answer = stub(ch).RecommendProduct(product(shopper=request(session_id=s), visit_count=1), timeout=5)
            answers[answer.decision_id] = answer
    source = DirectorySource(logs)
    rows = source.table("products").to_pylist()
    key = resolve_salt(logs, "")
    assert 5 < len(rows) < 35  # sampled by session, as the shopper's decisions are
    assert {r["session_id"] for r in rows} == set(source.table("decisions").column("session_id").to_pylist())
    stored = b"".join(p.read_bytes() for p in (logs / "products").iterdir())
    assert b"alice" not in stored and b"shoes" not in stored
    for row in rows:
        answer = answers[row["decision_id"]]
        assert row["session_id"] in {hash_id(s, key, SESSION) for s in sessions}
        assert row["category_ids"] == [hash_id(c, key, CATEGORY) for c in ("shoes", "bags")] and row["visit_count"] == 1
        chosen = 2 if answer.category.id == "shoes" else 3
        for layer, got, count in (("category", answer.category, 2), ("sku", answer.sku, chosen), ("price_band", answer.price_band, 3)):
            served = np.array(row[f"{layer}_served_probs"])
            assert len(row[f"{layer}_ids"]) == len(row[f"{layer}_features"]) == len(served) == count
            assert served.sum() == pytest.approx(1.0, abs=1e-9) and (served >= 0).all()
            assert row[f"{layer}_index"] == got.index and row[f"{layer}_propensity"] == served[got.index] == got.propensity
            assert row[f"{layer}_source"] == got.source and row[f"{layer}_rule"] == got.rule
        assert all(len(f) == 768 + 4 for f in row["category_features"] + row["sku_features"])
        assert all(len(f) == 4 for f in row["price_band_features"])
        assert row["price_band_served_probs"][2] == 0.0  # the top band, on a first visit: never served
        assert row["joint_propensity"] == pytest.approx(answer.joint_propensity) and row["model_version"] == "heads-v1"


NEAR_TIE = 2e-3  # candidates whose replayed probabilities are this close may be in either order in the server's float32


def _served_either_order(decoder: PluralityDecoder, q: np.ndarray, fallback: int, logged: list[float]) -> np.ndarray:
    """The replayed served distribution; where two candidates' ``q`` are within the float16 rounding of the logged
    features of each other, the vote's tie rule may have ranked them the other way round in the server (the served
    probabilities of a near tie then trade places), so that order is replayed too (their ``q`` swapped), and the one
    nearer the log is returned. Anywhere else only the replay's own order counts."""
    best = decoder.served(q, fallback)
    for i, j in itertools.combinations(np.flatnonzero(q > 0), 2):
        if abs(q[i] - q[j]) < NEAR_TIE:
            swapped = q.copy()
            swapped[[i, j]] = q[[j, i]]
            other = decoder.served(swapped, fallback)
            if np.abs(other - logged).max() < np.abs(best - logged).max():
                best = other
    return np.asarray(best)


def test_a_logged_product_decision_replays_from_the_log_alone(tmp_path: Path) -> None:
    """What a trainer would do for a candidate bundle: from a products record only (the shopper's columns, each layer's
    features, permitted candidates and rule's choice), the serving bundle's heads and decoder give back each layer's
    logged served distribution: up to the float16 rounding of the logged features."""
    from experience.segments import DirectorySource
    from policy.product_policy import masked_softmax
    from trainer.replay import buckets_of, write_embeddings

    weights, logs = tmp_path / "weights", tmp_path / "logs"
    weights.mkdir()
    publish(weights, HEADS)
    with running_server(weights_dir=weights, log_dir=logs) as live_logged, grpc.insecure_channel(live_logged.target) as ch:
        for i in range(12):
            stub(ch).RecommendProduct(product(shopper=request(session_id=f"s{i}", seed=i), visit_count=1 + i % 3), timeout=5)
    table = DirectorySource(logs).table("products")
    model = ModelSet.load(read_bundle(HEADS), LoadOptions(warmup_batch=1))
    assert model.product is not None
    spec = model.encoder.spec
    states = model.encoder.encode_columns(buckets_of(table, spec), np.asarray(table.column("hour").to_numpy(), dtype=np.int64))
    write_embeddings(states[:, : spec.item_dim], table.column("item_embedding"), spec.item_dim)
    heads, decoder = model.product.heads, model.product.decoder
    for row, state in zip(table.to_pylist(), states, strict=True):
        h = heads.encode(state[None, :])
        for layer, head in (("category", "category"), ("sku", "sku"), ("price_band", "band")):
            logits = heads.score(head, h, np.asarray(row[f"{layer}_features"], dtype=np.float32))
            q = masked_softmax(logits, np.asarray(row[f"{layer}_permitted"]))
            served = _served_either_order(decoder, q, row[f"{layer}_fallback"], row[f"{layer}_served_probs"])
            np.testing.assert_allclose(served, row[f"{layer}_served_probs"], atol=5e-3)
            assert served[row[f"{layer}_index"]] > 0
