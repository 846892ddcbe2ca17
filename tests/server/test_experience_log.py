"""Decision and outcome logs written by the real server: content, hashed ids, sampling, drops, shutdown."""

from __future__ import annotations

import gc
import itertools
import json
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry

from core.domain import Context, Outcome, OutcomeReport, PageType
from experience.recorder import SALT_FILE, ExperienceRecorder, RecorderOptions, resolve_salt, session_sampled
from experience.records import (
    DECISION,
    ENGAGEMENT,
    ITEM,
    OUTCOME,
    RECORD_BYTES,
    REQUEST,
    SESSION,
    LoggedOutcome,
    hash_id,
    hash_user,
    retained_bytes,
)
from experience.segments import DirectorySource, read_segment
from policy.features import FeatureSpec, behavior_buckets
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.metrics import Metrics
from server.product_validation import parse_product
from server.validation import Limits, parse_request
from server.wire_view import view_of
from tests.harness import ROOT, Spawned, request, running_server, spawn_server, stub, until
from tests.server.test_recommend_product import product, sku
from tests.small_disk import SmallDisk
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet


def outcome(**overrides: object) -> pb.ReportOutcomeRequest:
    fields: dict[str, object] = {"decision_id": "d-1", "session_id": "s-1", "outcome_id": "o-1", "outcome": pb.OUTCOME_ORDER,
                                 "value": 42.0, "coupon_discount": 3.5}
    fields.update(overrides)
    return pb.ReportOutcomeRequest(**fields)


def tables(root: Path) -> tuple[pa.Table, pa.Table]:
    source = DirectorySource(root)
    return source.table("decisions"), source.table("outcomes")


def test_every_answer_and_outcome_is_logged_with_what_was_served(tmp_path: Path) -> None:
    key = resolve_salt(tmp_path, "pepper")
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
        assert row["session_id"] == hash_id(req.session_id, key, SESSION) != req.session_id
        assert row["item_id"] == hash_id(req.item_id, key, ITEM) and row["request_id"] == hash_id(req.request_id, key, REQUEST)
        assert row["user_hash"] == hash_user(req.user_id, key) != req.user_id
        assert row["event_time_s"] == pytest.approx(req.event_time.seconds)
        np.testing.assert_allclose(row["item_embedding"], np.float16(list(req.item_embedding)), rtol=0, atol=0)
        assert row["behavior_bucket_indices"] == behavior_buckets(req.recent_behavior_ids, FeatureSpec())
        assert (row["behavior_bucket_count"], row["n_recent_behaviors"]) == (2048, len(req.recent_behavior_ids))
        assert (row["page_type"], row["cart_item_count"]) == (req.page_type, req.cart_item_count)
        assert (row["action"], row["source"], row["votes"], row["samples"]) == (resp.action, resp.source, resp.votes, resp.samples)
        assert row["propensity"] == resp.propensity and row["model_version"] == resp.model_version
        assert row["served_probs"] == [s.served_probability for s in resp.action_scores]
        assert row["policy_probs"] == [s.policy_probability for s in resp.action_scores]
        assert row["blocked"] == [s.blocked for s in resp.action_scores]
        assert row["served_probs"][row["action"] - 1] == row["propensity"]
        assert row["sample_rate"] == 1.0 and row["schema_version"] == 2
    by_id = {row["outcome_id"]: row for row in outcomes.to_pylist()}
    o5 = by_id[hash_id("o-5", key, OUTCOME)]
    assert o5["outcome"] == Outcome.ORDER and o5["value"] == 42.0 and o5["coupon_discount"] == 3.5
    assert o5["event_time_s"] == 1_790_000_105
    assert {row["decision_id"] for row in by_id.values()} == set(responses)  # issued ids are kept: the join key
    session_of = {row["decision_id"]: row["session_id"] for row in decisions.to_pylist()}
    assert all(row["session_id"] == session_of[row["decision_id"]] for row in by_id.values())  # one key for both kinds
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


def test_unknown_decision_is_accepted_and_logging_off_says_so(channel: grpc.Channel) -> None:
    ack = stub(channel).ReportOutcome(outcome(decision_id="never-seen"), timeout=5)
    assert ack.outcome_id == "o-1" and not ack.logged  # the module's server has no --log-dir


def test_unknown_decision_is_logged(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        assert stub(ch).ReportOutcome(outcome(decision_id="arrives-before-its-decision"), timeout=5).logged
        assert stub(ch).ReportOutcome(outcome(decision_id="0" * 32, outcome_id="o-2"), timeout=5).logged
    key = resolve_salt(tmp_path, "")  # the server's, kept next to the logs (no salt configured)
    # Not of the form of an id the server issues: the caller's text, so it is hashed like any other id.
    assert tables(tmp_path)[1].column("decision_id").to_pylist() == [hash_id("arrives-before-its-decision", key, DECISION),
                                                                      "0" * 32]


def test_sampling_keeps_sessions_whole(tmp_path: Path) -> None:
    sessions = [f"session-{i}" for i in range(40)]
    with running_server(log_dir=tmp_path, log_sample_rate=0.5) as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        for s in sessions:
            resp = call.RecommendAction(request(session_id=s), timeout=5)
            call.ReportOutcome(outcome(decision_id=resp.decision_id, session_id=s, outcome_id=f"o-{s}"), timeout=5)
    decisions, outcomes = tables(tmp_path)
    key = resolve_salt(tmp_path, "")
    expected = {hash_id(s, key, SESSION) for s in sessions if session_sampled(s, 0.5, key)}
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
    assert tables(tmp_path)[1].column("outcome_id").to_pylist() == [hash_id(f"o{i}", b"k" * 32, OUTCOME) for i in (0, 1)]
    assert value("shopping_agent_log_records_written_total", {"kind": "outcomes"}) == 2
    logged = [r.fields["dropped_total"] for r in caplog.records if r.getMessage().startswith("log records dropped")]  # type: ignore[attr-defined]
    assert logged and logged[-1]["outcomes"] == 3
    assert not recorder.outcome(_report(9))  # after close: refused and counted, not lost silently
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "closed"}) == 1


def _until_written(recorder: ExperienceRecorder, n: int) -> None:
    """The writer thread has written ``n`` outcomes (within 10 s, far below the tests' 60 s timers)."""
    deadline = time.monotonic() + 10
    while recorder.written["outcomes"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.written["outcomes"] == n


def test_a_queue_at_flush_rows_is_written_without_waiting_for_the_timer(tmp_path: Path) -> None:
    """What a busy server holds between flushes is bounded by rows, not by its throughput times flush_seconds."""
    metrics = Metrics(CollectorRegistry())
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(flush_seconds=60, flush_rows=4), metrics.experience)
    recorder.start()
    try:
        for i in range(3):
            recorder.outcome(_report(i))
        time.sleep(0.3)
        assert recorder.written["outcomes"] == 0  # below flush_rows: the 60 s timer
        recorder.outcome(_report(3))
        _until_written(recorder, 4)
        assert recorder.depth("outcomes") == 0
    finally:
        recorder.close()
    with pytest.raises(ValueError, match="flush_rows must be >= 1"):
        RecorderOptions(flush_rows=0)


def test_a_quarter_of_the_byte_bound_is_written_without_waiting_for_the_timer(tmp_path: Path) -> None:
    """Large records (256-SKU product decisions, about 0.86 MB each) filled the byte bound long before flush_rows, so
    honest ones were dropped while the writer slept out its timer (an attack review, 2026-12-06)."""
    options = RecorderOptions(flush_seconds=60, flush_rows=1000, max_queue_bytes=8 * retained_bytes(LoggedOutcome(_report(0), 0.0)))
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, options, Metrics(CollectorRegistry()).experience)
    recorder.start()
    try:
        recorder.outcome(_report(0))
        time.sleep(0.3)
        assert recorder.written["outcomes"] == 0  # below a quarter (2 records' bytes): the 60 s timer
        recorder.outcome(_report(1))
        _until_written(recorder, 2)
        assert recorder.queued_bytes("outcomes") == 0
    finally:
        recorder.close()


def test_the_byte_bound_counts_queued_records_then_the_encoded_ones_a_failed_write_holds(tmp_path: Path) -> None:
    """``max_queue_bytes`` against what records keep alive while queued (``retained_bytes``: ``RECORD_BYTES`` and the
    ids an outcome) and, after a failed write, against the encoded batch the writer holds; all of it is given back once
    written."""
    metrics = Metrics(CollectorRegistry())
    size = retained_bytes(LoggedOutcome(_report(0), 0.0))  # ids of one digit
    assert size > RECORD_BYTES
    options = RecorderOptions(max_queue_bytes=3 * size, retry_min_seconds=0.01, retry_max_seconds=0.01)
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, options, metrics.experience)  # not started: flush by hand
    assert [recorder.outcome(_report(i)) for i in range(4)] == [True, True, True, False]
    assert recorder.queued_bytes("outcomes") == 3 * size
    shutil.rmtree(tmp_path / "outcomes")
    (tmp_path / "outcomes").write_bytes(b"")  # no segment can be created: the writer holds the encoded batch
    recorder.flush()
    held = recorder.queued_bytes("outcomes")
    assert recorder.depth("outcomes") == 0 and 0 < held < 3 * size  # encoded and compressed: smaller
    accepted = 0
    while recorder.outcome(_report(10 + accepted)):  # the held bytes count: fewer than three fit beside them
        accepted += 1
    later = retained_bytes(LoggedOutcome(_report(10), 0.0))  # (the ids of two digits)
    assert accepted == max(1, (3 * size - held) // later)  # (an empty queue takes one whatever the bytes)
    (tmp_path / "outcomes").unlink()
    time.sleep(0.02)  # the back-off
    recorder.flush()
    assert recorder.queued_bytes("outcomes") == 0
    recorder.close()
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_records_written_total", {"kind": "outcomes"}) == 3 + accepted
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "queue_full"}) == 2


@pytest.mark.parametrize("ids", ["short", "longest"])
@pytest.mark.parametrize("kind", ["decisions", "products"])
def test_the_byte_bound_holds_what_queued_records_keep_alive_whatever_their_ids(tmp_path: Path, kind: str, ids: str) -> None:
    """A stalled log volume lets records queue up to ``max_queue_bytes``. The bound counted a fixed 1 KB a record
    besides the embeddings, while the ids a caller may send (4 of 256 characters and 32 behaviour ids, each character a
    4-byte code point: a 40 KB message) keep 44 KB alive: one client took a pod with a full volume to 870 MB, past its
    512 Mi limit (an attack review, 2026-12-06). Requests parsed as the server parses them, answered by the embedded
    default: what the queued records keep alive (tracemalloc, freed when the queue is emptied) stays within the bound
    (5 % for the estimate's error: it is within -1 % and +20 % of what was measured)."""
    emoji, serial = "\U0001F600", itertools.count(0x10000)

    def named(name: str) -> str:  # each id its own (the product ids must be unique)
        return name if ids == "short" else emoji * 255 + chr(next(serial))

    shopper = request() if ids == "short" else request(
        user_id=named("u"), session_id=named("s"), item_id=named("i"), request_id=named("r"),
        recent_behavior_ids=[named(f"b{i}") for i in range(32)])
    limits = Limits(item_dim=768, max_recent_behavior_ids=32, max_id_length=256)
    model, bound = ModelSet.load(default_bundle(), LoadOptions(warmup_batch=1)), 2**20
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(max_queue_bytes=bound))  # not started: nothing drains
    if kind == "decisions":
        data, view = shopper.SerializeToString(), view_of(pb.RecommendActionRequest)
        context = Context(PageType.SEARCH, 1, 12, 2)

        def queue() -> bool:
            parsed = parse_request(pb.RecommendActionRequest.FromString(data), limits, 1.0e9, view=view.FromString(data))
            decision_id = secrets.token_hex(16)
            return recorder.decision(parsed, 12, model.run([parsed], [context], [decision_id])[0], decision_id, FeatureSpec())
    else:
        shelf = [pb.ProductCategory(category_id=named(f"c{c}"), skus=[sku(named(f"c{c}-{k}"), 10.0 + k, seed=4 * c + k)
                                                                   for k in range(4)]) for c in range(3)]
        bands = [pb.PriceBand(band_id=named(f"p{b}"), price_multiplier=1.0 + b / 10) for b in range(3)]
        data = product(shopper=shopper, categories=shelf, price_bands=bands).SerializeToString()
        view = view_of(pb.RecommendProductRequest)

        def queue() -> bool:
            parsed = parse_product(pb.RecommendProductRequest.FromString(data), limits, 1.0e9, view=view.FromString(data))
            decision_id = secrets.token_hex(16)
            return recorder.product(parsed, 12, model.decide_product(parsed, 12, decision_id), decision_id, FeatureSpec())
    tracemalloc.start()
    try:
        accepted = 0
        while accepted < 2000 and queue():
            accepted += 1
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        recorder._queues[kind].clear()  # what emptying the queue frees is what its records kept alive
        gc.collect()
        kept = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        recorder.close()
    assert 5 <= accepted < 2000  # the bound, not the count, stopped it
    assert 0.7 * bound < kept <= 1.05 * bound, (accepted, kept)


def test_a_write_error_holds_the_records_and_the_writer_goes_on(tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    options = RecorderOptions(retry_min_seconds=0.01, retry_max_seconds=0.01)
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, options, metrics.experience)  # not started: flush by hand
    shutil.rmtree(tmp_path / "outcomes")
    (tmp_path / "outcomes").write_bytes(b"")  # a file where the directory was: no segment can be created (any user)
    recorder.outcome(_report(0))
    recorder.flush()
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_write_errors_total", {"kind": "outcomes"}) == 1
    assert value("shopping_agent_log_writer_degraded", {"kind": "outcomes"}) == 1
    assert value("shopping_agent_log_writer_degraded", {"kind": "decisions"}) == 0
    assert recorder.degraded("outcomes")
    (tmp_path / "outcomes").unlink()
    recorder.outcome(_report(1))
    time.sleep(0.02)  # the back-off
    recorder.flush()  # the held record first, then the new one
    assert not recorder.degraded("outcomes") and value("shopping_agent_log_writer_degraded", {"kind": "outcomes"}) == 0
    recorder.close()
    assert tables(tmp_path)[1].column("outcome_id").to_pylist() == [hash_id(f"o{i}", b"k" * 32, OUTCOME) for i in (0, 1)]
    assert value("shopping_agent_log_records_written_total", {"kind": "outcomes"}) == 2
    assert value("shopping_agent_log_records_dropped_total", {"kind": "outcomes", "reason": "write_error"}) == 0


def log_rules_decision(recorder: ExperienceRecorder, i: int, cart: int = 1) -> None:
    """Decision ``d{i}`` of session ``s{i}``, the rule engine's (no model), with ``cart`` items in the cart."""
    from core.domain import Context, DecisionRequest, PageType, Source
    from weights.embedded import default_bundle
    from weights.model_set import NoModel

    req = DecisionRequest("u", f"s{i}", "i", np.zeros(768, dtype=np.float32), (), PageType.DETAIL, 1.0e9, cart)
    served = NoModel(default_bundle().manifest).fallback(Context(PageType.DETAIL, 1, 12, 0), Source.FALLBACK_NO_MODEL)
    assert recorder.decision(req, 12, served, f"d{i}", FeatureSpec())


def test_a_record_that_cannot_be_encoded_loses_only_itself(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One record the log's columns cannot hold (here a cart count past int32, which the server's checks now refuse)
    must not take the rest of its flush with it."""
    metrics = Metrics(CollectorRegistry())
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(), metrics.experience)  # not started: flush by hand
    for i, cart in enumerate((1, 2**31, 3)):
        log_rules_decision(recorder, i, cart)
    recorder.flush()
    recorder.close()
    decisions = tables(tmp_path)[0]
    assert decisions.column("cart_item_count").to_pylist() == [1, 3]
    assert decisions.column("decision_id").to_pylist() == ["d0", "d2"]
    value = metrics.registry.get_sample_value
    assert value("shopping_agent_log_records_dropped_total", {"kind": "decisions", "reason": "write_error"}) == 1
    assert value("shopping_agent_log_records_written_total", {"kind": "decisions"}) == 2
    lost = [r.fields for r in caplog.records if r.getMessage().startswith("could not encode")]  # type: ignore[attr-defined]
    assert lost == [{"kind": "decisions", "records": 1, "of": 3}]


def test_a_flush_that_raises_leaves_the_writer_thread_running(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in one flush (here the segment writer raising what no disk raises, once) is logged; the writer thread goes
    on, and the records after it are written, where the thread died and every later record was dropped at the queue."""
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions(flush_seconds=0.05))
    writer = recorder._writers["decisions"]
    real_write, calls = writer.write, []

    def write_once_broken(batch: pa.RecordBatch) -> int:  # the one simulated part: a bug inside a flush
        calls.append(batch.num_rows)
        if len(calls) == 1:
            raise RuntimeError("simulated bug in a flush")
        return real_write(batch)

    writer.write = write_once_broken  # type: ignore[method-assign]
    recorder.start()

    log_rules_decision(recorder, 0)
    until(lambda: len(calls) == 1, "the broken flush")
    log_rules_decision(recorder, 1)
    until(lambda: recorder.written["decisions"] >= 1, "the next record written")
    assert recorder._thread.is_alive()
    recorder.close()
    assert tables(tmp_path)[0].column("decision_id").to_pylist() == ["d1"]
    assert recorder.dropped["decisions"] == 1  # the record the broken flush took is counted lost, not lost silently
    assert any(r.getMessage() == "the log writer could not flush; it goes on" for r in caplog.records)


def test_salt_file_is_created_once_and_shared(tmp_path: Path) -> None:
    first = resolve_salt(tmp_path, "")
    assert resolve_salt(tmp_path, "") == first and len(first) == 32
    assert (tmp_path / SALT_FILE).stat().st_mode & 0o777 == 0o600
    assert resolve_salt(tmp_path, "configured") != first


def test_sigterm_mid_run_loses_nothing(tmp_path: Path) -> None:
    """Clients keep calling while the server gets SIGTERM: every answered call is on disk, engagement reports too."""
    answered: list[str] = []
    outcomes_logged: list[str] = []
    engagements_logged: list[str] = []
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
                        seen = call.ReportEngagement(pb.ReportEngagementRequest(
                            decision_id=resp.decision_id, session_id=f"c{n}-{i}", engagement_id=f"e-{n}-{i}", dwell_seconds=float(i),
                            bounced=i % 2 == 0), timeout=5)
                        if seen.logged:
                            engagements_logged.append(seen.engagement_id)
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
    key = resolve_salt(tmp_path, "")
    assert len(answered) >= 200
    assert set(answered) <= set(decisions.column("decision_id").to_pylist())
    assert {hash_id(o, key, OUTCOME) for o in outcomes_logged} <= set(outcomes.column("outcome_id").to_pylist())
    assert len(engagements_logged) >= 150
    on_disk = set(DirectorySource(tmp_path).table("engagements").column("engagement_id").to_pylist())
    assert {hash_id(e, key, ENGAGEMENT) for e in engagements_logged} <= on_disk
    assert not list(tmp_path.rglob(".open-*"))  # every segment finalised


def test_logs_cat_prints_json_lines(tmp_path: Path) -> None:
    with running_server(log_dir=tmp_path) as live, grpc.insecure_channel(live.target) as ch:
        resp = stub(ch).RecommendAction(request(), timeout=5)
        stub(ch).ReportOutcome(outcome(decision_id=resp.decision_id), timeout=5)
        stub(ch).ReportEngagement(pb.ReportEngagementRequest(decision_id=resp.decision_id, session_id="s-1", engagement_id="e-1",
                                                             scroll_depth=0.5), timeout=5)
    cli = [sys.executable, "-m", "server", "logs", "cat", str(tmp_path)]
    run = subprocess.run([*cli, "--fields", "decision_id,action,outcome,scroll_depth,bounced"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines == [{"kind": "decisions", "decision_id": resp.decision_id, "action": resp.action},
                     {"kind": "outcomes", "decision_id": resp.decision_id, "outcome": pb.OUTCOME_ORDER},
                     {"kind": "engagements", "decision_id": resp.decision_id, "scroll_depth": 0.5, "bounced": None}]
    full = subprocess.run([*cli, "--kind", "decisions"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    record = json.loads(full.stdout)
    assert len(record["item_embedding"]) == 768 and record["propensity"] == resp.propensity
    bad = subprocess.run([*cli, "--kind", "outcomes", "--fields", "nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "no column 'nope'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "server", "logs", "cat", str(tmp_path / "none")], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 2 and "holds none of the directories decisions/, outcomes/" in missing.stderr
    by_uri = subprocess.run([sys.executable, "-m", "server", "logs", "cat", tmp_path.as_uri(), "--kind", "decisions"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert by_uri.returncode == 0 and by_uri.stdout == full.stdout  # the same records, read through pyarrow.fs
    unknown = subprocess.run([sys.executable, "-m", "server", "logs", "cat", "nosuch://KEY:SECRET@bucket/logs"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert unknown.returncode == 2 and "nosuch://bucket/logs: not a log location" in unknown.stderr
    assert "SECRET" not in unknown.stderr


SECRETS = {  # what a shopper typed or is known by: none of it may reach the logs volume
    "session_id": "sess-alice-7f3c",
    "user_id": "alice@example.com",
    "item_id": "sku-RED-SHOES-42",
    "request_id": "req-checkout-991",
}
BEHAVIOUR = ["search:red running shoes size 42", "view:sku-RED-SHOES-42", "search:pregnancy test", "cart:sku-9"]


def _plain_bytes(root: Path) -> bytes:
    """Every file under ``root`` as stored, and every segment's batches again without compression."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        out.append(path.read_bytes())
        for batch in read_segment(path) if path.suffix == ".arrows" else ():
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:  # uncompressed: strings as they are
                writer.write_batch(batch)
            out.append(sink.getvalue().to_pybytes())
    return b"\n".join(out)


def test_no_raw_id_or_search_text_reaches_the_disk(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with running_server(log_dir=logs, log_user_salt="pepper") as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch)
        resp = call.RecommendAction(request(recent_behavior_ids=BEHAVIOUR, **SECRETS), timeout=5)
        for i, decision_id in enumerate((resp.decision_id, "client-typed decision id")):
            assert call.ReportOutcome(outcome(decision_id=decision_id, session_id=SECRETS["session_id"],
                                              outcome_id=f"order-alice-000{i}"), timeout=5).logged
    decisions, outcomes = tables(logs)
    assert decisions.num_rows == 1 and outcomes.num_rows == 2
    stored = _plain_bytes(logs)
    cat = subprocess.run([sys.executable, "-m", "server", "logs", "cat", str(logs)], capture_output=True, cwd=ROOT, timeout=60)
    assert cat.returncode == 0
    assert resp.decision_id.encode() in stored and resp.decision_id.encode() in cat.stdout  # the check can see strings
    for text in [*SECRETS.values(), *BEHAVIOUR, "order-alice-0000", "order-alice-0001", "client-typed decision id",
                 "red running shoes", "pregnancy", "alice"]:
        assert text.encode() not in stored, text
        assert text.encode() not in cat.stdout, text
    assert not (logs / SALT_FILE).exists()  # a configured salt is never written down
    key = resolve_salt(logs, "pepper")
    row = decisions.to_pylist()[0]
    assert row["behavior_bucket_indices"] == behavior_buckets(BEHAVIOUR, FeatureSpec()) and row["n_recent_behaviors"] == 4
    assert outcomes.column("session_id").to_pylist() == [hash_id(SECRETS["session_id"], key, SESSION)] * 2 == [row["session_id"]] * 2


def test_sampling_is_keyed_with_the_salt() -> None:
    sessions = [f"session-{i}" for i in range(2000)]
    kept = {salt: {s for s in sessions if session_sampled(s, 0.3, salt)} for salt in (b"a" * 32, b"b" * 32)}
    assert kept[b"a" * 32] == {s for s in sessions if session_sampled(s, 0.3, b"a" * 32)}  # the same salt: the same sessions
    assert 500 < len(kept[b"a" * 32]) < 700 and 500 < len(kept[b"b" * 32]) < 700
    overlap = len(kept[b"a" * 32] & kept[b"b" * 32])
    assert 100 < overlap < 260  # another salt: another, independent sample (0.3 * 0.3 * 2000 = 180 expected)
    unkeyed = {s for s in sessions if session_sampled(s, 0.3, b"")}
    assert unkeyed != kept[b"a" * 32]  # a client who can compute the hash without the salt cannot pick its side


def test_recorders_with_one_salt_keep_the_same_sessions(tmp_path: Path) -> None:
    """Two processes (here: two recorders) on one salt log the same sessions whole; another salt logs others."""
    reports = [OutcomeReport(f"d{i}", f"s{i}", f"o{i}", Outcome.SHARE, 0.0, 0.0, 1.0e9) for i in range(200)]
    logged = {}
    for name, salt in (("a", b"x" * 32), ("b", b"x" * 32), ("c", b"y" * 32)):
        recorder = ExperienceRecorder(tmp_path / name, salt, RecorderOptions(sample_rate=0.5))
        logged[name] = {r.session_id for r in reports if recorder.outcome(r)}
        recorder.close()
        assert len(tables(tmp_path / name)[1]) == len(logged[name])
    assert logged["a"] == logged["b"] != logged["c"]
    assert 60 < len(logged["a"]) < 140


def _log_metrics(server: Spawned) -> dict[str, float]:
    port = next(json.loads(line)["port"] for line in server.lines if '"msg": "metrics endpoint"' in line)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("shopping_agent_log_")}


def test_a_full_log_volume_degrades_the_logs_not_the_service(small_disk: SmallDisk) -> None:
    """The server on a 1 MiB tmpfs that fills up: it keeps answering, writes one segment file per kind, logs one line
    per change, and once there is room again every answered decision and acknowledged outcome is on disk."""
    logs, env = small_disk.path / "logs", {"SHOPPING_AGENT_LOG_USER_SALT": "pepper"}
    answered, acknowledged, most_open = 0, 0, 0
    with spawn_server("--log-dir", str(logs), "--log-segment-seconds", "1", env=env) as server, \
            grpc.insecure_channel(server.target) as ch:
        call = stub(ch)

        def one(i: int) -> None:
            nonlocal answered, acknowledged
            resp = call.RecommendAction(request(session_id=f"s{i % 20}", seed=i % 5), timeout=5)
            answered += 1
            ack = call.ReportOutcome(outcome(decision_id=resp.decision_id, session_id=f"s{i % 20}", outcome_id=f"o{i}"), timeout=5)
            acknowledged += ack.logged

        for i in range(30):
            one(i)
        small_disk.fill()
        seen, started, i = len(server.lines), time.monotonic(), 30
        while time.monotonic() - started < 2.5:
            one(i)
            i += 1
            most_open = max(most_open, len(list(logs.rglob(".open-*"))))
        during = [json.loads(line)["msg"] for line in server.lines[seen:] if line.startswith("{")]
        full = _log_metrics(server)
        small_disk.free()
        deadline = time.monotonic() + 10
        while any(v for k, v in _log_metrics(server).items() if k.startswith("shopping_agent_log_writer_degraded")):
            assert time.monotonic() < deadline, "the writer did not recover"
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
    assert full['shopping_agent_log_writer_degraded{kind="decisions"}'] == 1
    assert 1 <= full['shopping_agent_log_write_errors_total{kind="decisions"}'] <= 4  # 0.5 s doubling: not one per flush
    assert most_open <= 2  # one open segment per kind, however many writes failed
    assert during.count("cannot write log segments; records are kept and retried with back-off (new ones queue, and are "
                        "dropped and counted once the queue is full)") == 2 and len(during) == 2  # one per kind, no traceback
    assert not any("Traceback" in line for line in server.lines)
    decisions, outcomes = tables(logs)
    assert decisions.num_rows == answered > 30 and outcomes.num_rows == acknowledged == answered
    assert not list(logs.rglob(".open-*"))
    with spawn_server("--log-dir", str(logs), env=env) as again:  # a clean restart: nothing to recover
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(30) == 0
    assert not any("recovered a log segment" in line for line in again.lines)
