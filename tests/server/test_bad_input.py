"""Malformed requests get INVALID_ARGUMENT naming the field (or RESOURCE_EXHAUSTED for size); the server stays up."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from core.domain import TIMESTAMP_MAX_S
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from tests.harness import request, stub

EMB = request().item_embedding


def _with(index: int, value: float) -> list[float]:
    values = list(EMB)
    values[index] = value
    return values


CASES = [
    pytest.param({"item_embedding": list(EMB)[:767]}, "item_embedding: expected exactly 768 values, got 767", id="short-embedding"),
    pytest.param({"item_embedding": [*EMB, 0.0]}, "item_embedding: expected exactly 768 values, got 769", id="long-embedding"),
    pytest.param({"item_embedding": []}, "item_embedding: expected exactly 768 values, got 0", id="no-embedding"),
    pytest.param({"item_embedding": _with(12, float("nan"))}, "item_embedding[12]: must be finite", id="nan"),
    pytest.param({"item_embedding": _with(767, float("inf"))}, "item_embedding[767]: must be finite", id="inf"),
    pytest.param({"item_embedding": _with(0, float("-inf"))}, "item_embedding[0]: must be finite", id="minus-inf"),
    # beyond float16's range the decision log would hold inf, which no trainer can rebuild a state from
    pytest.param({"item_embedding": _with(5, 70000.0)},
                 "item_embedding[5]: must be within ±65504 (the decision log stores float16), got 70000.0", id="past-float16"),
    pytest.param({"item_embedding": _with(5, -3e38)}, "item_embedding[5]: must be within ±65504", id="near-float32-max"),
    pytest.param({"cart_item_count": 2**31}, "cart_item_count: at most 2147483647, got 2147483648", id="count-past-int32"),
    pytest.param({"user_id": ""}, "user_id: required", id="empty-user"),
    pytest.param({"session_id": ""}, "session_id: required", id="empty-session"),
    pytest.param({"item_id": ""}, "item_id: required", id="empty-item"),
    pytest.param({"item_id": "x" * 257}, "item_id: longer than 256", id="long-item"),
    pytest.param({"request_id": "r" * 300}, "request_id: longer than 256", id="long-request-id"),
    pytest.param({"recent_behavior_ids": [f"b{i}" for i in range(33)]}, "recent_behavior_ids: at most 32 ids allowed, got 33",
                 id="too-many-ids"),
    pytest.param({"recent_behavior_ids": ["a", ""]}, "recent_behavior_ids[1]: must not be empty", id="empty-behavior-id"),
    pytest.param({"page_type": 9}, "page_type: unknown value 9", id="unknown-page-type"),
    pytest.param({"event_time": Timestamp(seconds=0, nanos=-5)}, "event_time: outside the range", id="bad-nanos"),
    pytest.param({"event_time": Timestamp(seconds=10**12)}, "event_time: outside the range", id="year-overflow"),
]


@pytest.mark.parametrize(("fields", "message"), CASES)
def test_invalid_argument_names_the_field(channel: grpc.Channel, fields: dict[str, object], message: str) -> None:
    call = stub(channel).RecommendAction
    with pytest.raises(grpc.RpcError) as info:
        call(request(**fields), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)
    assert "Traceback" not in info.value.details()
    assert call(request(), timeout=5).decision_id  # still up and answering


def test_oversized_message_is_resource_exhausted(channel: grpc.Channel) -> None:
    call = stub(channel).RecommendAction
    with pytest.raises(grpc.RpcError) as info:
        call(request(item_id="x" * 100_000), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert call(request(), timeout=5).decision_id


def test_garbage_bytes_are_rejected_without_harm(channel: grpc.Channel) -> None:
    raw = channel.unary_unary("/shopping_agent.v1.ShoppingAgent/RecommendAction")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff\x0f garbage", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "request: not a RecommendActionRequest (wire format is corrupt)"
    assert stub(channel).RecommendAction(request(), timeout=5).decision_id


def test_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    raw = channel.unary_unary("/shopping_agent.v1.ShoppingAgent/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_largest_values_the_log_holds_are_decided_by_the_model(channel: grpc.Channel) -> None:
    """±65504 in every place and the largest int32 cart: answered from the model's outputs (finite), neither refused
    nor degraded to the rules by an inference error."""
    reply = stub(channel).RecommendAction(request(item_embedding=[65504.0, -65504.0] * 384, cart_item_count=2**31 - 1), timeout=5)
    assert reply.source not in (pb.DECISION_SOURCE_FALLBACK_DEGRADED, pb.DECISION_SOURCE_FALLBACK_NO_MODEL)


def test_unspecified_page_type_is_accepted(channel: grpc.Channel) -> None:
    assert stub(channel).RecommendAction(request(page_type=pb.PAGE_TYPE_UNSPECIFIED), timeout=5).decision_id


@pytest.mark.parametrize(("fields", "message"), [
    ({"value": 1e308}, "value: must be at most 1e+06 (the server's max_outcome_value), got 1e+308"),
    ({"value": 1_000_000.01}, "value: must be at most 1e+06 (the server's max_outcome_value), got 1000000.01"),  # not 1e+06
    ({"coupon_discount": 2e6}, "coupon_discount: must be at most 1e+06"),
    ({"value": float("nan")}, "value: must be a finite amount >= 0"),
    ({"value": 10.0, "coupon_discount": 10.5}, "coupon_discount: an order's discount must be at most its value (10.0), got 10.5"),
    ({"coupon_discount": 1e6}, "coupon_discount: an order's discount must be at most its value (0.0), got 1000000.0"),
    ({"value": 123456.7, "coupon_discount": 123456.8},  # as given, not both shown as 123457
     "coupon_discount: an order's discount must be at most its value (123456.7), got 123456.8"),
])
def test_outcome_amounts_are_bounded(channel: grpc.Channel, fields: dict[str, object], message: str) -> None:
    """An order worth 1e308 would have gone into training as a reward: refused, naming the field."""
    report = pb.ReportOutcomeRequest(decision_id="d-1", session_id="s-1", outcome_id="o-cap", outcome=pb.OUTCOME_ORDER, **fields)
    with pytest.raises(grpc.RpcError) as caught:
        stub(channel).ReportOutcome(report, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in (caught.value.details() or "")
    ok = stub(channel).ReportOutcome(pb.ReportOutcomeRequest(decision_id="d-1", session_id="s-1", outcome_id="o-ok",
                                                             outcome=pb.OUTCOME_ORDER, value=1_000_000.0), timeout=10)
    assert ok.outcome_id == "o-ok"
    for outcome in (pb.OUTCOME_COUPON_USED, pb.OUTCOME_COMPLAINT):  # a discount beside no order: the objective ignores it
        assert stub(channel).ReportOutcome(pb.ReportOutcomeRequest(decision_id="d-1", session_id="s-1", outcome_id="o-c",
                                                                   outcome=outcome, coupon_discount=5.0), timeout=10)


def test_each_bound_admits_its_edge_and_refuses_one_past_it(channel: grpc.Channel) -> None:
    """The limits are inclusive where the docs say "at most": an id of exactly 256 characters, the last nanosecond of a
    second, and an order whose discount is its whole value are served; one past each is refused, naming the field."""
    call = stub(channel)
    assert call.RecommendAction(request(item_id="x" * 256, request_id="r" * 256, recent_behavior_ids=["b" * 256]),
                                timeout=5).decision_id
    assert call.RecommendAction(request(event_time=Timestamp(seconds=1_790_000_000, nanos=999_999_999)), timeout=5).decision_id
    last = Timestamp(seconds=TIMESTAMP_MAX_S, nanos=999_999_999)  # the last nanosecond of year 9999 (UTC here): its sum as
    assert call.RecommendAction(request(event_time=last), timeout=5).decision_id  # a double rounded up into year 10000
    refused = {"event_time": request(event_time=Timestamp(seconds=1_790_000_000, nanos=1_000_000_000)),
               "recent_behavior_ids[0]": request(recent_behavior_ids=["b" * 257])}
    for field, bad in refused.items():
        with pytest.raises(grpc.RpcError) as info:
            call.RecommendAction(bad, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(f"{field}: ")
    whole = pb.ReportOutcomeRequest(decision_id="d-1", session_id="s-1", outcome_id="o-edge", outcome=pb.OUTCOME_ORDER,
                                    value=10.0, coupon_discount=10.0)
    assert call.ReportOutcome(whole, timeout=5).outcome_id == "o-edge"
