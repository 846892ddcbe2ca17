"""A raw HTTP/2 client for the tests: the frames a misbehaving gRPC client sends, no library in between.

grpc's own clients respect the server's SETTINGS (they queue calls beyond
MAX_CONCURRENT_STREAMS locally) and always send their request; an attacker does neither.
This client opens streams with HEADERS only (no DATA: "a call that never sent its message"),
sends PINGs as fast as it likes, sends whole requests with a flow-control window of 0 so that no answer can come back
("a client that never takes its answers"), and records what the server answers, frame by frame.
The ``h2`` package is not a dependency; the framing (RFC 9113) and the literal-only subset of
HPACK (RFC 7541, no Huffman, no table) it needs fit here.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x7, 0xB
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x3, 0x4


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id & 0x7FFFFFFF) + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """HPACK "literal header field without indexing, new name" for each header (no Huffman)."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _integer(len(name), 7) + name.encode() + _integer(len(value), 7) + value.encode()
    return bytes(out)


@dataclass
class Seen:
    """What the server sent, by frame type; RST_STREAM and GOAWAY by error code."""

    frames: Counter[int] = field(default_factory=Counter)
    rst_codes: Counter[int] = field(default_factory=Counter)
    ended_streams: set[int] = field(default_factory=set)  # HEADERS with END_STREAM: the call was answered (refused)
    goaway: list[int] = field(default_factory=list)
    server_pings: int = 0  # PINGs the server sent (not ACKs of ours)
    server_settings: dict[int, int] = field(default_factory=dict)
    closed: bool = False


class RawH2:
    """One HTTP/2 connection, plaintext or TLS (ALPN h2); a thread reads the server's frames."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None, timeout: float = 10,
                 answer_pings: bool = True, source: str | None = None, window: int | None = None) -> None:
        self.answer_pings = answer_pings  # False: a peer that has gone away without closing (keepalive finds it)
        # window: each stream's initial flow-control window the client grants (0: the server may send no DATA, and the
        # client never sends WINDOW_UPDATE)
        # source: the address to connect from (127.0.0.2: another client than the tests' grpc channels on 127.0.0.1)
        sock = socket.create_connection((host, port), timeout=timeout, source_address=(source, 0) if source else None)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        self.sock, self.host, self.port = sock, host, port
        self.seen = Seen()
        self._lock = threading.Lock()
        self._next_stream = 1
        self._settings_acked = threading.Event()
        self._reader = threading.Thread(target=self._read, name="raw-h2", daemon=True)
        try:
            settings = b"" if window is None else struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window)
            self.send(PREFACE + frame(SETTINGS, 0, 0, settings))  # first: the reader thread answers the server's SETTINGS
            self._reader.start()
            if not self._settings_acked.wait(timeout):
                raise TimeoutError("no SETTINGS from the server")
        except BaseException:
            self.close()  # a server that closes at once (a connection cap) leaves no open socket behind
            raise

    def send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def open_calls(self, path: str, n: int, chunk: int = 200) -> list[int]:
        """Start ``n`` calls to ``path``: HEADERS (end of headers, not of the stream) and nothing else."""
        ids = []
        batch = bytearray()
        for i in range(n):
            stream_id, self._next_stream = self._next_stream, self._next_stream + 2
            block = header_block([(":method", "POST"), (":scheme", "http"), (":path", path),
                                  (":authority", f"{self.host}:{self.port}"), ("content-type", "application/grpc"),
                                  ("te", "trailers")])
            batch += frame(HEADERS, END_HEADERS, stream_id, block)
            ids.append(stream_id)
            if (i + 1) % chunk == 0:
                self.send(bytes(batch))
                batch.clear()
        if batch:
            self.send(bytes(batch))
        return ids

    def send_calls(self, path: str, message: bytes, n: int) -> list[int]:
        """Start ``n`` calls to ``path`` and send each its whole request (``message``, serialized) at once."""
        ids = self.open_calls(path, n)
        for stream_id in ids:
            self.send_request(stream_id, message)
        return ids

    def end_without_request(self, stream_id: int) -> None:
        """Half-close the call with no message at all."""
        self.send(frame(DATA, END_STREAM, stream_id))

    def send_request(self, stream_id: int, message: bytes) -> None:
        """The call's one request message (gRPC's 5-byte prefix, uncompressed), ending its stream."""
        self.send(frame(DATA, END_STREAM, stream_id, b"\x00" + struct.pack(">I", len(message)) + message))

    def ping(self, n: int = 1) -> None:
        self.send(b"".join(frame(PING, 0, 0, struct.pack(">Q", i)) for i in range(n)))

    def wait_for(self, predicate: object, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.seen):  # type: ignore[operator]
                return True
            time.sleep(0.05)
        return bool(predicate(self.seen))  # type: ignore[operator]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._reader.ident is not None:  # started
            self._reader.join(5)

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def _read(self) -> None:
        self.sock.settimeout(None)
        try:
            while True:
                head = self._recv_exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv_exact(length) if length else b""
                self.seen.frames[kind] += 1
                if kind == SETTINGS and not flags & ACK:
                    for i in range(0, len(payload), 6):
                        key, value = struct.unpack(">HI", payload[i:i + 6])
                        self.seen.server_settings[key] = value
                    self.send(frame(SETTINGS, ACK, 0))
                    self._settings_acked.set()
                elif kind == PING and not flags & ACK:
                    self.seen.server_pings += 1
                    if self.answer_pings:
                        self.send(frame(PING, ACK, 0, payload))
                elif kind == RST_STREAM:
                    self.seen.rst_codes[int.from_bytes(payload[:4], "big")] += 1
                elif kind == HEADERS and flags & END_STREAM:
                    self.seen.ended_streams.add(stream_id)
                elif kind == GOAWAY:
                    self.seen.goaway.append(int.from_bytes(payload[4:8], "big"))
        except (OSError, ConnectionError, ValueError):
            self.seen.closed = True


@contextlib.contextmanager
def hung_calls(port: int, method: str, per_connection: int, at_least: int, timeout: float = 10.0) -> Iterator[tuple[RawH2, RawH2]]:
    """Two connections that open ``per_connection`` calls each and never send their requests, yielded once the
    server has ended ``at_least`` of those calls (refused past a limit) or ``timeout`` passed, then a settling
    pause; closed on leaving."""
    first, second = RawH2("127.0.0.1", port), RawH2("127.0.0.1", port)
    try:
        first.open_calls(method, per_connection)
        second.open_calls(method, per_connection)
        deadline = time.monotonic() + timeout
        while len(first.seen.ended_streams) + len(second.seen.ended_streams) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        yield first, second
    finally:
        first.close()
        second.close()
