from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.harness import ServerThread, running_server


@pytest.fixture(scope="module")
def live() -> Iterator[ServerThread]:
    """One real server per test module, on the embedded default bundle."""
    with running_server() as thread:
        yield thread


@pytest.fixture(scope="module")
def channel(live: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(live.target) as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch
