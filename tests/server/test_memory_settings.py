"""``server.memory``: the glibc arena cap, Arrow's system pool and the frozen start-up heap, each in a fresh interpreter
(they act at start-up, so they are only meaningful in a process that has not yet done what they govern)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.memory import ARENAS, cap_malloc_arenas
from tests.harness import ROOT, spawn_server

GLIBC = platform.libc_ver()[0] == "glibc"

# Eight threads allocate through malloc at once (600-byte objects are past pymalloc), then glibc reports its arenas.
_THREADS = """
import ctypes, sys, threading
sys.path.insert(0, sys.argv[1])
from server.memory import cap_malloc_arenas
if sys.argv[2] == "cap":
    assert cap_malloc_arenas()
def work():
    for _ in range(3000):
        [bytearray(600) for _ in range(20)]
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()  # to stderr, one "Arena N:" block per arena
"""


def _arenas(mode: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _THREADS, str(ROOT), mode], capture_output=True, text=True, timeout=60,
                         env=env, check=True)
    return sum(1 for line in out.stderr.splitlines() if line.startswith("Arena "))


@pytest.mark.skipif(not GLIBC, reason="malloc arenas are glibc's")
def test_the_cap_holds_threads_to_two_arenas_where_they_would_make_more() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert _arenas("none", env) > ARENAS  # without it these threads make more: the count below means something
    assert _arenas("cap", env) == ARENAS


def test_an_operators_own_setting_wins() -> None:
    assert cap_malloc_arenas({"MALLOC_ARENA_MAX": "8"}) is False  # glibc has read it already: nothing is changed


_RECORDER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from server.app import make_recorder
from server.config import Config
recorder = make_recorder(Config(log_dir=Path(sys.argv[2])), None)
import pyarrow as pa
batch = pa.record_batch([pa.array(list(range(100_000)))], names=["x"])
with pa.ipc.new_stream(pa.BufferOutputStream(), batch.schema,  # Arrow's own C++ allocations, as the writer's encoding
                       options=pa.ipc.IpcWriteOptions(compression="zstd")) as stream:
    stream.write_batch(batch)
print(pa.default_memory_pool().backend_name, pa.mimalloc_memory_pool().max_memory() > 0)
"""


@pytest.mark.parametrize(("given", "expected"), [(None, "system"), ("mimalloc", "mimalloc")])
def test_a_logging_server_builds_its_batches_on_the_system_allocator(tmp_path: Path, given: str | None,
                                                                     expected: str) -> None:
    """The recorder as ``serve --log-dir`` makes it, in a process that had not imported pyarrow; an operator's
    ``ARROW_DEFAULT_MEMORY_POOL`` is kept."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if given is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = given
    out = subprocess.run([sys.executable, "-c", _RECORDER, str(ROOT), str(tmp_path / "logs")], capture_output=True,
                         text=True, timeout=60, env=env, check=True)
    pool, mimalloc_used = out.stdout.split()[-2:]
    assert pool == expected, out.stderr
    assert mimalloc_used == str(expected == "mimalloc")  # not only Python's default: Arrow's C++ default too


_FREEZE = """
import gc, json, sys, time
sys.path.insert(0, sys.argv[1])
from server.memory import freeze_startup_objects
startup = [[i] for i in range(300_000)]  # what a process builds at start: many small containers
def full_collection():
    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t
before = full_collection()
frozen = freeze_startup_objects()
after = full_collection()
class Node: pass
a, b = Node(), Node(); a.other, b.other = b, a  # a cycle made after the freeze
del a, b
print(json.dumps({"before": before, "after": after, "frozen": frozen, "later_cycle_collected": gc.collect()}))
"""


def test_freezing_exempts_what_exists_and_still_collects_what_comes_later() -> None:
    out = subprocess.run([sys.executable, "-c", _FREEZE, str(ROOT)], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["frozen"] >= 300_000
    assert got["after"] < got["before"] / 5, got  # a full collection no longer walks the frozen objects
    assert got["later_cycle_collected"] >= 2  # the cycle collector still frees what is made afterwards


def test_serve_freezes_what_it_built_before_loading_the_bundle() -> None:
    with spawn_server("--log-level", "DEBUG") as server:
        deadline = time.monotonic() + 20
        while not any('"serving"' in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = list(server.lines)
    frozen = [(i, json.loads(line)) for i, line in enumerate(lines) if "exempted from garbage collection" in line]
    loaded = [i for i, line in enumerate(lines) if "loaded the embedded default bundle" in line]
    assert frozen and frozen[0][1]["frozen"] > 10_000, frozen
    assert loaded and frozen[0][0] < loaded[0]  # frozen before the bundle's objects exist
