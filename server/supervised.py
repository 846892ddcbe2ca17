"""A ``--workers`` worker outlives no supervisor, and a supervisor sees a worker that hangs.

The supervisor forwards SIGTERM and SIGINT to its workers, so a normal stop drains them all.
A supervisor killed outright (SIGKILL, the OOM killer, a crash in the interpreter) forwards
nothing: its workers were left serving on the shared port, and since a server that finds its
port held refuses to start, no new supervisor could start there until someone found and
killed them. Each worker therefore watches its parent: once the process that started it is no
longer its parent (the kernel hands an orphan to init or to a subreaper), it stops as a
signal would stop it, draining its calls first. Polling ``getppid`` is portable and costs one
system call a second; gunicorn's workers watch their arbiter the same way.

The other direction: the kubelet's probes reach one worker of several at random (they share
the health port), so a worker whose event loop hangs or is stopped, while the others answer,
passed liveness, and the connections the kernel gave it hung (an SRE review, 2026-12-05: a
SIGSTOPped worker failed 4 of 12 probes, never 6 in a row). Each worker therefore writes a byte
a second from its event loop down a pipe the supervisor gave it (``heartbeat``); the supervisor
kills one that has not written for ``--worker-stall-seconds`` (``Heartbeats``), and a worker
gone takes the pod down, as any worker exiting on its own does. gunicorn's arbiter times its
workers out the same way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
"""How often a worker checks its parent: the longest an orphan serves before it starts to drain."""
BEAT_SECONDS = 1.0
"""How often a worker writes its heartbeat."""


async def stop_when_orphaned(supervisor_pid: int, stop: Callable[[], None], poll_seconds: float = POLL_SECONDS) -> None:
    """Call ``stop`` once ``supervisor_pid`` is no longer this process's parent (at once if it already is not)."""
    while (parent := os.getppid()) == supervisor_pid:
        await asyncio.sleep(poll_seconds)
    log.warning("the supervisor is gone; stopping this worker",
                extra={"fields": {"supervisor_pid": supervisor_pid, "parent_pid": parent}})
    stop()


async def heartbeat(fd: int, every: float = BEAT_SECONDS) -> None:
    """Write one byte to ``fd`` every ``every`` seconds from this event loop, for as long as it runs. A full pipe (a
    supervisor not reading) skips a beat; a closed one (the supervisor gone: ``stop_when_orphaned`` stops this worker)
    ends the beats."""
    os.set_blocking(fd, False)
    try:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    return
                raise
            await asyncio.sleep(every)
    finally:
        os.close(fd)


class Heartbeats:
    """The supervisor's side: one pipe a worker, read without blocking; which workers have been silent too long."""

    def __init__(self, stall_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_seconds = stall_seconds
        self._clock = clock
        self._pipes: dict[int, tuple[int, float]] = {}  # worker pid -> (read end, when it last wrote or started)
        self._checked: float | None = None  # when ``silent`` last ran

    def pipe(self) -> tuple[int, int]:
        """A new pipe: (read end, kept here once ``watch`` names its worker; write end, for the worker)."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        return read, write

    def watch(self, pid: int, read: int) -> None:
        self._pipes[pid] = (read, self._clock())

    def silent(self, running: Iterable[int]) -> list[tuple[int, float]]:
        """Drain every running worker's pipe; the workers (pid, seconds silent) past ``stall_seconds`` (none when 0).

        Silence counts from the supervisor's own last look: after a gap of more than half ``stall_seconds`` between
        two looks the supervisor itself did not run (the pod paused or frozen with its workers, a debugger), and
        every worker starts afresh rather than being judged for the pause they shared (a review: a 4 s pause of the
        whole process group killed both workers)."""
        now, late = self._clock(), []
        paused = self._checked is not None and now - self._checked > self.stall_seconds / 2
        self._checked = now
        for pid in running:
            if pid not in self._pipes:
                continue
            read, last = self._pipes[pid]
            if paused:
                last = now
            try:
                while os.read(read, 4096):
                    last = now
            except BlockingIOError:
                pass
            self._pipes[pid] = (read, last)
            if self.stall_seconds and now - last > self.stall_seconds:
                late.append((pid, now - last))
        return late

    def close(self) -> None:
        for read, _ in self._pipes.values():
            os.close(read)
        self._pipes.clear()
