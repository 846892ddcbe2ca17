"""grpc.health.v1 whose ``Watch`` streams end when the drain is over.

grpc's own ``HealthServicer`` keeps each ``Watch`` open until the client leaves, and ``server.stop(grace)`` counts an
open stream as a call in flight: one watcher that does not leave on GOAWAY (``grpcurl … Health/Watch``, a home-made
monitor) held every shutdown for the whole ``--grace-seconds`` and was then cut with UNAVAILABLE (a review,
2026-12-06). Once the drain delay is over, ``end_watches`` ends every stream with OK, its last message the status its
service has then (NOT_SERVING after ``enter_graceful_shutdown``), so none ends on a stale SERVING and the grace waits
for real calls only; a client's health checker retries its watch on another connection, as after any ended stream.

The service is this module's whole: one status map under one condition, with the library's semantics (``""`` starts
SERVING, an unknown service is NOT_FOUND to ``Check`` and SERVICE_UNKNOWN to ``Watch``, ``set`` is ignored once
draining). (Ending the library's ``Watch`` by cancelling it could cut it inside a write, and grpc then never finished
some of those calls: a re-read saw 3–5 stops in 40 wait out the grace.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class DrainingHealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._status: dict[str, int] = {"": SERVING}
        self._draining = False
        self._ended = False

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802 (grpc's name)
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def set(self, service: str, status: int) -> None:
        async with self._changed:
            if not self._draining:
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: ``set`` is ignored from now on."""
        async with self._changed:
            self._draining = True
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """End every open ``Watch`` stream (status OK) and any opened from now on, each after its service's status."""
        async with self._changed:
            self._ended = True
            self._changed.notify_all()

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (grpc's name)
        """The service's status now and at each change, until the client leaves or the end: then its status at the end
        if that was not the last one sent. No lock is held while writing to a slow client."""
        last: int | None = None
        while True:
            async with self._changed:
                while not self._ended and self._status.get(request.service, SERVICE_UNKNOWN) == last:
                    await self._changed.wait()
                status, ended = self._status.get(request.service, SERVICE_UNKNOWN), self._ended
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if ended:
                return
