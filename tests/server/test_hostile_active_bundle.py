"""A hostile file as the active bundle: the server keeps answering on the embedded default, counts the refusal, says why."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness import request, running_server, stub
from tests.weights import hostile
from weights.embedded import DEFAULT_MODEL_VERSION
from weights.store import ACTIVE_NAME

CASES = {
    "nested-manifest": (hostile.nested_manifest, "format"),
    "duplicate-members": (hostile.duplicate_member, "format"),
    "allocating-graph": (lambda: hostile.rebuilt({"guard.onnx": hostile.allocating_guard()}), "onnx"),
    "external-data": (lambda: hostile.rebuilt(hostile.zero_golden({"guard.onnx": hostile.external_data_guard()})), "onnx"),
    "bad-created-at": (lambda: hostile.rebuilt(created_at="soon"), "schema"),
    "unencodable-version": (lambda: hostile.rebuilt(model_version="\ud800"), "schema"),  # no answer could carry it
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_default_keeps_serving_and_the_refusal_is_counted(tmp_path: Path, case: str) -> None:
    make, reason = CASES[case]
    (tmp_path / ACTIVE_NAME).write_bytes(make())
    with running_server(weights_dir=tmp_path, weights_inotify=False) as live, grpc.insecure_channel(live.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reply = stub(channel).RecommendAction(request(), timeout=10)
        assert reply.model_version == DEFAULT_MODEL_VERSION
        rejected = live.registry.get_sample_value("shopping_agent_model_swaps_total", {"result": "rejected", "reason": reason})
        assert rejected == 1.0, f"{case}: the refusal was not counted with reason {reason}"


def test_a_server_with_a_public_key_refuses_an_unsigned_active_bundle(tmp_path: Path) -> None:
    from weights.signing import keypair_pem

    _, public = keypair_pem()
    (tmp_path / "k.pub").write_bytes(public)
    weights = tmp_path / "pv"
    weights.mkdir()
    (weights / ACTIVE_NAME).write_bytes(hostile.rebuilt(model_version="unsigned-v9"))
    with running_server(weights_dir=weights, weights_inotify=False, bundle_public_key=tmp_path / "k.pub") as live, \
            grpc.insecure_channel(live.target) as channel:
        assert stub(channel).RecommendAction(request(), timeout=10).model_version == DEFAULT_MODEL_VERSION
        assert live.registry.get_sample_value("shopping_agent_model_swaps_total", {"result": "rejected", "reason": "signature"}) == 1.0
