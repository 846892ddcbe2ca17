"""A request whose string holds bytes that are not UTF-8 is refused naming that field, by path; corrupt bytes as before.

The bytes are made by hand, as a client whose strings are bytes would send them: a valid message's encoding with one
more length-delimited field appended (a later singular field replaces the earlier; a repeated one adds an element).
"""

from __future__ import annotations

import grpc
import pytest

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.servicer import REQUEST_PARSERS, Malformed
from server.wire_diagnosis import misencoded_string
from tests.harness import request, stub
from tests.server.test_recommend_product import product
from tests.wire import varint

NOT_UTF8 = b"caf\xe9"  # Latin-1's é: what a client that never encodes its strings sends


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message) on the wire."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def action(number: int) -> bytes:
    return request().SerializeToString() + field(number, NOT_UTF8)


def test_each_string_of_a_decision_request_is_named() -> None:
    names = {1: "request_id", 2: "user_id", 3: "session_id", 4: "item_id"}
    for number, name in names.items():
        assert misencoded_string(pb.RecommendActionRequest, action(number)) == name
    assert misencoded_string(pb.RecommendActionRequest, action(6)) == "recent_behavior_ids[2]"  # after the two it had


def test_a_nested_string_is_named_by_its_path() -> None:
    bad_sku = pb.ProductSku(price=5.0, stock=1).SerializeToString() + field(1, NOT_UTF8)
    category = pb.ProductCategory(category_id="hats").SerializeToString() + field(2, bad_sku)
    data = product().SerializeToString() + field(2, category)  # a third category, its one SKU's id not UTF-8
    assert misencoded_string(pb.RecommendProductRequest, data) == "categories[2].skus[0].sku_id"
    shopper = request().SerializeToString() + field(3, NOT_UTF8)
    assert misencoded_string(pb.RecommendProductRequest, product().SerializeToString() + field(1, shopper)) == "shopper.session_id"


def test_the_first_by_field_number_is_named_and_bytes_that_do_not_parse_name_none() -> None:
    both = request().SerializeToString() + field(4, NOT_UTF8) + field(2, NOT_UTF8)
    assert misencoded_string(pb.RecommendActionRequest, both) == "user_id"
    assert misencoded_string(pb.RecommendActionRequest, b"\xff\xff\xff\xff\x0f garbage") is None
    assert misencoded_string(pb.RecommendActionRequest, request().SerializeToString()) is None  # (nothing wrong to name)
    assert misencoded_string(pb.ReportOutcomeRequest, pb.ReportOutcomeRequest(decision_id="d").SerializeToString()
                             + field(3, NOT_UTF8)) == "outcome_id"


def test_the_deserializers_carry_the_field_or_none() -> None:
    parsed = REQUEST_PARSERS["RecommendAction"](action(2))
    assert isinstance(parsed, Malformed) and parsed.field == "user_id"
    garbage = REQUEST_PARSERS["ReportEngagement"](b"\xff")
    assert isinstance(garbage, Malformed) and garbage.field is None


@pytest.mark.parametrize(("method", "data", "details"), [
    ("RecommendAction", action(2), "user_id: must be UTF-8 text (a protobuf string), got bytes that are not"),
    ("RecommendAction", action(6), "recent_behavior_ids[2]: must be UTF-8 text"),
    ("RecommendProduct", product().SerializeToString() + field(1, request().SerializeToString() + field(4, NOT_UTF8)),
     "shopper.item_id: must be UTF-8 text"),
    ("ReportEngagement", pb.ReportEngagementRequest(decision_id="d").SerializeToString() + field(3, NOT_UTF8),
     "engagement_id: must be UTF-8 text"),
    ("RecommendAction", b"\xff\xff\xff\xff\x0f garbage", "request: not a RecommendActionRequest (wire format is corrupt)"),
])
def test_the_server_answers_invalid_argument_naming_the_field(channel: grpc.Channel, method: str, data: bytes,
                                                              details: str) -> None:
    raw = channel.unary_unary(f"/shopping_agent.v1.ShoppingAgent/{method}")
    with pytest.raises(grpc.RpcError) as info:
        raw(data, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(details), info.value.details()
    assert stub(channel).RecommendAction(request(), timeout=5).decision_id  # still answering


def test_the_walk_is_bounded_past_any_valid_requests_counts() -> None:
    """Past ``MAX_VISITED`` strings the bytes are refused as corrupt without naming (the request's counts refuse it anyway):
    a flood of such requests must not cost the server more than parsing them does."""
    from server.wire_diagnosis import MAX_VISITED

    def ids(n: int) -> bytes:
        return request(recent_behavior_ids=[]).SerializeToString() + b"".join(field(6, b"a") for _ in range(n - 1)) + field(6, NOT_UTF8)

    assert misencoded_string(pb.RecommendActionRequest, ids(MAX_VISITED - 10)) == f"recent_behavior_ids[{MAX_VISITED - 11}]"
    assert misencoded_string(pb.RecommendActionRequest, ids(MAX_VISITED + 1)) is None
    skus = b"".join(field(2, field(1, b"s")) for _ in range(MAX_VISITED)) + field(2, field(1, NOT_UTF8))
    assert misencoded_string(pb.RecommendProductRequest, field(2, skus)) is None  # messages count too
