"""Several server processes on one port: the parent supervises, the children serve.

Each worker is the ordinary single-process server started with ``--reuse-port`` on the
same port, so the kernel spreads connections across them (SO_REUSEPORT); each has its own
event loop, GIL, onnxruntime sessions and micro-batcher. The parent owns what must be one
per pod: the metrics endpoint (prometheus_client's multiprocess mode over a directory whose
``*.db`` files it removes at start, so every worker reports as one target) and the signals:
SIGTERM/SIGINT are forwarded to every worker, which drains as usual; the parent exits 0
when all of them did. A worker still running ``grace_seconds + drain_delay_seconds`` plus a
margin after the signal is killed and the parent exits non-zero. A worker that exits on its
own, whatever its exit code, takes the pod down (non-zero exit) so Kubernetes restarts it
whole rather than serving with less capacity than it advertises; so does one whose event loop
stops writing its heartbeat for ``--worker-stall-seconds`` (hung or stopped: the parent kills
it, ``server.supervised``). A parent killed outright forwards nothing; each worker then notices
it has lost its parent and drains on its own (``server.supervised``), so none is left holding
the port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from server.config import SALT_ENV, Config, to_args
from server.owned_dirs import owned_dir, sweep_abandoned
from server.supervised import Heartbeats
from server.transport import check_port_free

log = logging.getLogger(__name__)

KILL_MARGIN_SECONDS = 5.0
"""Beyond the workers' own drain delay and grace, how long the parent waits before SIGKILL."""
_TICK_SECONDS = 0.5
"""Longest the supervisor blocks at once; bounds the delay of a signal delivered to another thread."""
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
# What prometheus_client's multiprocess mode writes: {counter,histogram,summary,gauge_<mode>}_<pid>.db
_DB_FILE = re.compile(r"(?:counter|histogram|summary|gauge_[a-z]+)_\d+\.db")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


METRICS_DIR_PREFIX = "sa-metrics-"


@dataclass(frozen=True)
class MultiprocDir:
    """prometheus_client's multiprocess directory; ``temporary`` when the parent created it itself, and then ``lock_fd``
    its owner lock (``server.owned_dirs``), which every worker inherits."""

    path: Path
    temporary: bool
    lock_fd: int | None = None

    def inherited(self) -> tuple[int, ...]:
        """The descriptors a worker must hold for as long as it runs."""
        return () if self.lock_fd is None else (self.lock_fd,)

    def remove_db_files(self) -> None:
        """Remove prometheus_client's files only: the directory may be a mount point or hold other files."""
        for entry in self.path.iterdir():
            if _DB_FILE.fullmatch(entry.name) and entry.is_file():
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.lock_fd is not None:
                os.close(self.lock_fd)  # the workers' copies are gone with them: nothing holds the lock now
            return
        try:
            self.remove_db_files()
        except OSError as exc:
            log.warning("could not clean the metrics directory", extra={"fields": {"path": str(self.path), "error": str(exc)}})


def prepare_multiproc_dir(config: Config) -> MultiprocDir:
    """The multiprocess directory without stale files: a previous run's would be summed in. A directory of its own
    (no ``--metrics-multiproc-dir``) is made under the temp dir, after removing those that supervisors killed outright
    left behind (``server.owned_dirs``)."""
    if config.metrics_multiproc_dir is None:
        try:
            for path in sweep_abandoned(METRICS_DIR_PREFIX):
                log.info("removed an abandoned metrics directory", extra={"fields": {"path": str(path)}})
        except Exception as exc:  # housekeeping: never a reason not to start
            log.warning("could not sweep abandoned metrics directories", extra={"fields": {"error": str(exc)}})
        path, lock_fd = owned_dir(METRICS_DIR_PREFIX)
        return MultiprocDir(path, temporary=True, lock_fd=lock_fd)
    mp_dir = MultiprocDir(Path(config.metrics_multiproc_dir), temporary=False)
    mp_dir.path.mkdir(parents=True, exist_ok=True)
    mp_dir.remove_db_files()
    return mp_dir


@dataclass(frozen=True)
class _Signalled:
    signum: int


@dataclass(frozen=True)
class _Exited:
    pid: int
    code: int


@dataclass
class _Supervisor:
    """Waits on the workers; every decision is taken here, on the main thread, one event at a time.

    Events come through a ``SimpleQueue``, whose ``put`` is safe from a signal handler: the
    handlers only record the signal, and one thread per worker blocks in ``wait()``.
    """

    config: Config
    mp_dir: MultiprocDir
    events: queue.SimpleQueue[_Signalled | _Exited] = field(default_factory=queue.SimpleQueue)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)  # signals the parent received (appended by the handler)
    codes: dict[int, int] = field(default_factory=dict)
    on_their_own: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    stalled: list[int] = field(default_factory=list)  # killed for a silent heartbeat
    deadline: float | None = None  # set once stopping: by a signal or by a worker exiting on its own
    heartbeats: Heartbeats = field(init=False)

    def __post_init__(self) -> None:
        self.heartbeats = Heartbeats(self.config.worker_stall_seconds)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.requested.append(signum)
        self.events.put(_Signalled(signum))

    def spawn(self, args: list[str], env: Mapping[str, str]) -> None:
        for _ in range(self.config.workers):
            if self.requested:  # asked to stop while starting: start no more, stop the ones started
                break
            read, write = self.heartbeats.pipe()
            try:
                child = subprocess.Popen([*args, "--heartbeat-fd", str(write)], env=env,
                                         pass_fds=(write, *self.mp_dir.inherited()))
            except BaseException:
                os.close(read)
                raise
            finally:
                os.close(write)  # the child holds its own copy
            self.heartbeats.watch(child.pid, read)
            self.children.append(child)
            threading.Thread(target=self._wait, args=(child,), name=f"wait-worker-{child.pid}", daemon=True).start()

    def _wait(self, child: subprocess.Popen[bytes]) -> None:
        self.events.put(_Exited(child.pid, child.wait()))

    def supervise(self) -> None:
        from prometheus_client import multiprocess

        while len(self.codes) < len(self.children):
            if self.deadline is None:
                self._kill_silent()
            try:
                event = self.events.get(timeout=self._timeout())
            except queue.Empty:
                if self.deadline is not None and not self.killed and time.monotonic() >= self.deadline:
                    self._kill_stragglers()
                continue
            if isinstance(event, _Signalled):
                log.info("signal received, stopping workers", extra={"fields": {"signal": signal.Signals(event.signum).name}})
                self._stop(event.signum)
                continue
            self.codes[event.pid] = event.code
            multiprocess.mark_process_dead(event.pid, str(self.mp_dir.path))  # type: ignore[no-untyped-call]
            if self.deadline is None:
                self.on_their_own.append(event.pid)
                log.error("a worker exited on its own; stopping the others",
                          extra={"fields": {"pid": event.pid, "code": event.code}})
                self._stop(signal.SIGTERM)

    def _kill_silent(self) -> None:
        """Kill a worker whose event loop has not written its heartbeat for ``worker_stall_seconds``; its exit then
        stops the others, as a worker exiting on its own does."""
        for pid, silent in self.heartbeats.silent(c.pid for c in self._running() if c.pid not in self.stalled):
            log.error("a worker's event loop has not run for too long (hung or stopped); killing it",
                      extra={"fields": {"pid": pid, "silent_s": round(silent, 1),
                                        "worker_stall_seconds": self.config.worker_stall_seconds}})
            self.stalled.append(pid)
            for child in self.children:
                if child.pid == pid:
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()

    def _timeout(self) -> float:
        if self.deadline is None or self.killed:
            return _TICK_SECONDS
        return min(_TICK_SECONDS, max(0.0, self.deadline - time.monotonic()))

    def _running(self) -> list[subprocess.Popen[bytes]]:
        return [c for c in self.children if c.pid not in self.codes]

    def _stop(self, signum: int) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
        for child in self._running():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    @property
    def grace_s(self) -> float:
        return self.config.grace_seconds + self.config.drain_delay_seconds + KILL_MARGIN_SECONDS

    def _kill_stragglers(self) -> None:
        stragglers = self._running()
        self.killed = [c.pid for c in stragglers]
        log.error("workers did not stop in time; killing them",
                  extra={"fields": {"pids": self.killed, "waited_s": round(self.grace_s, 3)}})
        for child in stragglers:
            with contextlib.suppress(ProcessLookupError):
                child.kill()

    def abandon(self) -> None:
        """After an error in the parent itself: no worker outlives it."""
        for child in self._running():
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(10)

    def exit_code(self) -> int:
        asked = set(self.requested)
        # A worker the forwarded signal reached before it installed its handlers had nothing to drain.
        failed = {pid: code for pid, code in self.codes.items() if code != 0 and not (asked and -code in asked)}
        return 1 if failed or self.on_their_own or self.killed else 0


def run_workers(config: Config, environ: Mapping[str, str]) -> int:
    from prometheus_client import CollectorRegistry, multiprocess

    from server.metrics import ModelAgeCollector
    from server.metrics_http import MetricsEndpoint

    try:
        mp_dir = prepare_multiproc_dir(config)
    except OSError as exc:
        where = (f"--metrics-multiproc-dir {config.metrics_multiproc_dir}" if config.metrics_multiproc_dir is not None
                 else f"a metrics directory under {tempfile.gettempdir()} (or set --metrics-multiproc-dir)")
        print(f"shopping-agent: {where}: cannot be prepared: {exc.strerror or exc}", file=sys.stderr)
        return 2
    sup = _Supervisor(config, mp_dir)
    previous = {signum: signal.signal(signum, sup.on_signal) for signum in _FORWARDED}  # before any worker exists
    endpoint = None
    try:
        for flag, taken in (("--port", config.port), ("--health-port", config.health_port)):
            if taken:  # the workers bind with SO_REUSEPORT, which a stale server's socket would share unseen
                check_port_free(config.host, taken, flag)
        port = config.port or free_port(config.host)
        health_port = free_port(config.host) if config.health_port == 0 else config.health_port  # one port for all
        if config.metrics and config.metrics_port is not None:
            registry = CollectorRegistry()
            collector = multiprocess.MultiProcessCollector(None, path=str(mp_dir.path))  # type: ignore[no-untyped-call]
            registry.register(collector)
            registry.register(ModelAgeCollector(collector))  # (a worker's own age cannot be carried)
            endpoint = MetricsEndpoint.for_config(registry, config)  # the same TLS and limits as a single process
            log.info("metrics endpoint", extra={"fields": {"host": config.metrics_host, "port": endpoint.port}})
        # Every other option (TLS files, limits, keepalive) reaches each worker as the same flag.
        child_args = to_args(config, workers=1, port=port, health_port=health_port, reuse_port=True, metrics_port=None,
                             metrics_multiproc_dir=None, supervisor_pid=os.getpid())
        # The salt travels in the environment, not on a command line that `ps` shows.
        env = {**environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir.path), SALT_ENV: config.log_user_salt}
        sup.spawn([sys.executable, "-m", "server", "serve", *child_args], env)
        log.info("workers started", extra={"fields": {"workers": len(sup.children), "port": port,
                                                       "pids": [c.pid for c in sup.children], "metrics_dir": str(mp_dir.path)}})
        sup.supervise()
    except OSError as exc:
        sup.abandon()
        if sup.children:
            raise
        print(f"shopping-agent: {exc}", file=sys.stderr)  # a port or the metrics endpoint, before any worker: set-up
        return 2
    except BaseException:
        sup.abandon()
        raise
    finally:
        sup.heartbeats.close()
        if endpoint is not None:
            endpoint.stop()
        mp_dir.cleanup()
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
    log.info("workers stopped", extra={"fields": {"exit_codes": sup.codes, "exited_on_their_own": sup.on_their_own,
                                                   "killed": sup.killed}})
    return sup.exit_code()
