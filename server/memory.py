"""How a serving process uses memory: fewer glibc malloc arenas, Arrow's log batches on the system allocator, and a
garbage collector that does not rescan what was built at start.

A serving process is one event loop plus a handful of threads (gRPC's, onnxruntime's, the log writer), and
glibc gives each thread that meets contention an arena of its own, whose freed pages it keeps. Capping the
arenas at ``ARENAS`` (2), and building the log writer's Arrow batches with the system allocator rather than
Arrow's default mimalloc (which keeps its own segments), took a process with ``--log-dir`` from 160-164 to 143-150
MiB RSS after load (two of the four changes that brought it from 178 to 149 MB: docs/performance.md, "Memory"),
with no change in throughput beyond noise. An operator's own ``MALLOC_ARENA_MAX`` (or ``GLIBC_TUNABLES``'s
``glibc.malloc.arena_max``) or ``ARROW_DEFAULT_MEMORY_POOL`` wins: the libraries read them themselves, and then
nothing here changes them. Elsewhere than glibc (musl has no arenas) the cap is a no-op.

Python's full collections walk every container object, and most of a serving process's are built at start (modules,
classes, the protobuf descriptors, gRPC's and onnxruntime's bindings). At 3,300 req/s one ran every 0.67 s and held
the event loop about 10 ms. ``freeze_startup_objects`` moves what exists before the server starts into the permanent
generation, which collections skip (CPython's ``gc.freeze``, made for this): a full collection then takes 0.3-0.4 ms,
and p99 at 2,200 req/s (half of capacity) went from 11.0-12.5 to 7.6-7.8 ms. Objects frozen are never freed by the
cycle collector, so it runs before the bundle is loaded: a model replaced by a hot swap is collected as before.

Python's youngest generation is collected every 700 new container objects by default. A call allocates about thirty
(its task, coroutines, futures, the request's and the decision's objects), and at 64-128 calls in flight a few thousand
of them are alive at any moment, so a collection came every twenty-odd calls and walked, then promoted, the live
objects of every call in flight. ``raise_young_threshold`` lets ``YOUNG_THRESHOLD`` (10,000) accumulate first, by
which time most are freed by reference counting: 8.8 % and 10.3 % more req/s at 64 in flight (two A/Bs of seven and
five rounds, ``bench.ab_trees``; 50,000 gave +2.8 % more, within noise). Cyclic garbage waits a little longer for its
collection; nothing else changes.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Mapping

ARENAS = 2
YOUNG_THRESHOLD = 10_000  # new container objects between collections of the youngest generation (module doc)
_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def cap_malloc_arenas(environ: Mapping[str, str] = os.environ, arenas: int = ARENAS) -> bool:
    """Limit glibc to ``arenas`` malloc arenas; whether the limit was set (not when the operator set it, through
    ``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES``, nor off glibc). Call it before any thread but the main one allocates:
    arenas already made stay."""
    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


def arrow_on_system_allocator() -> tuple[str, bool]:
    """Make the system allocator Arrow's default pool, unless ``ARROW_DEFAULT_MEMORY_POOL`` chose one: the pool Arrow
    uses, and whether the choice was in time.

    Arrow fixes its default pool, for its C++ allocations too, from that variable when pyarrow is imported, so it is
    set here first (a serving process imports pyarrow only to write logs, and ``serve`` calls this before building the
    recorder). Were pyarrow imported already, nothing would change, and the answer says so.
    """
    in_time = "pyarrow" not in sys.modules
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    import pyarrow as pa

    return str(pa.default_memory_pool().backend_name), in_time


def freeze_startup_objects() -> int:
    """Collect, then exempt every object alive now from later collections (``gc.freeze``); how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def raise_young_threshold(threshold: int = YOUNG_THRESHOLD) -> tuple[int, int, int]:
    """Collect the youngest generation every ``threshold`` new container objects instead of 700, leaving the older
    generations' thresholds as they are; the thresholds now in force."""
    gc.set_threshold(threshold, *gc.get_threshold()[1:])
    return gc.get_threshold()
