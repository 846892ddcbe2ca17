"""The hand-written RecommendActionResponse bytes parse to the message protobuf's own API builds: real decisions, and
every source and edge value built by hand."""

from __future__ import annotations

import os
import time
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as T

from bench.payload import build_request
from core.domain import ACTIONS, N_ACTIONS, Action, Decision, Source
from policy.features import context_of
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.response_wire import recommend_response, varint
from server.validation import Limits, parse_request
from weights.embedded import default_bundle
from weights.model_set import ModelSet


def reference(decision: Decision, decision_id: str, request_id: str) -> pb.RecommendActionResponse:
    """The answer through protobuf's Python API, field by field (what the servicer built before it wrote bytes)."""
    response = pb.RecommendActionResponse(
        decision_id=decision_id, action=pb.Action.ValueType(decision.action), source=pb.DecisionSource.ValueType(decision.source),
        propensity=decision.propensity,
        votes=decision.votes, samples=decision.samples, model_version=decision.model_version, request_id=request_id,
        rule=decision.rule)
    for a in ACTIONS:
        response.action_scores.add(action=pb.Action.ValueType(a), policy_probability=float(decision.policy_probs[a.index]),
                                   guard_allow_probability=float(decision.allow_probs[a.index]),
                                   blocked=bool(decision.blocked[a.index]), served_probability=float(decision.served_probs[a.index]))
    return response


def parsed(decision: Decision, decision_id: str, request_id: str) -> pb.RecommendActionResponse:
    """What a client reads from the written bytes; re-serialised it must be protobuf's own bytes of the reference
    (an unknown field, or a known one under the wrong wire type, would survive into it)."""
    message = pb.RecommendActionResponse.FromString(recommend_response(decision, decision_id, request_id))
    assert message.SerializeToString() == reference(decision, decision_id, request_id).SerializeToString()
    return message


def decision(**changes: object) -> Decision:
    served = np.array([0.7, 0.2, 0.1, 0.0, 0.0])
    base: dict[str, object] = dict(
        action=Action.ADD_TO_CART, source=Source.POLICY, propensity=0.7, votes=7, samples=10, served_probs=served,
        policy_probs=np.array([0.5, 0.3, 0.15, 0.05, 0.0]), allow_probs=np.array([0.9, 0.8, 0.7, 0.6, 0.5]),
        blocked=np.array([False, False, False, False, True]), model_version="v-2026-12-04")
    base.update(changes)
    return Decision(**base)  # type: ignore[arg-type]


def test_the_writer_uses_the_proto_field_numbers_and_types() -> None:
    fields = {f.name: (f.number, f.type) for f in pb.RecommendActionResponse.DESCRIPTOR.fields}
    assert fields == {
        "decision_id": (1, T.TYPE_STRING), "action": (2, T.TYPE_ENUM), "source": (3, T.TYPE_ENUM),
        "propensity": (4, T.TYPE_DOUBLE), "votes": (5, T.TYPE_UINT32), "samples": (6, T.TYPE_UINT32),
        "action_scores": (7, T.TYPE_MESSAGE), "model_version": (8, T.TYPE_STRING), "request_id": (9, T.TYPE_STRING),
        "rule": (10, T.TYPE_STRING)}
    scores = {f.name: (f.number, f.type) for f in pb.ActionScore.DESCRIPTOR.fields}
    assert scores == {"action": (1, T.TYPE_ENUM), "policy_probability": (2, T.TYPE_DOUBLE),
                      "guard_allow_probability": (3, T.TYPE_DOUBLE), "blocked": (4, T.TYPE_BOOL),
                      "served_probability": (5, T.TYPE_DOUBLE)}
    assert [a.name for a in ACTIONS] == [v.name.removeprefix("ACTION_") for v in pb.Action.DESCRIPTOR.values[1:]]


@pytest.mark.parametrize("n", [-1, 2**32])
def test_varint_refuses_what_is_not_a_uint32(n: int) -> None:
    with pytest.raises(ValueError, match="not a uint32"):
        varint(n)
    with pytest.raises(ValueError):  # protobuf's own message refuses it too
        pb.RecommendActionResponse(votes=n)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16_383, 16_384, 2**21, 2**32 - 1])
def test_varint_matches_protobuf(n: int) -> None:
    if n == 0:  # protobuf leaves a zero out; written explicitly, it reads back as zero
        assert pb.RecommendActionResponse.FromString(b"\x28" + varint(0)).votes == 0
    else:
        assert b"\x28" + varint(n) == pb.RecommendActionResponse(votes=n).SerializeToString()


def test_real_decisions_of_every_source_the_model_gives() -> None:
    model = ModelSet.load(default_bundle())
    limits, tz = Limits(model.item_dim, 50, 256), ZoneInfo("UTC")
    seen = set()
    for i in range(400):
        msg = build_request()
        msg.session_id, msg.request_id, msg.cart_item_count = f"s-{i}", f"r-{i}", i % 5
        req = parse_request(msg, limits, time.time())
        ctx = context_of(req, tz)
        decision_id = os.urandom(16).hex()
        d = model.run([req], [ctx], [decision_id])[0]
        seen.add(d.source)
        assert parsed(d, decision_id, req.request_id) == reference(d, decision_id, req.request_id)
    fallback = model.fallback(ctx, Source.FALLBACK_DEGRADED)  # the rule engine's answer: zeros and a rule name
    assert fallback.rule
    assert parsed(fallback, "f" * 32, "") == reference(fallback, "f" * 32, "")
    assert {Source.POLICY, Source.EXPLORATION} <= seen  # the other sources: test_edge_values_read_back_exactly


@pytest.mark.parametrize("changes", [
    {},
    {"source": Source.FALLBACK_NO_MODEL, "votes": 0, "samples": 0, "model_version": "", "rule": "default_view_detail",
     "policy_probs": np.zeros(N_ACTIONS), "allow_probs": np.zeros(N_ACTIONS), "propensity": 1.0,
     "served_probs": np.array([0.0, 1.0, 0.0, 0.0, 0.0]), "action": Action.VIEW_DETAIL},
    {"source": Source.FALLBACK_GUARD, "blocked": np.ones(N_ACTIONS, dtype=bool), "action": Action.EXIT},
    {"source": Source.FALLBACK_LOW_CONSENSUS, "votes": 3, "rule": "full_cart_coupon", "action": Action.APPLY_COUPON},
    {"source": Source.EXPLORATION, "votes": 0},
    {"propensity": 5e-324, "votes": 300, "samples": 1_000},  # a subnormal, and counts past one varint byte
    {"propensity": -0.0},  # a negative zero is written, and reads back as such
    {"model_version": "ü" * 200, "rule": "règle"},  # UTF-8 lengths in bytes, past one varint byte
])
def test_edge_values_read_back_exactly(changes: dict[str, object]) -> None:
    d = decision(**changes)
    for request_id in ("", "r", "é" * 100, "x" * 256):
        got, want = parsed(d, "a" * 32, request_id), reference(d, "a" * 32, request_id)
        assert got == want
        assert np.signbit(got.propensity) == np.signbit(want.propensity)
