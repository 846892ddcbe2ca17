"""Decision and outcome logs written by the real server: content, sampling, drops, shutdown."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry

from core.domain import Outcome, OutcomeReport
from experience.recorder import SALT_FILE, ExperienceRecorder, RecorderOptions, resolve_salt, session_sampled
from experience.records import hash_user
from experience.segments import DirectorySource
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.metrics import Metrics
from tests.harness import ROOT, request, running_server, spawn_server, stub


def outcome(**overrides: object) -> pb.ReportOutcomeRequest:
    fields: dict[str, object] = {"decision_id": "d-1", "session_id": "s-1", "outcome_id": "o-1", "outcome": pb.OUTCOME_ORDER,
                                 "value": 42.0, "coupon_discount": 3.5}
    fields.update(overrides)
    return pb.ReportOutcomeRequest(**fields)


def tables(root: Path) -> tuple[pa.Table, pa.Table]:
    source = DirectorySource(root)
    return source.table("decisions"), source.table("outcomes")


def test_every_answer_and_outcome_is_logged_with_what_was_served(tmp_path: Path) -> None:
    responses = {}
    with running_server(log_dir=tmp_path, log_user_salt="pepper") as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        for i in range(12):
            req = request(seed=i, session_id=f"s-{i % 3}", user_id=f"user-{i}", request_id=f"r-{i}",
                          event_time=Timestamp(seconds=1_790_000_000 + i))
            resp = call.RecommendAction(req, timeout=5)
            responses[resp.decision_id] = (req, resp)
            ack = call.ReportOutcome(outcome(decision_id=resp.decision_id, session_id=req.session_id, outcome_id=f"o-{i}",
                                             event_time=Timestamp(seconds=1_790_000_100 + i)), timeout=5)
            assert ack.outcome_id == f"o-{i}" and ack.logged
        registry = live.registry
    decisions, outcomes = tables(tmp_path)  # the server has stopped: its segments are final
    assert decisions.num_rows == 12 and outcomes.num_rows == 12
    for row in decisions.to_pylist():
        req, resp = responses[row["decision_id"]]
        assert row["session_id"] == req.session_id and row["item_id"] == req.item_id and row["request_id"] == req.request_id
        assert row["user_hash"] == hash_user(req.user_id, resolve_salt(tmp_path, "pepper")) != req.user_id
        assert row["event_time_s"] == pytest.approx(req.event_time.seconds)
        np.testing.assert_allclose(row["item_embedding"], np.float16(list(req.item_embedding)), rtol=0, atol=0)
        assert row["recent_behavior_ids"] == list(req.recent_behavior_ids)
        assert (row["page_type"], row["cart_item_count"]) == (req.page_type, req.cart_item_count)
        assert (row["action"], row["source"], row["votes"], row["samples"]) == (resp.action, resp.source, resp.votes, resp.samples)
        assert row["propensity"] == resp.propensity and row["model_version"] == resp.model_version
        assert row["served_probs"] == [s.served_probability for s in resp.action_scores]
        assert row["policy_probs"] == [s.policy_probability for s in resp.action_scores]
        assert row["blocked"] == [s.blocked for s in resp.action_scores]
        assert row["served_probs"][row["action"] - 1] == row["propensity"]
        assert row["sample_rate"] == 1.0 and row["schema_version"] == 1
    by_id = {row["outcome_id"]: row for row in outcomes.to_pylist()}
    assert by_id["o-5"]["outcome"] == Outcome.ORDER and by_id["o-5"]["value"] == 42.0 and by_id["o-5"]["coupon_discount"] == 3.5
    assert by_id["o-5"]["event_time_s"] == 1_790_000_105
    assert {row["decision_id"] for row in by_id.values()} == set(responses)
    assert registry.get_sample_value("shopping_agent_log_records_written_total", {"kind": "decisions"}) == 12
    assert registry.get_sample_value("shopping_agent_log_records_written_total", {"kind": "outcomes"}) == 12
    assert registry.get_sample_value("shopping_agent_outcomes_received_total", {"outcome": "order"}) == 12
    assert registry.get_sample_value("grpc_server_handled_total", {"grpc_type": "unary", "grpc_service": "shopping_agent.v1.ShoppingAgent",
                                                                    "grpc_method": "ReportOutcome", "grpc_code": "OK"}) == 12


BAD_OUTCOMES = [
    pytest.param({"decision_id": ""}, "decision_id: required", id="no-decision-id"),
    pytest.param({"session_id": ""}, "session_id: required", id="no-session"),
    pytest.param({"outcome_id": ""}, "outcome_id: required", id="no-outcome-id"),
    pytest.param({"outcome_id": "x" * 257}, "outcome_id: longer than 256", id="long-outcome-id"),
    pytest.param({"outcome": pb.OUTCOME_UNSPECIFIED}, "outcome: required", id="unspecified-outcome"),
    pytest.param({"outcome": 17}, "outcome: unknown value 17", id="unknown-outcome"),
    pytest.param({"value": float("nan")}, "value: must be a finite amount", id="nan-value"),
    pytest.param({"value": -1.0}, "value: must be a finite amount >= 0", id="negative-value"),
    pytest.param({"coupon_discount": float("inf")}, "coupon_discount: must be a finite amount", id="inf-discount"),
    pytest.param({"event_time": Timestamp(seconds=10**12)}, "event_time: outside the range", id="bad-time"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_OUTCOMES)
def test_bad_outcome_is_invalid_argument_naming_the_field(channel: grpc.Channel, fields: dict[str, object], message: str) -> None:
    call = stub(channel).ReportOutcome
    with pytest.raises(grpc.RpcError) as info:
        call(outcome(**fields), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)
    assert call(outcome(), timeout=5).outcome_id == "o-1"  # still answering


def test_corrupt_outcome_bytes_are_invalid_argument(channel: grpc.Channel) -> None:
    raw = channel.unary_unary("/shopping_agent.v1.ShoppingAgent/ReportOutcome")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x0a\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: not a ReportOutcomeRequest")


def test_unknown_decision_is_accepted_and_logging_off_says_so(channel: grpc.Channel) -> None:
    ack = stub(channel).ReportOutcome(outcome(decision_id="never-seen"), timeout=5)
    assert ack.outcome_id == "o-1" and not ack.logged  # the module's server has no --log-dir


def test_unknown_decision_is_logged(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        assert stub(ch).ReportOutcome(outcome(decision_id="arrives-before-its-decision"), timeout=5).logged
    assert tables(tmp_path)[1].column("decision_id").to_pylist() == ["arrives-before-its-decision"]


def test_sampling_keeps_sessions_whole(tmp_path: Path) -> None:
    sessions = [f"session-{i}" for i in range(40)]
    with running_server(log_dir=tmp_path, log_sample_rate=0.5) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        for s in sessions:
            resp = call.RecommendAction(request(session_id=s), timeout=5)
            call.ReportOutcome(outcome(decision_id=resp.decision_id, session_id=s, outcome_id=f"o-{s}"), timeout=5)
    decisions, outcomes = tables(tmp_path)
    expected = {s for s in sessions if session_sampled(s, 0.5)}
    assert 5 < len(expected) < 35  # the hash really splits them
    assert set(decisions.column("session_id").to_pylist()) == expected == set(outcomes.column("session_id").to_pylist())
    assert set(decisions.column("sample_rate").to_pylist()) == {0.5}


def _report(i: int) -> OutcomeReport:
    return OutcomeReport(f"d{i}", f"s{i}", f"o{i}", Outcome.SHARE, 0.0, 0.0, 1.0e9)


def test_full_queue_drops_are_counted_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(CollectorRegistry())
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(max_queue=2, flush_seconds=60), metrics.experience)
    recorder.start()
    accepted = [recorder.outcome(_report(i)) for i in range(5)]  # the writer sleeps 60 s: nothing drains
    assert accepted == [True, True, False, False, False]
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "queue_full"}) == 3
    recorder.close()  # wakes the writer: what was queued is written
    assert tables(tmp_path)[1].column("outcome_id").to_pylist() == ["o0", "o1"]
    assert value("shopping_agent_log_records_written_total", {"kind": "outcomes"}) == 2
    logged = [r.fields["dropped_total"] for r in caplog.records if r.getMessage().startswith("log records dropped")]  # type: ignore[attr-defined]
    assert logged and logged[-1]["outcomes"] == 3
    assert not recorder.outcome(_report(9))  # after close: refused and counted, not lost silently
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "closed"}) == 1


def test_write_error_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(), metrics.experience)  # not started: flush by hand
    shutil.rmtree(tmp_path / "outcomes")  # the volume lost the directory: the next segment cannot be created
    recorder.outcome(_report(0))
    recorder.flush()
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "write_error"}) == 1
    recorder.outcome(_report(1))
    recorder.flush()  # a fresh writer recreated the directory
    recorder.close()
    assert tables(tmp_path)[1].column("outcome_id").to_pylist() == ["o1"]


def test_salt_file_is_created_once_and_shared(tmp_path: Path) -> None:
    first = resolve_salt(tmp_path, "")
    assert resolve_salt(tmp_path, "") == first and len(first) == 32
    assert (tmp_path / SALT_FILE).stat().st_mode & 0o777 == 0o600
    assert resolve_salt(tmp_path, "configured") != first


def test_sigterm_mid_run_loses_nothing(tmp_path: Path) -> None:
    """Clients keep calling while the server gets SIGTERM: every answered call is on disk."""
    answered: list[str] = []
    outcomes_logged: list[str] = []
    stop = threading.Event()
    with spawn_server("--log-dir", str(tmp_path), "--grace-seconds", "5", "--drain-delay-seconds", "0.3") as server:
        def client(n: int) -> None:
            with grpc.insecure_channel(server.target) as ch:
                call = stub(ch)
                for i in range(10_000):
                    if stop.is_set():
                        return
                    try:
                        resp = call.RecommendAction(request(session_id=f"c{n}-{i}"), timeout=5)
                        answered.append(resp.decision_id)
                        ack = call.ReportOutcome(outcome(decision_id=resp.decision_id, session_id=f"c{n}-{i}",
                                                         outcome_id=f"o-{n}-{i}"), timeout=5)
                        if ack.logged:
                            outcomes_logged.append(ack.outcome_id)
                    except grpc.RpcError:
                        if server.proc.poll() is not None:
                            return
                        time.sleep(0.01)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(answered) < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0
        stop.set()
        for t in threads:
            t.join(20)
    decisions, outcomes = tables(tmp_path)
    assert len(answered) >= 200
    assert set(answered) <= set(decisions.column("decision_id").to_pylist())
    assert set(outcomes_logged) <= set(outcomes.column("outcome_id").to_pylist())
    assert not list(tmp_path.rglob(".open-*"))  # every segment finalised


def test_logs_cat_prints_json_lines(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        resp = stub(ch).RecommendAction(request(), timeout=5)
        stub(ch).ReportOutcome(outcome(decision_id=resp.decision_id), timeout=5)
    cli = [sys.executable, "-m", "server", "logs", "cat", str(tmp_path)]
    run = subprocess.run([*cli, "--fields", "decision_id,action,outcome"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines == [{"kind": "decisions", "decision_id": resp.decision_id, "action": resp.action},
                     {"kind": "outcomes", "decision_id": resp.decision_id, "outcome": pb.OUTCOME_ORDER}]
    full = subprocess.run([*cli, "--kind", "decisions"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    record = json.loads(full.stdout)
    assert len(record["item_embedding"]) == 768 and record["propensity"] == resp.propensity
    bad = subprocess.run([*cli, "--kind", "outcomes", "--fields", "nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "no column 'nope'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "server", "logs", "cat", str(tmp_path / "none")], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 2 and "holds no decisions/" in missing.stderr
