"""SIGTERM ends a command as Ctrl-C does, for every entry point that runs one (``shopping-agent …``, ``python -m trainer``).

A Job's pod deleted, ``timeout`` or torchrun stopping its ranks sends SIGTERM, whose default action kills the process
where it stands: a recorder's log segments left open (unreadable until a server recovers them), a temp file left in the
weights directory. Raised as ``KeyboardInterrupt`` instead, the ``finally`` blocks on the way out run; the command then
ends with one line and the exit code a shell gives a command that signal ended (128 + its number).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within it, SIGTERM raises ``KeyboardInterrupt("SIGTERM")`` in the main thread; the previous handler after."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped(command: str, exc: KeyboardInterrupt) -> int:
    """Say which signal stopped ``command`` (SIGTERM's, or Ctrl-C's with no message) and return its exit code."""
    name = "SIGTERM" if str(exc) == "SIGTERM" else "SIGINT"
    print(f"shopping-agent {command}: stopped by {name}", file=sys.stderr)
    return 128 + signal.Signals[name].value
