"""grpc.health.v1 whose ``Watch`` streams end when the drain is over.

grpc's ``HealthServicer`` keeps each ``Watch`` open until the client leaves, and ``server.stop(grace)`` counts an open
stream as a call in flight: one watcher that does not leave on GOAWAY (``grpcurl … Health/Watch``, a home-made monitor)
held every shutdown for the whole ``--grace-seconds`` and was then cut with UNAVAILABLE (a review, 2026-12-06). Once the
drain delay is over, ``end_watches`` ends every stream with OK, its last message the status its service has then
(NOT_SERVING after ``enter_graceful_shutdown``), so none ends on a stale SERVING and the grace waits for real calls only;
a client's health checker retries its watch on another connection, as after any ended stream.

``Check`` and the statuses are the library's; ``Watch`` is this module's own loop over the same statuses. (Ending the
library's ``Watch`` by cancelling it could cut it inside a write, and grpc then never finished some of those calls:
a re-read saw 3–5 stops in 40 wait out the grace.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class DrainingHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Condition()
        self._draining = False
        self._ended = False
        self._status: dict[str, int] = {"": SERVING}  # the library's own start

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)  # (Check's answer)
        async with self._changed:
            if not self._draining:  # after the drain begins the library ignores it too
                self._status[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        async with self._changed:
            self._draining = True
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """End every open ``Watch`` stream (status OK) and any opened from now on, each after its service's status."""
        async with self._changed:
            self._ended = True
            self._changed.notify_all()

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (grpc's method name)
        """The service's status now and at each change (as the library's), until the client leaves or the end: then
        its status at the end if that was not the last one sent. No lock is held while writing to a slow client."""
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
