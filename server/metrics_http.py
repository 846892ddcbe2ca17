"""The HTTP ``/metrics`` endpoint: prometheus_client's own server on a thread, for one registry.

With several workers the parent process serves it over a ``MultiProcessCollector``
(``server.workers``); a worker itself serves none.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @classmethod
    def serve(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
        server, thread = start_http_server(port, addr=host, registry=registry)
        return cls(server, thread)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
