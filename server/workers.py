"""Several server processes on one port: the parent supervises, the children serve.

Each worker is the ordinary single-process server started with ``--reuse-port`` on the
same port, so the kernel spreads connections across them (SO_REUSEPORT); each has its own
event loop, GIL, onnxruntime sessions and micro-batcher. The parent owns what must be one
per pod: the metrics endpoint (prometheus_client's multiprocess mode over a directory it
wipes at start, so every worker reports as one target) and the signals: SIGTERM/SIGINT are
forwarded to every worker, which drains as usual; the parent exits 0 when all of them did.
A worker that dies on its own takes the pod down (non-zero exit) so Kubernetes restarts it
whole rather than serving with less capacity than it advertises.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from server.config import Config, to_args

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def prepare_multiproc_dir(config: Config) -> Path:
    """The multiprocess directory, emptied: stale files from a previous run would be summed in."""
    path = Path(config.metrics_multiproc_dir) if config.metrics_multiproc_dir else Path(tempfile.mkdtemp(prefix="sa-metrics-"))
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


class ModelAgeCollector:
    """``shopping_agent_model_age_seconds`` for the pod: now minus the oldest created-at any worker serves.

    A worker computes its age at scrape time, which multiprocess mode cannot carry; the parent
    derives it from the workers' created timestamps instead.
    """

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        created = [s.value for f in self._source.collect() for s in f.samples
                   if s.name == "shopping_agent_model_created_timestamp_seconds" and math.isfinite(s.value) and s.value > 0]
        if created:
            family = GaugeMetricFamily("shopping_agent_model_age_seconds", "Seconds since the served bundle was created.")
            family.add_metric([], time.time() - min(created))
            yield family


def run_workers(config: Config, environ: Mapping[str, str]) -> int:
    from prometheus_client import CollectorRegistry, multiprocess

    from server.metrics_http import MetricsEndpoint

    mp_dir = prepare_multiproc_dir(config)
    port = config.port or free_port(config.host)
    child_args = to_args(config, workers=1, port=port, reuse_port=True, metrics_port=None, metrics_multiproc_dir=None)
    env = {**environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    children = [subprocess.Popen([sys.executable, "-m", "server", "serve", *child_args], env=env)
                for _ in range(config.workers)]
    log.info("workers started", extra={"fields": {"workers": config.workers, "port": port,
                                                   "pids": [c.pid for c in children]}})
    endpoint = None
    if config.metrics and config.metrics_port is not None:
        registry = CollectorRegistry()
        collector = multiprocess.MultiProcessCollector(None, path=str(mp_dir))  # type: ignore[no-untyped-call]
        registry.register(collector)
        registry.register(ModelAgeCollector(collector))
        endpoint = MetricsEndpoint.serve(registry, config.metrics_host, config.metrics_port)
        log.info("metrics endpoint", extra={"fields": {"host": config.metrics_host, "port": endpoint.port}})

    stopping = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        log.info("signal received, stopping workers", extra={"fields": {"signal": signal.Signals(signum).name}})
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        for child in children:
            if child.pid in codes:
                continue
            code = child.poll()
            if code is None:
                continue
            codes[child.pid] = code
            multiprocess.mark_process_dead(child.pid, str(mp_dir))  # type: ignore[no-untyped-call]
            if not stopping.is_set():
                log.error("a worker exited on its own; stopping the others", extra={"fields": {"pid": child.pid, "code": code}})
                forward(signal.SIGTERM, None)
        time.sleep(0.05)
    if endpoint is not None:
        endpoint.stop()
    shutil.rmtree(mp_dir, ignore_errors=True)
    failed = {pid: code for pid, code in codes.items() if code != 0}
    log.info("workers stopped", extra={"fields": {"exit_codes": codes}})
    return 0 if not failed and stopping.is_set() else 1
