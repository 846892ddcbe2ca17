"""RecommendProduct micro-batched as RecommendAction is, over the wire on a real server: concurrent calls share one
encoder call and one call per head, a full queue and an input that breaks inference answer by the rules for that
request only, and the batch metrics are real Prometheus samples."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from tests.harness import ServerThread, running_server, stub
from tests.poisoned import poisoned_graph, rebundled
from tests.server.test_hot_swap import publish
from tests.server.test_recommend_product import product
from tests.server.test_recommend_product_heads import HEADS, POLICY_SOURCES

RULES = ("bags", "b2", "list")  # what the rules answer to product() (test_recommend_product)


def _sources(answer: pb.RecommendProductResponse) -> set[int]:
    return {answer.category.source, answer.sku.source, answer.price_band.source}


@pytest.fixture()
def heads_dir(tmp_path: Path) -> Path:
    publish(tmp_path, HEADS)
    return tmp_path


@pytest.fixture()
def live(heads_dir: Path) -> Iterator[ServerThread]:
    with running_server(weights_dir=heads_dir) as thread:
        yield thread


def test_concurrent_product_calls_share_micro_batches(live: ServerThread) -> None:
    value = live.registry.get_sample_value
    calls = 0
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(live.target) as ch, ThreadPoolExecutor(32) as pool:
        call = stub(ch).RecommendProduct
        assert call(product(), timeout=5).model_version == "heads-v1"
        calls += 1
        while value("shopping_agent_product_batch_size_count") == calls and time.monotonic() < deadline:
            answers = [f.result() for f in [pool.submit(call, product(), timeout=10) for _ in range(128)]]
            calls += len(answers)
            assert all(_sources(a) <= POLICY_SOURCES and a.model_version == "heads-v1" for a in answers)
    batches = value("shopping_agent_product_batch_size_count")
    assert value("shopping_agent_product_batch_size_sum") == calls  # every call decided in a batch, counted once
    assert batches < calls  # some batch held more than one call
    assert value("shopping_agent_product_inference_seconds_count") == batches
    assert not value("shopping_agent_batch_size_count")  # RecommendAction's batcher saw none of them


def test_a_full_product_queue_degrades_to_the_rules_without_errors(heads_dir: Path) -> None:
    with running_server(weights_dir=heads_dir, max_queue=1, max_batch=1) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendProduct
        answers: list[pb.RecommendProductResponse] = []
        deadline = time.monotonic() + 20
        with ThreadPoolExecutor(32) as pool:
            while not any(_sources(a) == {pb.DECISION_SOURCE_FALLBACK_DEGRADED} for a in answers) and time.monotonic() < deadline:
                answers += [f.result() for f in [pool.submit(call, product(), timeout=10) for _ in range(128)]]
    degraded = [a for a in answers if _sources(a) == {pb.DECISION_SOURCE_FALLBACK_DEGRADED}]
    assert degraded and len(degraded) < len(answers)
    assert all((a.category.id, a.sku.id, a.price_band.id) == RULES and a.joint_propensity == 1.0 for a in degraded)
    assert all(_sources(a) <= POLICY_SOURCES for a in answers if a not in degraded)


POISON_ABOVE = 1_000.0  # no feature of an ordinary candidate comes near it; an accepted embedding value may


def _poisoned_heads() -> bytes:
    """HEADS with category and SKU heads that score NaN for a candidate with any feature above ``POISON_ABOVE`` (their
    logits plus 0 * sqrt(1000 - max(state))): an input the server accepts (embedding values within ±65504) that the
    graphs cannot score, as a bundle's bug would be. Golden and warm-up inputs stay below it, so the bundle loads."""
    import numpy as np
    from onnx import helper

    from weights.bundle import read_bundle

    bundle = read_bundle(HEADS)
    constants = {"poison_limit": np.array([POISON_ABOVE], dtype=np.float32), "poison_zero": np.array([0.0], dtype=np.float32)}
    nodes = [
        helper.make_node("ReduceMax", ["state"], ["top"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["poison_limit", "top"], ["room"]),
        helper.make_node("Sqrt", ["room"], ["root"]),  # NaN where room < 0
        helper.make_node("Mul", ["root", "poison_zero"], ["zeros"]),
    ]
    heads = ("product_category.onnx", "product_sku.onnx")  # the category's features are its SKUs' mean
    return rebundled(bundle, {head: poisoned_graph(bundle.parts[head], constants, nodes) for head in heads}, "heads-poisoned")


def test_an_input_that_breaks_inference_degrades_only_its_own_request(tmp_path: Path) -> None:
    """A SKU the head scores as NaN: its batch fails, the batch is rerun one by one, and only that request is answered
    by the rules, among concurrent good ones."""
    publish(tmp_path, _poisoned_heads())
    poison = product(categories=[pb.ProductCategory(category_id="p", skus=[
        pb.ProductSku(sku_id="x", embedding=[2 * POISON_ABOVE] * 768, price=10.0, stock=3)]), *product().categories])
    with running_server(weights_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch, \
            ThreadPoolExecutor(16) as pool:
        call = stub(ch).RecommendProduct
        assert call(product(), timeout=5).model_version == "heads-poisoned"
        futures = [pool.submit(call, poison if i % 8 == 0 else product(), timeout=10) for i in range(200)]
        results = [(i % 8 == 0, f.result()) for i, f in enumerate(futures)]
        for poisoned, answer in results:
            if poisoned:
                assert _sources(answer) == {pb.DECISION_SOURCE_FALLBACK_DEGRADED}
                assert (answer.category.id, answer.sku.id, answer.price_band.id) == RULES  # bags: the most SKUs in stock
            else:
                assert _sources(answer) <= POLICY_SOURCES
        # batches count the decisions they delivered (one-by-one reruns included): the 176 good ones, never the poison
        assert live.registry.get_sample_value("shopping_agent_product_batch_size_sum") == 176
