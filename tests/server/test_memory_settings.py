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

from server.memory import ARENAS, YOUNG_THRESHOLD, cap_malloc_arenas
from tests.harness import ROOT, Spawned, spawn_server

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
    assert cap_malloc_arenas({"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.arena_max=4"}) is False


_POOL = """
import sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "imported-first":
    import pyarrow
from server.memory import arrow_on_system_allocator
pool, in_time = arrow_on_system_allocator()
import pyarrow as pa
batch = pa.record_batch([pa.array(list(range(100_000)))], names=["x"])
with pa.ipc.new_stream(pa.BufferOutputStream(), batch.schema,  # Arrow's own C++ allocations, as the writer's encoding
                       options=pa.ipc.IpcWriteOptions(compression="zstd")) as stream:
    stream.write_batch(batch)
print(pool, in_time, pa.mimalloc_memory_pool().max_memory() > 0)
"""


@pytest.mark.parametrize(("given", "order", "expected"), [
    (None, "fresh", "system True False"),  # the whole process on the system allocator: mimalloc never used
    ("mimalloc", "fresh", "mimalloc True True"),  # an operator's choice is kept
    (None, "imported-first", "mimalloc False True"),  # too late: Arrow keeps the pool it chose, and the answer says so
])
def test_arrows_pool_is_the_system_allocator_when_chosen_before_pyarrow_is_imported(given: str | None, order: str,
                                                                                    expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if given is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = given
    out = subprocess.run([sys.executable, "-c", _POOL, str(ROOT), order], capture_output=True, text=True, timeout=60,
                         env=env, check=True)
    assert out.stdout.strip() == expected, out.stderr


def test_serve_with_logs_chooses_the_pool_before_pyarrow_is_imported(tmp_path: Path) -> None:
    with spawn_server("--log-dir", str(tmp_path / "logs"), "--log-level", "DEBUG") as server:
        lines = _until_serving(server)
    chosen = [json.loads(line) for line in lines if '"arrow memory pool"' in line]
    assert chosen and chosen[0]["pool"] == "system" and chosen[0]["before_pyarrow_import"] is True, chosen


def _until_serving(server: Spawned) -> list[str]:
    deadline = time.monotonic() + 20
    while not any('"serving"' in line for line in server.lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(server.lines)


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
        lines = _until_serving(server)
    frozen = [(i, json.loads(line)) for i, line in enumerate(lines) if "exempted from garbage collection" in line]
    loaded = [i for i, line in enumerate(lines) if "loaded the embedded default bundle" in line]
    assert frozen and frozen[0][1]["frozen"] > 10_000, frozen
    assert loaded and frozen[0][0] < loaded[0]  # frozen before the bundle's objects exist
    assert frozen[0][1]["gc_thresholds"] == [YOUNG_THRESHOLD, 10, 10]  # the youngest generation raised, the others as they were


_THRESHOLD = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from server.memory import raise_young_threshold
gc.set_threshold(700, 7, 9)  # an older generation's own setting must survive
got = raise_young_threshold(5000)
gc.collect()  # start from an empty youngest generation
junk = [[i] for i in range(4000)]  # 4,000 new containers: fewer than the threshold, no young collection
print(json.dumps({"got": got, "now": gc.get_threshold(), "young": gc.get_count()[0]}))
"""


def test_the_youngest_generation_waits_for_its_threshold_and_the_others_keep_theirs() -> None:
    out = subprocess.run([sys.executable, "-c", _THRESHOLD, str(ROOT)], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["got"] == [5000, 7, 9] and got["now"] == [5000, 7, 9]  # what it returns is what is in force
    assert got["young"] >= 4000  # 4,000 new containers counted, not collected at 700
