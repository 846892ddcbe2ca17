"""The /metrics HTTP server: prometheus_client's exposition, bounded in connections, time and threads; HTTPS."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from server.metrics_http import MetricsEndpoint
from server.tls import CertificateFiles
from tests.harness import Spawned, running_server, spawn_server
from tests.tls_certs import CA, ServerFiles


@contextlib.contextmanager
def endpoint(registry: CollectorRegistry | None = None, **kwargs: Any) -> Iterator[MetricsEndpoint]:
    if registry is None:
        registry = CollectorRegistry()
        Counter("sa_test_things", "Things.", registry=registry).inc(3)
    served = MetricsEndpoint.serve(registry, "127.0.0.1", 0, **kwargs)
    try:
        yield served
    finally:
        served.stop()


def get(port: int, headers: dict[str, str] | None = None, method: str = "GET", context: ssl.SSLContext | None = None,
        path: str = "/metrics") -> tuple[int, dict[str, str], bytes]:
    scheme = "https" if context is not None else "http"
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}", headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def exchange(port: int, request: bytes) -> bytes:
    """Every byte the endpoint sends back on one connection for ``request``, read until it closes."""
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(request)
        while chunk := raw.recv(65536):
            reply += chunk
    return reply


def client_context(trust: CA, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=trust.cert.decode())
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed ``sock`` (EOF or reset) within ``seconds``; what it sent before is skipped."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def test_a_taken_metrics_port_is_an_error_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot bind the metrics endpoint 127.0.0.1:{port}: .*--metrics-port"):
            MetricsEndpoint.serve(CollectorRegistry(), "127.0.0.1", port)


def test_serves_prometheus_text_openmetrics_gzip_and_head() -> None:
    with endpoint() as served:
        status, headers, body = get(served.port)
        assert status == 200 and headers["Connection"] == "close"
        assert headers["Content-Type"].startswith("text/plain")
        assert {f.name for f in text_string_to_metric_families(body.decode())} >= {"sa_test_things"}
        status, headers, body = get(served.port, {"Accept": "application/openmetrics-text; version=1.0.0"})
        assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        status, headers, body = get(served.port, {"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip" and b"sa_test_things_total 3.0" in gzip.decompress(body)
        reply = exchange(served.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # urllib never reads a HEAD's body
        head, _, after = reply.partition(b"\r\n\r\n")
        length = re.search(rb"\r\nContent-Length: (\d+)\r\n", head + b"\r\n")  # what a GET's body would be
        assert head.startswith(b"HTTP/1.1 200") and after == b"" and length is not None and int(length[1]) > 0
        status, _, _ = get(served.port, {"Content-Type": "text/plain"}, method="POST")
        assert status == 405
        status, _, body = get(served.port, path="/metrics?name[]=nothing_here")
        assert status == 200 and b"sa_test_things" not in body


def test_an_odd_accept_header_gets_the_text_format_not_a_500_and_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """An attack review (2026-12-07): ``Accept: application/openmetrics-text; version=abc`` made prometheus_client raise,
    answered 500 and logged an ERROR traceback (1.25 KB a 77-byte request, 11 MB in 5 s of a flood)."""
    with endpoint() as served, caplog.at_level(logging.ERROR):
        status, headers, body = get(served.port, {"Accept": "application/openmetrics-text; version=abc"})
        assert status == 200 and headers["Content-Type"].startswith("text/plain") and b"sa_test_things" in body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _logged(spawned: Spawned, msg: str, timeout: float = 30) -> dict[str, Any]:
    """The first log entry ``msg`` of the spawned server, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(spawned.lines):
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("msg") == msg:
                    return entry
        time.sleep(0.05)
    raise AssertionError("".join(spawned.lines))


def test_a_request_head_past_16_kib_is_answered_431_and_the_next_scrape_served() -> None:
    with endpoint() as served:
        reply = exchange(served.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 20_000 + b"\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large") and reply.endswith(b"request head too large\n")
        assert get(served.port)[0] == 200


def test_300_slow_clients_leave_metrics_answering_and_the_threads_bounded() -> None:
    """The real CLI with its defaults (64 connections, 5 s): 300 clients send half a request and hold.
    Scrapes are answered meanwhile, the process gains no thread, and every slow client is cut off."""
    with spawn_server() as spawned:
        port, pid = int(_logged(spawned, "metrics endpoint")["port"]), spawned.proc.pid
        _logged(spawned, "serving")  # the model is loaded: its loader's threads are there already
        assert get(port)[0] == 200
        before = len(os.listdir(f"/proc/{pid}/task"))
        slow = []
        try:
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
                slow.append(sock)
            during = len(os.listdir(f"/proc/{pid}/task"))
            started = time.monotonic()
            status, _, body = get(port)
            scrape_s = time.monotonic() - started
            assert status == 200 and b"shopping_agent_model_loaded" in body
            closed = sum(closed_within(sock, 8.0) for sock in slow)
        finally:
            for sock in slow:
                sock.close()
        after = len(os.listdir(f"/proc/{pid}/task"))
        print(f"\n300 slow /metrics clients: threads {before} -> {during} (held) -> {after}; a scrape meanwhile "
              f"{scrape_s * 1000:.1f} ms; {closed} of 300 cut off by the server")
        assert during <= before + 1 and after <= before + 1
        assert closed == 300
        assert get(port)[0] == 200


def test_a_client_trickling_its_request_is_cut_off_at_the_total_deadline() -> None:
    with endpoint(timeout_s=1.0) as served, socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40:
                sock.send(bytes([byte]))  # each byte well within any per-read timeout
                time.sleep(0.1)
                if time.monotonic() - started > 3:
                    break
        assert closed_within(sock, 3.0)
        assert time.monotonic() - started < 3.5
        assert served.timed_out == 1


def test_past_the_bound_the_oldest_client_still_sending_its_request_makes_room() -> None:
    with endpoint(max_connections=2) as served:
        first, second = (socket.create_connection(("127.0.0.1", served.port), timeout=5) for _ in range(2))
        with first, second:
            for sock in (first, second):
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            deadline = time.monotonic() + 5
            while served.open_connections < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert get(served.port)[0] == 200  # a third: the oldest waiting one (first) is closed for it
            assert closed_within(first, 2.0)
            assert served.evicted == 1 and served.refused == 0
            second.sendall(b"Host: x\r\n\r\n")  # the second one was kept and is answered
            second.settimeout(5)
            assert second.recv(64).startswith(b"HTTP/1.1 200 OK")


def test_https_metrics_with_a_client_certificate_and_rotation(tmp_path: Path) -> None:
    ca, new_ca = CA.create("metrics CA"), CA.create("the next metrics CA")
    files = ServerFiles.write(tmp_path / "server", ca)
    client = ca.issue("prometheus", server=False)
    (tmp_path / "client.crt").write_bytes(client.cert)
    (tmp_path / "client.key").write_bytes(client.key)
    with running_server(metrics_host="127.0.0.1", metrics_port=0, metrics_tls_cert=files.cert, metrics_tls_key=files.key,
                        metrics_tls_client_ca=files.client_ca) as live:
        assert live.server is not None and live.server.metrics_endpoint is not None
        port = live.server.metrics_endpoint.port
        status, _, body = get(port, context=client_context(ca, tmp_path / "client.crt", tmp_path / "client.key"))
        assert status == 200 and b"shopping_agent_model_loaded" in body
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(port, context=client_context(ca))  # no client certificate
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            get(port)  # plain HTTP to an HTTPS port
        new_client = new_ca.issue("prometheus", server=False)
        (tmp_path / "new.crt").write_bytes(new_client.cert)
        (tmp_path / "new.key").write_bytes(new_client.key)
        files.install(new_ca)
        status, _, _ = get(port, context=client_context(new_ca, tmp_path / "new.crt", tmp_path / "new.key"))
        assert status == 200
        with pytest.raises((ssl.SSLError, urllib.error.URLError)):
            get(port, context=client_context(ca, tmp_path / "client.crt", tmp_path / "client.key"))


def test_a_tls_handshake_that_never_finishes_is_cut_off(tmp_path: Path) -> None:
    ca = CA.create("metrics CA")
    files = ServerFiles.write(tmp_path, ca)
    with endpoint(tls=CertificateFiles(files.cert, files.key, flag="--metrics-tls-cert"), timeout_s=1.0) as served, \
            socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, and nothing more
        assert closed_within(sock, 3.0)
        assert served.timed_out == 1
