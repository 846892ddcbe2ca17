"""The health service's own Watch (server.health_service), in process: what a stream sends up to and at its end.

grpc's servicer context is stood in for by a recorder of what is written (the one thing Watch does with it); the
wire behaviour, a real server's shutdown with open watches, is tests/server/test_lifecycle.py's."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from server.health_service import NOT_SERVING, SERVICE_UNKNOWN, SERVING, DrainingHealthServicer

SERVICE = "shopping_agent.v1.ShoppingAgent"


class Written:
    def __init__(self) -> None:
        self.statuses: list[int] = []

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        self.statuses.append(message.status)


def _watch(health: DrainingHealthServicer, service: str, stream: Written) -> asyncio.Future[None]:
    return asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(service=service), stream))


def test_every_watch_ends_on_its_services_status_at_the_end_and_one_opened_later_gets_it_too() -> None:
    async def scenario() -> dict[str, list[int]]:
        health = DrainingHealthServicer()
        await health.set(SERVICE, NOT_SERVING)
        streams = {name: Written() for name in ("early", "late", "unknown", "after")}
        early = _watch(health, SERVICE, streams["early"])
        await asyncio.sleep(0.01)
        await health.set(SERVICE, SERVING)
        await asyncio.sleep(0.01)
        unknown = _watch(health, "nope", streams["unknown"])
        await health.enter_graceful_shutdown()
        late = _watch(health, SERVICE, streams["late"])  # opened in the drain: hears NOT_SERVING
        await asyncio.sleep(0.01)
        await health.end_watches()
        await asyncio.wait_for(asyncio.gather(early, unknown, late), 1)
        await asyncio.wait_for(_watch(health, SERVICE, streams["after"]), 1)  # after the end: its status, then the end
        await health.set(SERVICE, SERVING)  # ignored in the drain, as the library's
        return {name: stream.statuses for name, stream in streams.items()}

    sent = asyncio.run(scenario())
    assert sent["early"] == [NOT_SERVING, SERVING, NOT_SERVING]
    assert sent["late"] == [NOT_SERVING] and sent["after"] == [NOT_SERVING]
    assert sent["unknown"] == [SERVICE_UNKNOWN]  # as the library answers a service it does not know


def test_a_client_that_leaves_ends_its_watch_and_the_others_go_on() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        health = DrainingHealthServicer()
        await health.set(SERVICE, SERVING)
        leaving, staying = Written(), Written()
        gone, kept = _watch(health, SERVICE, leaving), _watch(health, SERVICE, staying)
        await asyncio.sleep(0.01)
        gone.cancel()  # what grpc does to the handler when its client goes
        await asyncio.sleep(0.01)
        await health.set(SERVICE, NOT_SERVING)
        await asyncio.sleep(0.01)
        await health.end_watches()
        await asyncio.wait_for(kept, 1)
        assert gone.cancelled()
        return leaving.statuses, staying.statuses

    leaving, staying = asyncio.run(scenario())
    assert leaving == [SERVING] and staying == [SERVING, NOT_SERVING]
