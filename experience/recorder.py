"""The experience recorder: decisions and outcomes to log segments, off the request path.

The request path calls ``decision()`` / ``outcome()``: a sampling check and one append to a
bounded in-memory queue, never I/O, never a wait. A full queue drops the record, counts it
(``observer.dropped``) and the writer thread logs the running count; nothing is lost
silently. The writer thread wakes every ``flush_seconds``, turns what is queued into one
Arrow record batch per kind and appends it to the open segment (``SegmentWriter``), which
rotates by size and age. ``close()`` drains the queues and finalises the segments; the
server calls it after in-flight calls have finished, so every answered decision is on disk.

Sampling is by session (a hash of ``session_id``), so a session's decisions and outcomes are
kept or skipped together, by every server process alike; the rate is in every record.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from core.domain import Decision, DecisionRequest, OutcomeReport
from experience.kinds import KINDS
from experience.records import LoggedDecision, LoggedOutcome, decisions_batch, outcomes_batch
from experience.segments import SegmentWriter, recover_abandoned

log = logging.getLogger(__name__)

SALT_FILE = ".user-salt"
_DROP_LOG_INTERVAL_S = 10.0


class RecorderObserver(Protocol):
    """Metrics hooks. ``dropped`` is called on the request path: keep it cheap."""

    def written(self, kind: str, n: int) -> None: ...

    def dropped(self, kind: str, reason: str, n: int) -> None: ...

    def queued(self, kind: str, depth: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RecorderOptions:
    sample_rate: float = 1.0
    max_queue: int = 8192
    segment_bytes: int = 64 * 1024 * 1024
    segment_seconds: float = 300.0
    flush_seconds: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate: expected 0..1, got {self.sample_rate}")
        if self.max_queue < 1 or self.segment_bytes < 1 or self.segment_seconds <= 0 or self.flush_seconds <= 0:
            raise ValueError("max_queue and segment_bytes must be >= 1, segment_seconds and flush_seconds > 0")


def session_sampled(session_id: str, rate: float) -> bool:
    """Whether a session is logged at ``rate``: the same answer in every process and on every day."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < rate * 2.0**64


def resolve_salt(root: Path, configured: str) -> bytes:
    """The configured salt, else a random one kept in ``root/.user-salt`` (shared by every writer on the volume)."""
    if configured:
        return hashlib.blake2b(configured.encode(), digest_size=32).digest()
    path = root / SALT_FILE
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another process may be writing it this very moment
            text = path.read_text().strip()
            if len(text) == 64:
                return bytes.fromhex(text)
            time.sleep(0.01)
        raise ValueError(f"{path}: not a 64-hex-digit salt; remove it or set the salt explicitly") from None
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    log.warning("no user-id salt configured; created a random one", extra={"fields": {"path": str(path)}})
    return bytes.fromhex(path.read_text().strip())


class ExperienceRecorder:
    def __init__(self, root: Path, salt: bytes, options: RecorderOptions, observer: RecorderObserver | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.options = options
        self._salt = salt
        self._observer = observer
        self._clock = clock
        self._queues: dict[str, collections.deque[Any]] = {kind: collections.deque() for kind in KINDS}
        self._writers = {kind: SegmentWriter(self.root, kind, options.segment_bytes, options.segment_seconds) for kind in KINDS}
        self._dropped = dict.fromkeys(KINDS, 0)  # since start, for the log line
        self._dropped_logged = dict.fromkeys(KINDS, 0)
        self._drop_log_after = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="experience-writer", daemon=True)
        self._closed = False
        self.written = dict.fromkeys(KINDS, 0)

    def start(self) -> None:
        for kind in KINDS:
            recover_abandoned(self.root, kind)
        self._thread.start()

    # --- request path --------------------------------------------------------------------
    def sampled(self, session_id: str) -> bool:
        return session_sampled(session_id, self.options.sample_rate)

    def decision(self, request: DecisionRequest, hour: int, decision: Decision, decision_id: str) -> bool:
        """Queue one answered decision; False when its session is not sampled or the queue is full."""
        if not self.sampled(request.session_id):
            return False
        return self._put("decisions", LoggedDecision(request, hour, decision, decision_id, self._clock()))

    def outcome(self, report: OutcomeReport) -> bool:
        if not self.sampled(report.session_id):
            return False
        return self._put("outcomes", LoggedOutcome(report, self._clock()))

    def _put(self, kind: str, item: Any) -> bool:
        queue = self._queues[kind]
        if self._closed or len(queue) >= self.options.max_queue:
            self._dropped[kind] += 1
            if self._observer is not None:
                self._observer.dropped(kind, "closed" if self._closed else "queue_full", 1)
            return False
        queue.append(item)  # deque.append and popleft are atomic: no lock with the writer thread
        return True

    def depth(self, kind: str) -> int:
        return len(self._queues[kind])

    # --- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.options.flush_seconds):
            self.flush()
        self.flush()
        for writer in self._writers.values():
            self._guarded(writer.close)

    def flush(self) -> None:
        """Write what is queued now (called by the writer thread; by tests once it has stopped)."""
        for kind in KINDS:
            queue = self._queues[kind]
            n = len(queue)
            if self._observer is not None:
                self._observer.queued(kind, n)
            writer = self._writers[kind]
            if n == 0:
                if writer.due():
                    self._guarded(writer.rotate)
                continue
            items = [queue.popleft() for _ in range(n)]
            try:
                batch = self._batch(kind, items)
                writer.write(batch)
            except Exception:
                log.exception("could not write log records; they are lost", extra={"fields": {"kind": kind, "records": n}})
                self._dropped[kind] += n
                if self._observer is not None:
                    self._observer.dropped(kind, "write_error", n)
                self._writers[kind] = self._replace(writer)
                continue
            self.written[kind] += n
            if self._observer is not None:
                self._observer.written(kind, n)
        self._log_drops()

    def _batch(self, kind: str, items: list[Any]) -> pa.RecordBatch:
        if kind == "decisions":
            return decisions_batch(items, self._salt, self.options.sample_rate)
        return outcomes_batch(items, self.options.sample_rate)

    def _replace(self, broken: SegmentWriter) -> SegmentWriter:
        """After a failed write: keep what the broken segment has (finalise it if possible), start afresh."""
        self._guarded(broken.close)
        return SegmentWriter(self.root, broken.kind, self.options.segment_bytes, self.options.segment_seconds)

    @staticmethod
    def _guarded(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("could not finalise a log segment")

    def _log_drops(self) -> None:
        if self._dropped == self._dropped_logged:
            return
        now = time.monotonic()
        if now < self._drop_log_after and not self._stop.is_set():
            return
        self._drop_log_after = now + _DROP_LOG_INTERVAL_S
        self._dropped_logged = dict(self._dropped)
        log.warning("log records dropped (queue full or write errors)", extra={"fields": {"dropped_total": dict(self._dropped)}})

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new records, write everything queued, finalise the open segments."""
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: write in this thread
            self.flush()
            for writer in self._writers.values():
                self._guarded(writer.close)
        for kind, queue in self._queues.items():  # a record that raced the close, or a writer that hung
            if queue:
                log.error("log records left unwritten at close", extra={"fields": {"kind": kind, "records": len(queue)}})
                self._dropped[kind] += len(queue)
                if self._observer is not None:
                    self._observer.dropped(kind, "closed", len(queue))
                queue.clear()
