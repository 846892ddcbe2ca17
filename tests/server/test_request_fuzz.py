"""Request fuzzing against the real server: messages drawn from the descriptor, and raw bytes; 0 crashes, 0 INTERNAL.

RecommendAction, and the two report rpcs (ReportOutcome, ReportEngagement), whose every refusal must name a field.

The strategy walks ``RecommendActionRequest``'s descriptor, so a field added to the proto is
fuzzed without touching this file: strings of any unicode (empty, long), integers at the
edges of their types, floats with NaN and infinities, repeated fields of any length, enums
with unknown numbers, nested messages (``event_time``) with out-of-range seconds and nanos.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from tests.harness import request, stub

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
}


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=300)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=300)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type in _INT_RANGES:
        low, high = _INT_RANGES[field.type]
        edges = st.sampled_from([low, high, 0, -1, 1]).filter(lambda v: low <= v <= high)
        return st.one_of(edges, st.integers(min_value=low, max_value=high))
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    raise AssertionError(f"unhandled field type {field.type} of {field.full_name}")


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Dictionaries of field values for ``descriptor``: any subset of its fields set."""
    fields = {}
    for field in descriptor.fields:
        value = _scalar(field, depth)
        if field.is_repeated:
            # the embedding: around its real length, and anything from empty to too long
            size = 800 if field.name == "item_embedding" else 40
            value = st.lists(value, max_size=size)
        fields[field.name] = value
    return st.fixed_dictionaries({}, optional=fields) if depth < 3 else st.just({})


def _build(descriptor: Descriptor, values: dict[str, Any]) -> Any:
    cls = pb.RecommendActionRequest if descriptor is pb.RecommendActionRequest.DESCRIPTOR else None
    message = cls() if cls is not None else _class(descriptor)()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            for item in items:
                target = getattr(message, name).add() if field.is_repeated else getattr(message, name)
                target.CopyFrom(_build(field.message_type, item))
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def _class(descriptor: Descriptor) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _call(channel: grpc.Channel, data: bytes) -> grpc.StatusCode:
    method = channel.unary_unary("/shopping_agent.v1.ShoppingAgent/RecommendAction", request_serializer=None,
                                 response_deserializer=pb.RecommendActionResponse.FromString)
    try:
        method(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _alive(channel: grpc.Channel) -> None:
    assert stub(channel).RecommendAction(request(), timeout=10).decision_id


@FUZZ
@given(messages(pb.RecommendActionRequest.DESCRIPTOR))
def test_fuzzed_messages_get_an_answer_or_a_named_error(channel: grpc.Channel, values: dict[str, Any]) -> None:
    message = _build(pb.RecommendActionRequest.DESCRIPTOR, values)
    code = _call(channel, message.SerializeToString())
    assert code in ALLOWED, (code, values)


@FUZZ
@given(messages(pb.RecommendActionRequest.DESCRIPTOR))
def test_a_valid_request_with_fuzzed_fields_gets_an_answer_or_a_named_error(channel: grpc.Channel, values: dict[str, Any]) -> None:
    """The same fields over a valid request, so most calls go past validation into the decision itself."""
    message = request()
    message.MergeFrom(_build(pb.RecommendActionRequest.DESCRIPTOR, {k: v for k, v in values.items() if k != "item_embedding"}))
    assert _call(channel, message.SerializeToString()) in ALLOWED


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzzed_bytes_get_an_answer_or_a_named_error(channel: grpc.Channel, data: bytes) -> None:
    assert _call(channel, data) in ALLOWED


REPORTS = [pytest.param(pb.ReportOutcomeRequest, id="ReportOutcome"), pytest.param(pb.ReportEngagementRequest, id="ReportEngagement")]


def _report_call(channel: grpc.Channel, cls: Any, data: bytes) -> tuple[grpc.StatusCode, str]:
    method = channel.unary_unary(f"/shopping_agent.v1.ShoppingAgent/{cls.__name__.removesuffix('Request')}", request_serializer=None,
                                 response_deserializer=None)
    try:
        method(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[no-any-return]
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("cls", REPORTS)
@FUZZ
@given(data=st.data())
def test_fuzzed_reports_are_accepted_or_refused_naming_the_field(channel: grpc.Channel, cls: Any, data: st.DataObject) -> None:
    values = data.draw(messages(cls.DESCRIPTOR))
    code, details = _report_call(channel, cls, _build(cls.DESCRIPTOR, values).SerializeToString())
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, (code, values)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        named = details.split(": ", 1)[0].split(", ")
        assert all(name in cls.DESCRIPTOR.fields_by_name for name in named), details


@pytest.mark.parametrize("cls", REPORTS)
@FUZZ
@given(raw=st.binary(max_size=2048))
def test_fuzzed_report_bytes_are_accepted_or_refused(channel: grpc.Channel, cls: Any, raw: bytes) -> None:
    code, details = _report_call(channel, cls, raw)
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, (code, details)


def test_the_server_still_answers_after_the_fuzzing(channel: grpc.Channel) -> None:
    _alive(channel)


def _field_root(details: str) -> str:
    """The top-level field an error names: ``categories`` of ``categories[1].skus[0].price: …``."""
    return details.split(": ", 1)[0].split(".", 1)[0].split("[", 1)[0]


@FUZZ
@given(data=st.data())
def test_fuzzed_product_requests_get_an_answer_or_a_named_error(channel: grpc.Channel, data: st.DataObject) -> None:
    """RecommendProduct's nested candidates from the descriptor, alone and merged over a valid request (so that many
    calls reach the layers): an answer, or an error naming a field of the request; never INTERNAL."""
    from tests.server.test_recommend_product import product

    cls = pb.RecommendProductRequest
    values = data.draw(messages(cls.DESCRIPTOR))
    for message in (_build(cls.DESCRIPTOR, values), _merged(product(), _build(cls.DESCRIPTOR, values))):
        code, details = _report_call(channel, cls, message.SerializeToString())
        assert code in ALLOWED, (code, details)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert _field_root(details) in cls.DESCRIPTOR.fields_by_name or details.startswith("request:"), details


def _merged(base: Any, extra: Any) -> Any:
    base.MergeFrom(extra)
    return base
