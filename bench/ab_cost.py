"""A/B cost of one server feature: the real server with it on against the same server with it off.

Same loader (h2load, one thread), same payload, same run; the two configurations alternate
(on, off, on, off, ...) so drift on a shared machine hits both alike. The cost is
1 - median(on) / median(off) of RecommendAction throughput. ``bench.metrics_cost`` and
``bench.log_cost`` are the two uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.load import Settings, measure, real_server_argv
from bench.loaders import H2Load, h2load_binary
from bench.payload import build_request, grpc_frame
from bench.procs import REPO, BenchError, ServerProcess


def alternated(rounds: int, settings: Settings, argvs: Callable[[Path, int], dict[str, list[str]]], prefix: str = "",
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` rounds of a fresh server per named argv (``argvs(tmp, round)``, in its order), the same load each:
    req/s and server CPU ms a request per name, in round order (``prefix``: before each name in the server's log
    lines). Raises ``BenchError`` or ``TimeoutError``."""
    request = build_request()
    rps: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        body = Path(tmp) / "request.grpc"
        body.write_bytes(grpc_frame(request.SerializeToString()))
        for round_ in range(rounds):
            for name, server_argv in argvs(Path(tmp), round_).items():
                result = measure(ServerProcess(prefix + name, server_argv), request, body, settings, None)
                rps.setdefault(name, []).append(result["throughput"]["requests_per_s"])
                cpu.setdefault(name, []).append(result["throughput"]["cpu"]["server_cpu_ms_per_request"])
    return rps, cpu


def run_ab(argv: Sequence[str] | None, prog: str, doc: str, feature: str, target: float,
           variants: Callable[[Path], dict[str, list[str]]], output: str) -> int:
    """``variants(tmp)`` gives the extra server flags of ``on`` and ``off`` (``tmp`` is scratch space)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs (default 2)")
    p.add_argument("--duration", type=float, default=8.0, help="h2load measured seconds per run (default 8)")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / output)
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 5 or not 0 < args.duration <= 60:
        p.error("--rounds 1..5, --duration 0..60 s")
    try:
        h2load_binary()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    settings = Settings(duration_s=args.duration, h2_warmup_s=2.0, h2=H2Load(4, 32), latency_duration_s=1.0,
                        concurrency=16, single_latency_duration_s=0.0, warmup_s=1.0, start_timeout_s=30.0,
                        server_args=(), profile_s=0.0)
    try:
        rps, cpu = alternated(args.rounds, settings, lambda tmp, round_: {
            name: real_server_argv(extra) for name, extra in variants(tmp / f"round-{round_}").items()}, prefix=f"{feature}-")
    except (BenchError, TimeoutError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    on, off = statistics.median(rps["on"]), statistics.median(rps["off"])
    cost = 1 - on / off
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    cpu_cost = cpu_on / cpu_off - 1
    verdict = "met" if cost <= target else "MISSED"
    print(f"\n{feature} on  (req/s): {', '.join(f'{v:.0f}' for v in rps['on'])}  median {on:.0f}")
    print(f"{feature} off (req/s): {', '.join(f'{v:.0f}' for v in rps['off'])}  median {off:.0f}")
    print(f"server CPU-ms per request on / off (medians): {cpu_on:.3f} / {cpu_off:.3f}  (+{100 * cpu_cost:.1f} %)")
    print(f"cost of {feature} in throughput: {100 * cost:.1f} %  target <= {100 * target:.0f} %  {verdict}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"when": time.time(), "feature": feature, "rps": rps, "cpu_ms_per_request": cpu,
                                       "median_on": on, "median_off": off, "cost": cost, "cpu_cost": cpu_cost,
                                       "target": target}, indent=2) + "\n")
    return 0
