"""Server subprocesses for the bench, and what /proc says about them.

``ServerProcess`` spawns a server on 127.0.0.1 with port 0, reads the port from its
``{"msg": "listening", "port": N}`` log line, polls the health service from spawn until
SERVING, reads RSS and per-thread CPU from /proc, and stops it (SIGTERM, wait, SIGKILL
after a timeout). ``CpuWindow`` says who used the CPU during a load window: the server,
the load generator, and everything else on the machine (another job skews the figures).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


# ``python -c HWM_CHILD COMMAND ...`` runs ``shopping-agent COMMAND ...`` and prints its process's peak RSS as it exits
# (``VMHWM_KB n`` on stderr: ``core.peak_memory``, not wait4's or RUSAGE_CHILDREN's ru_maxrss, which start at the
# parent's RSS).
HWM_CHILD = ("import sys\nfrom core.peak_memory import peak_rss_kb\nfrom server.cli import main\nrc = main(sys.argv[1:])\n"
             "print('VMHWM_KB', peak_rss_kb(), file=sys.stderr)\nsys.exit(rc)\n")


def hwm_mb(stderr: str) -> float | None:
    """The peak RSS (MB) an ``HWM_CHILD`` printed, or None."""
    kb = next((line.split()[1] for line in stderr.splitlines() if line.startswith("VMHWM_KB")), None)
    return None if kb is None or int(kb) < 0 else int(kb) / 1024


class BenchError(RuntimeError):
    """A measurement that cannot be trusted (a server died, a call failed, a tool is missing)."""


@dataclass
class ServerProcess:
    """A server subprocess: spawned, port read from its log, health polled, stopped."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    port: int | None = None
    spawned_at: float = 0.0
    listening_after_s: float | None = None
    log_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    _port_known: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    def spawn(self) -> None:
        self.spawned_at = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read_log, name=f"{self.name}-log", daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        """Drain stderr until EOF; note the port from the ``listening`` line."""
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log_tail.append(line.rstrip())
            if self.port is None and '"listening"' in line:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if entry.get("msg") == "listening" and isinstance(entry.get("port"), int):
                    self.listening_after_s = time.perf_counter() - self.spawned_at
                    self.port = entry["port"]
                    self._port_known.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.name} server exited (code {code}); last log lines:\n" + "\n".join(self.log_tail))

    def wait_serving(self, timeout_s: float, interval_s: float = 0.010) -> float:
        """Seconds from spawn until health says SERVING, polling every ``interval_s`` from spawn."""
        deadline = self.spawned_at + timeout_s
        channel: grpc.Channel | None = None
        try:
            tick = self.spawned_at
            while True:
                now = time.perf_counter()
                if now > deadline:
                    raise BenchError(f"{self.name} server not SERVING {timeout_s:.0f} s after spawn; log:\n"
                                     + "\n".join(self.log_tail))
                self.check_alive()
                if self.port is not None:
                    if channel is None:
                        channel = grpc.insecure_channel(self.target, options=[
                            ("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                            ("grpc.max_reconnect_backoff_ms", 10)])
                    stub = health_pb2_grpc.HealthStub(channel)
                    with contextlib.suppress(grpc.RpcError):
                        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return time.perf_counter() - self.spawned_at
                tick += interval_s
                time.sleep(max(0.0, tick - time.perf_counter()))
        finally:
            if channel is not None:
                channel.close()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of each thread, keyed ``TID name``, and ``total``."""
        self.check_alive()
        tick = os.sysconf("SC_CLK_TCK")
        times: dict[str, float] = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread may end while we read
                stat = (task / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
                name = stat[stat.index("(") + 1: stat.rindex(")")]
                times[f"{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        times["total"] = (int(fields[11]) + int(fields[12])) / tick
        return times

    def memory_mb(self) -> dict[str, float]:
        """VmRSS (now) and VmHWM (peak) from /proc/PID/status, in MB (10^6 bytes)."""
        self.check_alive()
        values: dict[str, float] = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024 / 1e6  # the kernel reports kB (KiB)
        return {"rss_mb": values["VmRSS"], "peak_rss_mb": values["VmHWM"]}

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it has not exited within ``timeout_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"  {self.name}: no exit {timeout_s:.0f} s after SIGTERM; SIGKILL", file=sys.stderr)
                self.proc.kill()
                self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode


@contextlib.contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    """Spawn ``server``; stop it on the way out, also on error."""
    try:
        server.spawn()
        yield server
    finally:
        code = server.stop()
        if code not in (0, None, -signal.SIGTERM):
            print(f"  {server.name}: exited with code {code}", file=sys.stderr)


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the ``cpu`` line of /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children waited for: the load generator
    return usage.ru_utime + usage.ru_stime


def machine_busy_cores(sample_s: float = 1.0) -> float:
    """How many cores the machine keeps busy right now (sampled over ``sample_s``)."""
    busy0, total0 = _machine_ticks()
    time.sleep(sample_s)
    busy1, total1 = _machine_ticks()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)


BUSY_MACHINE_CORES = 0.25  # more than this busy before a serving bench: warn that its figures will be noisy


def busy_before_run() -> float:
    """``machine_busy_cores`` over a second before a serving bench; warns on stderr above ``BUSY_MACHINE_CORES``."""
    busy = machine_busy_cores(1.0)
    if busy > BUSY_MACHINE_CORES:
        print(f"bench: warning: {busy:.2f} cores already busy before the run; figures will be noisy (ratios less so)",
              file=sys.stderr)
    return busy


class CpuWindow:
    """CPU use over a load window: the server (by thread), the loader (a waited-for child), the rest.

    Open it, run the load (a subprocess waited for inside the window), ``stop``, then ``report``.
    """

    def __init__(self, server: ServerProcess) -> None:
        self._server = server
        self._threads0 = server.cpu_seconds()
        self._machine0 = _machine_ticks()
        self._children0 = _children_cpu_s()
        self._wall0 = time.perf_counter()

    def stop(self) -> None:
        """End the window (right after the load)."""
        self._wall1 = time.perf_counter()
        self._threads1 = self._server.cpu_seconds()
        self._machine1 = _machine_ticks()
        self._children1 = _children_cpu_s()

    def report(self, requests_per_s: float) -> dict[str, Any]:
        wall = self._wall1 - self._wall0
        busy = self._machine1[0] - self._machine0[0]
        machine = (os.cpu_count() or 1) * busy / max(1, self._machine1[1] - self._machine0[1])
        server = (self._threads1["total"] - self._threads0["total"]) / wall
        loader = (self._children1 - self._children0) / wall
        per_thread = sorted(((k, (v - self._threads0.get(k, 0.0)) / wall) for k, v in self._threads1.items() if k != "total"),
                            key=lambda kv: -kv[1])
        main = next((c for k, c in per_thread if k.split(" ", 1)[0] == str(self._server.pid)), 0.0)
        return {
            "server_cores": round(server, 3),
            "main_thread_cores": round(main, 3),  # the event loop: at ~1.0 it is the bottleneck
            "server_cpu_ms_per_request": round(1e3 * server / requests_per_s, 4) if requests_per_s else None,
            "server_threads_cores": {k: round(v, 3) for k, v in per_thread if v >= 0.01},
            "loader_cores": round(loader, 3),
            "machine_cores_busy": round(machine, 3),
            "other_cores": round(max(0.0, machine - server - loader), 3),  # the harness itself and other jobs
            "cpus": os.cpu_count(),
        }
