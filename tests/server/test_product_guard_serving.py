"""A bundle's learned product guard over the wire, on a real server: a vetoed candidate is never served (not by the
policy, not by exploration, not by the rule), every veto is counted by layer, a layer whose candidates are all vetoed is
answered by its rule among what the guardrails permit with FALLBACK_GUARD, and a micro-batch decides as alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from core.domain import Source
from policy.product_policy import masked_softmax
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.product_validation import parse_product
from server.validation import Limits
from tests.harness import running_server, stub
from tests.server.test_hot_swap import publish
from tests.server.test_recommend_product import product, sku
from tests.weights.test_product_guard import HEADS_BUNDLE, guarded
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

SHELF = [pb.ProductCategory(category_id="kitchen", skus=[sku("fair", 100.0, competitor=100.0, seed=1),
                                                          sku("over", 130.0, competitor=100.0, seed=2),
                                                          sku("cheap", 80.0, competitor=100.0, seed=3)])]

OVERPRICED = [pb.ProductCategory(category_id="kitchen", skus=[sku("over", 130.0, competitor=100.0, seed=2),
                                                               sku("dearer", 150.0, competitor=100.0, seed=4)])]


def _served(directory: Path, data: bytes, calls: int) -> tuple[Counter[str], float | None, list[pb.RecommendProductResponse]]:
    directory.mkdir()
    publish(directory, data)
    with running_server(weights_dir=directory) as live, grpc.insecure_channel(live.target) as ch:
        answers = [stub(ch).RecommendProduct(product(categories=SHELF), timeout=5) for _ in range(calls)]
        vetoes = live.registry.get_sample_value("shopping_agent_product_guard_vetoes_total", {"layer": "sku"})
    return Counter(a.sku.id for a in answers), vetoes, answers


def test_an_overpriced_sku_the_guard_vetoes_is_never_served(tmp_path: Path) -> None:
    unguarded, vetoes, _ = _served(tmp_path / "heads", HEADS_BUNDLE, 150)
    assert unguarded["over"] > 0 and not vetoes  # the heads alone serve it
    served, vetoes, answers = _served(tmp_path / "guarded", guarded(), 150)
    assert served["over"] == 0 and served["fair"] > 0 and served["cheap"] > 0
    assert vetoes == 150  # one SKU vetoed a call
    assert {a.sku.source for a in answers} <= {pb.DECISION_SOURCE_POLICY, pb.DECISION_SOURCE_EXPLORATION,
                                               pb.DECISION_SOURCE_FALLBACK_LOW_CONSENSUS}
    # its propensities are over what the guard let through: the two it kept carry all of the SKU layer's probability
    total = {a.sku.id: a.sku.propensity for a in answers}
    assert total["fair"] + total["cheap"] == pytest.approx(1.0, abs=1e-9)


def test_a_layer_whose_candidates_are_all_vetoed_is_answered_by_its_rule(tmp_path: Path) -> None:
    publish(tmp_path, guarded(vetoes_every_band=True))
    with running_server(weights_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        answer = stub(ch).RecommendProduct(product(visit_count=1), timeout=5)  # a first visit: "high" is a guardrail's
        value = live.registry.get_sample_value
    assert answer.price_band.source == pb.DECISION_SOURCE_FALLBACK_GUARD
    assert (answer.price_band.id, answer.price_band.propensity, answer.price_band.rule) == ("list", 1.0, "price_band_nearest_list")
    assert answer.category.source != pb.DECISION_SOURCE_FALLBACK_GUARD
    assert value("shopping_agent_product_guard_vetoes_total", {"layer": "price_band"}) == 2  # of the two it permits
    assert value("shopping_agent_product_layer_decisions_total", {"layer": "price_band", "source": "fallback_guard"}) == 1
    # as logged: the band layer permitted the rule's band alone, so a replay of it (the trainer's) gives its certainty
    model = ModelSet.load(read_bundle(guarded(vetoes_every_band=True)), LoadOptions(warmup_batch=1))
    band = model.decide_product(parse_product(product(visit_count=1), Limits(768, 16, 256), 1_790_000_000.0), 9, "g").price_band
    assert (band.source, band.permitted, band.served, band.fallback, band.vetoed) == \
        (Source.FALLBACK_GUARD, (False, True, False), (0.0, 1.0, 0.0), 1, 2)
    decoder = model.product.decoder  # type: ignore[union-attr]
    replayed = decoder.served(masked_softmax(np.array([0.3, -1.0, 2.0], dtype=np.float32), np.array(band.permitted)), band.fallback)
    assert replayed[band.index] == pytest.approx(1.0, abs=1e-12)


def test_a_batch_with_the_guard_decides_each_request_as_alone() -> None:
    model = ModelSet.load(read_bundle(guarded()), LoadOptions(warmup_batch=1))
    limits = Limits(768, 16, 256)
    # every third shelf has only overpriced SKUs: its SKU layer is all vetoed, answered by its rule, the rest of the
    # batch by the policy (the rule-answered rows leave the batch's softmax and vote)
    shelves = [SHELF, SHELF, OVERPRICED]
    requests = [parse_product(product(categories=shelves[v % 3], visit_count=v % 3), limits, now_s=1_790_000_000.0)
                for v in range(12)]
    ids = [f"guarded-{i}" for i in range(len(requests))]
    batch = model.decide_products(requests, [9] * len(requests), ids)
    for v, (decision, req, did) in enumerate(zip(batch, requests, ids, strict=True)):
        alone = model.decide_product(req, 9, did)
        assert [(c.index, c.source, c.permitted, c.vetoed, c.served) for _, c in decision.choices()] == \
            [(c.index, c.source, c.permitted, c.vetoed, c.served) for _, c in alone.choices()]
        if v % 3 == 2:
            assert decision.sku.source is Source.FALLBACK_GUARD and decision.sku.vetoed == 2
        else:
            assert decision.sku.vetoed == 1 and decision.sku.permitted == (True, False, True)
            assert decision.sku.source is not Source.FALLBACK_GUARD
