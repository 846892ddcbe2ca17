"""Latency against load: the real server beside the bare gRPC ceiling, in one command.

    .venv/bin/python -m bench.latency_curve            # about 4 minutes on 2 cores
    .venv/bin/python -m bench.latency_curve --quick    # about 90 s
    .venv/bin/python -m bench.latency_curve --server-arg=--max-batch=32

Every figure comes from h2load (one thread; its ``--log-file`` gives each request's time, so
percentiles, not only its mean), the same request bytes for every server, all on 127.0.0.1.
Per server, a fresh process for each phase, stub calls that must answer OK before and after
each (h2load counts a gRPC error as a success):

1. **closed loop**: 64 in flight (8 connections x 8 streams) and 128 (8 x 16): req/s, p50, p99;
2. **few callers**: 1 and 4 connections, one call each in flight (a frontend's few pods);
3. **open loop**: offered loads at fractions of the *real* server's own capacity at 64 in
   flight (h2load ``--rps`` on 4 connections, at most 64 in flight each), the same offered
   loads for every server: achieved req/s, p50, p99. The open loop's own capacity can be below the closed loop's:
   the least share of an offered load the real server delivered is reported beside the targets (context), so a
   point that was past capacity in fact, queueing, is seen as such. Then the 50 % load once more on **one
   connection** (a frontend process with one channel to the pod: gRPC admits one connection's calls one at a time,
   the case where the real server used to stall, ``server/batching.py``), held to the same targets.
4. **open loop at the autoscaler's target**: the offered load at which the real server's CPU reaches what the
   HorizontalPodAutoscaler holds a pod to (``HPA_CPU_CORES``: 70 % of the 1-CPU request, ``k8s/base/hpa.yaml``),
   read off phase 3's points by linear interpolation of the server's CPU (all threads, as the container's CPU counts
   it) against the offered load; then that load for both servers, on fresh processes. This is the load a pod sees in
   steady state once the autoscaler has done its work, so its p99 is what the latency alert sees there. Reported
   (context) and counted toward the worst p99 below capacity.

``--rounds N`` runs all of it N times, one after the other, and judges each target on the median of its N values
(each value a ratio within its own round, so a round's bare and real servers share its minutes): single runs on a
shared 2-core machine are one sample of a moving hour (docs/performance.md). The JSON keeps every round
(``each_round``); its ``servers`` and the plot are the last round's.

The real server also runs phase 1 with ``--log-dir`` (a temporary directory), for what
logging costs, and with ``--workers N`` (``--workers``, default 2) against N bare processes
sharing one port by SO_REUSEPORT. Two more closed loops put the real server's ``--grpc-servers`` (8 by default) in
context: the real server with ``--grpc-servers 1`` (as it was before that lever), and the bare server with as many
servers as the real one (``bare_same_servers``: the bare ceiling had it used the same lever; reported, not a
target, which stays against the one-server bare process the issue set). Seldon MLServer 1.7.1, tuned, serving the
same two MLPs (``bench.peer_mlserver``,
from its own ``.venv-mlserver``; skipped with a message when that is missing, or with ``--no-mlserver``), runs phase 1
too, with the same item embedding as a ModelInfer call. Then the targets as ratios
within this run, JSON, and a PNG of p50/p99 against offered load (needs matplotlib, the
``bench`` extra; skipped with a message without it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peer_mlserver
from bench.load import bare_server_argv, real_server_argv
from bench.loaders import H2Load, check_calls, check_wire_frame, h2load_binary, run_h2load
from bench.payload import METHOD_PATH, build_request, grpc_frame
from bench.procs import REPO, BenchError, ServerProcess, busy_before_run, running
from bench.report import header, write_results
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb

CLOSED = {"64": H2Load(8, 8), "128": H2Load(8, 16)}
FEW = {"1": H2Load(1, 1), "4": H2Load(4, 1)}
OPEN_CONNECTIONS, OPEN_STREAMS = 4, 64
LOAD_FRACTIONS = (0.25, 0.5, 0.75, 0.9)
ONE_CONNECTION_FRACTION = 0.5  # the open-loop load also offered on one connection
SLO_P99_MS = 50.0  # ShoppingAgentLatencyP99High (k8s/base/alerts)
HPA_CPU_CORES = 0.7  # k8s/base/hpa.yaml's averageUtilization (70) of the Deployment's CPU request (1): tests keep them in step
TARGETS = {"throughput": 0.8, "log_dir_cost": 0.05, "p50": 1.5, "p99": 2.0, "start_s": 1.0, "rss_mb": 150.0, "over_mlserver": 3.0}


@dataclass(frozen=True)
class Timing:
    warmup_s: float
    duration_s: float


def _phase(server: ServerProcess, request: pb.RecommendActionRequest, body: Path, work: Any) -> dict[str, Any]:
    """Start ``server``, check it, run ``work(server)``, check it again, stop it whatever happens."""
    with running(server):
        start = server.wait_serving(30.0)
        check_calls(server, request, 5)
        check_wire_frame(server, body)
        out: dict[str, Any] = {"start_to_serving_s": start, **work(server)}
        check_calls(server, request, 3)
        out["rss_mb"] = server.memory_mb()["rss_mb"]
    return out


def _h2(server: ServerProcess, body: Path, shape: H2Load, timing: Timing, log: Path, rps: float | None = None,
        path: str = METHOD_PATH) -> dict[str, Any]:
    got = run_h2load(server, body, shape, timing.duration_s, timing.warmup_s, rps_per_client=rps, log_file=log, path=path)
    lat = got["latency_ms"]
    print(f"  [{server.name}] {shape.clients}x{shape.streams}{'' if rps is None else f' at {rps * shape.clients:.0f}/s'}: "
          f"{got['requests_per_s']:.0f} req/s, p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms", flush=True)
    return {"requests_per_s": got["requests_per_s"], "p50_ms": lat["p50"], "p99_ms": lat["p99"], "max_ms": lat["max"],
            "server_cpu_ms_per_request": got["cpu"]["server_cpu_ms_per_request"], "server_cores": got["cpu"]["server_cores"],
            "argv": got["argv"]}


def closed_and_few(name: str, argv: list[str], request: pb.RecommendActionRequest, body: Path, timing: Timing,
                   tmp: Path, few: bool = True) -> dict[str, Any]:
    log = tmp / f"{name}.log"

    def work(server: ServerProcess) -> dict[str, Any]:
        run_h2load(server, body, CLOSED["64"], timing.warmup_s, 0.5)  # warm-up, discarded
        out = {"closed": {k: _h2(server, body, shape, timing, log) for k, shape in CLOSED.items()}}
        if few:
            out["few"] = {k: _h2(server, body, shape, timing, log) for k, shape in FEW.items()}
        return out

    return _phase(ServerProcess(name, argv), request, body, work)


def _open(server: ServerProcess, body: Path, timing: Timing, log: Path, load: float,
          connections: int = OPEN_CONNECTIONS) -> dict[str, Any]:
    """One open-loop point: ``load`` req/s offered on ``connections`` connections, at most ``OPEN_STREAMS`` in flight each."""
    return {"offered_per_s": load, **_h2(server, body, H2Load(connections, OPEN_STREAMS), timing, log, rps=load / connections)}


def open_loop(name: str, argv: list[str], request: pb.RecommendActionRequest, body: Path, timing: Timing, tmp: Path,
              loads: Sequence[float]) -> dict[str, Any]:
    log = tmp / f"{name}-open.log"

    def work(server: ServerProcess) -> dict[str, Any]:
        run_h2load(server, body, CLOSED["64"], timing.warmup_s, 0.5)
        one = loads[LOAD_FRACTIONS.index(ONE_CONNECTION_FRACTION)]
        return {"open": [_open(server, body, timing, log, load) for load in loads],
                "open_one_connection": _open(server, body, timing, log, one, connections=1)}

    return _phase(ServerProcess(name, argv), request, body, work)


def hpa_load(points: Sequence[dict[str, Any]], cores: float = HPA_CPU_CORES) -> float | None:
    """The offered load (req/s) at which the server's CPU reaches ``cores``: linear between the open-loop points that
    straddle it, an idle server (no load, no CPU) the first; None when no point reaches it (or a point lacks its CPU)."""
    curve = [(0.0, 0.0)]
    for p in sorted(points, key=lambda p: p["offered_per_s"]):
        if p.get("server_cores") is None:
            return None
        curve.append((float(p["offered_per_s"]), float(p["server_cores"])))
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if y0 < cores <= y1:
            return x0 + (x1 - x0) * (cores - y0) / (y1 - y0)
    return None


def open_point(name: str, argv: list[str], request: pb.RecommendActionRequest, body: Path, timing: Timing, tmp: Path,
               load: float) -> dict[str, Any]:
    """One open-loop load on a fresh server, shaped as phase 3's points."""
    log = tmp / f"{name}-open-point.log"

    def work(server: ServerProcess) -> dict[str, Any]:
        run_h2load(server, body, CLOSED["64"], timing.warmup_s, 0.5)
        return {"point": _open(server, body, timing, log, load)}

    return _phase(ServerProcess(name, argv), request, body, work)["point"]


def mlserver_closed(peer: peer_mlserver.Peer, timing: Timing, tmp: Path) -> dict[str, Any]:
    """The peer's closed loop at 64 and 128 in flight, checked with real ModelInfer calls before and after."""
    log = tmp / "mlserver.log"
    server = peer.process()
    with running(server):
        start = server.wait_serving(60.0)
        peer.check(server, 5)
        check_wire_frame(server, peer.body, peer_mlserver.INFER_PATH)
        run_h2load(server, peer.body, CLOSED["64"], timing.warmup_s, 0.5, path=peer_mlserver.INFER_PATH)  # warm-up, discarded
        closed = {k: _h2(server, peer.body, shape, timing, log, path=peer_mlserver.INFER_PATH) for k, shape in CLOSED.items()}
        peer.check(server, 3)
        rss = server.memory_mb()["rss_mb"]
    return {"closed": closed, "closed_start_to_serving_s": start, "closed_rss_mb": rss}


def workers_closed(n: int, real_argv: list[str], request: pb.RecommendActionRequest, body: Path, timing: Timing,
                   tmp: Path) -> dict[str, Any]:
    """Closed loop at 64 and 128 in flight: ``serve --workers n`` and ``n`` bare processes on one SO_REUSEPORT port."""
    log = tmp / "workers.log"

    def loads(server: ServerProcess) -> dict[str, Any]:
        run_h2load(server, body, CLOSED["64"], timing.warmup_s, 0.5)
        return {k: _h2(server, body, shape, timing, log) for k, shape in CLOSED.items()}

    real = _phase(ServerProcess(f"real_workers_{n}", [*real_argv, "--workers", str(n)]), request, body,
                  lambda server: {"closed": loads(server)})
    with socket.socket() as s:  # a free port for the bare processes to share
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bare_argv = [*bare_server_argv()[:-2], "--port", str(port), "--reuse-port"]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(running(ServerProcess(f"bare_x{n}", bare_argv))) for _ in range(n)]
        for proc in procs:
            proc.wait_serving(30.0)
        check_calls(procs[0], request, 5)
        bare = {"closed": loads(procs[0])}  # (its CPU figures are the first process's alone)
        check_calls(procs[0], request, 3)
    return {"workers": n, "real": real, "bare": bare}


def grpc_servers_of(server_args: Sequence[str]) -> int:
    """The real server's ``--grpc-servers`` under these ``serve`` arguments and this environment, as ``serve`` reads them."""
    from server.cli import parser
    from server.config import build_config

    return build_config(parser("serve").parse_args(["serve", *server_args]), os.environ).grpc_servers


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def targets(servers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 16's goals, each as a ratio within this run (or a bound), with whether it held."""
    bare, real = servers["bare"], servers["real"]
    throughput, p50, p99 = f">= {TARGETS['throughput']}", f"<= {TARGETS['p50']}", f"<= {TARGETS['p99']}"
    out: dict[str, dict[str, Any]] = {}
    for k in CLOSED:
        out[f"throughput_{k}_in_flight_over_bare"] = goal(
            _ratio(real["closed"][k]["requests_per_s"], bare["closed"][k]["requests_per_s"]), throughput)
    for k in CLOSED:  # context, not targets (module doc): met is None
        rate = {name: servers[name]["closed"][k]["requests_per_s"] for name in ("real_one_server", "bare_same_servers")
                if name in servers}
        if "real_one_server" in rate:
            out[f"real_one_server_{k}_in_flight_over_bare"] = goal(
                _ratio(rate["real_one_server"], bare["closed"][k]["requests_per_s"]), "context")
        if "bare_same_servers" in rate:
            out[f"throughput_{k}_in_flight_over_bare_same_servers"] = goal(
                _ratio(real["closed"][k]["requests_per_s"], rate["bare_same_servers"]), "context")
    if "real_log_dir" in servers:
        v = 1.0 - _ratio(servers["real_log_dir"]["closed"]["64"]["requests_per_s"], real["closed"]["64"]["requests_per_s"])
        out["log_dir_throughput_cost"] = goal(v, f"<= {TARGETS['log_dir_cost']}")
    for k in FEW:
        out[f"p50_{k}_callers_over_bare"] = goal(_ratio(real["few"][k]["p50_ms"], bare["few"][k]["p50_ms"]), p50)
    for fraction, r_point, b_point in zip(LOAD_FRACTIONS, real["open"], bare["open"], strict=True):
        if fraction in (0.5, 0.75):
            out[f"p99_open_{fraction:.0%}_over_bare"] = goal(_ratio(r_point["p99_ms"], b_point["p99_ms"]), p99)
    if "workers" in servers:
        w = servers["workers"]
        for k in CLOSED:
            out[f"workers_{w['workers']}_{k}_in_flight_over_{w['workers']}_bare"] = goal(
                _ratio(w["real"]["closed"][k]["requests_per_s"], w["bare"]["closed"][k]["requests_per_s"]), throughput)
    if "mlserver" in servers:
        for k in CLOSED:
            out[f"throughput_{k}_in_flight_over_mlserver"] = goal(
                _ratio(real["closed"][k]["requests_per_s"], servers["mlserver"]["closed"][k]["requests_per_s"]),
                f">= {TARGETS['over_mlserver']:g}")
    one = real.get("open_one_connection")  # (results from before the point was added have none)
    if one is not None:
        out[f"p99_open_{ONE_CONNECTION_FRACTION:.0%}_one_connection_over_bare"] = goal(
            _ratio(one["p99_ms"], bare["open_one_connection"]["p99_ms"]), p99)
    at_hpa = real.get("open_at_hpa_target")  # (absent when no open point reached the target's CPU, and in older results)
    if at_hpa is not None:
        out["open_loop_at_hpa_target_offered_per_s"] = goal(at_hpa["offered_per_s"], "context")
        out["open_loop_at_hpa_target_server_cores"] = goal(at_hpa["server_cores"], "context")
        out["p99_open_at_hpa_target_ms"] = goal(at_hpa["p99_ms"], "context")
        out["p99_open_at_hpa_target_over_bare"] = goal(_ratio(at_hpa["p99_ms"], bare["open_at_hpa_target"]["p99_ms"]), "context")
    worst = max(p["p99_ms"] for p in [*real["open"], *([one] if one is not None else []), *([at_hpa] if at_hpa else [])])
    out["worst_open_loop_p99_ms_below_capacity"] = goal(worst, f"<= {SLO_P99_MS:g}")
    delivered = [_ratio(p["requests_per_s"], p["offered_per_s"]) for p in real["open"] if "requests_per_s" in p]
    if delivered:  # context: below 1, the loads set from the closed loop's capacity reached past the open loop's
        out["open_loop_least_delivered_over_offered"] = goal(min(delivered), "context")
    out["start_to_serving_s"] = goal(max(real["closed_start_to_serving_s"], real["open_start_to_serving_s"]),
                                     f"<= {TARGETS['start_s']:g}")
    out["rss_mb"] = goal(max(real["closed_rss_mb"], real["open_rss_mb"]), f"<= {TARGETS['rss_mb']:g}")
    return out


def goal(value: float, target: str) -> dict[str, Any]:
    """One target's entry: its value, its text (``>= x``, ``<= x`` or ``context``) and the verdict that text gives: the
    one judgement a round's value and a median over rounds (``combine``) both go through."""
    return {"value": value, "target": target, "met": judged(value, target)}


def judged(value: float, target: str) -> bool | None:
    """Whether ``value`` meets a target as ``targets`` writes it (``>= x``, ``<= x``; ``context``: None)."""
    if target == "context":
        return None
    op, bound = target.split()
    if op not in (">=", "<="):
        raise ValueError(f"target: expected '>= x', '<= x' or 'context', got {target!r}")
    return value >= float(bound) if op == ">=" else value <= float(bound)


def combine(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target over the rounds: the median of its values (those of the rounds that have it), judged as one round's
    value would be, with every round's value kept."""
    if not rounds:
        raise ValueError("combine: no rounds")
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(name for goals in rounds for name in goals):  # first-seen order
        values = [goals[name]["value"] for goals in rounds if name in goals]
        target = next(goals[name]["target"] for goals in rounds if name in goals)
        out[name] = {**goal(statistics.median(values), target), "values": values}
    return out


def plot(servers: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """p50 (dashed) and p99 (solid) against offered load, one colour a server; the 50 ms alert as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    for name, colour in (("bare", "tab:gray"), ("real", "tab:blue")):
        points = servers[name]["open"]
        x = [p["offered_per_s"] for p in points]
        ax.plot(x, [p["p99_ms"] for p in points], "-o", color=colour, label=f"{name} p99")
        ax.plot(x, [p["p50_ms"] for p in points], "--o", color=colour, label=f"{name} p50")
        one = servers[name].get("open_one_connection")
        if one is not None:
            ax.plot([one["offered_per_s"]], [one["p99_ms"]], "x", color=colour, ms=9, label=f"{name} p99, one connection")
        at_hpa = servers[name].get("open_at_hpa_target")
        if at_hpa is not None:
            ax.plot([at_hpa["offered_per_s"]], [at_hpa["p99_ms"]], "D", color=colour, ms=6, mfc="none",
                    label=f"{name} p99 at the HPA's CPU target")
    ax.axhline(SLO_P99_MS, color="tab:red", lw=0.8, label="p99 alert (50 ms)")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s, open loop)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("RecommendAction latency against load, 2 cores")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the points stay visible
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no bench/results yet
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.latency_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="h2load warm-up per point (default 1)")
    p.add_argument("--quick", action="store_true", help="2 s points, no --log-dir server")
    p.add_argument("--workers", type=int, default=2, help="then `serve --workers N` against N bare processes (0: skip)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra flag for `shopping-agent serve`")
    p.add_argument("--no-mlserver", action="store_true", help="skip the Seldon MLServer peer")
    p.add_argument("--rounds", type=int, default=1, help="run everything this many times; targets on the medians (default 1)")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "latency-curve.json")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 2.0
    if not (0 < args.duration <= 60 and 0 <= args.warmup <= 10 and 0 <= args.workers <= 8 and 1 <= args.rounds <= 10):
        p.error("--duration must be in (0, 60], --warmup in [0, 10], --workers in [0, 8] and --rounds in [1, 10]")
    return args


def run_round(args: argparse.Namespace, request: pb.RecommendActionRequest, body: Path, timing: Timing, tmp: Path,
              real_argv: list[str]) -> tuple[dict[str, dict[str, Any]], list[int], str | None]:
    """Every phase once (the module doc): each server's results, the open loop's offered loads, and why MLServer was
    skipped (None: it ran). Raises ``BenchError`` or ``subprocess.TimeoutExpired``."""
    servers: dict[str, dict[str, Any]] = {}
    for name, argv_ in (("real", real_argv), ("bare", bare_server_argv())):  # the real server first: its capacity
        print(f"[{name}] closed loop and few callers", flush=True)
        got = closed_and_few(name, argv_, request, body, timing, tmp)
        start, rss = got.pop("start_to_serving_s"), got.pop("rss_mb")
        servers[name] = {**got, "closed_start_to_serving_s": start, "closed_rss_mb": rss}
    capacity = servers["real"]["closed"]["64"]["requests_per_s"]
    loads = [round(capacity * f) for f in LOAD_FRACTIONS]
    for name, argv_ in (("bare", bare_server_argv()), ("real", real_argv)):
        print(f"[{name}] open loop at {loads} req/s", flush=True)
        got = open_loop(name, argv_, request, body, timing, tmp, loads)
        servers[name].update(open=got["open"], open_one_connection=got["open_one_connection"],
                             open_start_to_serving_s=got["start_to_serving_s"], open_rss_mb=got["rss_mb"])
    at_hpa = hpa_load(servers["real"]["open"])
    if at_hpa is None:
        print(f"[open loop at the HPA's target] skipped: no open-loop point reached {HPA_CPU_CORES:g} of a core", flush=True)
    else:
        print(f"[open loop at the HPA's target] {at_hpa:.0f} req/s, where the real server's CPU reached "
              f"{HPA_CPU_CORES:g} of a core", flush=True)
        for name, argv_ in (("bare", bare_server_argv()), ("real", real_argv)):
            servers[name]["open_at_hpa_target"] = open_point(name, argv_, request, body, timing, tmp, round(at_hpa))
    if not args.quick:
        n = grpc_servers_of(args.server_arg)
        print(f"[real --grpc-servers 1] and [bare --grpc-servers {n}] closed loop", flush=True)
        servers["real_one_server"] = closed_and_few("real_one_server", [*real_argv, "--grpc-servers", "1"], request,
                                                    body, timing, tmp, few=False)
        servers["bare_same_servers"] = closed_and_few("bare_same_servers", [*bare_server_argv(), "--grpc-servers", str(n)],
                                                      request, body, timing, tmp, few=False)
        print("[real --log-dir] closed loop", flush=True)
        logs = tmp / "logs"
        servers["real_log_dir"] = closed_and_few("real_log_dir", [*real_argv, "--log-dir", str(logs)], request, body,
                                                 timing, tmp, few=False)
    why_not = "MLServer skipped: --no-mlserver" if args.no_mlserver else peer_mlserver.missing()
    if why_not is None:
        print("[mlserver] closed loop", flush=True)
        servers["mlserver"] = mlserver_closed(peer_mlserver.prepare(tmp, request), timing, tmp)
    else:
        print(why_not, flush=True)
    if args.workers:
        print(f"[--workers {args.workers}] closed loop against {args.workers} bare processes", flush=True)
        servers["workers"] = workers_closed(args.workers, real_argv, request, body, timing, tmp)
    return servers, loads, why_not


def print_targets(goals: dict[str, dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    for name, goal in goals.items():
        verdict = "" if goal["met"] is None else "met" if goal["met"] else "MISSED"
        values = goal.get("values")
        spread = "" if values is None or len(values) < 2 else "  (" + ", ".join(f"{v:.3f}" for v in values) + ")"
        print(f"{name:42} {goal['value']:8.3f}  target {goal['target']:<8} {verdict}{spread}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        h2load_binary()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    busy = busy_before_run()
    started = time.time()
    timing = Timing(args.warmup, args.duration)
    request = build_request()
    real_argv = real_server_argv(args.server_arg)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-curve-") as tmp_name:
        tmp = Path(tmp_name)
        body = tmp / "request.grpc"
        body.write_bytes(grpc_frame(request.SerializeToString()))
        for index in range(args.rounds):
            if args.rounds > 1:
                print(f"=== round {index + 1} of {args.rounds}", flush=True)
            here = tmp / f"round-{index + 1}"  # each round's own files: MLServer's model directory, the --log-dir logs
            here.mkdir()
            try:
                servers, loads, why_not = run_round(args, request, body, timing, here, real_argv)
            except (BenchError, subprocess.TimeoutExpired) as exc:
                print(f"bench: {exc}", file=sys.stderr)
                return 1
            rounds.append({"offered_loads_per_s": loads, "servers": servers, "targets": targets(servers)})
            if args.rounds > 1:
                print_targets(rounds[-1]["targets"], f"round {index + 1}")
    goals = combine([r["targets"] for r in rounds])
    print_targets(goals, "targets" if args.rounds == 1 else f"targets: the median of {args.rounds} rounds")
    if why_not is not None:
        print(why_not)
    last = rounds[-1]
    results = {**header("bench.latency_curve", started, argv, cores_busy_before_run=round(busy, 3)), "mlserver_skipped": why_not,
               "rounds": len(rounds), "offered_loads_per_s": last["offered_loads_per_s"], "servers": last["servers"],
               "targets": goals, "each_round": rounds}
    png = plot(last["servers"], args.output.with_suffix(".png"))  # the last round's curves
    results["plot"] = str(png) if png else None
    write_results(args.output, results)
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
