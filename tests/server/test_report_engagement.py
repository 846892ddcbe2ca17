"""ReportEngagement on the real server: validation naming the field, the log records, metrics, nothing personal in clear."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry

from core.domain import EngagementReport
from experience.recorder import ExperienceRecorder, RecorderOptions, resolve_salt
from experience.records import DECISION, ENGAGEMENT, SESSION, hash_id
from experience.segments import DirectorySource
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.metrics import Metrics
from tests.harness import request, running_server, stub

SERVICE = "shopping_agent.v1.ShoppingAgent"


def engagement(**overrides: object) -> pb.ReportEngagementRequest:
    fields: dict[str, object] = {"decision_id": "d-1", "session_id": "s-1", "engagement_id": "e-1", "dwell_seconds": 12.5,
                                 "scroll_depth": 0.75, "bounced": False}
    fields.update(overrides)
    return pb.ReportEngagementRequest(**fields)


def engagements(root: Path) -> list[dict[str, object]]:
    return DirectorySource(root).table("engagements").to_pylist()


def test_reports_are_logged_hashed_with_unmeasured_signals_as_nulls(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path, log_user_salt="pepper") as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        resp = call.RecommendAction(request(session_id="alice-session"), timeout=5)
        full = call.ReportEngagement(engagement(decision_id=resp.decision_id, session_id="alice-session", engagement_id="alice-e1",
                                                event_time=Timestamp(seconds=1_790_000_040, nanos=500_000_000)), timeout=5)
        assert full.engagement_id == "alice-e1" and full.logged
        only_bounce = pb.ReportEngagementRequest(decision_id=resp.decision_id, session_id="alice-session", engagement_id="alice-e2",
                                                 bounced=True)
        assert call.ReportEngagement(only_bounce, timeout=5).logged
        registry = live.registry
    key = resolve_salt(tmp_path, "pepper")
    rows = {row["engagement_id"]: row for row in engagements(tmp_path)}
    first, second = rows[hash_id("alice-e1", key, ENGAGEMENT)], rows[hash_id("alice-e2", key, ENGAGEMENT)]
    assert first["decision_id"] == resp.decision_id  # an issued id: the join key, kept
    assert first["session_id"] == second["session_id"] == hash_id("alice-session", key, SESSION)
    decisions = DirectorySource(tmp_path).table("decisions")
    assert decisions.column("session_id").to_pylist() == [first["session_id"]]  # the session join's key
    assert (first["dwell_s"], first["scroll_depth"], first["bounced"]) == (12.5, 0.75, False)
    assert first["event_time_s"] == 1_790_000_040.5 and first["schema_version"] == 2 and first["sample_rate"] == 1.0
    assert (second["dwell_s"], second["scroll_depth"], second["bounced"]) == (None, None, True)  # not measured: null, not 0
    stored = b"".join(p.read_bytes() for p in (tmp_path / "engagements").iterdir())
    assert first["session_id"].encode() in stored and b"alice" not in stored  # the check can see strings; no raw id
    value = registry.get_sample_value
    assert value("shopping_agent_engagement_reports_received_total", {"kind": "stayed"}) == 1
    assert value("shopping_agent_engagement_reports_received_total", {"kind": "bounced"}) == 1
    assert value("shopping_agent_engagement_reports_received_total", {"kind": "unknown"}) == 0
    assert value("shopping_agent_engagement_dwell_seconds_count") == 1 and value("shopping_agent_engagement_dwell_seconds_sum") == 12.5
    assert value("shopping_agent_engagement_scroll_depth_count") == 1
    assert value("shopping_agent_log_records_written_total", {"kind": "engagements"}) == 2
    assert value("grpc_server_handled_total", {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "ReportEngagement",
                                               "grpc_code": "OK"}) == 2


BAD_ENGAGEMENTS = [
    pytest.param({"decision_id": ""}, "decision_id: required", id="no-decision-id"),
    pytest.param({"session_id": ""}, "session_id: required", id="no-session"),
    pytest.param({"engagement_id": ""}, "engagement_id: required", id="no-engagement-id"),
    pytest.param({"engagement_id": "x" * 257}, "engagement_id: longer than 256", id="long-engagement-id"),
    pytest.param({"dwell_seconds": float("nan")}, "dwell_seconds: must be a finite number of seconds", id="nan-dwell"),
    pytest.param({"dwell_seconds": -0.5}, "dwell_seconds: must be a finite number of seconds in [0, 86400]", id="negative-dwell"),
    pytest.param({"dwell_seconds": 86_400.5}, "dwell_seconds: must be a finite number", id="dwell-past-a-day"),
    pytest.param({"scroll_depth": 1.01}, "scroll_depth: must be a finite fraction in [0, 1]", id="scroll-past-the-end"),
    pytest.param({"scroll_depth": float("-inf")}, "scroll_depth: must be a finite fraction", id="inf-scroll"),
    pytest.param({"event_time": Timestamp(seconds=10**12)}, "event_time: outside the range", id="bad-time"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_ENGAGEMENTS)
def test_bad_engagement_is_invalid_argument_naming_the_field(channel: grpc.Channel, fields: dict[str, object], message: str) -> None:
    call = stub(channel).ReportEngagement
    with pytest.raises(grpc.RpcError) as info:
        call(engagement(**fields), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)
    assert call(engagement(), timeout=5).engagement_id == "e-1"  # still answering


@pytest.mark.parametrize("fields", [{"scroll_depth": 0.0}, {"scroll_depth": 1.0}, {"dwell_seconds": 0.0}, {"dwell_seconds": 86_400.0}],
                         ids=["unscrolled", "scrolled-to-the-end", "no-dwell", "a-whole-day"])
def test_the_ends_of_each_range_are_measurements(channel: grpc.Channel, fields: dict[str, float]) -> None:
    """A page scrolled to its very end or not at all, a dwell of nothing or of the whole day the range allows: accepted."""
    assert stub(channel).ReportEngagement(engagement(**fields, engagement_id="e-edge"), timeout=5).engagement_id == "e-edge"


def test_a_report_without_any_signal_is_refused(channel: grpc.Channel) -> None:
    empty = pb.ReportEngagementRequest(decision_id="d-1", session_id="s-1", engagement_id="e-empty")
    with pytest.raises(grpc.RpcError) as info:
        stub(channel).ReportEngagement(empty, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "dwell_seconds, scroll_depth, bounced: at least one is required"
    # zeros are signals when they are set: an instant bounce with no scroll is a report
    zeros = pb.ReportEngagementRequest(decision_id="d-1", session_id="s-1", engagement_id="e-zero", dwell_seconds=0.0, scroll_depth=0.0)
    assert stub(channel).ReportEngagement(zeros, timeout=5).engagement_id == "e-zero"


@pytest.mark.parametrize("method", ["ReportOutcome", "ReportEngagement"])
def test_corrupt_report_bytes_are_invalid_argument(channel: grpc.Channel, method: str) -> None:
    raw = channel.unary_unary(f"/{SERVICE}/{method}")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x0a\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"request: not a {method}Request")


def test_unknown_decision_is_accepted_and_logging_off_says_so(channel: grpc.Channel) -> None:
    ack = stub(channel).ReportEngagement(engagement(decision_id="never-served"), timeout=5)
    assert ack.engagement_id == "e-1" and not ack.logged  # the module's server has no --log-dir


def test_unknown_decision_is_logged_hashed(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        assert stub(ch).ReportEngagement(engagement(decision_id="typed by the caller"), timeout=5).logged
    key = resolve_salt(tmp_path, "")
    assert [row["decision_id"] for row in engagements(tmp_path)] == [hash_id("typed by the caller", key, DECISION)]


def test_sampling_keeps_a_sessions_engagements_with_its_decisions(tmp_path: Path) -> None:
    sessions = [f"session-{i}" for i in range(40)]
    with running_server(log_dir=tmp_path, log_sample_rate=0.5) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        for s in sessions:
            resp = call.RecommendAction(request(session_id=s), timeout=5)
            call.ReportEngagement(engagement(decision_id=resp.decision_id, session_id=s, engagement_id=f"e-{s}"), timeout=5)
    source = DirectorySource(tmp_path)
    kept = set(source.table("decisions").column("session_id").to_pylist())
    assert 5 < len(kept) < 35
    assert set(source.table("engagements").column("session_id").to_pylist()) == kept


def test_a_full_queue_drops_engagements_counted(tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(max_queue=2, flush_seconds=60), metrics.experience)
    recorder.start()
    reports = [EngagementReport(f"d{i}", f"s{i}", f"e{i}", 3.0, None, None, 1.0e9) for i in range(4)]
    assert [recorder.engagement(r) for r in reports] == [True, True, False, False]
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_records_dropped_total", {"kind": "engagements", "reason": "queue_full"}) == 2
    recorder.close()
    assert [row["engagement_id"] for row in engagements(tmp_path)] == [hash_id(f"e{i}", b"k" * 32, ENGAGEMENT) for i in (0, 1)]
    assert not recorder.engagement(reports[0])
    assert value("shopping_agent_log_records_dropped_total", {"kind": "engagements", "reason": "closed"}) == 1
