"""RecommendProduct on the real server: every layer answered by its rule within its guardrails (no bundle has product
heads yet), validation naming the field, per-layer metrics, and RecommendAction unchanged beside it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from core.domain import TIMESTAMP_MAX_S
from experience.records import LoggedProduct, retained_bytes
from experience.segments import DirectorySource
from policy.features import FeatureSpec
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.product_validation import parse_product
from server.validation import Limits
from tests.harness import ServerThread, request, running_server, stub
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet

SERVICE = "shopping_agent.v1.ShoppingAgent"
ONE_MIB = 1 << 20


@pytest.fixture(scope="module")
def live() -> Iterator[ServerThread]:
    """This module's server takes messages up to 1 MiB: a request at the candidate limits (256 SKUs of 768 floats) is
    about 0.8 MB, past the default 64 KiB (``--max-message-bytes``; tested below)."""
    with running_server(max_message_bytes=ONE_MIB) as thread:
        yield thread


def sku(sku_id: str, price: float, stock: int = 5, competitor: float | None = None, seed: int = 0) -> pb.ProductSku:
    embedding = (np.random.default_rng(seed).standard_normal(768) / np.sqrt(768)).astype(np.float32).tolist()
    fields: dict[str, Any] = {"sku_id": sku_id, "embedding": embedding, "price": price, "stock": stock}
    if competitor is not None:
        fields["competitor_price"] = competitor
    return pb.ProductSku(**fields)


def product(**overrides: Any) -> pb.RecommendProductRequest:
    fields: dict[str, Any] = {
        "shopper": request(request_id="req-p"),
        "categories": [
            pb.ProductCategory(category_id="shoes", skus=[sku("s1", 80.0), sku("s2", 60.0, stock=0)]),
            pb.ProductCategory(category_id="bags", skus=[sku("b1", 120.0, competitor=100.0), sku("b2", 90.0, competitor=100.0),
                                                         sku("b3", 50.0)]),
        ],
        "price_bands": [pb.PriceBand(band_id="low", price_multiplier=0.9), pb.PriceBand(band_id="list", price_multiplier=1.0),
                        pb.PriceBand(band_id="high", price_multiplier=1.2)],
        "visit_count": 3,
    }
    fields.update(overrides)
    return pb.RecommendProductRequest(**fields)


def test_each_layer_is_answered_by_its_rule_in_order_with_certainty(channel: grpc.Channel) -> None:
    answer = stub(channel).RecommendProduct(product(), timeout=5)
    # the category with the most SKUs in stock; within it the best deal (b2: 0.9 of the competitor's price; b3 has none
    # known, so 1.0); the band nearest the list price
    assert (answer.category.id, answer.category.index) == ("bags", 1)
    assert (answer.sku.id, answer.sku.index) == ("b2", 1)
    assert (answer.price_band.id, answer.price_band.index) == ("list", 1)
    for choice, rule in ((answer.category, "category_most_in_stock"), (answer.sku, "sku_best_deal"),
                         (answer.price_band, "price_band_nearest_list")):
        assert choice.source == pb.DECISION_SOURCE_FALLBACK_NO_MODEL and choice.rule == rule
        assert choice.propensity == 1.0 and choice.votes == 0
    assert answer.joint_propensity == 1.0 and answer.request_id == "req-p" and answer.model_version
    assert len(answer.decision_id) == 32 and answer.decision_id != stub(channel).RecommendProduct(product(), timeout=5).decision_id
    assert stub(channel).RecommendAction(request(), timeout=5).action  # the flat decision is unchanged beside it


def test_guardrails_hold_out_what_is_out_of_stock_and_the_top_band_on_a_first_visit(channel: grpc.Channel) -> None:
    call = stub(channel).RecommendProduct
    only_shoes = product(categories=[pb.ProductCategory(category_id="bags", skus=[sku("b1", 50.0, stock=0)]),
                                     pb.ProductCategory(category_id="shoes", skus=[sku("s1", 70.0, stock=0), sku("s2", 99.0, stock=1)])])
    answer = call(only_shoes, timeout=5)
    assert (answer.category.id, answer.sku.id) == ("shoes", "s2")  # the empty category and the sold-out SKU are never served
    two_bands = [pb.PriceBand(band_id="list", price_multiplier=1.0), pb.PriceBand(band_id="premium", price_multiplier=1.0001)]
    assert call(product(price_bands=two_bands, visit_count=2), timeout=5).price_band.id == "list"
    top_only_near = [pb.PriceBand(band_id="deep", price_multiplier=0.5), pb.PriceBand(band_id="near", price_multiplier=1.05)]
    assert call(product(price_bands=top_only_near, visit_count=4), timeout=5).price_band.id == "near"
    assert call(product(price_bands=top_only_near, visit_count=1), timeout=5).price_band.id == "deep"  # first visit: not the top
    same = [pb.PriceBand(band_id="a", price_multiplier=1.1), pb.PriceBand(band_id="b", price_multiplier=1.1)]
    assert call(product(price_bands=same, visit_count=1), timeout=5).price_band.id == "a"  # none above another: none banned
    single = [pb.PriceBand(band_id="only", price_multiplier=1.3)]
    assert call(product(price_bands=single, visit_count=1), timeout=5).price_band.id == "only"
    assert call(product(price_bands=top_only_near, visit_count=0), timeout=5).price_band.id == "deep"  # unknown: as a first visit
    unset = product(price_bands=top_only_near)
    unset.ClearField("visit_count")
    assert call(unset, timeout=5).price_band.id == "deep"  # an omitted field does not switch the guardrail off


def _many_skus(n: int) -> list[pb.ProductSku]:
    return [sku(f"x{i}", 10.0 + i) for i in range(n)]


BAD_PRODUCTS = [
    pytest.param({"shopper": None}, "shopper: required", id="no-shopper"),
    pytest.param({"shopper": request(session_id="")}, "shopper.session_id: required", id="shopper-session"),
    pytest.param({"shopper": request(item_embedding=[0.0] * 3)}, "shopper.item_embedding: expected exactly 768", id="shopper-dim"),
    pytest.param({"categories": []}, "categories: expected 1 to 32 categories, got 0", id="no-categories"),
    pytest.param({"categories": [pb.ProductCategory(category_id=f"c{i}", skus=[sku("z", 1.0)]) for i in range(33)]},
                 "categories: expected 1 to 32", id="too-many-categories"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=_many_skus(65))]}, "categories[0].skus: expected 1 to 64",
                 id="too-many-skus-in-one"),
    pytest.param({"categories": [pb.ProductCategory(category_id=f"c{j}", skus=[sku(f"{j}-{i}", 5.0) for i in range(60)])
                                 for j in range(5)]}, "categories: at most 256 SKUs in all, got 300", id="too-many-skus"),
    pytest.param({"categories": [pb.ProductCategory(category_id="", skus=[sku("a", 1.0)])]}, "categories[0].category_id: required",
                 id="no-category-id"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 1.0)]),
                                 pb.ProductCategory(category_id="c", skus=[sku("b", 1.0)])]}, "categories[1].category_id: duplicate id",
                 id="duplicate-category"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[])]}, "categories[0].skus: expected 1 to 64 SKUs, got 0",
                 id="empty-category"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 1.0), sku("a", 2.0)])]},
                 "categories[0].skus[1].sku_id: duplicate id", id="duplicate-sku"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", float("nan"))])]},
                 "categories[0].skus[0].price: must be a finite price", id="nan-price"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 0.0)])]},
                 "categories[0].skus[0].price: must be a finite price in [0.01, 1e+06]", id="zero-price"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 5e-324)])]},
                 "categories[0].skus[0].price: must be a finite price in [0.01", id="denormal-price"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 5.0, competitor=5e-324)])]},
                 "categories[0].skus[0].competitor_price: must be a finite price in [0.01", id="denormal-competitor"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 5.0, competitor=-1.0)])]},
                 "categories[0].skus[0].competitor_price: must be a finite price", id="negative-competitor"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[pb.ProductSku(sku_id="a", embedding=[0.1] * 767, price=5.0,
                                                                                         stock=1)])]},
                 "categories[0].skus[0].embedding: expected exactly 768 values, got 767", id="sku-dim"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[pb.ProductSku(sku_id="a", embedding=[float("inf")] + [0.0] * 767,
                                                                                         price=5.0, stock=1)])]},
                 "categories[0].skus[0].embedding[0]: must be finite", id="sku-inf"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[pb.ProductSku(sku_id="a", embedding=[0.0] * 767 + [-7e4],
                                                                                         price=5.0, stock=1)])]},
                 "categories[0].skus[0].embedding[767]: must be within ±65504", id="sku-past-float16"),
    pytest.param({"visit_count": 2**32 - 1}, "visit_count: at most 2147483647, got 4294967295", id="visit-count-past-int32"),
    pytest.param({"categories": [pb.ProductCategory(category_id="c", skus=[sku("a", 5.0, stock=0)])]},
                 "categories: no SKU is in stock", id="nothing-in-stock"),
    pytest.param({"price_bands": []}, "price_bands: expected 1 to 8 price bands, got 0", id="no-bands"),
    pytest.param({"price_bands": [pb.PriceBand(band_id=f"b{i}", price_multiplier=1.0) for i in range(9)]}, "price_bands: expected 1 to 8",
                 id="too-many-bands"),
    pytest.param({"price_bands": [pb.PriceBand(band_id="b", price_multiplier=0.0)]}, "price_bands[0].price_multiplier: must be finite",
                 id="zero-multiplier"),
    pytest.param({"price_bands": [pb.PriceBand(band_id="b", price_multiplier=10.5)]}, "price_bands[0].price_multiplier",
                 id="big-multiplier"),
    pytest.param({"price_bands": [pb.PriceBand(band_id="b", price_multiplier=1e-300)]},
                 "price_bands[0].price_multiplier: must be finite, in [0.01, 10]", id="tiny-multiplier"),
    pytest.param({"price_bands": [pb.PriceBand(band_id="b", price_multiplier=1.0),
                                  pb.PriceBand(band_id="b", price_multiplier=1.1)]}, "price_bands[1].band_id: duplicate id",
                 id="duplicate-band"),
    pytest.param({"price_bands": [pb.PriceBand(band_id="x" * 257, price_multiplier=1.0)]}, "price_bands[0].band_id: longer than 256",
                 id="long-band-id"),
]


@pytest.mark.parametrize("fields", [
    {"categories": [pb.ProductCategory(category_id=f"c{i}", skus=[sku(f"z{i}", 1.0)]) for i in range(32)]},
    {"categories": [pb.ProductCategory(category_id="c", skus=_many_skus(64))]},
    {"categories": [pb.ProductCategory(category_id=f"c{j}", skus=[sku(f"{j}-{i}", 5.0) for i in range(64)]) for j in range(4)]},
    {"price_bands": [pb.PriceBand(band_id=f"b{i}", price_multiplier=0.8 + 0.05 * i) for i in range(8)]},
    {"shopper": request(event_time=Timestamp(seconds=TIMESTAMP_MAX_S, nanos=999_999_999))},  # was "cannot be placed" (UTC)
], ids=["32-categories", "64-skus-in-one", "256-skus-in-all", "8-bands", "last-nanosecond-of-year-9999"])
def test_a_request_at_each_limit_is_answered(channel: grpc.Channel, fields: dict[str, Any]) -> None:
    """The limits are "at most": a request exactly at one is a product decision, where one past it is refused above."""
    assert stub(channel).RecommendProduct(product(**fields), timeout=30).decision_id


@pytest.mark.parametrize(("fields", "message"), BAD_PRODUCTS)
def test_a_bad_product_request_is_invalid_argument_naming_the_field(channel: grpc.Channel, fields: dict[str, Any], message: str) -> None:
    call = stub(channel).RecommendProduct
    msg = product(**{k: v for k, v in fields.items() if v is not None})
    if fields.get("shopper", "") is None:
        msg.ClearField("shopper")
    with pytest.raises(grpc.RpcError) as info:
        call(msg, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()
    assert call(product(), timeout=5).sku.id == "b2"  # still answering


def test_corrupt_product_bytes_are_invalid_argument(channel: grpc.Channel) -> None:
    raw = channel.unary_unary(f"/{SERVICE}/RecommendProduct")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x0a\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: not a RecommendProductRequest")


def test_layer_choices_are_counted_by_layer_and_source() -> None:
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendProduct
        for _ in range(3):
            call(product(), timeout=5)
        with pytest.raises(grpc.RpcError):
            call(product(price_bands=[]), timeout=5)
        value = live.registry.get_sample_value
    for layer in ("category", "sku", "price_band"):
        assert value("shopping_agent_product_layer_decisions_total", {"layer": layer, "source": "fallback_no_model"}) == 3
        assert value("shopping_agent_product_layer_decisions_total", {"layer": layer, "source": "policy"}) == 0
    handled = {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "RecommendProduct"}
    assert value("grpc_server_handled_total", {**handled, "grpc_code": "OK"}) == 3
    assert value("grpc_server_handled_total", {**handled, "grpc_code": "INVALID_ARGUMENT"}) == 1


def test_at_the_default_message_limit_a_large_candidate_list_is_resource_exhausted() -> None:
    """The server-wide ``--max-message-bytes`` (64 KiB by default) bounds every rpc: about 19 SKUs of 768 floats fit; a shop
    that sends more raises it (docs/api.md). The transport refuses, before any parsing, and the server answers on."""
    with running_server() as live_default, grpc.insecure_channel(live_default.target) as ch:
        call = stub(ch).RecommendProduct
        fits = product(categories=[pb.ProductCategory(category_id="c", skus=_many_skus(18))])
        assert fits.ByteSize() < 64 * 1024 and call(fits, timeout=5).category.id == "c"
        big = product(categories=[pb.ProductCategory(category_id="c", skus=_many_skus(30))])
        with pytest.raises(grpc.RpcError) as info:
            call(big, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert call(fits, timeout=5).category.id == "c"


def test_a_short_deadline_without_product_networks_is_the_rules_not_a_degradation() -> None:
    """The rules are the answer of a bundle without heads whatever the deadline: nothing was degraded, so the layers say
    FALLBACK_NO_MODEL as they do with time to spare (a review found FALLBACK_DEGRADED here, counted as a degradation on a
    server with nothing to degrade). With heads, a short deadline degrades: ``test_recommend_product_heads``."""
    with running_server(min_inference_budget_ms=10_000) as slow, grpc.insecure_channel(slow.target) as ch:
        answer = stub(ch).RecommendProduct(product(), timeout=5)
        value = slow.registry.get_sample_value
    assert {answer.category.source, answer.sku.source, answer.price_band.source} == {pb.DECISION_SOURCE_FALLBACK_NO_MODEL}
    assert (answer.category.id, answer.sku.id, answer.price_band.id) == ("bags", "b2", "list") and answer.joint_propensity == 1.0
    assert value("shopping_agent_product_layer_decisions_total", {"layer": "sku", "source": "fallback_no_model"}) == 1
    assert not value("shopping_agent_product_layer_decisions_total", {"layer": "sku", "source": "fallback_degraded"})


def test_rule_answers_are_logged_with_certainty(tmp_path: Path) -> None:
    """Without product heads the rows are logged too, each layer's distribution one-hot at the rule's choice."""
    from experience.segments import DirectorySource

    shoes = [pb.ProductCategory(category_id="shoes", skus=[sku("s1", 80.0, stock=0), sku("s2", 60.0), sku("s3", 70.0)])]
    with running_server(log_dir=tmp_path) as logged, grpc.insecure_channel(logged.target) as ch:
        answer = stub(ch).RecommendProduct(product(), timeout=5)
        first_visit = stub(ch).RecommendProduct(product(categories=shoes, visit_count=1), timeout=5)
    row, other = sorted(DirectorySource(tmp_path).table("products").to_pylist(), key=lambda r: r["decision_id"] != answer.decision_id)
    assert row["decision_id"] == answer.decision_id and row["joint_propensity"] == 1.0
    assert row["sku_served_probs"] == [0.0, 1.0, 0.0] and row["sku_index"] == 1 and row["sku_rule"] == "sku_best_deal"
    assert row["category_served_probs"] == [0.0, 1.0] and row["price_band_served_probs"] == [0.0, 1.0, 0.0]
    assert row["category_source"] == pb.DECISION_SOURCE_FALLBACK_NO_MODEL
    # what a replay under another bundle's guard needs: the guardrails alone, and the rule's order (most in stock; best
    # deal: b2 at 0.9 of the competitor's price, then b3 with none known, then b1 at 1.2; the band nearest the list price)
    assert row["category_guardrail"] == [True, True] and row["category_rule_rank"] == [1, 0]
    assert row["sku_guardrail"] == [True, True, True] and row["sku_rule_rank"] == [2, 0, 1]
    assert row["price_band_guardrail"] == row["price_band_permitted"] == [True, True, True]
    assert row["price_band_rule_rank"] == [1, 0, 2]
    # an out-of-stock SKU and, on a first visit, the top band: banned by the guardrails, still ranked by the rules
    assert other["decision_id"] == first_visit.decision_id and other["sku_guardrail"] == [False, True, True]
    assert other["sku_rule_rank"] == [2, 0, 1] and other["sku_index"] == 1  # the cheapest, s1 ranks last (dearest)
    assert other["price_band_guardrail"] == other["price_band_permitted"] == [True, True, False]
    assert other["price_band_rule_rank"] == [1, 0, 2] and other["price_band_index"] == 1


def test_product_records_compact_like_the_other_kinds(tmp_path: Path) -> None:
    """``logs compact`` rewrites the products segments as hourly Arrow IPC file parts (nested feature lists included),
    and they read back as the same records."""
    import subprocess
    import sys

    from experience.segments import DirectorySource

    with running_server(log_dir=tmp_path) as logged, grpc.insecure_channel(logged.target) as ch:
        for _ in range(4):
            stub(ch).RecommendProduct(product(), timeout=5)
    before = DirectorySource(tmp_path).table("products").sort_by("decision_id")
    done = subprocess.run([sys.executable, "-m", "server", "logs", "compact", str(tmp_path), "--older-than-hours", "0"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name for p in (tmp_path / "products").iterdir() if p.is_dir()] and before.num_rows == 4
    assert DirectorySource(tmp_path).table("products").sort_by("decision_id").equals(before)
    # A part compacted before the guardrail and rule-order columns existed reads with them null, the rest as written.
    import pyarrow as pa

    later = [f"{layer}_{name}" for layer in ("category", "sku", "price_band") for name in ("guardrail", "rule_rank")]
    for part in (tmp_path / "products").glob("*/*.arrow"):
        old = pa.ipc.open_file(pa.memory_map(str(part))).read_all().drop_columns(later)
        with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_file(sink, old.schema) as writer:
            writer.write_table(old)
    read = DirectorySource(tmp_path).table("products").sort_by("decision_id")
    assert all(read.column(c).null_count == 4 for c in later)
    assert read.drop_columns(later).equals(before.drop_columns(later))
    source = DirectorySource(tmp_path)
    batch = next(source.segment_batches(source.segments("products")[0], "products", ["session_id", "sku_rule_rank"]))
    assert batch.schema.names == ["session_id", "sku_rule_rank"] and batch.column(1).null_count == batch.num_rows > 0


def test_queued_product_records_wake_the_writer_before_they_fill_the_byte_bound(tmp_path: Path) -> None:
    """A product record keeps its request's embeddings alive until the writer encodes it (about 0.9 MB for 256 SKUs): a
    count alone let one client hold gigabytes, so the queue is bounded in bytes too (tests/server/test_experience_log.py
    drops past it). That bound then dropped honest records while the writer slept out its timer (an attack review,
    2026-12-06: a third of 256-SKU decisions at 140 a second), so records this large wake it at a quarter of the bound:
    three 128-SKU requests (430 kB each) against a 1 MiB bound, the timer at 60 s, are all written, none dropped."""
    shelf = [pb.ProductCategory(category_id=f"c{c}", skus=[sku(f"c{c}-{k}", 10.0 + k, seed=16 * c + k) for k in range(16)])
             for c in range(8)]
    parsed = parse_product(product(categories=shelf), Limits(item_dim=768, max_recent_behavior_ids=32, max_id_length=256), 0.0)
    model = ModelSet.load(default_bundle(), LoadOptions(warmup_batch=1))
    size = retained_bytes(LoggedProduct(parsed, 12, model.decide_product(parsed, 12, "d"), "d", 0.0, FeatureSpec()))
    assert 2 * size <= 2**20 < 3 * size  # what the queue counts for each (the embeddings, the ids, a fixed amount a SKU)
    with running_server(max_message_bytes=ONE_MIB, log_dir=tmp_path, log_queue_mb=1.0, log_flush_seconds=60,
                        log_flush_rows=10_000) as live, grpc.insecure_channel(live.target) as ch:
        answers = []
        for _ in range(3):
            answers.append(stub(ch).RecommendProduct(product(categories=shelf), timeout=10))
            deadline = time.monotonic() + 10  # written long before the 60 s timer
            while live.registry.get_sample_value("shopping_agent_log_records_written_total", {"kind": "products"}) < len(answers):
                assert time.monotonic() < deadline, "the writer was not woken"
                time.sleep(0.01)
        dropped = live.registry.get_sample_value("shopping_agent_log_records_dropped_total", {"kind": "products", "reason": "queue_full"})
    assert dropped == 0
    logged = DirectorySource(tmp_path).table("products").column("decision_id").to_pylist()
    assert logged == [a.decision_id for a in answers]
