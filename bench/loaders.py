"""What the bench sends: status checks with a real stub, h2load for throughput, a grpc.aio
closed loop for latency. All of it to 127.0.0.1, bounded in time and in count.

h2load counts a gRPC error as a success (HTTP 200 with a non-zero grpc-status trailer),
so its figures are only trusted between stub checks that assert OK, after a raw HTTP/2
call (nghttp) has shown that the exact body h2load posts ends with ``grpc-status: 0``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.payload import GRPC_HEADERS, METHOD_PATH
from bench.procs import BenchError, CpuWindow, ServerProcess
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc

MAX_LATENCY_CALLS = 2_000_000  # count bound of the latency loop (its duration bounds it first)


def check_calls(server: ServerProcess, request: pb.RecommendActionRequest, calls: int) -> dict[str, Any]:
    """``calls`` unary calls with a real stub; each must answer OK. Returns what answered."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ShoppingAgentStub(channel)
        sources: collections.Counter[str] = collections.Counter()
        version = ""
        for _ in range(calls):
            try:
                reply = stub.RecommendAction(request, timeout=5.0)
            except grpc.RpcError as exc:
                raise BenchError(f"{server.name}: RecommendAction answered {exc.code().name}: {exc.details()}") from None
            sources[pb.DecisionSource.Name(reply.source)] += 1
            version = reply.model_version
    return {"ok": calls, "sources": dict(sources), "model_version": version}


def check_wire_frame(server: ServerProcess, body_file: Path, path: str = METHOD_PATH) -> None:
    """One raw HTTP/2 POST of the h2load body (nghttp): the trailers must say grpc-status 0.

    The stub checks prove the message is valid; this proves the hand-made framing is too,
    since h2load would count a framing error (HTTP 200, grpc-status 13) as a success.
    """
    nghttp = shutil.which("nghttp")
    if nghttp is None:
        print("  (nghttp not found: skipping the raw-frame check; it comes with nghttp2-client)", file=sys.stderr)
        return
    argv = [nghttp, "-nv", "-t", "5", "-d", str(body_file)]
    for header in GRPC_HEADERS:
        argv += ["-H", header]
    out = subprocess.run([*argv, f"http://{server.target}{path}"], capture_output=True, text=True,
                         timeout=15, check=False)
    status = re.findall(r"grpc-status: (\d+)", out.stdout)
    if status != ["0"]:
        raise BenchError(f"{server.name}: raw h2 call of the h2load body gave grpc-status {status or 'none'}:\n"
                         + out.stdout[-2000:] + out.stderr[-1000:])


@dataclass(frozen=True)
class H2Load:
    """One h2load shape: HTTP/2 connections x concurrent streams each, one client thread."""

    clients: int
    streams: int


def h2load_binary() -> str:
    path = shutil.which("h2load")
    if path is None:
        raise BenchError("h2load not found. It is in the Debian package nghttp2-client:\n"
                         "    apt-get update && apt-get install -y nghttp2-client")
    return path


_H2_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")
_H2_REQUESTS = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                          r"(\d+) errored, (\d+) timeout")
_H2_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")
_H2_REQ_TIME = re.compile(r"time for request:\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)")
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def run_h2load(server: ServerProcess, body_file: Path, shape: H2Load, duration_s: float, warmup_s: float,
               rps_per_client: float | None = None, log_file: Path | None = None, path: str = METHOD_PATH) -> dict[str, Any]:
    """Throughput with h2load (one thread), and who used the CPU meanwhile.

    ``rps_per_client``: an open loop (h2load ``--rps``, each client at most ``shape.streams`` in flight); otherwise a
    closed loop. ``log_file``: h2load's per-request log, read back into latency percentiles (``latency_ms``) of the
    measured window. ``path``: the gRPC method posted to (RecommendAction; another server's for a peer). Raises
    unless every request got HTTP 200 (the grpc-status is checked around it).
    """
    argv = [h2load_binary(), "-t", "1", "-c", str(shape.clients), "-m", str(shape.streams),
            "-D", f"{round(duration_s * 1000)}ms", "--warm-up-time", f"{round(warmup_s * 1000)}ms", "-d", str(body_file)]
    if rps_per_client is not None:
        argv.append(f"--rps={rps_per_client:g}")
    if log_file is not None:
        log_file.unlink(missing_ok=True)  # h2load appends
        argv.append(f"--log-file={log_file}")
    for header in GRPC_HEADERS:
        argv += ["-H", header]
    argv.append(f"http://{server.target}{path}")
    window = CpuWindow(server)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + warmup_s + 30, check=False)
    finally:
        window.stop()  # spans the warm-up too; at a steady rate the CPU per request is the same
    text = out.stdout + out.stderr
    finished, requests, status = _H2_FINISHED.search(text), _H2_REQUESTS.search(text), _H2_STATUS.search(text)
    if out.returncode != 0 or not (finished and requests and status):
        raise BenchError(f"{server.name}: h2load failed (exit {out.returncode}):\n{text[-3000:]}")
    _total, _started, done, succeeded, failed, errored, timeouts = map(int, requests.groups())
    ok_2xx = int(status.group(1))
    if succeeded == 0 or failed or errored or timeouts or ok_2xx != succeeded:
        raise BenchError(f"{server.name}: h2load saw failures:\n{text[-3000:]}")
    result: dict[str, Any] = {
        "requests_per_s": float(finished.group(3)),
        "requests": done,
        "http_2xx": ok_2xx,
        "failed": failed + errored + timeouts,
        "measured_s": duration_s,  # h2load's req/s counts the -D window; its "finished in" adds the warm-up
        "warmup_s": warmup_s,
        "argv": " ".join(argv),
    }
    result["cpu"] = window.report(result["requests_per_s"])
    if log_file is not None:
        result["latency_ms"] = h2load_log_percentiles(log_file)
    req_time = _H2_REQ_TIME.search(text)
    if req_time:
        g = req_time.groups()
        result["request_time_ms"] = {"min": float(g[0]) * _UNIT_MS[g[1]], "max": float(g[2]) * _UNIT_MS[g[3]],
                                     "mean": float(g[4]) * _UNIT_MS[g[5]]}
    return result


def h2load_log_percentiles(log_file: Path) -> dict[str, Any]:
    """p50/p90/p99/max (ms) of h2load's ``--log-file`` (start µs, HTTP status, µs to the end of the response)."""
    ms = sorted(int(line.split("\t")[2]) / 1000.0 for line in log_file.read_text().splitlines() if line.count("\t") >= 2)
    return {"requests": len(ms), "p50": _percentile(ms, 50), "p90": _percentile(ms, 90), "p99": _percentile(ms, 99),
            "max": ms[-1] if ms else float("nan")}


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(q / 100.0 * len(sorted_values) - 1e-9)))  # ceil(q n): nearest rank
    return sorted_values[rank - 1]


@dataclass
class Calls:
    """What a closed loop of grpc.aio calls saw: (start, latency, model_version) per answered call."""

    samples: list[tuple[float, float, str]]
    errors: collections.Counter[str]
    elapsed_s: float


async def aio_calls(target: str, request: pb.RecommendActionRequest, concurrency: int, duration_s: float,
                    max_calls: int, on_start: Callable[[float], None] | None = None,
                    error_pause_s: float = 0.0) -> Calls:
    """``concurrency`` in-flight RecommendAction calls, back to back, until the time or count bound."""
    samples: list[tuple[float, float, str]] = []
    errors: collections.Counter[str] = collections.Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ShoppingAgentStub(channel)
        await channel.channel_ready()
        started = time.perf_counter()
        end = started + duration_s
        if on_start is not None:
            on_start(started)

        async def worker() -> None:
            while time.perf_counter() < end and len(samples) + sum(errors.values()) < max_calls:
                t0 = time.perf_counter()
                try:
                    reply = await stub.RecommendAction(request, timeout=5.0)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] += 1
                    if error_pause_s:
                        await asyncio.sleep(error_pause_s)
                    continue
                samples.append((t0, time.perf_counter() - t0, reply.model_version))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Calls(samples, errors, elapsed)


async def _latency_loop(target: str, request: pb.RecommendActionRequest, concurrency: int, duration_s: float,
                        max_calls: int) -> dict[str, Any]:
    calls = await aio_calls(target, request, concurrency, duration_s, max_calls)
    elapsed = calls.elapsed_s
    ms = sorted(latency * 1e3 for _, latency, _ in calls.samples)
    return {
        "concurrency": concurrency,
        "duration_s": round(elapsed, 3),
        "ok": len(ms),
        "errors": dict(calls.errors),
        "requests_per_s": len(ms) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": _percentile(ms, 50),
        "p90_ms": _percentile(ms, 90),
        "p99_ms": _percentile(ms, 99),
        "max_ms": ms[-1] if ms else float("nan"),
    }


def run_latency(server: ServerProcess, request: pb.RecommendActionRequest, concurrency: int, duration_s: float,
                max_calls: int = MAX_LATENCY_CALLS) -> dict[str, Any]:
    """Latency percentiles from a closed loop of ``concurrency`` in-flight grpc.aio calls."""
    result = asyncio.run(_latency_loop(server.target, request, concurrency, duration_s, max_calls))
    if result["errors"]:
        raise BenchError(f"{server.name}: latency loop got errors {result['errors']}")
    return result
