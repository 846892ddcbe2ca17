"""--max-connection-age-seconds: the server closes aged connections (GOAWAY) and calls keep succeeding."""

from __future__ import annotations

import time

import grpc

from tests.harness import request, running_server, stub


def test_aged_connections_are_closed_and_clients_reconnect() -> None:
    with running_server(max_connection_age_seconds=0.3) as live, grpc.insecure_channel(live.target) as channel:
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append, try_to_connect=True)
        call = stub(channel).RecommendAction
        deadline = time.monotonic() + 3.0
        answered = 0
        while time.monotonic() < deadline:
            assert call(request(), timeout=5).decision_id  # never a failed call
            answered += 1
            time.sleep(0.02)
        channel.unsubscribe(states.append)
    ready_again = [i for i, s in enumerate(states) if s == grpc.ChannelConnectivity.READY]
    assert answered > 20
    assert len(ready_again) >= 2, states  # the connection was closed and opened again


def test_without_the_option_one_connection_serves_throughout() -> None:
    with running_server() as live, grpc.insecure_channel(live.target) as channel:
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append, try_to_connect=True)
        call = stub(channel).RecommendAction
        for _ in range(30):
            call(request(), timeout=5)
            time.sleep(0.02)
        channel.unsubscribe(states.append)
    assert states.count(grpc.ChannelConnectivity.READY) == 1, states
