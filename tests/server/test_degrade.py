"""Degrade, don't fail: no model, a bad bundle, a full queue, a short deadline, an inference error."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.models import ACTIVE_NAME
from tests.harness import request, running_server, stub
from tests.poisoned import poisoned_graph, rebundled
from weights.bundle import write_bundle
from weights.embedded import DEFAULT_MODEL_VERSION, default_bundle, default_bundle_bytes


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_no_model_answers_from_the_rules_and_is_not_serving(tmp_path: Path) -> None:
    with running_server(weights_dir=tmp_path, use_embedded_default=False) as live:
        with grpc.insecure_channel(live.target) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            resp = stub(ch).RecommendAction(request(page_type=pb.PAGE_TYPE_CART), timeout=5)
            assert resp.source == pb.DECISION_SOURCE_FALLBACK_NO_MODEL
            assert resp.action == pb.ACTION_APPLY_COUPON and resp.rule == "cart_page_coupon"
            assert resp.propensity == 1.0 and resp.model_version == ""
            resp = stub(ch).RecommendAction(request(page_type=pb.PAGE_TYPE_SEARCH, cart_item_count=0), timeout=5)
            assert (resp.action, resp.rule) == (pb.ACTION_VIEW_DETAIL, "default")
            # Validation still applies without a model.
            with pytest.raises(grpc.RpcError) as info:
                stub(ch).RecommendAction(request(item_embedding=[0.0] * 10), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert live.registry.get_sample_value(
            "shopping_agent_decisions_total", {"action": "apply_coupon", "source": "fallback_no_model"}) == 1.0


def test_a_server_without_a_model_loads_the_first_good_bundle_published_and_serves(tmp_path: Path) -> None:
    """ShoppingAgentNoModelLoaded's runbook: publishing a good bundle is enough, no restart."""
    weights = tmp_path / "weights"
    weights.mkdir()
    with running_server(weights_dir=weights, use_embedded_default=False, weights_poll_seconds=0.1,
                        weights_debounce_ms=20) as live, grpc.insecure_channel(live.target) as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
        staged = tmp_path / "staged.bundle"
        staged.write_bytes(default_bundle_bytes())
        staged.rename(weights / ACTIVE_NAME)  # as the publisher does: an atomic rename onto the active name
        deadline = time.monotonic() + 20
        while _health(ch) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the published bundle was never loaded"
            time.sleep(0.05)
        resp = stub(ch).RecommendAction(request(), timeout=5)
        assert resp.model_version == DEFAULT_MODEL_VERSION and resp.source != pb.DECISION_SOURCE_FALLBACK_NO_MODEL


def test_a_corrupt_active_bundle_falls_back_to_the_embedded_default(tmp_path: Path) -> None:
    good = (tmp_path / ACTIVE_NAME)
    from weights.embedded import default_bundle_bytes

    data = bytearray(default_bundle_bytes())
    data[len(data) // 2] ^= 0xFF
    good.write_bytes(bytes(data))
    with running_server(weights_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        assert stub(ch).RecommendAction(request(), timeout=5).model_version == DEFAULT_MODEL_VERSION


def test_an_active_name_that_cannot_be_resolved_falls_back_to_the_embedded_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: a link to itself as the active file (ELOOP) raised in the watcher's stat; the server started with no model,
    # NOT_SERVING, nothing counted, a traceback logged every second (an attack review, 2026-12-06).
    (tmp_path / ACTIVE_NAME).symlink_to(ACTIVE_NAME)
    with running_server(weights_dir=tmp_path, weights_poll_seconds=0.1) as live, grpc.insecure_channel(live.target) as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        assert stub(ch).RecommendAction(request(), timeout=5).model_version == DEFAULT_MODEL_VERSION
        time.sleep(1.0)  # ten polls of the unresolvable name
        rejected = {"result": "rejected", "reason": "io"}
        assert live.registry.get_sample_value("shopping_agent_model_swaps_total", rejected) == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]  # the start's refusal, once, without a traceback
    assert [(r.getMessage(), r.exc_info, r.fields["reason"]) for r in errors] == [("cannot serve the active bundle", None, "io")]  # type: ignore[attr-defined]


def test_a_valid_active_bundle_is_served(tmp_path: Path) -> None:
    bundle = default_bundle()
    manifest = {k: v for k, v in bundle.manifest.items() if k not in ("format", "format_version", "parts")}
    write_bundle(tmp_path / ACTIVE_NAME, {**manifest, "model_version": "from-the-volume"}, bundle.parts)
    with running_server(weights_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        assert stub(ch).RecommendAction(request(), timeout=5).model_version == "from-the-volume"


def test_a_full_queue_degrades_to_the_rules_without_errors() -> None:
    with running_server(max_queue=1, max_batch=1) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        sources: list[int] = []
        deadline = time.monotonic() + 20
        with ThreadPoolExecutor(32) as pool:
            while pb.DECISION_SOURCE_FALLBACK_DEGRADED not in sources and time.monotonic() < deadline:
                futures = [pool.submit(call, request(), timeout=10) for _ in range(256)]
                sources += [f.result().source for f in futures]  # every call succeeds
        assert pb.DECISION_SOURCE_FALLBACK_DEGRADED in sources
        assert live.registry.get_sample_value("shopping_agent_degraded_decisions_total", {"reason": "overload"}) >= 1
        degraded = [s for s in sources if s == pb.DECISION_SOURCE_FALLBACK_DEGRADED]
        assert len(degraded) < len(sources)


def test_a_deadline_too_short_for_inference_gets_the_rule_answer() -> None:
    with running_server(min_inference_budget_ms=200) as live, grpc.insecure_channel(live.target) as ch:
        resp = stub(ch).RecommendAction(request(page_type=pb.PAGE_TYPE_DETAIL), timeout=0.15)
        assert resp.source == pb.DECISION_SOURCE_FALLBACK_DEGRADED
        assert (resp.action, resp.rule, resp.propensity) == (pb.ACTION_ADD_TO_CART, "detail_page_add", 1.0)
        assert resp.model_version == DEFAULT_MODEL_VERSION
        assert stub(ch).RecommendAction(request(), timeout=5).source != pb.DECISION_SOURCE_FALLBACK_DEGRADED
        assert live.registry.get_sample_value("shopping_agent_degraded_decisions_total", {"reason": "deadline"}) == 1.0


def _poisoned_bundle(path: Path, nan: bool = False) -> None:
    """The default bundle with a policy graph that fails at run time when state[0] >= 2.

    A Gather indexes a 2-element tensor with int(state[:, 0]): in range for every ordinary
    state (golden inputs, warm-up zeros, small embeddings), out of range for a poison value,
    so onnxruntime itself raises — a real inference error, nothing mocked.
    """
    from onnx import TensorProto, helper

    bundle = default_bundle()
    constants = {"poison_table": np.zeros(2, dtype=np.float32), "col0": np.array([0], dtype=np.int64),
                 "one": np.array([1], dtype=np.int64), "axis1": np.array([1], dtype=np.int64),
                 "one_f": np.array([1.0], dtype=np.float32), "zero_f": np.array([0.0], dtype=np.float32)}
    poison = [  # nan=True: logits + 0 * sqrt(1 - state[:, 0]), NaN (not an error) when state[0] > 1
        helper.make_node("Slice", ["state", "col0", "one", "axis1"], ["first"]),
        helper.make_node("Sub", ["one_f", "first"], ["rest"]),
        helper.make_node("Sqrt", ["rest"], ["root"]),
        helper.make_node("Mul", ["root", "zero_f"], ["zeros"]),
    ] if nan else [
        helper.make_node("Slice", ["state", "col0", "one", "axis1"], ["first"]),
        helper.make_node("Cast", ["first"], ["first_i"], to=TensorProto.INT64),
        helper.make_node("Gather", ["poison_table", "first_i"], ["zeros"]),
    ]
    path.write_bytes(rebundled(bundle, {"policy.onnx": poisoned_graph(bundle.parts["policy.onnx"], constants, poison)},
                              "poisoned"))


@pytest.mark.parametrize("nan", [False, True], ids=["onnxruntime-error", "nan-output"])
def test_an_inference_error_degrades_only_the_request_that_caused_it(tmp_path: Path, nan: bool) -> None:
    _poisoned_bundle(tmp_path / ACTIVE_NAME, nan=nan)
    poison = list(request().item_embedding)
    poison[0] = 5.0
    with running_server(weights_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        assert call(request(), timeout=5).model_version == "poisoned"
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(call, request(item_embedding=poison) if i % 8 == 0 else request(), timeout=10)
                       for i in range(400)]
            results = [(i % 8 == 0, f.result()) for i, f in enumerate(futures)]
        for poisoned, resp in results:
            assert (resp.source == pb.DECISION_SOURCE_FALLBACK_DEGRADED) == poisoned
        assert live.registry.get_sample_value("shopping_agent_degraded_decisions_total", {"reason": "error"}) == 50
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_an_event_time_the_local_calendar_cannot_hold_is_invalid_argument() -> None:
    from google.protobuf.timestamp_pb2 import Timestamp

    with running_server(timezone="Asia/Tokyo") as live, grpc.insecure_channel(live.target) as ch:
        with pytest.raises(grpc.RpcError) as info:
            stub(ch).RecommendAction(request(event_time=Timestamp(seconds=253402300799)), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("event_time: cannot be placed in the server's timezone Asia/Tokyo")
        assert stub(ch).RecommendAction(request(), timeout=5).decision_id
