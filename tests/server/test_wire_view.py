"""Embeddings read from the wire bytes (``server.wire_view``): the same float32 values as protobuf's container gives, however
a client encodes the field (packed in one run, unpacked, or packed in several runs), and the same errors naming the field.
The server reads both rpcs' embeddings through the view (its deserializers are checked to give one); ``RecommendAction`` is
checked over the wire with every encoding, ``RecommendProduct`` over the wire with bad ones and offline with every one."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor

from core.domain import LOGGED_EMBEDDING_MAX
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.product_validation import parse_product
from server.servicer import REQUEST_PARSERS, Malformed, Viewed
from server.validation import InvalidRequest, Limits, parse_request
from server.wire_view import float32_of, view_descriptor, view_of
from tests.harness import request
from tests.server.test_recommend_product import product
from tests.wire import varint

ACTION_PATH = "/shopping_agent.v1.ShoppingAgent/RecommendAction"
PRODUCT_PATH = "/shopping_agent.v1.ShoppingAgent/RecommendProduct"
LIMITS = Limits(768, 32, 256)
EMBEDDING = 5  # RecommendActionRequest.item_embedding
SKU_EMBEDDING, CATEGORY_SKUS, PRODUCT_CATEGORIES = 2, 2, 2  # ProductSku.embedding, ProductCategory.skus, RecommendProductRequest.categories


def packed(field: int, floats: list[float]) -> bytes:
    """One packed run of ``floats`` (wire type 2)."""
    payload = struct.pack(f"<{len(floats)}f", *floats)
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def unpacked(field: int, floats: list[float]) -> bytes:
    """The same field one tag per value (wire type 5), which every parser must accept too."""
    tag = varint(field << 3 | 5)
    return b"".join(tag + struct.pack("<f", v) for v in floats)


def submessage(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def _floats() -> list[float]:
    """768 float32 values with the awkward ones in: -0.0, a subnormal, the largest magnitude a request may carry (what
    the log's float16 holds) and the smallest normal one."""
    rng = np.random.default_rng(11)
    v = rng.standard_normal(768).astype(np.float32)
    v[:4] = np.array([-0.0, 1e-45, LOGGED_EMBEDDING_MAX, -np.finfo(np.float32).tiny], dtype=np.float32)
    return [float(x) for x in v]


FLOATS = _floats()
ENCODINGS = {
    "packed": packed(EMBEDDING, FLOATS),
    "unpacked": unpacked(EMBEDDING, FLOATS),
    "two runs": packed(EMBEDDING, FLOATS[:300]) + packed(EMBEDDING, FLOATS[300:]),
    "a run, values, a run": packed(EMBEDDING, FLOATS[:10]) + unpacked(EMBEDDING, FLOATS[10:20]) + packed(EMBEDDING, FLOATS[20:]),
    "an empty run then all": packed(EMBEDDING, []) + packed(EMBEDDING, FLOATS),
}


def action_bytes(embedding: bytes) -> bytes:
    return request(item_embedding=[]).SerializeToString() + embedding


def _messages(messages: list[descriptor.Descriptor]) -> list[descriptor.Descriptor]:
    """These messages and every message nested in them."""
    return [m for message in messages for m in (message, *_messages(list(message.nested_types)))]


def test_every_repeated_float_is_bytes_in_the_view_and_nothing_else_differs() -> None:
    """Derived from the API's descriptor: a new embedding field gets a view (a nested message's too), and no other field can
    drift from the API."""
    changed = []
    for message in _messages(list(pb.DESCRIPTOR.message_types_by_name.values())):
        view = view_descriptor(message)
        assert [f.name for f in view.fields] == [f.name for f in message.fields]
        for ours, theirs in zip(view.fields, message.fields, strict=True):
            assert ours.number == theirs.number
            if theirs.type == descriptor.FieldDescriptor.TYPE_FLOAT and theirs.is_repeated:
                assert ours.type == descriptor.FieldDescriptor.TYPE_BYTES and not ours.is_repeated
                changed.append(f"{message.name}.{theirs.name}")
            else:
                assert (ours.type, ours.is_repeated) == (theirs.type, theirs.is_repeated)
    assert changed == ["RecommendActionRequest.item_embedding", "ProductSku.embedding"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_encoding_gives_the_values_bit_for_bit(encoding: str) -> None:
    data = action_bytes(ENCODINGS[encoding])
    message = pb.RecommendActionRequest.FromString(data)
    view = view_of(pb.RecommendActionRequest).FromString(data)
    expected = np.array(FLOATS, dtype=np.float32)
    got = parse_request(message, LIMITS, 0.0, view).item_embedding
    assert got.dtype == np.float32 and got.tobytes() == expected.tobytes()
    # read from the wire bytes only when they hold the whole field (a read-only view of them), else from the container
    assert got.flags.writeable == (encoding not in ("packed", "an empty run then all"))
    assert parse_request(message, LIMITS, 0.0).item_embedding.tobytes() == expected.tobytes()  # no view: the container


def test_a_last_run_as_long_as_the_field_is_not_taken_for_all_of_it() -> None:
    """Two whole runs are 1,536 values (an error), though the view's bytes, the last run, hold exactly 768."""
    data = action_bytes(packed(EMBEDDING, FLOATS) + packed(EMBEDDING, FLOATS))
    view = view_of(pb.RecommendActionRequest).FromString(data)
    assert len(view.item_embedding) == 4 * 768
    with pytest.raises(InvalidRequest, match=r"^item_embedding: expected exactly 768 values, got 1536"):
        parse_request(pb.RecommendActionRequest.FromString(data), LIMITS, 0.0, view)
    assert float32_of([1.0, 2.0], struct.pack("<3f", 1.0, 2.0, 3.0)).tolist() == [1.0, 2.0]  # bytes of another length: unused


def _call(channel: grpc.Channel, path: str, data: bytes, response: Any) -> Any:
    return channel.unary_unary(path, request_serializer=None, response_deserializer=response.FromString)(data, timeout=5)


def test_the_server_parses_both_embedding_requests_as_their_wire_view() -> None:
    """The registered deserializers give the view (the fast path) for the rpcs with embeddings, the message alone for the rest."""
    data = action_bytes(ENCODINGS["packed"])
    parsed = REQUEST_PARSERS["RecommendAction"](data)
    assert isinstance(parsed, Viewed) and parsed.view.item_embedding == ENCODINGS["packed"][-4 * 768:]
    assert parsed.message == pb.RecommendActionRequest.FromString(data)
    product_bytes = product().SerializeToString()
    assert isinstance(REQUEST_PARSERS["RecommendProduct"](product_bytes), Viewed)
    assert isinstance(REQUEST_PARSERS["RecommendAction"](b"\xff"), Malformed)
    outcome = pb.ReportOutcomeRequest(decision_id="d")
    assert REQUEST_PARSERS["ReportOutcome"](outcome.SerializeToString()) == outcome


@pytest.mark.parametrize("encoding", ["unpacked", "two runs", "a run, values, a run", "an empty run then all"])
def test_the_server_decides_the_same_state_from_any_encoding(channel: grpc.Channel, encoding: str) -> None:
    def probabilities(data: bytes) -> list[float]:
        answer = _call(channel, ACTION_PATH, data, pb.RecommendActionResponse)
        return [s.policy_probability for s in answer.action_scores]

    assert probabilities(action_bytes(ENCODINGS[encoding])) == probabilities(action_bytes(ENCODINGS["packed"]))


@pytest.mark.parametrize(("embedding", "message"), [
    (unpacked(EMBEDDING, [*FLOATS[:12], float("nan"), *FLOATS[13:]]), "item_embedding[12]: must be finite"),
    (packed(EMBEDDING, [*FLOATS[:767], float("inf")]), "item_embedding[767]: must be finite"),
    (packed(EMBEDDING, FLOATS) + packed(EMBEDDING, FLOATS), "item_embedding: expected exactly 768 values, got 1536"),
    (packed(EMBEDDING, FLOATS[:400]) + unpacked(EMBEDDING, FLOATS[:100]), "item_embedding: expected exactly 768 values, got 500"),
])
def test_the_server_refuses_a_bad_embedding_in_any_encoding_naming_it(channel: grpc.Channel, embedding: bytes, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, ACTION_PATH, action_bytes(embedding), pb.RecommendActionResponse)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)


def _product_bytes(first_sku_embedding: bytes) -> bytes:
    """``product()`` with its first SKU's embedding encoded by hand."""
    whole = product()
    first = whole.categories[0]
    lead = pb.ProductSku(sku_id=first.skus[0].sku_id, price=first.skus[0].price, stock=first.skus[0].stock)
    category = (pb.ProductCategory(category_id=first.category_id).SerializeToString()
                + submessage(CATEGORY_SKUS, lead.SerializeToString() + first_sku_embedding)
                + b"".join(submessage(CATEGORY_SKUS, s.SerializeToString()) for s in first.skus[1:]))
    rest = pb.RecommendProductRequest(shopper=whole.shopper, categories=whole.categories[1:],
                                      price_bands=whole.price_bands, visit_count=whole.visit_count)
    return submessage(PRODUCT_CATEGORIES, category) + rest.SerializeToString()  # (categories keep their order)


@pytest.mark.parametrize("encoding", [unpacked, lambda f, v: packed(f, v[:5]) + packed(f, v[5:])], ids=["unpacked", "two runs"])
def test_product_embeddings_read_the_same_from_any_encoding(encoding: Callable[[int, list[float]], bytes]) -> None:
    data = _product_bytes(encoding(SKU_EMBEDDING, FLOATS))
    message = pb.RecommendProductRequest.FromString(data)
    view = view_of(pb.RecommendProductRequest).FromString(data)
    with_view, without = parse_product(message, LIMITS, 0.0, view=view), parse_product(message, LIMITS, 0.0)
    skus, plain = [s for c in with_view.categories for s in c.skus], [s for c in without.categories for s in c.skus]
    expected = [FLOATS, *[s.embedding for c in product().categories for s in c.skus][1:]]
    assert len(skus) == len(plain) == len(expected) == 5
    for ours, theirs, floats in zip(skus, plain, expected, strict=True):
        assert ours.embedding.tobytes() == theirs.embedding.tobytes() == np.array(floats, dtype=np.float32).tobytes()
    assert skus[0].embedding.flags.writeable and not any(s.embedding.flags.writeable for s in skus[1:])  # who read what
    assert not with_view.shopper.item_embedding.flags.writeable


def test_the_server_names_a_bad_sku_embedding_in_any_encoding(channel: grpc.Channel) -> None:
    for embedding, message in [
        (unpacked(SKU_EMBEDDING, [*FLOATS[:5], float("nan"), *FLOATS[6:]]), "categories[0].skus[0].embedding[5]: must be finite"),
        (packed(SKU_EMBEDDING, FLOATS) + packed(SKU_EMBEDDING, FLOATS),
         "categories[0].skus[0].embedding: expected exactly 768 values, got 1536"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            _call(channel, PRODUCT_PATH, _product_bytes(embedding), pb.RecommendProductResponse)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(message)
    answer = _call(channel, PRODUCT_PATH, _product_bytes(packed(SKU_EMBEDDING, FLOATS)), pb.RecommendProductResponse)
    assert answer.sku.id == "b2"  # the rules answer as for product(): the encoding changes nothing
