"""Serving benchmark: the real server against a bare gRPC baseline, in one run.

    .venv/bin/python -m bench.load                 # full run, about a minute on 2 cores
    .venv/bin/python -m bench.load --quick         # smoke run, about 15 s
    .venv/bin/python -m bench.load --server-arg=--max-batch=1 --output bench/results/serving-batch1.json
    .venv/bin/python -m bench.load --profile 8     # then py-spy each server for 8 s under h2load

For each server (first ``bench/bare_server.py``, then ``shopping-agent serve``), with the
same loaders and the same request bytes:

1. spawn it on 127.0.0.1 (port 0, read from its ``listening`` log line) and poll the health
   service every 10 ms from spawn until SERVING: start-to-SERVING time;
2. real gRPC calls must answer OK, and one raw HTTP/2 call (nghttp) of the exact h2load
   body must end with ``grpc-status: 0``; a short warm-up; RSS;
3. throughput: h2load, one thread, fixed clients x streams, fixed duration after a warm-up,
   with the CPU used meanwhile by the server, the loader and the rest of the machine; a stub
   call must still answer OK afterwards (h2load counts gRPC errors as successes);
4. latency: a closed-loop grpc.aio client, fixed in-flight calls for a fixed time, every
   status checked: p50/p90/p99; RSS again; then one call at a time (unloaded latency);
5. SIGTERM and wait (SIGKILL after a timeout), in ``finally``, also on error.

Then a table, the real/bare ratios against the targets, and JSON in bench/results/.
Every loop is bounded in time and in count; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench import profile_top
from bench.loaders import H2Load, check_calls, check_wire_frame, h2load_binary, run_h2load, run_latency
from bench.payload import build_request, grpc_frame
from bench.procs import HOST, REPO, BenchError, ServerProcess, busy_before_run, running
from bench.report import header
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb

TARGET_THROUGHPUT_RATIO = 0.50
TARGET_RSS_MB = 200.0
TARGET_START_TO_SERVING_S = 2.0
PROFILE_RATE_HZ = 100


@dataclass(frozen=True)
class Settings:
    """What one run measures; built once from the flags."""

    duration_s: float
    """h2load's measured duration (after its warm-up)."""
    h2_warmup_s: float
    """h2load's --warm-up-time."""
    h2: H2Load
    """h2load's connections x streams."""
    latency_duration_s: float
    """How long the grpc.aio latency loop runs."""
    concurrency: int
    """In-flight calls of the latency loop."""
    single_latency_duration_s: float
    """How long the one-call-at-a-time latency loop runs (0: skip it)."""
    warmup_s: float
    """grpc.aio warm-up before the first RSS reading."""
    start_timeout_s: float
    """Give up when a server is not SERVING this long after spawn."""
    server_args: tuple[str, ...]
    """Extra flags for ``shopping-agent serve``."""
    profile_s: float
    """py-spy record each server for this long under h2load, after its measurements (0: off)."""


def run_profile(server: ServerProcess, body_file: Path, settings: Settings, out_dir: Path) -> dict[str, Any]:
    """py-spy record the server while h2load loads it (after, not during, the measured phases).

    ``--gil`` keeps only the samples of the thread holding the GIL: the event loop's Python
    work, which saturates first. Without it, threads blocked in C (gRPC's
    poller) count as busy, since py-spy's idle detection misses them here.
    """
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise BenchError("py-spy not found: .venv/bin/pip install py-spy")
    raw = out_dir / f"profile-{server.name}.txt"
    argv = [py_spy, "record", "--gil", "-d", f"{settings.profile_s:g}", "-r", str(PROFILE_RATE_HZ),
            "--format", "raw", "-o", str(raw), "-p", str(server.pid)]
    err = ""
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as spy:
        try:
            load = run_h2load(server, body_file, settings.h2, settings.profile_s + 2, 0.5)
            _, err = spy.communicate(timeout=settings.profile_s + 30)
        finally:
            if spy.poll() is None:
                spy.terminate()
                spy.wait(10)
    if spy.returncode != 0 or not raw.exists():
        raise BenchError(f"py-spy failed (exit {spy.returncode}): {err[-1500:]}")
    stacks = profile_top.read_raw(raw)
    samples = sum(stacks.values())
    gil_busy = samples / (settings.profile_s * PROFILE_RATE_HZ)
    return {
        "file": str(raw),
        "argv": " ".join(argv),
        "samples": samples,
        "gil_busy": gil_busy,
        "requests_per_s_while_profiled": load["requests_per_s"],
        "gil_ms_per_request": 1e3 * gil_busy / load["requests_per_s"],
        "top_self": profile_top.top(stacks, 15, inclusive=False),
        "top_inclusive": profile_top.top(stacks, 15, inclusive=True),
    }


def measure(server: ServerProcess, request: pb.RecommendActionRequest, body_file: Path, settings: Settings,
            profile_dir: Path | None) -> dict[str, Any]:
    """Start ``server``, check it, load it, read it; stop it whatever happens."""
    print(f"[{server.name}] {' '.join(server.argv)}", flush=True)
    with running(server):
        start_to_serving = server.wait_serving(settings.start_timeout_s)
        print(f"[{server.name}] port {server.port}, SERVING {start_to_serving:.3f} s after spawn", flush=True)
        before = check_calls(server, request, 5)
        check_wire_frame(server, body_file)
        run_latency(server, request, settings.concurrency, settings.warmup_s)  # warm-up, discarded
        mem_warm = server.memory_mb()
        print(f"[{server.name}] h2load {settings.h2_warmup_s:g}+{settings.duration_s:g} s ...", flush=True)
        h2 = run_h2load(server, body_file, settings.h2, settings.duration_s, settings.h2_warmup_s)
        after = check_calls(server, request, 3)
        print(f"[{server.name}] {h2['requests_per_s']:.0f} req/s; latency loop {settings.latency_duration_s:g} s ...",
              flush=True)
        latency = run_latency(server, request, settings.concurrency, settings.latency_duration_s)
        mem_load = server.memory_mb()
        single = (run_latency(server, request, 1, settings.single_latency_duration_s)
                  if settings.single_latency_duration_s > 0 else None)
        result: dict[str, Any] = {
            "argv": server.argv,
            "start_to_listening_s": server.listening_after_s,
            "start_to_serving_s": start_to_serving,
            "check_before": before,
            "check_after": after,
            "throughput": h2,
            "latency": latency,
            "latency_one_in_flight": single,
            "rss_mb_after_warmup": mem_warm["rss_mb"],
            "rss_mb_after_load": mem_load["rss_mb"],
            "peak_rss_mb": mem_load["peak_rss_mb"],
        }
        if profile_dir is not None:
            print(f"[{server.name}] py-spy {settings.profile_s:g} s under h2load ...", flush=True)
            try:
                result["profile"] = run_profile(server, body_file, settings, profile_dir)
            except (BenchError, subprocess.TimeoutExpired) as exc:  # the measurements above still stand
                print(f"[{server.name}] profile failed: {exc}", file=sys.stderr)
            check_calls(server, request, 1)
    return result


def results_header(module: str, started: float, argv: Sequence[str] | None, busy_before: float,
                   settings: Any) -> dict[str, Any]:
    """What the serving benches' JSON starts with: ``bench.report.header`` and the settings."""
    return {
        **header(module, started, argv, cores_busy_before_run=round(busy_before, 3), grpcio=grpc.__version__),
        "settings": {**asdict(settings), "server_args": list(settings.server_args)},
    }


def bare_server_argv() -> list[str]:
    return [sys.executable, "-m", "bench.bare_server", "--host", HOST, "--port", "0"]


def real_server_argv(extra: Sequence[str]) -> list[str]:
    script = Path(sys.executable).parent / "shopping-agent"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "server"]
    return [*head, "serve", "--host", HOST, "--port", "0", "--metrics-host", HOST, "--metrics-port", "0", *extra]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(bare: dict[str, Any], real: dict[str, Any]) -> dict[str, Any]:
    tput = _ratio(real["throughput"]["requests_per_s"], bare["throughput"]["requests_per_s"])
    rss = max(real["rss_mb_after_warmup"], real["rss_mb_after_load"])
    return {
        "ratios": {
            "throughput_real_over_bare": tput,
            "cpu_ms_per_request_real_over_bare": _ratio(real["throughput"]["cpu"]["server_cpu_ms_per_request"],
                                                        bare["throughput"]["cpu"]["server_cpu_ms_per_request"]),
            "latency_loop_rps_real_over_bare": _ratio(real["latency"]["requests_per_s"], bare["latency"]["requests_per_s"]),
            "p50_real_over_bare": _ratio(real["latency"]["p50_ms"], bare["latency"]["p50_ms"]),
            "p99_real_over_bare": _ratio(real["latency"]["p99_ms"], bare["latency"]["p99_ms"]),
        },
        "targets": {
            "throughput_ratio": {"target": f">= {TARGET_THROUGHPUT_RATIO:.0%}", "value": tput,
                                 "met": tput is not None and tput >= TARGET_THROUGHPUT_RATIO},
            "rss_mb": {"target": f"<= {TARGET_RSS_MB:g}", "value": rss, "met": rss <= TARGET_RSS_MB},
            "start_to_serving_s": {"target": f"<= {TARGET_START_TO_SERVING_S:g}", "value": real["start_to_serving_s"],
                                   "met": real["start_to_serving_s"] <= TARGET_START_TO_SERVING_S},
        },
    }


Row = tuple[str, str, Callable[[dict[str, Any]], Any]]
ROWS: list[Row] = [
    ("h2load throughput (req/s)", "{:.0f}", lambda r: r["throughput"]["requests_per_s"]),
    ("  server CPU (cores busy)", "{:.2f}", lambda r: r["throughput"]["cpu"]["server_cores"]),
    ("  event-loop thread (cores busy)", "{:.2f}", lambda r: r["throughput"]["cpu"]["main_thread_cores"]),
    ("  server CPU-ms per request", "{:.3f}", lambda r: r["throughput"]["cpu"]["server_cpu_ms_per_request"]),
    ("  h2load CPU (cores)", "{:.2f}", lambda r: r["throughput"]["cpu"]["loader_cores"]),
    ("  rest of machine (cores)", "{:.2f}", lambda r: r["throughput"]["cpu"]["other_cores"]),
    ("  h2load mean request time (ms)", "{:.1f}", lambda r: r["throughput"].get("request_time_ms", {}).get("mean")),
    ("grpc.aio closed loop (req/s)", "{:.0f}", lambda r: r["latency"]["requests_per_s"]),
    ("  latency p50 (ms)", "{:.2f}", lambda r: r["latency"]["p50_ms"]),
    ("  latency p90 (ms)", "{:.2f}", lambda r: r["latency"]["p90_ms"]),
    ("  latency p99 (ms)", "{:.2f}", lambda r: r["latency"]["p99_ms"]),
    ("latency 1 in flight p50 (ms)", "{:.2f}", lambda r: (r["latency_one_in_flight"] or {}).get("p50_ms")),
    ("latency 1 in flight p99 (ms)", "{:.2f}", lambda r: (r["latency_one_in_flight"] or {}).get("p99_ms")),
    ("start to SERVING (s)", "{:.3f}", lambda r: r["start_to_serving_s"]),
    ("RSS after warm-up (MB)", "{:.1f}", lambda r: r["rss_mb_after_warmup"]),
    ("RSS after load (MB)", "{:.1f}", lambda r: r["rss_mb_after_load"]),
    ("peak RSS (MB)", "{:.1f}", lambda r: r["peak_rss_mb"]),
]


def print_report(bare: dict[str, Any], real: dict[str, Any], summary: dict[str, Any]) -> None:
    print()
    print(f"{'':32} {'bare':>10} {'real':>10} {'real/bare':>10}")
    for label, fmt, get in ROWS:
        b, r = get(bare), get(real)
        cells = [fmt.format(v) if v is not None else "-" for v in (b, r)]
        ratio = _ratio(r, b)
        print(f"{label:32} {cells[0]:>10} {cells[1]:>10} {f'{ratio:.2f}' if ratio is not None else '-':>10}")
    print()
    for name, target in summary["targets"].items():
        value = target["value"]
        shown = "-" if value is None else f"{value:.1%}" if name == "throughput_ratio" else f"{value:.3g}"
        print(f"{name:20} {shown:>10}  target {target['target']:<8} {'met' if target['met'] else 'MISSED'}")
    for name, result in (("bare", bare), ("real", real)):
        if "profile" not in result:
            continue
        prof = result["profile"]
        print(f"\n{name} server under h2load ({prof['requests_per_s_while_profiled']:.0f} req/s), py-spy --gil:"
              f" {prof['samples']} samples, GIL held {prof['gil_busy']:.0%} of the time,"
              f" {prof['gil_ms_per_request']:.3f} GIL-ms per request ({prof['file']})")
        for label, key in (("self", "top_self"), ("inclusive", "top_inclusive")):
            print(f"  top by {label} time:")
            for entry in prof[key][: 15 if name == "real" else 5]:
                print(f"    {entry['share']:6.1%}  {entry['function']}")


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.load", description="The real server against a bare gRPC baseline.")
    p.add_argument("--duration", type=float, default=10.0, help="h2load measured seconds (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="h2load --warm-up-time seconds (default 2)")
    p.add_argument("--clients", type=int, default=4, help="h2load -c connections (default 4)")
    p.add_argument("--streams", type=int, default=32, help="h2load -m streams per connection (default 32)")
    p.add_argument("--latency-duration", type=float, default=8.0, help="grpc.aio latency loop seconds (default 8)")
    p.add_argument("--concurrency", type=int, default=16, help="in-flight calls of the latency loop (default 16)")
    p.add_argument("--single-latency-duration", type=float, default=2.0,
                   help="then one call at a time for this long: unloaded latency (default 2; 0 skips)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for `shopping-agent serve`, repeatable: --server-arg=--max-batch=1")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                   help="after measuring, py-spy record each server this long under h2load (needs py-spy)")
    p.add_argument("--quick", action="store_true", help="smoke run: h2load 1+3 s, latency loop 2 s")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "serving.json", help="JSON results")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.latency_duration, args.single_latency_duration = 3.0, 1.0, 2.0, 1.0
    for name in ("duration", "latency_duration", "concurrency", "clients", "streams"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if min(args.warmup, args.profile, args.single_latency_duration) < 0:
        p.error("--warmup, --profile and --single-latency-duration must be >= 0")
    if max(args.duration, args.latency_duration, args.warmup, args.single_latency_duration) > 120 or args.profile > 60:
        p.error("durations are bounded: 120 s each, --profile 60 s")
    settings = Settings(
        duration_s=args.duration, h2_warmup_s=args.warmup, h2=H2Load(args.clients, args.streams),
        latency_duration_s=args.latency_duration, concurrency=args.concurrency,
        single_latency_duration_s=args.single_latency_duration,
        warmup_s=0.5 if args.quick else 1.0, start_timeout_s=30.0, server_args=tuple(args.server_arg),
        profile_s=args.profile,
    )
    return settings, args.output


def main(argv: Sequence[str] | None = None) -> int:
    settings, out_path = parse_args(argv)
    try:
        h2load_binary()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    busy_before = busy_before_run()
    request = build_request()
    message = request.SerializeToString()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    profile_dir = out_path.parent if settings.profile_s > 0 else None
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        body_file = Path(tmp) / "request.grpc"
        body_file.write_bytes(grpc_frame(message))
        try:
            bare = measure(ServerProcess("bare", bare_server_argv()), request, body_file, settings, profile_dir)
            real = measure(ServerProcess("real", real_server_argv(settings.server_args)), request, body_file, settings,
                           profile_dir)
        except (BenchError, subprocess.TimeoutExpired) as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 1
    summary = summarize(bare, real)
    print_report(bare, real, summary)
    results = {
        **results_header("bench.load", started, argv, busy_before, settings),
        "payload": {"message_bytes": len(message), "frame_bytes": len(message) + 5},
        "servers": {"bare": bare, "real": real},
        **summary,
    }
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {out_path}  ({results['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
