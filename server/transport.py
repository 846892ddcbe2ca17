"""How the gRPC servers meet the network: one set of channel options, and the credentials of a port.

Every server of the process (the service port's ``--grpc-servers`` and the plaintext health
port) is built by ``new_server`` with the options of ``server_options``, so each limit is set
in one place.

Why several servers on the service port: a ``grpc.aio`` server admits new calls one at a time
(it asks grpc-core for the next call only after the event loop has taken the last one), so
under load calls queue inside grpc-core, out of the batcher's sight, while the loop runs
batches of one or two. Measured (2026-12-04, h2load 4 connections at 3,300 req/s, channelz's
calls started against the handler's entries): a bad window held all 256 of the client's calls
in grpc-core and 0-8 in the handler. Servers bound with SO_REUSEPORT each take the
connections the kernel hands them, so the calls of several connections are admitted at once.

- ``maximum_concurrent_rpcs``: calls in progress over all connections (shared out between
  the service port's servers by ``concurrency_share``: each enforces its share, so the
  connections one server holds meet its share before the total). grpc counts a call
  from the moment its HEADERS arrive, before any message, so calls that never send their
  request count too; past the limit grpc answers new calls RESOURCE_EXHAUSTED ("Concurrent
  RPC limit exceeded!") itself, before any handler runs, so they are not in
  ``grpc_server_*`` (the client sees them);
- ``grpc.max_concurrent_streams``: calls at once on one connection (HTTP/2 SETTINGS); the
  server resets streams past it (REFUSED_STREAM);
- keepalive: the server pings every connection (even one whose only calls are stuck, so a
  dead peer's calls are freed) and closes it when the ping is not answered in time (grpc-core
  acts on ``grpc.http2.ping_timeout_ms`` for that, so it is set with the keepalive timeout); a
  client that pings more often than allowed collects strikes and is sent GOAWAY
  (ENHANCE_YOUR_CALM);
- ``grpc.max_allowed_incoming_connections``: connections open at once (``--max-connections``,
  shared out as the calls are); past it grpc-core closes a new connection as it arrives. Idle
  connections cost about 16 KB each and nothing else bounded them: an attack review
  (2026-12-05) held 12,000 for 287 MB. A memory backstop sized to the pod, not a per-client
  limit (grpc has no hook at accept): one client can fill it, and new clients are then refused;
- a call's request must arrive within ``--request-receive-timeout-seconds`` of its start, one
  address may have ``--max-waiting-calls-per-peer`` calls waiting for theirs, and streaming calls
  are held to a budget (``server.call_bounds``): grpc has no option for any of them;
- ``grpc.max_connection_idle_ms`` closes connections with no call in progress,
  ``grpc.max_connection_age_ms`` (plus 30 s of grace) every connection, stuck calls
  included; ``grpc.server_handshake_timeout_ms`` bounds the TLS handshake and the wait for
  the client's HTTP/2 settings.
"""

from __future__ import annotations

import socket

import grpc
from grpc import aio

from server.config import Config

CONNECTION_AGE_GRACE_MS = 30_000
HEALTH_MAX_CONCURRENT_RPCS = 64
"""The health port serves probes: a few calls at a time."""
HEALTH_RECEIVE_TIMEOUT_SECONDS = 2.0
"""The health port's receive timeout, whatever the service port's (``--request-receive-timeout-seconds`` 0 is for a
port behind a proxy, and no proxy stands before the kubelet's probes)."""
HEALTH_WAITING_PER_PEER = 8
"""Of them, how many one address may have waiting for their request (``server.call_bounds``): the kubelet's probes send
theirs with their headers, so another address cannot take the port's slots alone."""
HEALTH_CALLS_PER_PEER = 16
"""And how many one address may have in progress at all (a call whose answer it does not take counts until it is cut):
the kubelet runs a pod's three probes a few at a time."""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(config: Config, reuse_port: bool | None = None) -> list[tuple[str, int]]:
    """The channel options of a server (``reuse_port``: SO_REUSEPORT; ``None``: the config's ``--reuse-port``)."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port if reuse_port is None else reuse_port)),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.keepalive_time_ms", _ms(config.keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", _ms(config.keepalive_timeout_seconds)),
        ("grpc.http2.ping_timeout_ms", _ms(config.keepalive_timeout_seconds)),  # what closes the connection (default 1 min)
        ("grpc.keepalive_permit_without_calls", 1),  # idle connections are pinged, and clients may ping them too
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging connections whose calls send nothing
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is spelt this way (a "..._recv_..." key is ignored).
        ("grpc.http2.min_ping_interval_without_data_ms", round(config.keepalive_min_client_ping_seconds * 1000)),
        ("grpc.http2.max_ping_strikes", config.keepalive_max_ping_strikes),
        ("grpc.server_handshake_timeout_ms", _ms(config.handshake_timeout_seconds)),
    ]
    if config.max_connection_idle_seconds is not None:
        options.append(("grpc.max_connection_idle_ms", _ms(config.max_connection_idle_seconds)))
    if config.max_connection_age_seconds is not None:  # clients reconnect, re-resolve and spread over new pods
        options += [("grpc.max_connection_age_ms", _ms(config.max_connection_age_seconds)),
                    ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_MS)]
    return options


def concurrency_share(limit: int | None, servers: int, index: int) -> int | None:
    """Server ``index``'s share of ``limit`` calls over ``servers`` servers: equal shares that add up to ``limit``."""
    if limit is None:
        return None
    return limit // servers + (1 if index < limit % servers else 0)


def new_server(config: Config, maximum_concurrent_rpcs: int | None, reuse_port: bool | None = None,
               max_connections: int | None = None) -> aio.Server:
    options = server_options(config, reuse_port)
    if max_connections is not None:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return aio.server(options=options, maximum_concurrent_rpcs=maximum_concurrent_rpcs)


def service_servers(config: Config) -> list[aio.Server]:
    """The service port's ``--grpc-servers`` servers, each with its share of ``--max-concurrent-rpcs`` and of
    ``--max-connections`` (module doc)."""
    n = config.grpc_servers
    return [new_server(config, concurrency_share(config.max_concurrent_rpcs, n, i), reuse_port=config.reuse_port or n > 1,
                       max_connections=concurrency_share(config.max_connections, n, i))
            for i in range(n)]


def check_port_free(host: str, port: int, flag: str | None = None) -> None:
    """Raise ``OSError`` naming ``host:port`` (and ``flag``) if anything listens there already.

    The service port is bound with SO_REUSEPORT when ``--grpc-servers`` > 1, and such a bind
    succeeds beside another process of the same user that did the same (a stale server, a second
    one started by mistake), which would then take a share of the connections unseen. A probe
    bound without SO_REUSEPORT fails if any socket holds the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no listener
        try:
            probe.bind((host, port))
        except OSError as exc:
            where = f"{flag}: " if flag else ""
            raise OSError(exc.errno, f"{where}cannot bind {host}:{port}: {exc.strerror} (is another server running on it?)") from None


def add_port(server: aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None, flag: str = "--port") -> int:
    """Bind ``host:port`` (TLS with ``credentials``, else plaintext); return the bound port. ``OSError`` naming the
    address and ``flag`` when it cannot be bound (grpcio raises a ``RuntimeError`` for a taken port; older releases
    returned 0)."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"{flag}: cannot bind {address} (is another server running on it?): {exc}") from None
    if bound == 0:
        raise OSError(f"{flag}: cannot bind {address}")
    return int(bound)
