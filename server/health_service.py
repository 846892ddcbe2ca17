"""grpc.health.v1 whose ``Watch`` streams end when the drain is over.

grpc's ``HealthServicer`` keeps each ``Watch`` open until the client leaves, and ``server.stop(grace)`` counts an open
stream as a call in flight: one watcher that does not leave on GOAWAY (``grpcurl … Health/Watch``, a home-made monitor)
held every shutdown for the whole ``--grace-seconds`` and was then cut with UNAVAILABLE (a review, 2026-12-06). Once the
drain delay is over, ``end_watches`` ends every stream with OK, its last message the status its service has then
(NOT_SERVING after ``enter_graceful_shutdown``): a watcher woken by the shutdown but not yet written to when its stream
ends is sent it first, so none ends on a stale SERVING. The grace then waits for real calls only; a client's health
checker retries its watch on another connection, as after any ended stream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health, health_pb2

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _Sent:
    """A Watch call's context that remembers the last status written to it (the library's Watch only writes)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.last: int | None = None

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        await self.context.write(message)
        self.last = message.status

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)


class DrainingHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()
        self._draining = False
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}  # the library's own start

    async def set(self, service: str, status: int) -> None:
        if not self._draining:  # after the drain begins the library ignores it too
            self._status[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self._draining = True
        self._status = dict.fromkeys(self._status, NOT_SERVING)
        await super().enter_graceful_shutdown()

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (grpc's method name)
        sent = _Sent(context)
        if not self._ended.is_set():
            watching = asyncio.ensure_future(super().Watch(request, sent))
            ended = asyncio.ensure_future(self._ended.wait())
            try:
                await asyncio.wait((watching, ended), return_when=asyncio.FIRST_COMPLETED)
            finally:  # ended, or the call cancelled (the client left): neither task outlives the call
                for task in (watching, ended):
                    task.cancel()
                await asyncio.gather(watching, ended, return_exceptions=True)
            error = None if watching.cancelled() else watching.exception()  # done: awaited above
            if error is not None:  # the stream failed before the end (a write to a client that left): as grpc's own would
                raise error
        final = self._status.get(request.service, SERVICE_UNKNOWN)
        if sent.last != final:
            await context.write(health_pb2.HealthCheckResponse(status=final))

    def end_watches(self) -> None:
        """End every open ``Watch`` stream (status OK) and any opened from now on, each after its service's status."""
        self._ended.set()
