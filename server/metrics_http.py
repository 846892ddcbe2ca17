"""The HTTP ``/metrics`` endpoint: prometheus_client's own server on a thread, for one registry.

In multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set) it serves a fresh registry with a
``MultiProcessCollector``, so all worker processes report as one target.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from server.metrics import multiprocess_mode


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
        if multiprocess_mode():
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        server, thread = start_http_server(port, addr=host, registry=registry)
        return cls(server, thread)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
