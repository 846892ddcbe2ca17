"""gRPC server metrics under the go-grpc-prometheus names, for every service on the server.

Handlers are wrapped once, when they are registered (``InstrumentedRegistrar`` stands in
for the server while the generated ``add_*_to_server`` functions run), rather than by an
interceptor that would build a new handler for every call. A call is counted as started
when its handler runs and as handled with the status code it ended with: OK, the code an
``abort`` set, CANCELLED when the client went away, UNKNOWN for an escaped exception.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc import aio

from server.metrics import Metrics

_TYPES = {(False, False): "unary", (False, True): "server_stream", (True, False): "client_stream", (True, True): "bidi_stream"}
_BEHAVIOURS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class MethodMetrics:
    """Pre-bound metric children for one method."""

    def __init__(self, metrics: Metrics, grpc_type: str, service: str, method: str) -> None:
        labels = {"grpc_type": grpc_type, "grpc_service": service, "grpc_method": method}
        self.started = metrics.grpc_started.labels(**labels)
        self.handling = metrics.grpc_handling.labels(**labels)
        self.handled = {code.name: metrics.grpc_handled.labels(**labels, grpc_code=code.name) for code in grpc.StatusCode}

    def finish(self, code: str, started: float) -> None:
        """For handlers that count themselves: the call ended with ``code`` (a StatusCode name)."""
        self.handling.observe(time.perf_counter() - started)
        self.handled[code].inc()

    def done(self, context: Any, started: float, error: BaseException | None) -> None:
        self.handling.observe(time.perf_counter() - started)
        code = context.code()
        if code is None:
            if error is None:
                code = grpc.StatusCode.OK
            elif isinstance(error, asyncio.CancelledError):
                code = grpc.StatusCode.CANCELLED
            else:
                code = grpc.StatusCode.UNKNOWN
        elif isinstance(code, int):  # some grpc versions report the numeric code
            code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
        self.handled[code.name].inc()


def _wrap(behaviour: Callable[..., Any], labels: MethodMetrics) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            labels.started.inc()
            started, error = time.perf_counter(), None
            try:
                async for item in behaviour(request, context):
                    yield item
            except BaseException as exc:
                error = exc
                raise
            finally:
                labels.done(context, started, error)
        return stream

    async def call(request: Any, context: Any) -> Any:
        labels.started.inc()
        started, error = time.perf_counter(), None
        try:
            return await behaviour(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            labels.done(context, started, error)
    return call


def instrument_handler(handler: grpc.RpcMethodHandler, path: str, metrics: Metrics) -> grpc.RpcMethodHandler:
    """The same handler, counting calls and their codes and timing them."""
    _, service, method = path.split("/", 2)
    grpc_type = _TYPES[(handler.request_streaming, handler.response_streaming)]
    labels = MethodMetrics(metrics, grpc_type, service, method)
    for name in _BEHAVIOURS:
        behaviour = getattr(handler, name)
        if behaviour is not None:
            return handler._replace(**{name: _wrap(behaviour, labels)})  # type: ignore[attr-defined, no-any-return]
    return handler


class _Unparseable:
    """What a request message that does not parse is handed to its handler as (``parsing_named``)."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    type_name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    name = type_name.full_name if type_name is not None else "request"

    def parsed(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:  # protobuf's DecodeError, or any other refusal of the bytes
            return _Unparseable(name)
    return parsed


async def _refuse(context: Any, request: _Unparseable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {request.type_name} message")


def parsing_named(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, answering a request message that does not parse with INVALID_ARGUMENT naming its type, as the
    ShoppingAgent methods answer. grpc's own deserializer failure ends the call UNKNOWN, logs a traceback at ERROR (1.3 KB
    a call: 2,000 garbage Health/Check calls wrote 2.65 MB of log) and runs no handler, so no metric counted it (a review,
    2026-12-07). A handler that parses its own bytes (no deserializer) is returned as it is."""
    if handler.request_deserializer is None:
        return handler
    name = next(n for n in _BEHAVIOURS if getattr(handler, n) is not None)
    inner = getattr(handler, name)
    streamed_requests = name.startswith("stream_")

    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Unparseable):
                await _refuse(context, request)
            yield request

    async def given(request: Any, context: Any) -> Any:  # the request (or the checked stream of them) to pass on
        if streamed_requests:
            return checked(request, context)
        if isinstance(request, _Unparseable):
            await _refuse(context, request)
        return request

    if inspect.isasyncgenfunction(inner):  # it yields its answers (instrument_handler tells a stream by this)
        async def yielding(request: Any, context: Any) -> AsyncIterator[Any]:
            async for item in inner(await given(request, context), context):
                yield item
        behaviour: Callable[..., Any] = yielding
    else:  # it returns its answer, or writes its answers (context.write), as grpc_health's Watch does
        async def returning(request: Any, context: Any) -> Any:
            return await inner(await given(request, context), context)
        behaviour = returning
    changes = {"request_deserializer": _tolerant(handler.request_deserializer), name: behaviour}
    return handler._replace(**changes)  # type: ignore[attr-defined, no-any-return]


Wrap = Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler]


class _WrappedGeneric(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]) -> None:
        self._inner = inner
        self._wrap = wrap
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        path = handler_call_details.method  # type: ignore[attr-defined]
        wrapped = self._cache.get(path)
        if wrapped is None:
            handler = self._inner.service(handler_call_details)
            if handler is None:  # not ours: cache nothing, or any client could grow the cache without bound
                return None
            wrapped = self._cache[path] = self._wrap(path, handler)
        return wrapped


class InstrumentedRegistrar:
    """Looks like a server to generated ``add_*_to_server`` code; registers instrumented handlers.

    ``counted=True`` registers handlers that record these metrics themselves (the hot
    RecommendAction path, which saves the wrapper's extra coroutine per call). ``outer`` wraps
    every handler last, counted or not (``server.call_bounds``).
    """

    def __init__(self, server: aio.Server, metrics: Metrics | None, outer: Wrap | None = None) -> None:
        self._server = server
        self._metrics = metrics
        self._outer = outer

    def instrument(self, service: str, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` counted by the wrapper, for a service that registers some methods ``counted``."""
        if self._metrics is None:
            return handler
        return instrument_handler(handler, f"/{service}/{method}", self._metrics)

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler, counted: bool) -> grpc.RpcMethodHandler:
        if not counted:  # a service that counts its calls parses its own bytes (server.servicer.REQUEST_PARSERS)
            handler = parsing_named(handler)
        if self._metrics is not None and not counted:
            handler = instrument_handler(handler, path, self._metrics)
        return handler if self._outer is None else self._outer(handler)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler], counted: bool = False) -> None:
        if self._outer is not None or not counted:
            handlers = [_WrappedGeneric(h, lambda path, handler: self._wrap(path, handler, counted)) for h in handlers]
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler],
                                       counted: bool = False) -> None:
        handlers = {name: self._wrap(f"/{service}/{name}", h, counted) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, handlers)


class _Only(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, inner: grpc.GenericRpcHandler, paths: frozenset[str]) -> None:
        self._inner = inner
        self._paths = paths

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method not in self._paths:  # type: ignore[attr-defined]
            return None  # UNIMPLEMENTED
        return self._inner.service(handler_call_details)


class OnlyMethods:
    """Stands in for a registrar while generated ``add_*_to_server`` code runs, passing on only ``methods``."""

    def __init__(self, registrar: InstrumentedRegistrar, service: str, methods: Sequence[str]) -> None:
        self._registrar = registrar
        self._service = service
        self._methods = frozenset(methods)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        paths = frozenset(f"/{self._service}/{m}" for m in self._methods)
        self._registrar.add_generic_rpc_handlers([_Only(h, paths) for h in handlers])

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        kept = {name: h for name, h in handlers.items() if service == self._service and name in self._methods}
        if kept:
            self._registrar.add_registered_method_handlers(service, kept)
