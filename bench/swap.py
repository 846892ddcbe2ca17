"""Hot-swap benchmark: how fast a published bundle is served, what swaps cost in latency and memory.

    .venv/bin/python -m bench.swap             # full run, about 2 minutes on 2 cores
    .venv/bin/python -m bench.swap --quick     # smoke run, about 40 s

Publishing is what an operator does: write a temp file in the weights directory, fsync,
``os.replace`` it onto ``weights_active.bundle``. Each bundle is the embedded default with
its own ``model_version``, so every response says which model set answered it. Three
servers (``shopping-agent serve --weights-dir DIR``, 127.0.0.1, port 0), one after another:

1. **Swap latency** (inotify on, poll 1 s; then a second server poll-only, poll 0.5 s):
   clients call RecommendAction back to back (sync gRPC, 2 in flight); for each of N swaps,
   the time from the rename to the first response carrying the new version. Before each
   rename a random pause, so the renames fall at random phases of the poll. Each swap's
   load time (read, validate, self-test, warm-up) is read from the server's log.
2. **p99 under load** (the inotify server): a grpc.aio closed loop (16 in flight) in
   segments that alternate steady / swapping (a rename every 2 s), same server, same
   client; p50/p99 of each phase over all its segments and the ratio.
3. **Memory** (a fresh inotify server): RSS (VmRSS) after the first swap and after 200
   swaps, each bundle distinct and published once the previous one has been served
   (at least 0.15 s apart); the metrics endpoint's ``shopping_agent_model_swaps_total``
   confirms how many the server swapped in.

Every call's status is checked (a swap must never fail a call). Every loop is bounded in
time and in count; all traffic goes to 127.0.0.1. Results: a table and bench/results/swap.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.load import real_server_argv, results_header
from bench.loaders import Calls, _percentile, aio_calls, check_calls
from bench.payload import build_request
from bench.procs import HOST, REPO, BenchError, ServerProcess, busy_before_run, running
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc
from weights.bundle import write_bundle
from weights.embedded import default_bundle
from weights.store import ACTIVE_NAME

TARGET_INOTIFY_MS = 200.0
TARGET_POLL_EXTRA_MS = 200.0  # poll-only: at most the poll interval plus this
TARGET_P99_RATIO = 1.25
TARGET_RSS_GROWTH = 0.10
MAX_CLIENT_CALLS = 2_000_000  # count bound of every client loop (their deadlines bound them first)


@dataclass(frozen=True)
class Settings:
    swaps: int
    """Swaps timed per watcher mode (step 1)."""
    inotify_poll_s: float
    """--weights-poll-seconds with inotify on."""
    poll_only_s: float
    """--weights-poll-seconds with --no-weights-inotify."""
    swap_timeout_s: float
    """Give up on one swap this long after its rename (counted as missed)."""
    client_in_flight: int
    """Sync clients calling back to back in steps 1 and 3."""
    load_concurrency: int
    """In-flight calls of the grpc.aio loop (step 2)."""
    load_rounds: int
    """Step 2: rounds of (steady segment, swapping segment), order alternating."""
    segment_s: float
    """Step 2: seconds of one segment."""
    swap_every_s: float
    """Step 2: seconds between renames in a swapping segment (first at half of it)."""
    memory_swaps: int
    """Step 3: swaps in all, the first included."""
    memory_spacing_s: float
    """Step 3: least time between two renames."""
    memory_budget_s: float
    """Step 3: stop publishing after this long, whatever the count."""
    start_timeout_s: float
    server_args: tuple[str, ...]
    """Extra flags for every server."""
    seed: int


# --- bundles and publishing -------------------------------------------------------------------


class Bundles:
    """Distinct bundles made cheaply: the embedded default with another ``model_version``."""

    def __init__(self) -> None:
        base = default_bundle()
        self._manifest = {k: v for k, v in base.manifest.items() if k not in ("format", "format_version", "parts")}
        self._parts = dict(base.parts)

    def make(self, version: str) -> bytes:
        buf = io.BytesIO()
        write_bundle(buf, {**self._manifest, "model_version": version}, self._parts)
        return buf.getvalue()


def stage(directory: Path, data: bytes) -> Path:
    """Write ``data`` to a temp file in ``directory`` and fsync it: ready to be renamed."""
    fd, name = tempfile.mkstemp(prefix=".bench-tmp-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fchmod(f.fileno(), 0o644)
        os.fsync(f.fileno())
    return Path(name)


def rename_active(staged: Path) -> float:
    """The publish itself: rename onto the active name (then fsync the directory). perf_counter at the rename."""
    directory = staged.parent
    t0 = time.perf_counter()
    os.replace(staged, directory / ACTIVE_NAME)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return t0


def publish(directory: Path, data: bytes) -> float:
    return rename_active(stage(directory, data))


# --- the server, its log and its metrics ------------------------------------------------------


def server_argv(weights_dir: Path, poll_s: float, inotify: bool, extra: Sequence[str]) -> list[str]:
    flags = ["--weights-dir", str(weights_dir), "--weights-poll-seconds", f"{poll_s:g}"]
    if not inotify:
        flags.append("--no-weights-inotify")
    return real_server_argv([*flags, *extra])


def metrics_port(server: ServerProcess) -> int | None:
    """The /metrics port from the ``metrics endpoint`` log line (logged before ``listening``)."""
    for line in list(server.log_tail):
        if '"metrics endpoint"' in line:
            try:
                port = json.loads(line).get("port")
            except json.JSONDecodeError:
                continue
            if isinstance(port, int):
                return port
    return None


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def scrape_swaps(port: int | None) -> dict[str, float]:
    """``shopping_agent_model_swaps_total`` by result, and the load-time histogram's sum and count."""
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group("name"), m.group("labels") or "", float(m.group("value"))
        if name == "shopping_agent_model_swaps_total":
            result = re.search(r'result="([^"]*)"', labels)
            out[f"swaps_{result.group(1) if result else ''}"] += value
        elif name in ("shopping_agent_model_swap_seconds_sum", "shopping_agent_model_swap_seconds_count"):
            out[name.rsplit("_", 1)[1]] = value
    return dict(out)


def logged_load_s(server: ServerProcess, version: str, wait_s: float = 0.5) -> float | None:
    """``load_s`` of the ``swapped model`` log line for ``version`` (read, validate, self-test, warm-up)."""
    deadline = time.perf_counter() + wait_s
    while True:
        for line in reversed(list(server.log_tail)):
            if '"swapped model"' in line and f'"to": "{version}"' in line:
                try:
                    value = json.loads(line).get("load_s")
                except json.JSONDecodeError:
                    return None
                return float(value) if isinstance(value, (int, float)) else None
        if time.perf_counter() > deadline:
            return None
        time.sleep(0.01)


def rss_mb(server: ServerProcess) -> dict[str, float]:
    return {k: round(v, 1) for k, v in server.memory_mb().items()}


# --- clients ----------------------------------------------------------------------------------


class VersionClient:
    """Sync gRPC threads calling RecommendAction back to back, noting when each version is first seen."""

    def __init__(self, target: str, request: pb.RecommendActionRequest, in_flight: int, max_s: float) -> None:
        self._target = target
        self._request = request
        self._in_flight = in_flight
        self._max_s = max_s
        self._first_seen: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._channel: grpc.Channel | None = None
        self.calls = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> VersionClient:
        self._channel = grpc.insecure_channel(self._target)
        grpc.channel_ready_future(self._channel).result(timeout=10)
        call = pb_grpc.ShoppingAgentStub(self._channel).RecommendAction
        deadline = time.perf_counter() + self._max_s
        for i in range(self._in_flight):
            t = threading.Thread(target=self._run, args=(call, deadline), name=f"version-client-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        if self._channel is not None:
            self._channel.close()

    def _run(self, call: Any, deadline: float) -> None:
        while not self._stop.is_set() and time.perf_counter() < deadline and self.calls < MAX_CLIENT_CALLS:
            try:
                version = call(self._request, timeout=5.0).model_version
            except grpc.RpcError as exc:
                with self._cond:
                    self.errors[exc.code().name] += 1
                time.sleep(0.01)  # a dead server must not spin
                continue
            now = time.perf_counter()
            with self._cond:
                self.calls += 1
                if version not in self._first_seen:
                    self._first_seen[version] = now
                    self._cond.notify_all()

    def wait_for(self, version: str, timeout_s: float) -> float | None:
        """perf_counter when a response first carried ``version``; None after ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: version in self._first_seen, timeout_s)
            return self._first_seen.get(version)


async def _aio_segment(target: str, request: pb.RecommendActionRequest, concurrency: int, duration_s: float,
                       on_start: Callable[[float], None] | None) -> Calls:
    return await aio_calls(target, request, concurrency, duration_s, MAX_CLIENT_CALLS, on_start, error_pause_s=0.01)


def _ms_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in latencies_s)
    return {"calls": len(ms), "p50_ms": _percentile(ms, 50), "p90_ms": _percentile(ms, 90), "p99_ms": _percentile(ms, 99),
            "max_ms": ms[-1] if ms else float("nan")}


# --- step 1: swap latency ---------------------------------------------------------------------


def measure_swap_latency(mode: str, poll_s: float, inotify: bool, weights_dir: Path, bundles: Bundles,
                         request: pb.RecommendActionRequest, settings: Settings, rng: random.Random,
                         then: Callable[[ServerProcess, int | None], dict[str, Any]] | None = None) -> dict[str, Any]:
    """N renames, each timed to the first response with the new version; ``then`` runs on the same server."""
    publish(weights_dir, bundles.make(f"{mode}-start"))
    server = ServerProcess(f"swap-{mode}", server_argv(weights_dir, poll_s, inotify, settings.server_args))
    print(f"[{server.name}] {' '.join(server.argv)}", flush=True)
    latencies: list[float | None] = []
    load_s: list[float | None] = []
    pauses: list[float] = []
    with running(server):
        server.wait_serving(settings.start_timeout_s)
        check = check_calls(server, request, 3)
        if check["model_version"] != f"{mode}-start":
            raise BenchError(f"{server.name}: serving {check['model_version']!r}, expected {mode}-start")
        port = metrics_port(server)
        bound_s = settings.swaps * (poll_s + settings.swap_timeout_s + 1.0) + 10
        with VersionClient(server.target, request, settings.client_in_flight, bound_s) as client:
            client.wait_for(f"{mode}-start", 5.0)
            for i in range(settings.swaps):
                version = f"{mode}-{i}"
                staged = stage(weights_dir, bundles.make(version))
                # A random pause: renames at random phases of the poll (and of inotify's debounce).
                pause = rng.uniform(0.1, 0.1 + poll_s) if not inotify else rng.uniform(0.1, 0.3)
                pauses.append(pause)
                time.sleep(pause)
                t0 = rename_active(staged)
                seen = client.wait_for(version, poll_s + settings.swap_timeout_s)
                latencies.append(None if seen is None else seen - t0)
                load_s.append(logged_load_s(server, version))
                server.check_alive()
                shown = "MISSED" if seen is None else f"{1e3 * (seen - t0):.0f} ms"
                print(f"[{server.name}] swap {i + 1}/{settings.swaps}: {shown}", flush=True)
            calls, errors = client.calls, dict(client.errors)
        metrics = scrape_swaps(port)
        extra = then(server, port) if then is not None else None
    ok = [x for x in latencies if x is not None]
    loads = [x for x in load_s if x is not None]
    debounce_ms = _debounce_ms(settings.server_args)
    result: dict[str, Any] = {
        "argv": server.argv,
        "poll_s": poll_s,
        "inotify": inotify,
        "debounce_ms": debounce_ms,
        "swaps": settings.swaps,
        "missed": sum(1 for x in latencies if x is None),
        "latencies_ms": [None if x is None else round(1e3 * x, 1) for x in latencies],
        "median_ms": 1e3 * statistics.median(ok) if ok else None,
        "max_ms": 1e3 * max(ok) if ok else None,
        "min_ms": 1e3 * min(ok) if ok else None,
        "load_ms": [None if x is None else round(1e3 * x, 1) for x in load_s],
        "median_load_ms": 1e3 * statistics.median(loads) if loads else None,
        "max_load_ms": 1e3 * max(loads) if loads else None,
        "client_calls": calls,
        "client_errors": errors,
        "metrics": metrics,
    }
    if extra is not None:
        result["then"] = extra
    return result


def _debounce_ms(server_args: Sequence[str]) -> float:
    for i, arg in enumerate(server_args):
        if arg.startswith("--weights-debounce-ms="):
            return float(arg.split("=", 1)[1])
        if arg == "--weights-debounce-ms" and i + 1 < len(server_args):
            return float(server_args[i + 1])
    return 50.0  # server/config.py's default


# --- step 2: p99 with and without swaps -------------------------------------------------------


def measure_load(server: ServerProcess, port: int | None, weights_dir: Path, bundles: Bundles,
                 request: pb.RecommendActionRequest, settings: Settings) -> dict[str, Any]:
    """Alternating steady and swapping segments of a grpc.aio closed loop against one server."""
    offsets = [settings.swap_every_s / 2 + k * settings.swap_every_s
               for k in range(max(1, round(settings.segment_s / settings.swap_every_s)))]
    offsets = [o for o in offsets if o < settings.segment_s]
    swap_segments = settings.load_rounds
    prepared = [bundles.make(f"load-{i}") for i in range(swap_segments * len(offsets))]  # made before any load
    print(f"[{server.name}] load: {settings.load_concurrency} in flight, {settings.load_rounds} x "
          f"({settings.segment_s:g} s steady + {settings.segment_s:g} s with renames at {offsets} s)", flush=True)
    asyncio.run(_aio_segment(server.target, request, settings.load_concurrency, 1.0, None))  # warm-up, discarded
    phases: dict[str, list[Calls]] = {"steady": [], "swapping": []}
    renames: list[float] = []
    cpu: dict[str, float] = {"steady": 0.0, "swapping": 0.0}
    wall: dict[str, float] = {"steady": 0.0, "swapping": 0.0}
    published = 0
    for r in range(settings.load_rounds):
        order = ("steady", "swapping") if r % 2 == 0 else ("swapping", "steady")
        for phase in order:
            threads: list[threading.Thread] = []

            def start_publisher(t_start: float, threads: list[threading.Thread] = threads) -> None:
                nonlocal published
                batch = prepared[published: published + len(offsets)]
                published += len(batch)
                t = threading.Thread(target=_publish_on_schedule, args=(weights_dir, batch, t_start, offsets, renames),
                                     name="publisher", daemon=True)
                t.start()
                threads.append(t)

            cpu0 = server.cpu_seconds()["total"]
            calls = asyncio.run(_aio_segment(server.target, request, settings.load_concurrency, settings.segment_s,
                                             start_publisher if phase == "swapping" else None))
            for t in threads:
                t.join(30)
            cpu[phase] += server.cpu_seconds()["total"] - cpu0
            wall[phase] += calls.elapsed_s
            phases[phase].append(calls)
            summary = _ms_summary([lat for _, lat, _ in calls.samples])
            print(f"[{server.name}] round {r + 1} {phase:8}: {summary['calls'] / calls.elapsed_s:.0f} req/s, "
                  f"p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms, max {summary['max_ms']:.1f} ms", flush=True)
    result: dict[str, Any] = {"concurrency": settings.load_concurrency, "rounds": settings.load_rounds,
                              "segment_s": settings.segment_s, "rename_offsets_s": offsets, "renames": len(renames)}
    for phase, segments in phases.items():
        samples = [s for seg in segments for s in seg.samples]
        errors: collections.Counter[str] = collections.Counter()
        for seg in segments:
            errors.update(seg.errors)
        result[phase] = {
            **_ms_summary([lat for _, lat, _ in samples]),
            "requests_per_s": len(samples) / wall[phase] if wall[phase] else 0.0,
            "server_cores": cpu[phase] / wall[phase] if wall[phase] else 0.0,
            "errors": dict(errors),
            "versions_seen": len({v for _, _, v in samples}),
        }
    swapping = [s for seg in phases["swapping"] for s in seg.samples]
    near = [lat for start, lat, _ in swapping if any(0.0 <= start - t <= 0.3 for t in renames)]
    result["swapping"]["calls_started_within_300ms_after_a_rename"] = _ms_summary(near)
    result["swapping"]["versions_published"] = sorted({f"load-{i}" for i in range(published)})
    served = {v for _, _, v in swapping}
    result["swapping"]["published_versions_served"] = sum(1 for i in range(published) if f"load-{i}" in served)
    steady_p99, swap_p99 = result["steady"]["p99_ms"], result["swapping"]["p99_ms"]
    result["p99_ratio"] = swap_p99 / steady_p99 if steady_p99 else None
    result["p50_ratio"] = result["swapping"]["p50_ms"] / result["steady"]["p50_ms"] if result["steady"]["p50_ms"] else None
    result["metrics"] = scrape_swaps(port)
    return result


def _publish_on_schedule(weights_dir: Path, batch: Sequence[bytes], t_start: float, offsets: Sequence[float],
                         renames: list[float]) -> None:
    for data, offset in zip(batch, offsets, strict=False):
        staged = stage(weights_dir, data)
        time.sleep(max(0.0, t_start + offset - time.perf_counter()))
        renames.append(rename_active(staged))


# --- step 3: memory ---------------------------------------------------------------------------


def measure_memory(weights_dir: Path, bundles: Bundles, request: pb.RecommendActionRequest,
                   settings: Settings) -> dict[str, Any]:
    """RSS after the first swap and after ``memory_swaps`` swaps, each served before the next rename."""
    publish(weights_dir, bundles.make("mem-start"))
    server = ServerProcess("memory", server_argv(weights_dir, settings.inotify_poll_s, True, settings.server_args))
    print(f"[{server.name}] {' '.join(server.argv)}", flush=True)
    checkpoints: dict[int, dict[str, float]] = {}
    served, missed = 0, 0
    with running(server):
        server.wait_serving(settings.start_timeout_s)
        check_calls(server, request, 3)
        port = metrics_port(server)
        asyncio.run(_aio_segment(server.target, request, settings.load_concurrency, 1.0, None))  # warm-up
        rss_before = rss_mb(server)
        every = max(1, settings.memory_swaps // 4)
        started = time.perf_counter()
        with VersionClient(server.target, request, settings.client_in_flight, settings.memory_budget_s + 30) as client:
            for i in range(1, settings.memory_swaps + 1):
                if time.perf_counter() - started > settings.memory_budget_s:
                    print(f"[{server.name}] budget of {settings.memory_budget_s:g} s spent after {i - 1} swaps", flush=True)
                    break
                version = f"mem-{i}"
                t0 = publish(weights_dir, bundles.make(version))
                if client.wait_for(version, settings.swap_timeout_s) is None:
                    missed += 1
                else:
                    served += 1
                time.sleep(max(0.0, t0 + settings.memory_spacing_s - time.perf_counter()))
                if i == 1 or i % every == 0:
                    time.sleep(0.3)  # let the old model set go
                    checkpoints[i] = rss_mb(server)
                    print(f"[{server.name}] {i} swaps: RSS {checkpoints[i]['rss_mb']:.1f} MB", flush=True)
            elapsed = time.perf_counter() - started
            time.sleep(0.5)
            last = max(checkpoints) if checkpoints else 0
            rss_after = rss_mb(server)
            calls, errors = client.calls, dict(client.errors)
        metrics = scrape_swaps(port)
    first = checkpoints.get(1, {}).get("rss_mb")
    growth = rss_after["rss_mb"] / first - 1 if first else None
    return {
        "argv": server.argv,
        "swaps_published": served + missed,
        "swaps_served": served,
        "swaps_missed": missed,
        "seconds": round(elapsed, 1),
        "spacing_s": settings.memory_spacing_s,
        "rss_before_first_swap": rss_before,
        "rss_after_first_swap_mb": first,
        "rss_by_swaps": {str(k): v for k, v in sorted(checkpoints.items())},
        "swaps_at_end": last,
        "rss_after_all_mb": rss_after["rss_mb"],
        "peak_rss_mb": rss_after["peak_rss_mb"],
        "growth": growth,
        "client_calls": calls,
        "client_errors": errors,
        "metrics": metrics,
    }


# --- report -----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def summarize(latency: dict[str, dict[str, Any]], load: dict[str, Any], memory: dict[str, Any],
              settings: Settings) -> dict[str, Any]:
    ino, poll = latency["inotify"], latency["poll_only"]
    poll_bound = 1e3 * settings.poll_only_s + TARGET_POLL_EXTRA_MS
    failed = (sum(ino["client_errors"].values()) + sum(poll["client_errors"].values())
              + sum(load["steady"]["errors"].values()) + sum(load["swapping"]["errors"].values())
              + sum(memory["client_errors"].values()))

    def target(text: str, value: Any, met: bool) -> dict[str, Any]:
        return {"target": text, "value": value, "met": met}

    return {"targets": {
        "swap_latency_inotify_max_ms": target(f"<= {TARGET_INOTIFY_MS:g}", ino["max_ms"],
                                              ino["missed"] == 0 and ino["max_ms"] is not None and ino["max_ms"] <= TARGET_INOTIFY_MS),
        "swap_latency_poll_only_max_ms": target(f"<= {poll_bound:g}", poll["max_ms"],
                                                poll["missed"] == 0 and poll["max_ms"] is not None and poll["max_ms"] <= poll_bound),
        "p99_swapping_over_steady": target(f"<= {TARGET_P99_RATIO:g}", load["p99_ratio"],
                                           load["p99_ratio"] is not None and load["p99_ratio"] <= TARGET_P99_RATIO),
        "rss_growth": target(f"<= {TARGET_RSS_GROWTH:.0%}", memory["growth"],
                             memory["growth"] is not None and abs(memory["growth"]) <= TARGET_RSS_GROWTH),
        "failed_calls": target("0", failed, failed == 0),
    }}


def print_report(latency: dict[str, dict[str, Any]], load: dict[str, Any], memory: dict[str, Any],
                 summary: dict[str, Any]) -> None:
    print("\nSwap latency: rename -> first response with the new version")
    print(f"{'':28} {'swaps':>6} {'missed':>6} {'median':>8} {'max':>8} {'min':>8} {'load med':>9} {'load max':>9}")
    for key, label in (("inotify", "inotify, poll {p:g} s"), ("poll_only", "poll-only, poll {p:g} s")):
        r = latency[key]
        print(f"{label.format(p=r['poll_s']):28} {r['swaps']:>6} {r['missed']:>6} {_fmt(r['median_ms']):>8} "
              f"{_fmt(r['max_ms']):>8} {_fmt(r['min_ms']):>8} {_fmt(r['median_load_ms']):>9} {_fmt(r['max_load_ms']):>9}  ms")
    print(f"\nLatency under load: grpc.aio, {load['concurrency']} in flight, {load['rounds']} x "
          f"({load['segment_s']:g} s steady + {load['segment_s']:g} s swapping), {load['renames']} renames")
    print(f"{'':28} {'req/s':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'cores':>6}")
    for phase in ("steady", "swapping"):
        r = load[phase]
        print(f"{phase:28} {r['requests_per_s']:>8.0f} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['max_ms']:>8.1f} {r['server_cores']:>6.2f}")
    near = load["swapping"]["calls_started_within_300ms_after_a_rename"]
    print(f"{'  started <= 300 ms after':28} {near['calls']:>8} {near['p50_ms']:>8.2f} {near['p90_ms']:>8.2f} "
          f"{near['p99_ms']:>8.2f} {near['max_ms']:>8.1f}   (calls, ms)")
    print(f"p99 ratio swapping/steady {_fmt(load['p99_ratio'], '.2f')}, p50 ratio {_fmt(load['p50_ratio'], '.2f')}; "
          f"published versions served {load['swapping']['published_versions_served']}/{len(load['swapping']['versions_published'])}")
    print(f"\nMemory: {memory['swaps_served']} swaps served ({memory['swaps_missed']} missed) in {memory['seconds']:g} s; "
          f"metrics swaps_total ok={memory['metrics'].get('swaps_ok', '-')}")
    print(f"RSS before first swap {memory['rss_before_first_swap']['rss_mb']:.1f} MB, after first swap "
          f"{_fmt(memory['rss_after_first_swap_mb'])} MB, after {memory['swaps_at_end']} swaps {memory['rss_after_all_mb']:.1f} MB "
          f"(peak {memory['peak_rss_mb']:.1f} MB); by swaps: "
          + ", ".join(f"{k}: {v['rss_mb']:.1f}" for k, v in memory["rss_by_swaps"].items()))
    print()
    for name, t in summary["targets"].items():
        value = t["value"]
        shown = "-" if value is None else f"{value:+.1%}" if name == "rss_growth" else f"{value:.3g}"
        print(f"{name:32} {shown:>10}  target {t['target']:<9} {'met' if t['met'] else 'MISSED'}")


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__.splitlines()[0])
    p.add_argument("--swaps", type=int, default=10, help="swaps timed per watcher mode (default 10)")
    p.add_argument("--inotify-poll", type=float, default=1.0, help="poll seconds with inotify on (default 1)")
    p.add_argument("--poll-only", type=float, default=0.5, help="poll seconds with inotify off (default 0.5)")
    p.add_argument("--concurrency", type=int, default=16, help="in-flight calls of the load loop (default 16)")
    p.add_argument("--rounds", type=int, default=3, help="load rounds of steady + swapping segments (default 3)")
    p.add_argument("--segment", type=float, default=6.0, help="seconds of one load segment (default 6)")
    p.add_argument("--swap-every", type=float, default=2.0, help="seconds between renames under load (default 2)")
    p.add_argument("--memory-swaps", type=int, default=200, help="swaps of the memory step (default 200)")
    p.add_argument("--memory-spacing", type=float, default=0.15, help="least seconds between renames there (default 0.15)")
    p.add_argument("--memory-budget", type=float, default=60.0, help="stop the memory step after this long (default 60)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every `shopping-agent serve`, repeatable: --server-arg=--weights-debounce-ms=20")
    p.add_argument("--seed", type=int, default=1, help="seed of the random pauses before renames")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 swaps, 1 round of 4 s, 40 memory swaps")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "swap.json", help="JSON results")
    args = p.parse_args(argv)
    if args.quick:
        args.swaps, args.rounds, args.segment, args.memory_swaps, args.memory_budget = 4, 1, 4.0, 40, 20.0
    if not 1 <= args.swaps <= 50 or not 1 <= args.rounds <= 10 or not 1 <= args.memory_swaps <= 1000:
        p.error("--swaps 1..50, --rounds 1..10, --memory-swaps 1..1000")
    if not 0 < args.inotify_poll <= 10 or not 0 < args.poll_only <= 10 or not 1 <= args.concurrency <= 256:
        p.error("--inotify-poll and --poll-only in (0, 10], --concurrency 1..256")
    if not 1 <= args.segment <= 60 or not 0.2 <= args.swap_every <= args.segment or not 0 < args.memory_budget <= 300:
        p.error("--segment 1..60 s, --swap-every 0.2 s..segment, --memory-budget (0, 300] s")
    if not 0 <= args.memory_spacing <= 5:
        p.error("--memory-spacing 0..5 s")
    settings = Settings(
        swaps=args.swaps, inotify_poll_s=args.inotify_poll, poll_only_s=args.poll_only, swap_timeout_s=3.0,
        client_in_flight=2, load_concurrency=args.concurrency, load_rounds=args.rounds, segment_s=args.segment,
        swap_every_s=args.swap_every, memory_swaps=args.memory_swaps, memory_spacing_s=args.memory_spacing,
        memory_budget_s=args.memory_budget, start_timeout_s=30.0, server_args=tuple(args.server_arg), seed=args.seed,
    )
    return settings, args.output


def main(argv: Sequence[str] | None = None) -> int:
    settings, out_path = parse_args(argv)
    busy_before = busy_before_run()
    request = build_request()
    bundles = Bundles()
    rng = random.Random(settings.seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    latency: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
            ino_dir, poll_dir, mem_dir = (Path(tmp) / name for name in ("inotify", "poll", "memory"))
            for d in (ino_dir, poll_dir, mem_dir):
                d.mkdir()
            holder: dict[str, Any] = {}

            def then_load(server: ServerProcess, port: int | None) -> dict[str, Any]:
                holder["load"] = measure_load(server, port, ino_dir, bundles, request, settings)
                return {"see": "load"}

            latency["inotify"] = measure_swap_latency("inotify", settings.inotify_poll_s, True, ino_dir, bundles, request,
                                                      settings, rng, then=then_load)
            latency["poll_only"] = measure_swap_latency("poll", settings.poll_only_s, False, poll_dir, bundles, request,
                                                        settings, rng)
            memory = measure_memory(mem_dir, bundles, request, settings)
    except (BenchError, subprocess.TimeoutExpired, OSError, grpc.FutureTimeoutError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    load = holder["load"]
    latency["inotify"].pop("then", None)
    summary = summarize(latency, load, memory, settings)
    print_report(latency, load, memory, summary)
    results = {
        **results_header("bench.swap", started, argv, busy_before, settings),
        "swap_latency": latency,
        "load": load,
        "memory": memory,
        **summary,
    }
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {out_path}  ({results['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
