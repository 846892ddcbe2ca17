"""The server object: ``start()`` binds and returns, ``stop(grace)`` drains; only the CLI blocks.

Shutdown has one owner and one order: health to NOT_SERVING; after the drain delay, end the
health Watch streams, stop accepting and let in-flight calls finish within the grace; stop the
micro-batcher, write out and finalise the decision and outcome logs, close the plaintext health
port (the probes read NOT_SERVING until then), stop the metrics endpoint.

The service port serves TLS when certificate files are configured (``server.tls``); its
limits and keepalive are ``server.transport``'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from core.domain import Decision, DecisionRequest
from core.product import ProductDecision, ProductRequest
from server import transport
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.batching import MicroBatcher
from server.call_bounds import CallBounds
from server.config import Config
from server.grpc_metrics import InstrumentedRegistrar, OnlyMethods
from server.health_service import NOT_SERVING, SERVING, DrainingHealthServicer
from server.metrics import Metrics
from server.metrics_http import MetricsEndpoint
from server.models import ModelHolder, active_path, canary_path, load_canary, load_file, load_initial, load_options, make_validator
from server.servicer import ShoppingAgentServicer, add_to_server
from server.tls import ReloadingCertificates, grpc_files, server_credentials
from server.watcher import WeightsWatcher
from weights.bundle import BundleError
from weights.canary import CanaryRoute
from weights.model_set import LoadOptions, ModelSet, NoModel

if TYPE_CHECKING:
    from pathlib import Path

    from experience.recorder import ExperienceRecorder

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ShoppingAgent"].full_name


class ShoppingAgentServer:
    def __init__(self, config: Config, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry) if config.metrics else None
        self.models = ModelHolder(on_swap=self.metrics.model_served if self.metrics else None, on_canary=self._canary_changed)
        self.health = DrainingHealthServicer()
        self.port: int | None = None
        self.health_port: int | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.certificates: ReloadingCertificates | None = None
        self._servers: list[aio.Server] = []
        self._health_server: aio.Server | None = None
        self._batcher: MicroBatcher[DecisionRequest, Decision] | None = None
        self._product_batcher: MicroBatcher[ProductRequest, ProductDecision] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._watcher: WeightsWatcher | None = None
        self._canary_watcher: WeightsWatcher | None = None
        self.recorder = make_recorder(config, self.metrics)
        self.validator = make_validator(config)  # validates bundles from the volume in limited children
        self.stopped = asyncio.Event()
        metrics = self.metrics
        cut = (lambda reason: metrics.calls_cut.labels(reason=reason).inc()) if metrics is not None else None
        self.bounds = CallBounds(config.request_receive_timeout_seconds, config.max_streaming_calls,
                                 config.max_waiting_calls_per_peer, cut, config.max_calls_per_peer,
                                 config.max_streaming_calls_per_peer)
        # the health port's own: its 64 slots would be one address's share of the service port's bounds
        self.health_bounds = CallBounds(transport.HEALTH_RECEIVE_TIMEOUT_SECONDS, 0, transport.HEALTH_WAITING_PER_PEER, cut,
                                        transport.HEALTH_CALLS_PER_PEER)

    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING), load the model in the background; return the port."""
        config = self.config
        files = grpc_files(config)
        self.certificates = ReloadingCertificates(files) if files is not None else None  # TlsError: before anything starts
        servers = transport.service_servers(config)  # --grpc-servers on one port: why, in server/transport.py
        metrics = self.metrics
        self._batcher = MicroBatcher(config.max_batch, config.max_queue, metrics.batch if metrics else None,
                                     duty=config.batch_duty, max_delay_s=config.max_batch_delay_ms / 1000.0,
                                     gap_s=config.batch_gap_ms / 1000.0, on_idle=metrics.queue_empty if metrics else None)
        self._batcher.start()
        self._product_batcher = MicroBatcher(config.max_batch, config.max_queue, metrics.product_batch if metrics else None,
                                             duty=config.batch_duty, max_delay_s=config.max_batch_delay_ms / 1000.0,
                                             gap_s=config.batch_gap_ms / 1000.0,
                                             on_idle=metrics.product_queue_empty if metrics else None)
        self._product_batcher.start()
        if self.recorder is not None:
            self.recorder.start()
            log.info("logging decisions and outcomes", extra={"fields": {"log_dir": str(config.log_dir),
                                                                         "sample_rate": config.log_sample_rate}})
        servicer = ShoppingAgentServicer(config, self.models, self._batcher, self._product_batcher, self.metrics, self.recorder)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        port = config.port
        if len(servers) > 1 and not config.reuse_port and port != 0:  # --workers' children share the port on purpose
            transport.check_port_free(config.host, port)
        self.bounds.start()
        for server in servers:  # the first binds (port 0 picks one), the others join it
            registrar = InstrumentedRegistrar(server, self.metrics, self.bounds.bound)
            add_to_server(servicer, registrar)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), registrar)
            credentials = server_credentials(self.certificates) if self.certificates is not None else None
            port = transport.add_port(server, config.host, port, credentials)
        health_server = self._health_only_server() if config.health_port is not None else None
        if self.metrics is not None and config.metrics_port is not None:
            self.metrics_endpoint = MetricsEndpoint.for_config(self.registry, config)
            log.info("metrics endpoint", extra={"fields": {"host": config.metrics_host, "port": self.metrics_endpoint.port,
                                                           "tls": config.metrics_tls_cert is not None}})
        await self._set_health(NOT_SERVING)
        if health_server is not None:
            await health_server.start()
            self._health_server = health_server
            log.info("health port", extra={"fields": {"host": config.host, "port": self.health_port}})
        for server in servers:
            await server.start()
            self._servers.append(server)  # what started is stopped by stop(), also if a later one fails
        self.port = self.bounds.local_port = port
        log.info("listening", extra={"fields": {"host": config.host, "port": port, "tls": self.certificates is not None,
                                                "mutual_tls": config.tls_client_ca is not None}})
        self._loading = asyncio.get_running_loop().create_task(self._load(), name="initial-load")
        return port

    def _health_only_server(self) -> aio.Server:
        """A plaintext server with grpc.health.v1's Check only, bound to ``health_port``: what the kubelet's gRPC
        probes (which cannot do TLS, and call Check only) call when the service port serves TLS. Watch streams never
        end, and 64 of them from one client took every slot of this port (an attack review, 2026-12-05)."""
        assert self.config.health_port is not None
        server = transport.new_server(self.config, transport.HEALTH_MAX_CONCURRENT_RPCS)
        self.health_bounds.start()
        registrar = InstrumentedRegistrar(server, self.metrics, self.health_bounds.bound)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, OnlyMethods(registrar, health.SERVICE_NAME, ["Check"]))
        self.health_port = self.health_bounds.local_port = transport.add_port(server, self.config.host,
                                                                              self.config.health_port, None, "--health-port")
        return server

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        options = load_options(self.config)  # once for the start and both watchers (same keys); the CLI read it first, to exit 2
        if options.public_keys:
            from weights.signing import key_id

            trusted = [key_id(k) for k in options.public_keys]
            log.info("bundles must be signed by a trusted key", extra={"fields": {"trusted_keys": trusted}})
        try:
            model, seen, rejected = await loop.run_in_executor(None, load_initial, self.config, options, self.validator)
        except Exception:
            log.exception("no model could be loaded; answering from the rule engine (FALLBACK_NO_MODEL)")
            model, seen, rejected = None, None, None
        if rejected is not None:  # the active bundle was refused at start: counted like a refused swap
            self._rejected("active", rejected, 0.0)
        if model is not None:
            await self._swap_in(model)
        path = active_path(self.config)
        if path is not None:  # even after a failed start: publishing a good bundle recovers the server
            validator = self.validator
            self._watcher = WeightsWatcher(
                path,
                load=lambda p: load_file(p, options, validator),
                # The watcher thread waits for the swap, so swaps happen in the order they were loaded.
                on_loaded=lambda m, s: asyncio.run_coroutine_threadsafe(self._swapped(m, s), loop).result(30),
                on_rejected=lambda e, s: self._call_soon(loop, self._rejected, "active", e, s),
                on_missing=lambda: self._call_soon(loop, self._active_missing, path),
                poll_interval_s=self.config.weights_poll_seconds,
                debounce_s=self.config.weights_debounce_ms / 1000.0,
                use_inotify=self.config.weights_inotify,
                seen=seen,
                rejected=rejected,
            )
            self._watcher.start()
        self._watch_canary(loop, options)

    def _watch_canary(self, loop: asyncio.AbstractEventLoop, options: LoadOptions) -> None:
        """Serve the canary on its share of the sessions while its file is there (loaded, swapped and refused as the
        active bundle is; its removal ends it)."""
        path = canary_path(self.config)
        if path is None:
            return
        validator, cap = self.validator, self.config.max_canary_fraction
        self._canary_watcher = WeightsWatcher(
            path,
            load=lambda p: load_canary(p, options, cap, validator),
            on_loaded=lambda route, s: self._call_soon(loop, self._canary_loaded, route, s),
            on_rejected=lambda e, s: self._call_soon(loop, self._canary_rejected, e, s),
            on_missing=lambda: self._call_soon(loop, self._canary_missing),
            poll_interval_s=self.config.weights_poll_seconds,
            debounce_s=self.config.weights_debounce_ms / 1000.0,
            use_inotify=self.config.weights_inotify,
        )
        self._canary_watcher.start()

    def _canary_loaded(self, route: CanaryRoute, seconds: float) -> None:
        self.models.set_canary(route)
        if self.metrics is not None:
            self.metrics.swap_done("canary", "ok", "", seconds)

    def _canary_rejected(self, error: BundleError, seconds: float) -> None:
        """A canary file that cannot be served ends the canary: its slot no longer holds the one that was running."""
        self._rejected("canary", error, seconds)
        self.models.set_canary(None)

    def _canary_missing(self) -> None:
        self.models.set_canary(None)
        if self.metrics is not None:
            self.metrics.file_gone("canary")

    def _active_missing(self, path: Path) -> None:
        log.warning("the active bundle is missing; the current model keeps serving", extra={"fields": {"path": str(path)}})
        if self.metrics is not None:
            self.metrics.file_gone("active")

    def _canary_changed(self, route: CanaryRoute | None) -> None:
        if self.metrics is not None:
            self.metrics.canary_served(None if route is None else route.model.version, 0.0 if route is None else route.fraction)
        if route is None:
            log.info("no canary: the active bundle serves every session")
        else:
            log.info("serving a canary", extra={"fields": {"model_version": route.model.version, "fraction": route.fraction}})

    async def _swap_in(self, model: ModelSet | NoModel) -> None:
        """Serve ``model`` from the next request on (one reference assignment); health follows."""
        self.models.swap(model)
        if model.ready:
            await self._set_health(SERVING)
            log.info("serving", extra={"fields": {"model_version": model.version}})

    async def _swapped(self, model: ModelSet, seconds: float) -> None:
        previous = self.models.current.version
        await self._swap_in(model)
        if self.metrics is not None:
            self.metrics.swap_done("active", "ok", "", seconds)
        log.info("swapped model", extra={"fields": {"from": previous, "to": model.version, "load_s": round(seconds, 3),
                                                    "providers": list(model.policy.providers)}})

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
        loop.call_soon_threadsafe(fn, *args)

    def _rejected(self, file: str, error: BundleError, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.swap_done(file, "rejected", error.reason, seconds)

    async def wait_loaded(self) -> None:
        if self._loading is not None:
            await self._loading

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def _close_batchers(self) -> None:
        """Finish what the micro-batchers hold, then stop them."""
        for batcher in (self._batcher, self._product_batcher):
            if batcher is not None:
                await batcher.close()
        self._batcher = self._product_batcher = None

    async def stop(self, grace: float | None = None, drain_delay: float | None = None) -> None:
        """Health NOT_SERVING; keep serving for ``drain_delay`` while clients and load balancers
        move away; then refuse new calls and let in-flight ones finish within ``grace``; stop
        the batcher.

        grpc cancels calls that reach the server after it stops accepting but before the
        application picked them up, so the delay is what makes a drain lossless for clients
        that watch health (or for a Kubernetes endpoint removal to propagate).
        """
        grace = self.config.grace_seconds if grace is None else grace
        drain_delay = self.config.drain_delay_seconds if drain_delay is None else drain_delay
        if not self._servers:  # never started, or start() failed part-way: release what it did start
            await self._close_batchers()
            if self.recorder is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.recorder.close)
            if self._health_server is not None:
                await self._health_server.stop(0)
                self._health_server = None
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.stop()
                self.metrics_endpoint = None
            if self.validator is not None:
                self.validator.close()
            await self.bounds.stop()
            await self.health_bounds.stop()
            return
        log.info("draining", extra={"fields": {"grace_s": grace, "drain_delay_s": drain_delay}})
        await self.health.enter_graceful_shutdown()
        if drain_delay > 0:
            await asyncio.sleep(drain_delay)
        await self.health.end_watches()  # they heard NOT_SERVING: an open Watch must not hold the grace (server.health_service)
        await asyncio.gather(*(server.stop(grace) for server in self._servers))
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        for watcher in (self._watcher, self._canary_watcher):
            if watcher is not None:
                await asyncio.get_running_loop().run_in_executor(None, watcher.stop)
        if self.validator is not None:  # after the watcher: no bundle is being validated any more
            await asyncio.get_running_loop().run_in_executor(None, self.validator.close)
        await self._close_batchers()
        if self.recorder is not None:  # after the last call: every answered decision is written
            await asyncio.get_running_loop().run_in_executor(None, self.recorder.close)
        if self._health_server is not None:  # last: the probes read NOT_SERVING, not a refused port, until here
            await self._health_server.stop(0)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        await self.bounds.stop()
        await self.health_bounds.stop()
        self._servers = []
        log.info("stopped")
        self.stopped.set()


def make_recorder(config: Config, metrics: Metrics | None) -> ExperienceRecorder | None:
    """The decision and outcome log writer, when ``log_dir`` is set."""
    if config.log_dir is None:
        return None
    from experience.recorder import (  # pyarrow: only when logging
        ExperienceRecorder,
        RecorderOptions,
        resolve_salt,
        unusable_log_dir,
    )

    options = RecorderOptions(
        sample_rate=config.log_sample_rate,
        max_queue=config.log_queue,
        max_queue_bytes=int(config.log_queue_mb * 1024 * 1024),
        segment_bytes=int(config.log_segment_mb * 1024 * 1024),
        segment_seconds=config.log_segment_seconds,
        flush_seconds=config.log_flush_seconds,
        flush_rows=config.log_flush_rows,
    )
    try:
        salt = resolve_salt(config.log_dir, config.log_user_salt)
        return ExperienceRecorder(config.log_dir, salt, options, metrics.experience if metrics is not None else None)
    except OSError as exc:  # a set-up problem to report in one line (exit 2), as a bad flag is: not a traceback
        raise ValueError(unusable_log_dir(config.log_dir, exc)) from None
