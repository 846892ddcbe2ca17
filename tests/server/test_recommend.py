"""RecommendAction over the wire on the embedded default bundle: valid calls and their contract."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from tests.harness import ServerThread, request, stub
from weights.embedded import DEFAULT_MODEL_VERSION

POLICY_SOURCES = {pb.DECISION_SOURCE_POLICY, pb.DECISION_SOURCE_FALLBACK_LOW_CONSENSUS, pb.DECISION_SOURCE_EXPLORATION}


def test_valid_request_gets_a_complete_decision(channel: grpc.Channel) -> None:
    resp = stub(channel).RecommendAction(request(request_id="r-42"), timeout=5)
    assert len(resp.decision_id) == 32
    assert resp.request_id == "r-42"
    assert resp.model_version == DEFAULT_MODEL_VERSION
    assert resp.source in POLICY_SOURCES
    assert resp.action != pb.ACTION_EXIT  # the default guardrails ban exit
    assert resp.samples == 10
    assert [s.action for s in resp.action_scores] == [1, 2, 3, 4, 5]
    served = {s.action: s.served_probability for s in resp.action_scores}
    assert math.isclose(sum(served.values()), 1.0, abs_tol=1e-9)
    assert resp.propensity == pytest.approx(served[resp.action], abs=1e-12)
    assert resp.propensity > 0
    exit_score = resp.action_scores[4]
    assert exit_score.blocked and exit_score.policy_probability == 0 and exit_score.served_probability == 0
    assert math.isclose(sum(s.policy_probability for s in resp.action_scores), 1.0, abs_tol=1e-9)
    if resp.source == pb.DECISION_SOURCE_POLICY:
        assert resp.votes >= 4


def test_decision_ids_are_unique(channel: grpc.Channel) -> None:
    ids = {stub(channel).RecommendAction(request(), timeout=5).decision_id for _ in range(200)}
    assert len(ids) == 200


def test_optional_fields_may_be_absent(channel: grpc.Channel) -> None:
    resp = stub(channel).RecommendAction(request(recent_behavior_ids=[], page_type=pb.PAGE_TYPE_UNSPECIFIED, request_id="",
                                                 cart_item_count=0), timeout=5)
    assert resp.action in (1, 2, 3, 4)


def test_cart_rule_lowers_add_to_cart(channel: grpc.Channel) -> None:
    """Guardrail request rule: cart_item_count >= 3 multiplies add_to_cart by 0.3 (in probability ratios)."""
    at = Timestamp(seconds=1_764_460_800)  # fixed hour so both requests share the state
    light = stub(channel).RecommendAction(request(cart_item_count=2, event_time=at), timeout=5)
    full = stub(channel).RecommendAction(request(cart_item_count=3, event_time=at), timeout=5)
    ratio = lambda r: r.action_scores[0].policy_probability / r.action_scores[1].policy_probability  # noqa: E731
    assert ratio(full) / ratio(light) == pytest.approx(0.3, rel=1e-5)


def test_propensity_matches_repeated_decisions(channel: grpc.Channel) -> None:
    """The returned propensities equal the empirical frequency of each action over many calls."""
    call = stub(channel).RecommendAction
    req = request(event_time=Timestamp(seconds=1_764_460_800), seed=7)
    n = 1500
    responses = [call(req, timeout=5) for _ in range(n)]
    served = [s.served_probability for s in responses[0].action_scores]
    assert all([s.served_probability for s in r.action_scores] == served for r in responses)  # same request, same law
    for action in (1, 2, 3, 4, 5):
        p = served[action - 1]
        freq = sum(r.action == action for r in responses) / n
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(freq - p) <= 5 * sigma + 1e-9, (action, freq, p)
    sources = {r.source for r in responses}
    assert pb.DECISION_SOURCE_POLICY in sources and pb.DECISION_SOURCE_EXPLORATION in sources


def test_hour_feature_uses_the_configured_timezone() -> None:
    from tests.harness import running_server

    night_utc = Timestamp(seconds=1_764_460_800 + 23 * 3600)  # 23:00 UTC, 08:00 in Tokyo
    with running_server(timezone="UTC") as utc, running_server(timezone="Asia/Tokyo") as tokyo:
        with grpc.insecure_channel(utc.target) as a, grpc.insecure_channel(tokyo.target) as b:
            ra = stub(a).RecommendAction(request(event_time=night_utc), timeout=5)
            rb = stub(b).RecommendAction(request(event_time=night_utc), timeout=5)
    assert [s.policy_probability for s in ra.action_scores] != [s.policy_probability for s in rb.action_scores]


def test_response_echo_and_version_with_event_time(live: ServerThread, channel: grpc.Channel) -> None:
    assert live.server is not None
    resp = stub(channel).RecommendAction(request(event_time=Timestamp(seconds=0)), timeout=5)
    assert resp.model_version == live.server.models.current.version
