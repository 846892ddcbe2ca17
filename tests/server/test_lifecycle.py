"""Health, reflection, start-up and the SIGTERM drain, against real servers (in-thread and the real CLI)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.harness import ROOT, ServerThread, make_config, request, spawn_server, stub
from weights.embedded import DEFAULT_MODEL_VERSION

SERVICE = "shopping_agent.v1.ShoppingAgent"


def _health(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _watching(channel: grpc.Channel, service: str = SERVICE) -> Any:
    """A Watch of ``service``'s health opened once the server is SERVING, its first answer (SERVING) read."""
    grpc.channel_ready_future(channel).result(timeout=10)
    deadline = time.monotonic() + 10
    while _health(channel) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    return watch


def test_health_is_serving_once_the_model_is_loaded(channel: grpc.Channel) -> None:
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert _health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:  # a service it does not serve, as grpc's own health service answers
        _health(channel, "nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(channel: grpc.Channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    assert SERVICE in db.get_services()
    assert "grpc.health.v1.Health" in db.get_services()
    desc = db.FindFileContainingSymbol(SERVICE)
    methods = [m.name for s in desc.service for m in s.method]
    assert "RecommendAction" in methods


def test_a_client_built_only_from_proto(live: ServerThread, tmp_path: Path) -> None:
    """Compile proto/ with plain protoc into a fresh directory and call the server from a clean interpreter."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    proto = ROOT / "proto" / "shopping_agent" / "v1" / "shopping_agent.proto"
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", str(proto)]) == 0
    client = textwrap.dedent(f"""
        import sys, grpc
        sys.path = [p for p in sys.path if p not in ("", {str(ROOT)!r})]
        sys.path.insert(0, {str(tmp_path)!r})
        from shopping_agent.v1 import shopping_agent_pb2 as pb, shopping_agent_pb2_grpc as rpc
        assert "server" not in sys.modules
        with grpc.insecure_channel({live.target!r}) as ch:
            r = rpc.ShoppingAgentStub(ch).RecommendAction(pb.RecommendActionRequest(
                user_id="u", session_id="s", item_id="i", item_embedding=[0.01] * 768,
                page_type=pb.PAGE_TYPE_CART, cart_item_count=5), timeout=5)
        print(pb.Action.Name(r.action), pb.DecisionSource.Name(r.source), r.model_version)
    """)
    out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    action, source, version = out.stdout.split()
    assert action.startswith("ACTION_") and source.startswith("DECISION_SOURCE_") and version


def test_sigterm_drains_and_exits_zero() -> None:
    """Real CLI: SIGTERM turns health NOT_SERVING, the server keeps answering through the drain
    delay, clients that watch health move away, every call they sent is answered OK, exit 0."""
    results: list[tuple[float, grpc.StatusCode]] = []
    with spawn_server("--grace-seconds", "5", "--drain-delay-seconds", "1") as spawned:
        with grpc.insecure_channel(spawned.target) as ch:
            watch = _watching(ch)
            draining = threading.Event()

            def hammer() -> None:
                call = stub(ch).RecommendAction
                while not draining.is_set() and len(results) < 20000:
                    try:
                        call(request(), timeout=5)
                        results.append((time.monotonic(), grpc.StatusCode.OK))
                    except grpc.RpcError as exc:
                        results.append((time.monotonic(), exc.code()))

            workers = [threading.Thread(target=hammer) for _ in range(4)]
            for w in workers:
                w.start()
            time.sleep(0.5)
            sent_signal = time.monotonic()
            spawned.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            saw_not_serving = time.monotonic()
            draining.set()
            watch.cancel()
            for w in workers:
                w.join(10)
            assert _health(ch, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING  # still answering while draining
            assert stub(ch).RecommendAction(request(), timeout=5).decision_id
            assert spawned.proc.wait(timeout=10) == 0
            assert time.monotonic() - sent_signal >= 1.0  # the drain delay was honoured
    assert len(results) > 20
    assert {code for _, code in results} == {grpc.StatusCode.OK}, "a call sent before or during the drain failed"
    assert saw_not_serving - sent_signal < 1.0
    log = "".join(spawned.lines)
    assert '"msg": "draining"' in log and '"msg": "stopped"' in log


def test_sigterm_when_idle_exits_at_once_and_closes_the_port() -> None:
    """Without a drain delay and with nothing in flight, SIGTERM exits 0 without waiting out the grace."""
    codes: list[grpc.StatusCode] = []
    with spawn_server("--grace-seconds", "8") as spawned:
        with grpc.insecure_channel(spawned.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            call = stub(ch).RecommendAction
            call(request(), timeout=10)
            sent = time.monotonic()
            spawned.proc.send_signal(signal.SIGTERM)
            assert spawned.proc.wait(timeout=10) == 0
            assert time.monotonic() - sent < 4  # well inside the 8 s grace
            for _ in range(3):
                try:
                    call(request(), timeout=2)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes  # nothing listens any more
    assert any('"msg": "stopped"' in line for line in spawned.lines)


def test_an_open_health_watch_does_not_hold_the_shutdown_for_the_grace() -> None:
    """A client that keeps its Watch open through the drain (grpcurl, a home-made monitor) hears NOT_SERVING, and when
    the drain delay is over its stream ends with OK: grpc counted it as a call in flight, so it held every shutdown for
    the whole grace and was then cut with UNAVAILABLE (a review, 2026-12-06: exit after 8.06 s of an 8 s grace)."""
    with spawn_server("--grace-seconds", "8", "--drain-delay-seconds", "1") as spawned:
        with grpc.insecure_channel(spawned.target) as ch:
            watch = _watching(ch)
            sent = time.monotonic()
            spawned.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert list(watch) == [] and watch.code() == grpc.StatusCode.OK  # ended, not cut
            ended = time.monotonic() - sent
            assert spawned.proc.wait(timeout=10) == 0
            exited = time.monotonic() - sent
    assert 1.0 <= ended < 4 and exited < 4, (ended, exited)  # after the 1 s drain, well inside the 8 s grace


def test_without_a_drain_delay_every_watcher_hears_not_serving_before_its_stream_ends() -> None:
    """With no drain delay the streams end in the same turn of the event loop that wakes the watchers: most had not been
    written to yet, and ended on SERVING (a re-read: 2 of 20 heard NOT_SERVING). Each now gets its service's status
    before its stream ends, and none holds the 5 s grace."""
    server = ServerThread(make_config(grace_seconds=5.0, drain_delay_seconds=0.0))
    server.start()
    try:
        with grpc.insecure_channel(server.target) as ch:
            watches = [_watching(ch, service) for service in ("", SERVICE) * 10]
            took = time.monotonic()
            server.stop(grace=5.0)
            took = time.monotonic() - took
            for watch in watches:
                assert list(watch)[-1:] == [health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)]
                assert watch.code() == grpc.StatusCode.OK
    except BaseException:
        if server.server is not None:  # failed before its stop: stop it here, once
            server.stop()
        raise
    assert took < 2.5, took  # the grace is 5 s: nothing waited for it


def test_start_to_serving_with_the_cli_logs_json() -> None:
    with spawn_server() as spawned:
        with grpc.insecure_channel(spawned.target) as ch:
            deadline = time.monotonic() + 15
            while True:
                try:
                    if _health(ch) == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "never SERVING"
                time.sleep(0.02)
            assert stub(ch).RecommendAction(request(), timeout=5).model_version == DEFAULT_MODEL_VERSION
        spawned.proc.send_signal(signal.SIGINT)
        assert spawned.proc.wait(timeout=10) == 0
    assert any('"msg": "serving"' in line for line in spawned.lines)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--port", "70000"], {}, "port: expected 0..65535"),
        (["--timezone", "Mars/Olympus"], {}, "timezone: unknown IANA timezone"),
        ([], {"SHOPPING_AGENT_MAX_BATCH": "many"}, "SHOPPING_AGENT_MAX_BATCH: expected int"),
        (["--device", "tpu"], {}, "device: expected auto, cpu or cuda"),
        (["--samples", "17"], {}, "samples: expected 1..16"),
        (["--batch-duty", "0"], {}, "batch_duty: expected 0 < duty <= 1"),
        (["--device", "cuda"], {}, "device=cuda but onnxruntime has no CUDAExecutionProvider"),  # no GPU here
    ],
)
def test_bad_configuration_exits_2_with_the_reason(args: list[str], env: dict[str, str], message: str) -> None:
    import os

    out = subprocess.run([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", *args], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env}, cwd=ROOT)
    assert out.returncode == 2
    assert message in out.stderr


def test_a_port_or_log_dir_that_cannot_be_had_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A taken health port, a taken service port bound without our probe (one gRPC server), a log directory under a
    file: the flag is named in one line and the exit is 2 (a set-up problem), not a traceback and 1."""
    import os
    import socket

    (tmp_path / "afile").write_text("not a directory")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = {"--health-port": ["--health-port", port], "--port": ["--port", port, "--grpc-servers", "1"],
                 "--log-dir": ["--log-dir", str(tmp_path / "afile" / "logs")]}
        for flag, args in cases.items():
            out = subprocess.run([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--metrics-port", "",
                                  "--log-user-salt", "s", *args], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "SHOPPING_AGENT_LOG_FORMAT": "text"}, cwd=ROOT)
            assert out.returncode == 2, (flag, out.stderr[-2000:])
            assert "Traceback" not in out.stderr, out.stderr[-2000:]
            assert f"shopping-agent: {flag}" in out.stderr, out.stderr[-2000:]
            if flag == "--log-dir":
                assert "cannot be created or written: Not a directory" in out.stderr


@pytest.mark.parametrize(("grpc_servers", "error", "says"), [
    (8, OSError, "cannot bind 127.0.0.1:{port}: .* another server"),  # our probe, before SO_REUSEPORT could share it
    (1, OSError, r"--port: cannot bind 127.0.0.1:{port} .*Failed to bind")])  # grpc's own error, as an OSError naming the flag
def test_stop_after_a_failed_start_releases_the_threads(tmp_path: Path, grpc_servers: int, error: type[Exception], says: str) -> None:
    import asyncio
    import socket

    from server.app import ShoppingAgentServer
    from tests.harness import make_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ShoppingAgentServer(make_config(port=port, log_dir=tmp_path, grpc_servers=grpc_servers))

        async def start_then_stop() -> None:
            with pytest.raises(error, match=says.format(port=port)):
                await server.start()
            batcher, recorder = server._batcher, server.recorder
            assert batcher is not None and recorder is not None
            await server.stop()
            assert batcher._task is not None and batcher._task.done()
            assert not recorder._thread.is_alive()

        asyncio.run(start_then_stop())
