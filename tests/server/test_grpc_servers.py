"""--grpc-servers: several grpc.aio servers on one port, each admitting its own connections' calls (server/transport.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc._cython import cygrpc  # channelz: the calls each grpc-core server started (no other public view of it)

from server.config import Config
from server.transport import concurrency_share, server_options
from tests.harness import ROOT, make_config, request, running_server, stub
from tests.raw_h2 import hung_calls

METHOD = "/shopping_agent.v1.ShoppingAgent/RecommendAction"


def calls_started_per_server() -> dict[str, int]:
    servers = json.loads(cygrpc.channelz_get_servers(0)).get("server", [])
    return {s["ref"]["serverId"]: int(s.get("data", {}).get("callsStarted", 0)) for s in servers}


@pytest.mark.parametrize(("limit", "servers", "shares"), [
    (2048, 8, [256] * 8), (64, 1, [64]), (10, 4, [3, 3, 2, 2]), (None, 3, [None] * 3)])
def test_the_call_limit_is_shared_out_and_adds_up(limit: int | None, servers: int, shares: list[int | None]) -> None:
    assert [concurrency_share(limit, servers, i) for i in range(servers)] == shares


def test_the_servers_of_one_port_share_it_and_the_health_port_does_not() -> None:
    assert make_config().grpc_servers == 8
    assert dict(server_options(make_config(grpc_servers=1)))["grpc.so_reuseport"] == 0
    assert dict(server_options(make_config(grpc_servers=4), reuse_port=True))["grpc.so_reuseport"] == 1
    assert dict(server_options(make_config(grpc_servers=4)))["grpc.so_reuseport"] == 0  # the health port's: --reuse-port's
    for bad, says in ((dict(grpc_servers=0), "grpc_servers: expected 1..64, got 0"),
                      (dict(grpc_servers=65), "grpc_servers: expected 1..64, got 65"),
                      (dict(grpc_servers=4, max_concurrent_rpcs=3), "max_concurrent_rpcs: 3 cannot be shared out between 4")):
        with pytest.raises(ValueError, match=says):
            Config(**bad)


def test_connections_spread_over_the_servers_and_every_call_is_answered() -> None:
    with running_server(grpc_servers=4) as live:
        assert live.server is not None
        target = f"127.0.0.1:{live.server.port}"
        before = calls_started_per_server()
        for i in range(16):  # each channel its own connection
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                assert stub(ch).RecommendAction(request(session_id=f"s-{i}"), timeout=10).decision_id
        after = calls_started_per_server()
        grew = [sid for sid, n in after.items() if n > before.get(sid, 0)]
        assert 2 <= len(grew) <= 4, (before, after)  # 16 connections on one of 4 servers: 4^-15
        assert sum(after[s] - before.get(s, 0) for s in grew) == 16


def test_each_server_enforces_its_share_of_the_call_limit() -> None:
    """64 calls over 4 servers, 16 each: two connections of 50 hung calls keep 16 each when the kernel gives them
    different servers (68 refused at once), 16 between them when it gives them one (84); never more than 64."""
    with running_server(max_concurrent_rpcs=64, grpc_servers=4) as live:
        assert live.server is not None
        with hung_calls(live.server.port, METHOD, 50, at_least=68) as (first, second):
            refused, deadline = (-1, -1), time.monotonic() + 10
            while time.monotonic() < deadline:  # until the count stops moving (84 when both share a server)
                now = (len(first.seen.ended_streams), len(second.seen.ended_streams))
                if now == refused:
                    break
                refused = now
                time.sleep(0.5)
        assert sum(refused) in (68, 84), refused
        assert min(refused) >= 34, refused  # no connection kept more than its server's share


def test_a_port_another_server_holds_is_refused_not_shared(tmp_path: Path) -> None:
    """SO_REUSEPORT would let a second server of the same user bind beside the first and take a share of its
    connections unseen; the real CLI refuses the port instead, naming it, and exits 2."""
    with running_server(grpc_servers=2) as live:
        assert live.server is not None
        port = live.server.port
        run = subprocess.run([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--metrics-port", "", "--log-format", "text"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert run.returncode == 2, run.stderr[-2000:]
        assert f"cannot bind 127.0.0.1:{port}" in run.stderr and "another server" in run.stderr
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # the first one still serves
            assert stub(ch).RecommendAction(request(), timeout=10).decision_id
