from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from server.memory import freeze_startup_objects
from tests.harness import ServerThread, running_server
from tests.small_disk import SmallDisk, mounted

MAX_WORKERS = 4  # each worker process holds its own models, servers and simulated logs


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one test process per core, at most ``MAX_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # the cores this may use
    return max(1, min(cores, MAX_WORKERS))


if os.environ.get("PYTEST_XDIST_WORKER"):  # one of several test processes sharing the cores (pytest-xdist)
    # One OpenMP thread in each, and in the trainer processes the tests start (torch reads this when it is imported,
    # after this file): two workers each spinning two threads on two cores made trainer tests up to 7 times slower.
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported: what they imported (torch, onnxruntime, pyarrow, numpy: about 270,000
    objects that live as long as the process) moves to the collector's permanent generation, so its full collections,
    which the tests' garbage triggers, stop rescanning it (as the server does after its start-up): 32.1 → 20.7 s of
    collection in two runs of the suite on 2 cores (2026-12-07, Intel Xeon)."""
    freeze_startup_objects()


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


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A real 1 MiB tmpfs (skipped where it cannot be mounted)."""
    yield from mounted(tmp_path)
