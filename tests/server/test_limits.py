"""Flood resistance of the gRPC port: stream and call limits, keepalive enforcement, idle and handshake timeouts.

The attacker is tests/raw_h2.py: it opens calls with HEADERS and never sends the request
message (grpc's own clients would queue calls past the server's stream limit and always send
their request), and pings as often as it likes.
"""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.config import Config
from server.transport import concurrency_share, server_options
from tests.harness import ServerThread, make_config, request, running_server, spawn_server, stub
from tests.raw_h2 import ENHANCE_YOUR_CALM, PING, REFUSED_STREAM, SETTINGS_MAX_CONCURRENT_STREAMS, RawH2, hung_calls

METHOD = "/shopping_agent.v1.ShoppingAgent/RecommendAction"
UNARY = {"grpc_type": "unary", "grpc_service": "shopping_agent.v1.ShoppingAgent", "grpc_method": "RecommendAction"}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def port_of(live: ServerThread) -> int:
    assert live.server is not None and live.server.port is not None
    return live.server.port


def wait_serving(target: str, timeout: float = 30) -> None:
    """Until the model is loaded (before that, calls get the rule engine's answer and the RSS is not yet the model's)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        while health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the model never loaded"
            time.sleep(0.05)


def timed_call(target: str) -> float:
    """A normal RecommendAction on a connection of its own; its latency in seconds."""
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        started = time.perf_counter()
        assert stub(ch).RecommendAction(request(), timeout=5).decision_id
        return time.perf_counter() - started


def test_defaults_leave_room_above_the_batcher_queue() -> None:
    """The batcher answers past max_queue with the rule engine at once; the RPC limit sits well above it."""
    config = Config()
    assert config.max_concurrent_rpcs is not None and config.max_concurrent_rpcs >= 2 * config.max_queue
    # Each of the port's servers enforces its share (server/transport.py): one connection's streams must not fill it,
    # or a client holding calls open would refuse every new connection the kernel hands that server.
    shares = [concurrency_share(config.max_concurrent_rpcs, config.grpc_servers, i) for i in range(config.grpc_servers)]
    assert min(s for s in shares if s is not None) >= 2 * config.max_concurrent_streams
    options = dict(server_options(config))
    assert options["grpc.max_concurrent_streams"] == config.max_concurrent_streams == 256
    assert options["grpc.http2.max_ping_strikes"] == 2 and options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000  # the key grpc-core reads
    assert "grpc.max_connection_age_ms" not in options
    assert dict(server_options(make_config(max_connection_age_seconds=60)))["grpc.max_connection_age_ms"] == 60_000


def test_values_grpc_cannot_take_are_named_at_start() -> None:
    """gRPC's channel arguments are C ints: 30 days of connection age (in ms), 2 GiB messages, 10^11 streams stopped
    ``serve`` with an ``OverflowError`` traceback; ``--max-batch 99999999999`` started and served no model (its warm-up
    ran out of memory). A review, 2026-12-07. The largest values that fit start a real server."""
    for overrides, message in (
            ({"max_connection_age_seconds": 2_592_000.0}, "max_connection_age_seconds: expected at most 2147483 seconds"),
            ({"max_connection_idle_seconds": float("inf")}, "max_connection_idle_seconds: expected at most 2147483 seconds"),
            ({"keepalive_seconds": 1e300}, "keepalive_seconds: expected at most 2147483 seconds"),
            ({"max_message_bytes": 2**31}, "max_message_bytes: expected at most 2147483647 (gRPC takes a 32-bit integer)"),
            ({"max_concurrent_streams": 10**11}, "max_concurrent_streams: expected at most 2147483647"),
            ({"max_connections": 10**11}, "max_connections: expected at most 2147483647"),
            ({"keepalive_max_ping_strikes": 10**11}, "keepalive_max_ping_strikes: expected at most 2147483647"),
            ({"max_batch": 10**11}, "max_batch: expected at most 4096"),
            ({"workers": 257}, "workers: expected at most 256"),
            ({"validate_memory_mb": 2**20 + 1}, "validate_memory_mb: expected 0 (off) or 256 to 1048576"),
            # a NaN flush period spun a core, 1e10 killed the log writer at start (SERVING, nothing logged), an infinite
            # debounce logged a traceback a second, an infinite drain delay never let SIGTERM finish (a review)
            ({"log_flush_seconds": float("nan")}, "log_flush_seconds: expected a number, got nan"),
            ({"grace_seconds": float("nan")}, "grace_seconds: expected a number, got nan"),
            ({"log_flush_seconds": 1e10}, "log_flush_seconds: expected at most 3600"),
            ({"weights_debounce_ms": float("inf")}, "weights_debounce_ms: expected at most 60000"),
            ({"drain_delay_seconds": float("inf")}, "drain_delay_seconds: expected at most 3600"),
            ({"log_segment_mb": float("inf")}, "log_segment_mb: expected at most 1e.06, got inf")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_config(**overrides)
    edge = make_config(max_connection_age_seconds=2_147_483.0, max_connection_idle_seconds=2_147_483.0, max_message_bytes=2**31 - 1,
                       keepalive_max_ping_strikes=2**31 - 1)
    assert dict(server_options(edge))["grpc.max_connection_age_ms"] == 2_147_483_000
    with running_server(max_connection_age_seconds=2_147_483.0, max_message_bytes=2**31 - 1) as live, \
            grpc.insecure_channel(live.target) as channel:
        assert stub(channel).RecommendAction(request(), timeout=10).model_version


def test_5000_calls_that_never_send_a_message_on_one_connection() -> None:
    """The real CLI with its defaults: the connection gets 256 streams at once and the streams past them are refused;
    what was admitted is ended by the server's call bounds (past the address's 64 waiting calls at once, those 64 after
    the receive timeout), which frees streams for more of them; the server keeps answering normal calls, its memory and
    threads stay where they were."""
    with spawn_server() as spawned:
        pid = spawned.proc.pid
        wait_serving(spawned.target)
        for _ in range(20):  # warm: the first batches run, the allocator's arenas in use
            timed_call(spawned.target)
        before_rss, before_threads = rss_mb(pid), threads(pid)
        with RawH2("127.0.0.1", spawned.port) as raw:
            assert raw.seen.server_settings[SETTINGS_MAX_CONCURRENT_STREAMS] == 256
            raw.open_calls(METHOD, 5000)
            assert raw.wait_for(lambda seen: seen.rst_codes[REFUSED_STREAM] + len(seen.ended_streams) == 5000, timeout=20), \
                raw.seen
            latency = timed_call(spawned.target)
            after_rss, after_threads = rss_mb(pid), threads(pid)
            assert not raw.seen.closed and len(raw.seen.ended_streams) >= 256  # each admitted call ended by the server
        print(f"\n5000 hung calls on one connection: RSS {before_rss:.1f} -> {after_rss:.1f} MB, threads {before_threads} -> "
              f"{after_threads}, a normal call meanwhile {latency * 1000:.1f} ms")
        assert latency < 1.0
        assert after_rss - before_rss < 24, (before_rss, after_rss)  # unbounded: +55 MB (2193 of them held)
        assert after_threads <= before_threads + 2


def test_calls_past_max_concurrent_rpcs_get_resource_exhausted_and_the_slots_come_back() -> None:
    """Two connections of 50 hung calls against a limit of 64: grpc answers the 36 past it at once, before any
    handler runs (so grpc_server_* does not see them); a normal call gets RESOURCE_EXHAUSTED until the hung
    calls go away, then OK."""
    with running_server(max_concurrent_rpcs=64, grpc_servers=1) as live:  # one server: the whole limit (shares: test_grpc_servers)
        with hung_calls(port_of(live), METHOD, 50, at_least=36) as (first, second):
            assert len(first.seen.ended_streams) + len(second.seen.ended_streams) == 36
            with grpc.insecure_channel(live.target) as ch, pytest.raises(grpc.RpcError) as info:
                stub(ch).RecommendAction(request(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert live.registry.get_sample_value("grpc_server_started_total", UNARY) in (None, 0.0)
        deadline = time.monotonic() + 10
        while True:  # the reset streams end their calls, and the limiter counts them down
            try:
                timed_call(live.target)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        assert live.registry.get_sample_value("grpc_server_started_total", UNARY) == 1


def test_a_client_that_pings_too_often_is_sent_away() -> None:
    with running_server() as live, RawH2("127.0.0.1", port_of(live)) as raw:
        raw.ping(5)  # five pings at once: the minimum interval is 10 s, two strikes are allowed
        assert raw.wait_for(lambda seen: seen.goaway, timeout=5), raw.seen
        assert raw.seen.goaway == [ENHANCE_YOUR_CALM]


def test_pings_at_the_allowed_interval_are_answered_even_without_calls() -> None:
    with running_server(keepalive_min_client_ping_seconds=0.1) as live, RawH2("127.0.0.1", port_of(live)) as raw:
        for _ in range(5):
            raw.ping()
            time.sleep(0.25)
        assert raw.wait_for(lambda seen: seen.frames[PING] >= 5, timeout=2), raw.seen  # the server's ACKs
        assert raw.seen.goaway == [] and not raw.seen.closed


def test_keepalive_pings_connections_whose_calls_send_nothing_and_drops_dead_peers() -> None:
    """A connection whose only call never sends a message is still pinged; a peer that stops answering is cut
    off, and its call with it (it would otherwise hold a slot of --max-concurrent-rpcs for good)."""
    with running_server(keepalive_seconds=0.2, keepalive_timeout_seconds=0.5) as live:
        with RawH2("127.0.0.1", port_of(live)) as alive, RawH2("127.0.0.1", port_of(live), answer_pings=False) as dead:
            alive.open_calls(METHOD, 1)
            dead.open_calls(METHOD, 1)
            assert dead.wait_for(lambda seen: seen.closed, timeout=5), dead.seen
            assert alive.seen.server_pings >= 2 and not alive.seen.closed


def test_idle_connections_are_closed() -> None:
    with running_server(max_connection_idle_seconds=0.3) as live, RawH2("127.0.0.1", port_of(live)) as raw:
        assert raw.wait_for(lambda seen: seen.goaway, timeout=5), raw.seen  # grpc's "connection idle"
        assert raw.wait_for(lambda seen: seen.closed, timeout=5), raw.seen  # a grpc client reconnects on its next call


def test_a_connection_that_never_says_hello_is_closed() -> None:
    with running_server(handshake_timeout_seconds=0.5) as live:
        with socket.create_connection(("127.0.0.1", port_of(live)), timeout=5) as sock:
            started = time.monotonic()
            while sock.recv(1024):  # the server's SETTINGS, then the close (a recv would time out otherwise)
                assert time.monotonic() - started < 3
            assert time.monotonic() - started < 3
