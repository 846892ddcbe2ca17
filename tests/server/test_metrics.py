"""Metrics from a live server, read from its own fresh registry and from its HTTP endpoint."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.metrics import MAX_TRAINING_NAMES, Metrics
from server.models import ACTIVE_NAME
from tests.harness import ServerThread, request, running_server, stub, until
from weights.bundle import write_bundle
from weights.embedded import default_bundle

UNARY = {"grpc_type": "unary", "grpc_service": "shopping_agent.v1.ShoppingAgent", "grpc_method": "RecommendAction"}


def _value(live: ServerThread, name: str, labels: dict[str, str] | None = None) -> float:
    value = live.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_grpc_metrics_count_calls_by_code_and_time_them() -> None:
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        for _ in range(7):
            call(request(), timeout=5)
        for bad in ({"item_id": ""}, {"item_embedding": [0.0]}):
            with pytest.raises(grpc.RpcError):
                call(request(**bad), timeout=5)
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert _value(live, "grpc_server_started_total", UNARY) == 9
        assert _value(live, "grpc_server_handled_total", {**UNARY, "grpc_code": "OK"}) == 7
        assert _value(live, "grpc_server_handled_total", {**UNARY, "grpc_code": "INVALID_ARGUMENT"}) == 2
        assert _value(live, "grpc_server_handling_seconds_count", UNARY) == 9
        assert 0 < _value(live, "grpc_server_handling_seconds_sum", UNARY) < 9 * 5
        health = {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
        assert _value(live, "grpc_server_handled_total", {**health, "grpc_code": "OK"}) == 1


def test_garbage_bytes_to_health_and_reflection_are_invalid_argument_counted_and_not_logged_as_errors(
        caplog: pytest.LogCaptureFixture) -> None:
    """grpc's generated deserializers let a corrupt message end the call UNKNOWN with a traceback logged at ERROR (1.3 KB
    a call: 2,000 calls wrote 2.65 MB) and no handler ran, so no metric counted it (a review, 2026-12-07). They answer as
    the ShoppingAgent methods do: INVALID_ARGUMENT naming the message type; and well-formed calls still work."""
    garbage = b"\xff\xff\xff"
    caplog.set_level("ERROR")
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        ident = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        calls = {
            "Check": lambda: ch.unary_unary("/grpc.health.v1.Health/Check", **ident)(garbage, timeout=5),
            "Watch": lambda: list(ch.unary_stream("/grpc.health.v1.Health/Watch", **ident)(garbage, timeout=5)),
            "ServerReflectionInfo": lambda: list(ch.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", **ident)(iter([garbage]), timeout=5)),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, caught.value.details())
            assert caught.value.details().startswith("request: not a valid grpc."), caught.value.details()
        check = {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
        assert _value(live, "grpc_server_handled_total", {**check, "grpc_code": "INVALID_ARGUMENT"}) == 1
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status  # still answers
        assert _value(live, "grpc_server_handled_total", {**check, "grpc_code": "OK"}) == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage()[:200] for r in caplog.records]


def test_a_call_the_client_cancels_is_counted_cancelled_not_a_server_error() -> None:
    """A cancelled stream ends its handler with CancelledError: that is the client's doing (CANCELLED), not an error
    of the server's (UNKNOWN), which the error-rate alert counts."""
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        next(stream)  # the handler is running
        stream.cancel()
        watch = {"grpc_type": "server_stream", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Watch"}
        until(lambda: _value(live, "grpc_server_handled_total", {**watch, "grpc_code": "CANCELLED"}) == 1, "the cancel counted")
        assert _value(live, "grpc_server_handled_total", {**watch, "grpc_code": "UNKNOWN"}) == 0


def test_decision_metrics_follow_what_was_served() -> None:
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        responses = [stub(ch).RecommendAction(request(cart_item_count=4), timeout=5) for _ in range(40)]
        by_key: dict[tuple[str, str], int] = {}
        for r in responses:
            key = (pb.Action.Name(r.action)[len("ACTION_"):].lower(), pb.DecisionSource.Name(r.source)[len("DECISION_SOURCE_"):].lower())
            by_key[key] = by_key.get(key, 0) + 1
        for (action, source), n in by_key.items():
            assert _value(live, "shopping_agent_decisions_total", {"action": action, "source": source}) == n
        voted = [r.votes for r in responses if r.source == pb.DECISION_SOURCE_POLICY]
        assert _value(live, "shopping_agent_decision_votes_count") == len(voted)
        assert _value(live, "shopping_agent_decision_votes_sum") == sum(voted)
        assert all(r.votes == 0 for r in responses if r.source != pb.DECISION_SOURCE_POLICY)  # as the proto says
        assert _value(live, "shopping_agent_guardrail_rule_hits_total", {"rule": "full_cart_damp_add"}) == 40
        assert _value(live, "shopping_agent_batch_size_sum") == 40
        assert _value(live, "shopping_agent_inference_seconds_count") == _value(live, "shopping_agent_batch_size_count") > 0
        assert _value(live, "shopping_agent_inflight_requests") == 0


def test_the_queue_depth_falls_to_zero_once_none_waits() -> None:
    """Set when a batch is taken (its own requests included), the gauge used to stay at the last batch's depth on an
    idle server: 1 after a lone request, whatever came since."""
    with running_server() as live, grpc.insecure_channel(live.target) as ch:
        stub(ch).RecommendAction(request(), timeout=5)
        deadline = time.monotonic() + 5.0
        while _value(live, "shopping_agent_inference_queue_depth") != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _value(live, "shopping_agent_batch_size_count") == 1
        assert _value(live, "shopping_agent_inference_queue_depth") == 0


def test_the_log_queue_depth_is_what_waits_after_the_writers_last_flush(tmp_path: Path) -> None:
    """Set only as a flush began, the gauge read 0 while records waited and then, for a whole flush interval after they
    were written, their count (a review of the metrics: the queue_full runbook reads it)."""
    with running_server(log_dir=tmp_path / "logs", log_flush_seconds=3.0) as live, grpc.insecure_channel(live.target) as ch:
        for _ in range(4):
            stub(ch).RecommendAction(request(), timeout=5)
        until(lambda: _value(live, "shopping_agent_log_records_written_total", {"kind": "decisions"}) == 4, "the flush", 10.0)
        until(lambda: _value(live, "shopping_agent_log_queue_depth", {"kind": "decisions"}) == 0,  # none waits: it read 4
              "the depth set as the flush ended", 1.0)  # for the 3 s until the next flush


def test_guard_vetoes_are_counted_per_action() -> None:
    # The default guard allows every action with probability about 0.90; a threshold just
    # above that for some actions makes the guard veto them for this request.
    with running_server(guard_threshold=0.99) as live, grpc.insecure_channel(live.target) as ch:
        served = []
        for _ in range(3):
            resp = stub(ch).RecommendAction(request(), timeout=5)
            assert resp.source == pb.DECISION_SOURCE_FALLBACK_GUARD and resp.rule == "default:least_risky"
            served.append(pb.Action.Name(resp.action)[len("ACTION_"):].lower())
        assert len(set(served)) == 1
        for action in ("add_to_cart", "view_detail", "apply_coupon", "share_social"):
            assert _value(live, "shopping_agent_guard_vetoes_total", {"action": action}) == 3
        assert _value(live, "shopping_agent_guard_vetoes_total", {"action": "exit"}) == 0  # banned, not vetoed
        assert _value(live, "shopping_agent_decisions_total", {"action": served[0], "source": "fallback_guard"}) == 3


def test_model_metrics_carry_version_times_and_training_metrics(tmp_path: Path) -> None:
    bundle = default_bundle()
    manifest = {k: v for k, v in bundle.manifest.items() if k not in ("format", "format_version", "parts")}
    manifest.update(model_version="trained-7", created_at="2026-11-29T12:00:00Z",
                    training_metrics={"kl_to_behavior": 0.04, "effective_sample_size": 1234.0, "note": "text is skipped"})
    buf = io.BytesIO()
    write_bundle(buf, manifest, bundle.parts)
    (tmp_path / ACTIVE_NAME).write_bytes(buf.getvalue())
    with running_server(weights_dir=tmp_path) as live:
        assert _value(live, "shopping_agent_model_info", {"model_version": "trained-7", "format_version": "1"}) == 1
        assert _value(live, "shopping_agent_model_loaded") == 1
        created = datetime(2026, 11, 29, 12, tzinfo=UTC).timestamp()
        assert _value(live, "shopping_agent_model_created_timestamp_seconds") == created
        assert _value(live, "shopping_agent_model_age_seconds") > 0
        assert _value(live, "shopping_agent_model_load_timestamp_seconds") > created
        assert _value(live, "shopping_agent_model_training_metric", {"metric": "kl_to_behavior"}) == 0.04
        assert _value(live, "shopping_agent_model_training_metric", {"metric": "effective_sample_size"}) == 1234.0
        assert live.registry.get_sample_value("shopping_agent_model_training_metric", {"metric": "note"}) is None


def test_no_model_reports_not_loaded_and_counts_no_model_decisions(tmp_path: Path) -> None:
    with running_server(weights_dir=tmp_path, use_embedded_default=False) as live, grpc.insecure_channel(live.target) as ch:
        stub(ch).RecommendAction(request(), timeout=5)
        assert _value(live, "shopping_agent_model_loaded") == 0
        assert live.registry.get_sample_value("shopping_agent_model_info", {"model_version": "", "format_version": ""}) is None
        assert _value(live, "shopping_agent_decisions_total", {"action": "view_detail", "source": "fallback_no_model"}) == 1
        # no age at all, as with --workers (it was NaN, which the dashboard's fallback reads as a value: a review)
        assert live.registry.get_sample_value("shopping_agent_model_age_seconds") is None


def test_metrics_endpoint_serves_prometheus_text() -> None:
    with running_server(metrics_host="127.0.0.1", metrics_port=0) as live, grpc.insecure_channel(live.target) as ch:
        stub(ch).RecommendAction(request(), timeout=5)
        assert live.server is not None and live.server.metrics_endpoint is not None
        url = f"http://127.0.0.1:{live.server.metrics_endpoint.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"grpc_server_handled", "shopping_agent_decisions", "shopping_agent_model_info"} <= names


def test_no_metrics_collects_nothing() -> None:
    with running_server(metrics=False, metrics_port=0) as live, grpc.insecure_channel(live.target) as ch:
        assert stub(ch).RecommendAction(request(), timeout=5).decision_id
        assert live.server is not None and live.server.metrics is None and live.server.metrics_endpoint is None
        assert list(live.registry.collect()) == []


def _names_manifest(version: str, names: list[str]) -> dict[str, object]:
    return {"model_version": version, "format_version": 1, "created_at": "2026-11-29T12:00:00Z",
            "training_metrics": dict.fromkeys(names, 1.0)}


def test_one_process_exports_each_bundle_s_training_metrics_in_full() -> None:
    """Without --workers a swap drops the old bundle's series, so a new bundle's names are all exported however many
    came before (the limit below is for multiprocess mode only)."""
    metrics = Metrics(CollectorRegistry())
    for i in range(3):
        metrics.model_served(f"v{i}", _names_manifest(f"v{i}", [f"m{i}_{j}" for j in range(512)]), time.time())
    exported = {s.labels["metric"] for f in metrics.registry.collect() for s in f.samples
                if s.name == "shopping_agent_model_training_metric"}
    assert exported == {f"m2_{j}" for j in range(512)}


def test_with_workers_the_training_metric_series_stay_bounded(tmp_path: Path) -> None:
    """Multiprocess mode (``--workers``) cannot remove a series: 40 bundles of 512 new names each, as a review sent,
    leave at most MAX_TRAINING_NAMES series, not 40 x 512. In a child: the mode is chosen when prometheus_client is
    imported."""
    script = f"""
import time
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from server.metrics import Metrics, multiprocess_mode
from tests.server.test_metrics import _names_manifest
assert multiprocess_mode()
metrics = Metrics(CollectorRegistry())
for i in range(40):
    metrics.model_served(f"v{{i}}", _names_manifest(f"v{{i}}", [f"m{{i}}_{{j}}" for j in range(512)]), time.time())
scrape = CollectorRegistry()
MultiProcessCollector(scrape, {str(tmp_path)!r})
print(sum(1 for f in scrape.collect() for s in f.samples if s.name == "shopping_agent_model_training_metric"))
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) == MAX_TRAINING_NAMES
