"""Progress a person can follow: a bar on a terminal, one JSON line a stage in a job's log.

    with progress("train.updates", total=config.updates, unit="step") as bar:
        for ...:
            ...
            bar.update()

Where stderr is a terminal, tqdm draws the bar. Elsewhere (the CronJob's log, a pipe), each stage
writes JSON objects to stderr, one a line::

    {"progress": "read.narrow", "done": 12, "total": 40, "unit": "segment", "rows": 3072,
     "elapsed_s": 9.1, "eta_s": 21.2, "final": false}

at the first ``update`` after each ``every_s`` seconds (so a stage's lines are at most that far
apart while its updates are) and one when it ends (``"final": true``). ``eta_s`` is the elapsed
time scaled by what is left, null without a total. ``SHOPPING_AGENT_PROGRESS`` = ``bar``, ``json``
or ``off`` overrides the choice (another value: a warning, and the default). While a bar is drawn,
log lines on the console go through tqdm, so they do not break it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

log = logging.getLogger(__name__)
MODES = ("bar", "json", "off")
EVERY_S = 30.0


def mode_for(stream: IO[str], env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    chosen = env.get("SHOPPING_AGENT_PROGRESS", "").strip().lower()
    if chosen in MODES:
        return chosen
    if chosen:  # a typo in an environment variable should not fail a cycle
        log.warning("SHOPPING_AGENT_PROGRESS: expected one of %s, got %r; using the default", ", ".join(MODES), chosen)
    return "bar" if stream.isatty() else "json"


class Progress:
    """One stage's progress (use ``progress``); ``update`` counts work done, with counters such as rows beside it."""

    def __init__(self, stage: str, total: int | None, unit: str, stream: IO[str], mode: str, every_s: float,
                 clock: Callable[[], float]) -> None:
        self.stage, self.total, self.unit, self.stream, self.mode = stage, total, unit, stream, mode
        self.every_s, self.clock = every_s, clock
        self.done = 0
        self.counters: dict[str, float] = {}
        self.started = self.last = clock()
        self._bar: Any = None
        self._logs: Any = None
        if mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, desc=stage, unit=unit, file=stream, leave=True, dynamic_ncols=True)
            self._logs = logging_redirect_tqdm()
            self._logs.__enter__()

    def update(self, n: int = 1, **counters: float) -> None:
        self.done += n
        for name, value in counters.items():
            self.counters[name] = self.counters.get(name, 0) + value
        if self._bar is not None:
            self._bar.update(n)
            if self.counters:
                self._bar.set_postfix(self.counters, refresh=False)
        elif self.mode == "json" and self.clock() - self.last >= self.every_s:
            self._emit(final=False)

    def record(self, final: bool) -> dict[str, Any]:
        elapsed = self.clock() - self.started
        left = None if self.total is None or self.done <= 0 else elapsed * max(self.total - self.done, 0) / self.done
        return {"progress": self.stage, "done": self.done, "total": self.total, "unit": self.unit, **self.counters,
                "elapsed_s": round(elapsed, 3), "eta_s": None if left is None else round(left, 3), "final": final}

    def _emit(self, final: bool) -> None:
        self.last = self.clock()
        self.stream.write(json.dumps(self.record(final)) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._logs.__exit__(None, None, None)
            self._bar.close()
        elif self.mode == "json":
            self._emit(final=True)


@contextmanager
def progress(stage: str, total: int | None = None, unit: str = "item", *, stream: IO[str] | None = None,
             mode: str | None = None, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> Iterator[Progress]:
    """A stage's progress, closed (its final line written) when the block ends, also by an exception."""
    out = sys.stderr if stream is None else stream
    bar = Progress(stage, total, unit, out, mode or mode_for(out), every_s, clock)
    try:
        yield bar
    finally:
        bar.close()
