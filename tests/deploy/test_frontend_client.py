"""docs/deploy.md's Python client, run as written against two real servers on 127.0.0.1.

Its calls succeed with the deadline on each call (a service-config timeout under about 2 s expired every call at once
in grpcio: grpc/grpc#34547), and with client-side health checking it sends a draining server nothing: a pod on
SIGTERM reports NOT_SERVING first, and calls that reach it as it stops end CANCELLED, which no retry policy retries.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from tests.deploy.test_deploy_docs import code_blocks, text
from tests.harness import ServerThread, make_config, request, stub

HEADLESS = "dns:///shopping-agent-headless.shopping-agent.svc.cluster.local:50051"


LAST_OPTION = '("grpc.enable_retries", 1)]'


def documented_channel(target: str, more_options: str = "") -> grpc.Channel:
    """The Python block of docs/deploy.md, executed with its target replaced by ``target`` (and ``more_options``, a
    Python fragment such as ``', ("name", 1)'``, after its channel options): its ``channel``."""
    [block] = code_blocks("python")
    assert HEADLESS in block and LAST_OPTION in block
    namespace: dict[str, Any] = {}
    exec(block.replace(HEADLESS, target).replace(LAST_OPTION, LAST_OPTION[:-1] + more_options + "]"),
         namespace)  # our own documentation, run as a frontend would run it
    channel: grpc.Channel = namespace["channel"]
    return channel


def decisions(live: ServerThread) -> float:
    return sum(sample.value for metric in live.registry.collect() if metric.name == "shopping_agent_decisions"
               for sample in metric.samples if sample.name == "shopping_agent_decisions_total")


def test_the_documented_client_calls_with_a_deadline_and_leaves_a_draining_server() -> None:
    draining, staying = ServerThread(make_config(drain_delay_seconds=3.0)), ServerThread(make_config())
    draining.start()
    staying.start()
    stopping: threading.Thread | None = None
    try:
        channel = documented_channel(f"ipv4:{draining.target},{staying.target}")
        call = stub(channel).RecommendAction
        for seed in range(20):
            assert call(request(seed=seed), timeout=0.1).decision_id  # the deadline on the call, as the docs say
        assert decisions(draining) > 0 and decisions(staying) > 0  # round_robin: both served
        before = decisions(draining)
        stopping = threading.Thread(target=draining.stop, kwargs={"grace": 1.0})
        stopping.start()  # SIGTERM's path: NOT_SERVING, then 3 s of serving on, then stop
        time.sleep(0.5)  # the client's Watch hears NOT_SERVING
        for seed in range(40):
            assert call(request(seed=seed), timeout=0.5).decision_id
        assert decisions(draining) == before, "a call went to the draining server"
        channel.close()
    finally:
        if stopping is not None:
            stopping.join(15)  # the drain ends on its own: stopping it again would hide the failure above
            assert not stopping.is_alive()
        for live in (draining, staying):
            if live.server is not None and (live is staying or stopping is None):
                live.stop()


def test_past_the_streaming_budget_the_client_skips_that_server_until_a_watch_fits() -> None:
    """docs/deploy.md: each client channel holds one Health/Watch stream per pod, within --max-streaming-calls; a
    client whose Watch is refused sends that pod nothing (its other pods serve it), and comes back once one fits."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    full, other = ServerThread(make_config(max_streaming_calls=1)), ServerThread(make_config())
    full.start()
    other.start()
    try:
        with grpc.insecure_channel(full.target) as holder:
            watch = health_pb2_grpc.HealthStub(holder).Watch(health_pb2.HealthCheckRequest(service=""))
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # the budget's one stream
            channel = documented_channel(f"ipv4:{full.target},{other.target}")
            for seed in range(20):
                assert stub(channel).RecommendAction(request(seed=seed), timeout=1).decision_id
            assert (decisions(full), decisions(other)) == (0, 20)
            watch.cancel()
        deadline = time.monotonic() + 20  # the client retries its Watch with back-off
        while decisions(full) == 0:
            assert time.monotonic() < deadline, "the client never came back to the server"
            stub(channel).RecommendAction(request(), timeout=1)
            time.sleep(0.05)
        channel.close()
    finally:
        full.stop()
        other.stop()


def _established_to(port: int) -> int:
    """TCP connections from this host to ``port`` that are established (state 01; grpc's sockets may be IPv6 ones
    holding a mapped IPv4 address, so both tables)."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as table:
            rows += [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[3] == "01" and int(row[2].rsplit(":", 1)[1], 16) == port)


def test_identical_channels_share_a_connection_and_a_local_subchannel_pool_gives_each_its_own() -> None:
    """docs/deploy.md, a busy client: one connection's calls are admitted one at a time, and the way to more than one
    connection a pod is the option the docs name (grpc's global subchannel pool otherwise shares one)."""
    live = ServerThread(make_config())
    live.start()
    try:
        port = int(live.target.rsplit(":", 1)[1])
        local_pool = '("grpc.use_local_subchannel_pool", 1)'
        assert local_pool in text()  # what the docs tell a busy client to add
        for extra, expected in (("", 1), (f", {local_pool}", 3)):
            channels = [documented_channel(f"ipv4:{live.target}", extra) for _ in range(3)]
            for channel in channels:
                assert stub(channel).RecommendAction(request(), timeout=2).decision_id
            time.sleep(0.2)
            assert _established_to(port) == expected
            for channel in channels:
                channel.close()
            deadline = time.monotonic() + 5
            while _established_to(port) and time.monotonic() < deadline:  # the closed channels' connections go
                time.sleep(0.05)
            assert _established_to(port) == 0, "the closed channels' connections stayed open"
    finally:
        live.stop()
