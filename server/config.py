"""Server configuration: one frozen, typed object built once at the edge.

Every field can be set by a command-line flag (``--max-batch``) or an environment variable
(``SHOPPING_AGENT_MAX_BATCH``); flags win over the environment, which wins over the
defaults. No other module reads ``os.environ``. ``describe()`` renders the table in
docs/configuration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from core.domain import MAX_OUTCOME_VALUE
from weights.sandbox import MAX_MEMORY_MB

ENV_PREFIX = "SHOPPING_AGENT_"


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


MAX_GRPC_SERVERS = 64
C_INT_MAX = 2**31 - 1
"""gRPC's channel arguments are C ``int``s: a count past this, or a duration past it in milliseconds (about 24.8 days),
stopped ``serve`` with an ``OverflowError`` traceback (a review, 2026-12-07)."""
MAX_GRPC_SECONDS = C_INT_MAX // 1000
CEILINGS = {"workers": 256, "intra_op_threads": 256, "max_batch": 4096, "log_flush_seconds": 3600.0, "log_segment_seconds": 86400.0,
            "log_segment_mb": 1e6, "drain_delay_seconds": 3600.0, "grace_seconds": 3600.0, "weights_debounce_ms": 60_000.0,
            "max_batch_delay_ms": 1000.0, "batch_gap_ms": 1000.0, "min_inference_budget_ms": 60_000.0,
            "metrics_timeout_seconds": 3600.0}
"""Sanity ceilings (an attack review, 2026-12-07): of what the server multiplies into processes, threads or memory at
start (``--max-batch 99999999999`` passed, then the warm-up ran out of memory and the server served no model), and of
times and sizes that feed a timer or an integer (``--log-flush-seconds 1e10`` killed the log writer at start while the
server went on logging nothing; an infinite debounce logged a traceback a second and loaded no bundle; an infinite
drain delay never let SIGTERM finish; an infinite segment size stopped the start)."""


@dataclass(frozen=True)
class Config:
    host: str = _opt("0.0.0.0", "address to bind the gRPC server to")
    port: int = _opt(50051, "gRPC port; 0 picks a free port (logged at start)")
    workers: int = _opt(1, "server processes sharing the port (SO_REUSEPORT); metrics report as one target")
    reuse_port: bool = _opt(False, "bind with SO_REUSEPORT (set for each worker when --workers > 1)")
    supervisor_pid: int | None = _opt(None, "set for each worker when --workers > 1: the worker drains and exits once this "
                                            "process is no longer its parent (the supervisor was killed without forwarding a "
                                            "signal, so no worker is left holding the port)")
    heartbeat_fd: int | None = _opt(None, "set for each worker when --workers > 1: a pipe to the supervisor, written once a "
                                          "second from the worker's event loop")
    worker_stall_seconds: float = _opt(30.0, "with --workers > 1: a worker whose event loop has not written its heartbeat for "
                                             "this long (hung, stopped; at least 3) is killed, and the pod with it; 0: never")
    grpc_servers: int = _opt(8, "grpc.aio servers in each process, all on the one port (SO_REUSEPORT between them): one "
                                "admits new calls one at a time through the event loop, several admit several connections' "
                                "calls at once (a connection's calls stay on one server); --max-concurrent-rpcs is shared "
                                "out evenly between them")
    metrics_multiproc_dir: Path | None = _opt(
        None, "with --workers > 1: prometheus_client's multiprocess directory; its *.db files are removed at start "
              "(default: a temporary one)")
    metrics: bool = _opt(True, "collect Prometheus metrics (--no-metrics turns collection and the endpoint off)")
    metrics_host: str = _opt("0.0.0.0", "address of the HTTP /metrics endpoint")
    metrics_port: int | None = _opt(9095, "port of the HTTP /metrics endpoint; 0 picks a free port (logged); empty: no endpoint")
    metrics_tls_cert: Path | None = _opt(None, "PEM certificate chain of /metrics: with --metrics-tls-key it serves HTTPS only "
                                               "(the files are re-read when they change)")
    metrics_tls_key: Path | None = _opt(None, "PEM private key (unencrypted) of --metrics-tls-cert")
    metrics_tls_client_ca: Path | None = _opt(None, "PEM CA certificates: /metrics then requires a client certificate one of "
                                                    "them signed (needs --metrics-tls-cert)")
    metrics_max_connections: int = _opt(64, "most /metrics connections open at once; past it the oldest one still sending its "
                                            "request is closed, or the new one gets 503 when all are being answered")
    metrics_timeout_seconds: float = _opt(5.0, "a /metrics connection has this long for its TLS handshake, request and answer")
    weights_dir: Path | None = _opt(None, "directory holding the active bundle (weights_active.bundle); unset: the embedded default")
    weights_poll_seconds: float = _opt(1.0, "how often the active bundle is stat()ed (the source of truth on NFS, where inotify is blind)")
    weights_inotify: bool = _opt(True, "also watch the weights directory with inotify (watchdog), so changes are seen sooner")
    weights_debounce_ms: float = _opt(50.0, "wait until the active bundle has been still this long before loading it")
    max_canary_fraction: float = _opt(0.5, "largest share of sessions a canary (weights_dir/canary/canary.bundle) may serve; its "
                                           "manifest asks for its share, capped here; 0: never serve a canary")
    use_embedded_default: bool = _opt(True, "serve the embedded default bundle when weights_dir has no usable bundle")
    timezone: str = _opt("UTC", "IANA timezone of the hour-of-day feature")
    device: str = _opt("auto", "onnxruntime device: auto (CUDA when present), cpu or cuda")
    intra_op_threads: int = _opt(1, "onnxruntime threads per session")
    max_batch: int = _opt(64, "most requests micro-batched into one inference call")
    max_queue: int = _opt(1024, "requests waiting for inference before new ones get the degraded (rule) answer")
    batch_duty: float = _opt(0.05, "after a batch that ran t, requests may gather for up to t*(1/duty-1) before the next, "
                                   "so under load inference takes about this share of the event loop; 1: never wait")
    max_batch_delay_ms: float = _opt(10.0, "longest such gathering pause (it also ends for a caller's deadline)")
    batch_gap_ms: float = _opt(1.0, "a gathering pause ends once this long passes without a new request (a lone client "
                                    "calling one at a time is never held)")
    min_inference_budget_ms: float = _opt(5.0, "a call whose deadline leaves less than this gets the rule answer at once")
    max_recent_behavior_ids: int = _opt(32, "most recent_behavior_ids accepted in one request")
    max_id_length: int = _opt(256, "longest accepted id string (characters)")
    max_connection_age_seconds: float | None = _opt(
        None, "close each client connection after this long (then 30 s to finish calls), so clients re-resolve DNS and "
              "reach new pods; empty: never")
    max_message_bytes: int = _opt(64 * 1024, "largest accepted request message (gRPC RESOURCE_EXHAUSTED above)")
    tls_cert: Path | None = _opt(None, "PEM certificate chain of the gRPC port: with --tls-key the port serves TLS only "
                                       "(the files are re-read when they change, no restart)")
    tls_key: Path | None = _opt(None, "PEM private key (unencrypted) of --tls-cert")
    tls_client_ca: Path | None = _opt(None, "PEM CA certificates: clients must present a certificate one of them signed "
                                            "(mutual TLS; needs --tls-cert)")
    health_port: int | None = _opt(None, "a second, plaintext gRPC port answering grpc.health.v1's Check only, for kubelet probes "
                                         "(which cannot do TLS); 0 picks a free port; empty: none")
    max_concurrent_rpcs: int | None = _opt(4096, "calls in progress at once over all connections (each costs about 20-25 KB); "
                                                 "each of the --grpc-servers enforces its even share (512 by default: two "
                                                 "connections' worth of streams, so one connection cannot fill its server); past "
                                                 "it new calls fail at once with RESOURCE_EXHAUSTED; empty: no limit")
    max_concurrent_streams: int = _opt(256, "calls in progress at once on one connection (HTTP/2 MAX_CONCURRENT_STREAMS); "
                                            "the server refuses the streams past it, and a client that keeps this many in "
                                            "flight has some refused as answered streams are released (keep a channel to "
                                            "about half, docs/deploy.md)")
    request_receive_timeout_seconds: float = _opt(
        2.0, "a call whose request message has not arrived this long after it started is ended (DEADLINE_EXCEEDED), and "
             "one whose answer has not gone out this long after it was ready ends its connection: grpc counts a call against "
             "--max-concurrent-rpcs from its headers to its answer's delivery, so calls that never send their request, or "
             "never let the server send the answer, would hold those slots for as long as their connection lasts; 0: off, "
             "with the per-peer bounds (for a port behind a proxy that bounds what a client holds: the read costs about "
             "4 per cent of the throughput)")
    max_waiting_calls_per_peer: int = _opt(64, "calls from one address (the peer's IP) that may wait for their request "
                                               "at once in a process; past it a new call from there gets RESOURCE_EXHAUSTED, "
                                               "so one client reopening calls it never completes cannot hold the others' slots")
    max_calls_per_peer: int = _opt(256, "calls from one address in progress at once in a process (from the call's "
                                        "start to its answer's delivery); past it a new call from there gets "
                                        "RESOURCE_EXHAUSTED. Half of one --grpc-servers' share of --max-concurrent-rpcs "
                                        "by default (4,096 / 8 / 2), so one client cannot fill any one server")
    max_streaming_calls: int = _opt(256, "streaming calls (Health/Watch, reflection) in progress at once in a process; past "
                                         "it new ones get RESOURCE_EXHAUSTED, so streams that never end cannot take the "
                                         "slots of RecommendAction's calls")
    max_streaming_calls_per_peer: int = _opt(64, "of those, how many one address may hold at once; past it a new one "
                                                 "from there gets RESOURCE_EXHAUSTED, so one client cannot take the "
                                                 "Watch streams of the clients that check health with them")
    max_connections: int | None = _opt(16384, "client connections open at once in a process, shared out evenly between "
                                              "the --grpc-servers; past it the server closes new connections. A memory "
                                              "backstop (an idle connection holds about 16 KB: 16,384 of them fit the pod's "
                                              "512Mi beside one server process; lower it with --workers), not a "
                                              "per-client limit: one client can reach it, and new connections are then "
                                              "refused; empty: no limit")
    max_connection_idle_seconds: float | None = _opt(300.0, "close a connection (GOAWAY) that had no call in progress for "
                                                            "this long; empty: never")
    keepalive_seconds: float = _opt(60.0, "ping each client connection this often, to find dead peers and free their calls")
    keepalive_timeout_seconds: float = _opt(20.0, "close a connection whose peer does not answer a ping within this")
    keepalive_min_client_ping_seconds: float = _opt(10.0, "a client ping sooner than this after the previous one is a strike")
    keepalive_max_ping_strikes: int = _opt(2, "strikes after which the connection is closed (GOAWAY ENHANCE_YOUR_CALM); "
                                              "0: unlimited")
    handshake_timeout_seconds: float = _opt(10.0, "a new connection has this long for its TLS handshake and HTTP/2 settings")
    samples: int | None = _opt(None, "K, samples drawn per decision, also per RecommendProduct layer (default: the bundle's)")
    min_votes: int | None = _opt(None, "votes the majority needs before the rule engine answers, also per product layer "
                                       "(default: the bundle's)")
    exploration_epsilon: float | None = _opt(None, "probability of an exploration draw, also per product layer (default: the bundle's)")
    guard_threshold: float | None = _opt(None, "guard allow-probability below which an action is vetoed (default: the bundle's)")
    bundle_public_key: Path | None = _opt(None, "Ed25519 public key file (PEM): load only bundles signed by the private half of "
                                                "one of its keys (one, or up to 8 during a key rotation, SECURITY.md); unset: "
                                                "signatures are not checked")
    validate_memory_mb: int = _opt(512, "address-space limit (MiB) of the child process that loads and self-tests each new "
                                        "bundle before the server does; 0: no child (validate in-process)")
    validate_timeout_seconds: float = _opt(30.0, "how long that child may take before the bundle is rejected")
    max_outcome_value: float = _opt(MAX_OUTCOME_VALUE, "largest ReportOutcome value or coupon_discount accepted (INVALID_ARGUMENT above)")
    log_dir: Path | None = _opt(None, "write the decision, outcome, engagement and product logs (Arrow IPC segments) "
                                      "under this directory; unset: no logs")
    log_sample_rate: float = _opt(1.0, "share of sessions whose decisions and outcomes are logged (a session is kept whole)")
    log_user_salt: str = _opt("", "secret key of every id hash and of session sampling in the logs; empty: a random salt kept "
                                  "in LOG_DIR/.user-salt (on the logs volume: development only, warned at each start)")
    log_queue: int = _opt(8192, "log records waiting for the writer thread before new ones are dropped (and counted)")
    log_queue_mb: float = _opt(32.0, "MB those records of one kind may keep alive (a RecommendProduct request of 256 SKUs "
                                     "keeps about 0.9 MB) before new ones are dropped (and counted)")
    log_segment_mb: float = _opt(64.0, "finalise a log segment once it holds this many MB")
    log_segment_seconds: float = _opt(300.0, "finalise a log segment once it is this old")
    log_flush_seconds: float = _opt(0.25, "how often the writer thread writes what is queued")
    log_flush_rows: int = _opt(256, "also write as soon as this many records of one kind are queued (bounds the memory "
                                    "they hold at high throughput)")
    drain_delay_seconds: float = _opt(0.0, "on SIGTERM/SIGINT, keep serving this long with health NOT_SERVING before refusing new calls")
    grace_seconds: float = _opt(10.0, "on SIGTERM/SIGINT, how long in-flight calls may finish")
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = _opt("json", "json (one object per line) or text")

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port: expected 0..65535, got {self.port}")
        if self.supervisor_pid is not None and self.supervisor_pid < 1:
            problems.append(f"supervisor_pid: expected a process id >= 1, got {self.supervisor_pid}")
        if self.heartbeat_fd is not None and self.heartbeat_fd < 3:
            problems.append(f"heartbeat_fd: expected a file descriptor >= 3, got {self.heartbeat_fd}")
        if not (self.worker_stall_seconds == 0 or 3 <= self.worker_stall_seconds < float("inf")):
            problems.append(f"worker_stall_seconds: expected 0 (never) or a finite number >= 3 (three heartbeats), "
                            f"got {self.worker_stall_seconds}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port: expected 0..65535, got {self.metrics_port}")
        if not 1 <= self.grpc_servers <= MAX_GRPC_SERVERS:
            problems.append(f"grpc_servers: expected 1..{MAX_GRPC_SERVERS}, got {self.grpc_servers}")
        elif self.max_concurrent_rpcs is not None and 1 <= self.max_concurrent_rpcs < self.grpc_servers:
            problems.append(f"max_concurrent_rpcs: {self.max_concurrent_rpcs} cannot be shared out between "
                            f"{self.grpc_servers} --grpc-servers (at least one call each)")
        if not 0 <= self.request_receive_timeout_seconds <= 3600:
            problems.append(f"request_receive_timeout_seconds: expected 0 (off) to 3600 seconds, got "
                            f"{self.request_receive_timeout_seconds}")
        if self.max_connections is not None and self.max_connections < self.grpc_servers:
            problems.append(f"max_connections: {self.max_connections} cannot be shared out between {self.grpc_servers} "
                            "--grpc-servers (at least one connection each)")
        for name in ("workers", "intra_op_threads", "max_streaming_calls", "max_streaming_calls_per_peer",
                     "max_waiting_calls_per_peer", "max_calls_per_peer", "max_batch", "max_queue", "max_recent_behavior_ids",
                     "max_id_length", "max_message_bytes", "log_queue", "log_flush_rows"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name, ceiling in CEILINGS.items():
            if getattr(self, name) > ceiling:
                problems.append(f"{name}: expected at most {ceiling:g}, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"device: expected auto, cpu or cuda, got {self.device!r}")
        if self.log_format not in ("json", "text"):
            problems.append(f"log_format: expected json or text, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            problems.append(f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not 0 < self.weights_poll_seconds <= 3600 or self.weights_debounce_ms < 0:
            problems.append("weights_poll_seconds must be in (0, 3600] and weights_debounce_ms >= 0")
        if not 0 < self.batch_duty <= 1:
            problems.append(f"batch_duty: expected 0 < duty <= 1, got {self.batch_duty}")
        if not (self.max_batch_delay_ms >= 0 and self.batch_gap_ms > 0):
            problems.append(f"max_batch_delay_ms must be >= 0 and batch_gap_ms > 0, got {self.max_batch_delay_ms} "
                            f"and {self.batch_gap_ms}")
        if self.grace_seconds < 0 or self.min_inference_budget_ms < 0 or self.drain_delay_seconds < 0:
            problems.append("grace_seconds, drain_delay_seconds and min_inference_budget_ms must be >= 0")
        for name in ("samples", "min_votes"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 16:
                problems.append(f"{name}: expected 1..16, got {value}")
        if self.samples is not None and self.min_votes is not None and self.min_votes > self.samples:
            problems.append(f"min_votes: expected <= samples ({self.samples}), got {self.min_votes}")
        if not 0 <= self.max_canary_fraction <= 0.5:
            problems.append(f"max_canary_fraction: expected 0..0.5, got {self.max_canary_fraction}")
        if self.exploration_epsilon is not None and not 0 <= self.exploration_epsilon <= 1:
            problems.append(f"exploration_epsilon: expected 0..1, got {self.exploration_epsilon}")
        if self.guard_threshold is not None and not 0 <= self.guard_threshold <= 1:
            problems.append(f"guard_threshold: expected 0..1, got {self.guard_threshold}")
        if self.validate_memory_mb != 0 and not 256 <= self.validate_memory_mb <= MAX_MEMORY_MB:
            problems.append(f"validate_memory_mb: expected 0 (off) or 256 to {MAX_MEMORY_MB}, got {self.validate_memory_mb}")
        if not 0 < self.validate_timeout_seconds <= 3600:
            problems.append(f"validate_timeout_seconds: expected 0 < seconds <= 3600, got {self.validate_timeout_seconds}")
        if not 0 < self.max_outcome_value < float("inf"):
            problems.append(f"max_outcome_value: expected a finite number > 0, got {self.max_outcome_value}")
        if self.max_connection_age_seconds is not None and not self.max_connection_age_seconds > 0:
            problems.append(f"max_connection_age_seconds: expected > 0, got {self.max_connection_age_seconds}")
        if not 0 <= self.log_sample_rate <= 1:
            problems.append(f"log_sample_rate: expected 0..1, got {self.log_sample_rate}")
        if self.log_segment_mb <= 0 or self.log_segment_seconds <= 0 or self.log_flush_seconds <= 0:
            problems.append("log_segment_mb, log_segment_seconds and log_flush_seconds must be > 0")
        if not 1 <= self.log_queue_mb * 1024 * 1024 < float("inf"):
            problems.append(f"log_queue_mb: expected a finite number > 0 (at least one byte), got {self.log_queue_mb}")
        for f in dataclasses.fields(self):  # NaN passes every `x < limit` check (a review: a NaN flush period spun a core)
            number = getattr(self, f.name)
            if _base_type(f) is float and number is not None and number != number:
                problems.append(f"{f.name}: expected a number, got nan")
        problems += self._transport_problems()
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            problems.append(f"timezone: unknown IANA timezone {self.timezone!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def _transport_problems(self) -> list[str]:
        """TLS, the gRPC limits and the /metrics limits."""
        problems: list[str] = []
        for prefix in ("", "metrics_"):
            cert, key, ca = (f"{prefix}tls_{part}" for part in ("cert", "key", "client_ca"))
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                given, missing = (cert, key) if getattr(self, key) is None else (key, cert)
                problems.append(f"{missing}: {_flag(given)} needs {_flag(missing)} too (both or neither)")
            if getattr(self, ca) is not None and getattr(self, cert) is None:
                problems.append(f"{ca}: {_flag(ca)} (mutual TLS) needs {_flag(cert)} and {_flag(key)}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            problems.append(f"health_port: expected 0..65535, got {self.health_port}")
        elif self.health_port is not None and self.health_port != 0 and self.health_port == self.port:
            problems.append(f"health_port: --health-port must differ from --port ({self.port})")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            problems.append(f"max_concurrent_rpcs: expected >= 1 or empty, got {self.max_concurrent_rpcs}")
        for name in ("max_concurrent_streams", "metrics_max_connections"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("keepalive_seconds", "keepalive_timeout_seconds", "handshake_timeout_seconds", "metrics_timeout_seconds"):
            if not 0 < getattr(self, name) < float("inf"):
                problems.append(f"{name}: expected a finite number > 0, got {getattr(self, name)}")
        if self.max_connection_idle_seconds is not None and not self.max_connection_idle_seconds > 0:
            problems.append(f"max_connection_idle_seconds: expected > 0 or empty, got {self.max_connection_idle_seconds}")
        if not 0 <= self.keepalive_min_client_ping_seconds < float("inf") or self.keepalive_max_ping_strikes < 0:
            problems.append("keepalive_min_client_ping_seconds and keepalive_max_ping_strikes must be >= 0")
        for name in ("max_message_bytes", "max_concurrent_streams", "keepalive_max_ping_strikes", "max_connections",
                     "max_concurrent_rpcs"):
            value = getattr(self, name)
            if value is not None and value > C_INT_MAX:
                problems.append(f"{name}: expected at most {C_INT_MAX} (gRPC takes a 32-bit integer), got {value}")
        for name in ("keepalive_seconds", "keepalive_timeout_seconds", "handshake_timeout_seconds", "max_connection_idle_seconds",
                     "max_connection_age_seconds", "keepalive_min_client_ping_seconds"):
            value = getattr(self, name)
            if value is not None and value > MAX_GRPC_SECONDS:  # inf and NaN: their own checks
                problems.append(f"{name}: expected at most {MAX_GRPC_SECONDS} seconds (gRPC takes milliseconds as a 32-bit "
                                f"integer: about 24.8 days), got {value}")
        return problems

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_type(f: dataclasses.Field[Any]) -> type:
    text = str(f.type)
    for candidate, typ in (("bool", bool), ("int", int), ("float", float), ("Path", Path)):
        if text.startswith(candidate):
            return typ
    return str


def _convert(f: dataclasses.Field[Any], raw: str, source: str) -> Any:
    typ = _base_type(f)
    if raw == "" and "None" in str(f.type):
        return None
    if typ is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{source}: expected true or false, got {raw!r}")
    try:
        return typ(raw)
    except ValueError:
        raise ValueError(f"{source}: expected {typ.__name__}, got {raw!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; unset flags stay ``None`` so the environment can fill them."""
    for f in dataclasses.fields(Config):
        if _base_type(f) is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=f"{f.metadata['help']} (env {_env_name(f.name)})")
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                                help=f"{f.metadata['help']} (env {_env_name(f.name)}; default {f.default})")


def build_config(args: argparse.Namespace | None, environ: Mapping[str, str]) -> Config:
    """Flags over ``SHOPPING_AGENT_*`` environment variables over defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            values[f.name] = flag_value if isinstance(flag_value, bool) else _convert(f, str(flag_value), _flag(f.name))
        elif _env_name(f.name) in environ:
            values[f.name] = _convert(f, environ[_env_name(f.name)], _env_name(f.name))
    return Config(**values)


SECRET_FIELDS = ("log_user_salt",)
SALT_ENV = ENV_PREFIX + "LOG_USER_SALT"


def to_args(config: Config, **overrides: Any) -> list[str]:
    """Flags that rebuild ``config`` (with ``overrides``) in another process, e.g. a worker.

    Secrets are left out: pass them in the environment (``SALT_ENV``).
    """
    args: list[str] = []
    for f in dataclasses.fields(Config):
        if f.name in SECRET_FIELDS:
            continue
        value = overrides.get(f.name, getattr(config, f.name))
        if _base_type(f) is bool:
            args.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            args.append(f"{_flag(f.name)}={'' if value is None else value}")  # one word: a value may begin with "-" (a review)
    return args


def describe() -> str:
    """The configuration table (Markdown) for docs/configuration.md."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        rows.append(f"| `{_flag(f.name)}` | `{_env_name(f.name)}` | `{f.default}` | {f.metadata['help']} |")
    return "\n".join(rows)
