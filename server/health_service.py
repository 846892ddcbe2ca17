"""grpc.health.v1 whose ``Watch`` streams end when the drain is over.

grpc's ``HealthServicer`` keeps each ``Watch`` open until the client leaves, and ``server.stop(grace)`` counts an open
stream as a call in flight: one watcher that does not leave on GOAWAY (``grpcurl … Health/Watch``, a home-made monitor)
held every shutdown for the whole ``--grace-seconds`` and was then cut with UNAVAILABLE (a review, 2026-12-06). The
watchers have been told NOT_SERVING when the drain begins; once the drain delay is over, ``end_watches`` ends their
streams with OK, so the grace waits for real calls only. A client's health checker then retries its watch on another
connection, as it does after any ended stream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health


class DrainingHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def Watch(self, request: Any, context: Any) -> None:  # noqa: N802 (grpc's method name)
        if self._ended.is_set():
            return
        watching = asyncio.ensure_future(super().Watch(request, context))
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

    def end_watches(self) -> None:
        """End every open ``Watch`` stream (status OK) and any opened from now on."""
        self._ended.set()
