"""A ``--workers`` worker outlives no supervisor.

The supervisor forwards SIGTERM and SIGINT to its workers, so a normal stop drains them all.
A supervisor killed outright (SIGKILL, the OOM killer, a crash in the interpreter) forwards
nothing: its workers were left serving on the shared port, and since a server that finds its
port held refuses to start, no new supervisor could start there until someone found and
killed them. Each worker therefore watches its parent: once the process that started it is no
longer its parent (the kernel hands an orphan to init or to a subreaper), it stops as a
signal would stop it, draining its calls first. Polling ``getppid`` is portable and costs one
system call a second; gunicorn's workers watch their arbiter the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
"""How often a worker checks its parent: the longest an orphan serves before it starts to drain."""


async def stop_when_orphaned(supervisor_pid: int, stop: Callable[[], None], poll_seconds: float = POLL_SECONDS) -> None:
    """Call ``stop`` once ``supervisor_pid`` is no longer this process's parent (at once if it already is not)."""
    while (parent := os.getppid()) == supervisor_pid:
        await asyncio.sleep(poll_seconds)
    log.warning("the supervisor is gone; stopping this worker",
                extra={"fields": {"supervisor_pid": supervisor_pid, "parent_pid": parent}})
    stop()
