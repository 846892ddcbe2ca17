"""The HTTP ``/metrics`` endpoint: prometheus_client's exposition, served by one thread whatever clients do.

prometheus_client's own server (``start_http_server``) starts a thread per connection and
reads without a timeout, so 300 clients that each send half a request hold 300 threads.
Here one thread runs an event loop that holds every connection, and:

- a connection has ``timeout_s`` in all for its TLS handshake, its request and the answer
  (a total, not a timeout per read: a client that trickles a byte at a time is cut off too);
- at most ``max_connections`` are open at once. Past that, the oldest connection that has
  not yet sent its whole request is closed to make room (a scraper sends its request at
  once: the one still waiting is the slow one), or, when every open connection is being
  answered, the new one gets 503 (TLS: is closed);
- one request per connection (``Connection: close``), a request head of at most 16 KiB (431 past it).

What is served is prometheus_client's ``make_wsgi_app`` for the registry, called in-line:
the same text or OpenMetrics negotiation, gzip and ``name[]`` filters, and with several
workers the registry over their ``MultiProcessCollector`` (``server.workers``, where the
parent serves it and a worker serves none). With TLS each handshake uses the certificates
of the moment (``server.tls``), so they rotate without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app

from server.config import Config
from server.tls import CertificateFiles, ReloadingCertificates, metrics_files

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
         b"Connection: close\r\n\r\ntoo many connections\n")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _response(status: str, headers: list[tuple[str, str]], body: bytes, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection")),
             f"Content-Length: {len(body) if length is None else length}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


class MetricsEndpoint:
    def __init__(self, app: WsgiApp, sock: socket.socket, certificates: ReloadingCertificates | None,
                 max_connections: int, timeout_s: float) -> None:
        self._app = app
        self._sock = sock
        self._certificates = certificates
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.refused = 0  # turned away at once: every open connection was being answered
        self.evicted = 0  # closed to make room: it had not sent its request yet
        self.timed_out = 0
        self._open: set[asyncio.Task[None]] = set()
        self._waiting: dict[asyncio.Task[None], None] = {}  # open and still reading the request, oldest first
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metrics-http", daemon=True)
        self._acceptor: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @classmethod
    def serve(cls, registry: CollectorRegistry, host: str, port: int, *, tls: CertificateFiles | None = None,
              max_connections: int = 64, timeout_s: float = 5.0) -> MetricsEndpoint:
        """Bind (port 0: a free one) and serve on a thread of its own; return once listening."""
        certificates = ReloadingCertificates(tls) if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind the metrics endpoint {host}:{port}: {exc.strerror} (is another server "
                                     "running on it? --metrics-port chooses another port, an empty one none)") from None
        sock.setblocking(False)
        endpoint = cls(make_wsgi_app(registry), sock, certificates, max_connections, timeout_s)
        endpoint._thread.start()
        asyncio.run_coroutine_threadsafe(endpoint._start(), endpoint._loop).result(10)
        return endpoint

    @classmethod
    def for_config(cls, registry: CollectorRegistry, config: Config) -> MetricsEndpoint:
        assert config.metrics_port is not None
        return cls.serve(registry, config.metrics_host, config.metrics_port, tls=metrics_files(config),
                         max_connections=config.metrics_max_connections, timeout_s=config.metrics_timeout_seconds)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()
            self._sock.close()

    async def _start(self) -> None:
        self._acceptor = asyncio.get_running_loop().create_task(self._accept(), name="metrics-accept")

    async def _close(self) -> None:
        tasks = [t for t in (self._acceptor, *self._open) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: back off instead of spinning
                log.warning("metrics endpoint cannot accept", extra={"fields": {"error": str(exc)}})
                await asyncio.sleep(0.1)
                continue
            if len(self._open) >= self.max_connections and not self._evict_oldest_waiting():
                self.refused += 1
                with contextlib.suppress(OSError):
                    if self._certificates is None:
                        conn.send(_BUSY)
                conn.close()
                continue
            task = loop.create_task(self._serve(conn))
            self._open.add(task)
            self._waiting[task] = None
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._open.discard(task)
        self._waiting.pop(task, None)

    def _evict_oldest_waiting(self) -> bool:
        oldest = next(iter(self._waiting), None)
        if oldest is None:
            return False
        self._forget(oldest)
        oldest.cancel()
        self.evicted += 1
        return True

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        transport: asyncio.Transport | None = None
        handed_over = False  # from then on the transport owns the socket (and closes it on failure)
        try:
            async with asyncio.timeout(self.timeout_s):
                reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES, loop=loop)
                protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
                context = self._certificates.ssl_context() if self._certificates is not None else None
                handed_over = True
                accepted, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=context,
                    ssl_handshake_timeout=self.timeout_s if context is not None else None,
                    ssl_shutdown_timeout=self.timeout_s if context is not None else None)
                assert isinstance(accepted, asyncio.Transport)
                transport = accepted
                transport.set_write_buffer_limits(high=0)  # drain() then waits for the whole answer
                writer = asyncio.StreamWriter(transport, protocol, reader, loop)
                try:
                    head: bytes | None = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:  # a head past MAX_HEAD_BYTES: said as HTTP says it, then closed
                    head = None
                if task is not None:
                    self._waiting.pop(task, None)
                writer.write(self._answer(head) if head is not None else _response(
                    "431 Request Header Fields Too Large", [("Content-Type", "text/plain")], b"request head too large\n"))
                await writer.drain()
            transport.close()
            transport = None
        except TimeoutError:
            self.timed_out += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError, OSError):
            pass  # the client went away, sent too much or failed the handshake: nothing to answer
        finally:
            if transport is not None:
                transport.abort()
            elif not handed_over:
                conn.close()

    def _answer(self, head: bytes) -> bytes:
        try:
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, target, _version = request_line.split(" ")
        except ValueError:
            return _response("400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n")
        environ: dict[str, Any] = {}
        for line in lines:
            name, colon, value = line.partition(":")
            if colon:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        path, _, query = target.partition("?")
        environ.update(REQUEST_METHOD="GET" if method == "HEAD" else method, PATH_INFO=path, QUERY_STRING=query)
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
            started[:] = [status, headers]

        try:
            try:
                body = b"".join(self._app(environ, start_response))
            except (TypeError, ValueError):  # prometheus_client's parse of an odd Accept (``version=abc``): the client's
                if "HTTP_ACCEPT" not in environ:  # fault, answered in the plain text format, not logged as ours (a review:
                    raise  # 1.25 KB of ERROR traceback per 77-byte request)
                del environ["HTTP_ACCEPT"]
                body = b"".join(self._app(environ, start_response))
        except Exception:
            log.exception("collecting metrics failed")
            return _response("500 Internal Server Error", [("Content-Type", "text/plain")], b"collecting metrics failed\n")
        status, headers = started
        return _response(status, headers, b"" if method == "HEAD" else body, length=len(body))
