"""The experience recorder: decisions, outcomes and engagement reports to log segments, off the request path.

The request path calls ``decision()`` / ``outcome()`` / ``engagement()`` / ``product()``: a sampling check and one
append to a bounded in-memory queue, never I/O, never a wait. A full queue drops the record, counts it
(``observer.dropped``, ``queue_full``) and the writer thread logs the running count; nothing is lost silently. The
writer thread wakes every ``flush_seconds``, or as soon as one kind's queue reaches ``flush_rows`` (so what a process
holds between flushes does not grow with its throughput: at 5,500 decisions a second, 0.25 s of them held about 8 MB of
requests) or a quarter of ``max_queue_bytes``, whatever record crosses it (256-SKU product decisions keep about 0.86 MB
each: 37 of them filled the 32 MB bound before either, and an attack review, 2026-12-06, saw a third of honest ones
dropped at 140 a second, a rate the writer keeps up with), turns what is queued into one Arrow record batch per kind
and appends it to the open segment (``SegmentWriter``), which rotates by size and age. ``close()`` drains the queues
and finalises the segments; the server calls it after in-flight calls have finished, so every answered decision is on
disk.

Each kind's queue is bounded in records (``max_queue``) and in the bytes its records keep alive (``max_queue_bytes``,
``experience.records.retained_bytes``). A ``RecommendProduct`` request of 256 SKUs keeps about 0.9 MB until the
writer encodes it, and the writer encodes such records more slowly than one client can send them: with a count alone,
one client took a server to 1.7 GB (a review, 2026-12-05). A record is always taken into an empty queue, so one larger
than the byte bound is still logged.

When the disk fails (full, I/O errors) the writer keeps the records it could not write
(``SegmentWriter`` holds them, in the same segment file) and tries again with exponential
back-off (``retry_min_seconds`` doubling to ``retry_max_seconds``); meanwhile records wait in
the queue, whose bound counts the held ones, so a long outage drops new records (counted,
``queue_full``), not memory. The kind is *degraded* from the first failed attempt to the
next good one: one log line when that starts, one when it ends, and ``observer.degraded``.
Every record accepted is written, or counted as dropped: at shutdown, what the disk still
refuses is counted (``write_error``).

Sampling is by session, a hash of ``session_id`` keyed with the salt, so a session's
decisions, outcomes and engagement reports are kept or skipped together, by every server process alike, and a
client cannot choose its session id to be logged or not; the rate is in every record.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from core.domain import Decision, DecisionRequest, EngagementReport, OutcomeReport
from core.product import ProductDecision, ProductRequest
from experience.kinds import DECISIONS_KIND, ENGAGEMENTS_KIND, KINDS, OUTCOMES_KIND, PRODUCTS_KIND
from experience.records import (
    LoggedDecision,
    LoggedEngagement,
    LoggedOutcome,
    LoggedProduct,
    decisions_batch,
    engagements_batch,
    outcomes_batch,
    products_batch,
    retained_bytes,
)
from experience.salt import SALT_FILE as SALT_FILE
from experience.salt import SaltError as SaltError
from experience.salt import resolve_salt as resolve_salt
from experience.segment_writer import SegmentWriter, recover_abandoned
from policy.features import FeatureSpec

log = logging.getLogger(__name__)

_DROP_LOG_INTERVAL_S = 10.0
_SAMPLE = b"sa.sample"
_ENCODERS: dict[str, Callable[[list[Any], bytes, float], pa.RecordBatch]] = {
    DECISIONS_KIND: decisions_batch, OUTCOMES_KIND: outcomes_batch, ENGAGEMENTS_KIND: engagements_batch,
    PRODUCTS_KIND: products_batch}


class RecorderObserver(Protocol):
    """Metrics hooks. ``dropped`` is called on the request path: keep it cheap."""

    def written(self, kind: str, n: int) -> None: ...

    def dropped(self, kind: str, reason: str, n: int) -> None: ...

    def queued(self, kind: str, depth: int) -> None: ...

    def write_failed(self, kind: str) -> None: ...

    def degraded(self, kind: str, degraded: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class RecorderOptions:
    sample_rate: float = 1.0
    max_queue: int = 8192
    max_queue_bytes: int = 32 * 1024 * 1024
    segment_bytes: int = 64 * 1024 * 1024
    segment_seconds: float = 300.0
    flush_seconds: float = 0.25
    flush_rows: int = 256
    retry_min_seconds: float = 0.5
    retry_max_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate: expected 0..1, got {self.sample_rate}")
        if min(self.max_queue, self.max_queue_bytes, self.segment_bytes, self.flush_rows) < 1 or self.segment_seconds <= 0 \
                or self.flush_seconds <= 0:
            raise ValueError("max_queue, max_queue_bytes, segment_bytes and flush_rows must be >= 1, segment_seconds and "
                             "flush_seconds > 0")
        if not 0 < self.retry_min_seconds <= self.retry_max_seconds:
            raise ValueError("retry_min_seconds must be > 0 and <= retry_max_seconds")


def unusable_log_dir(log_dir: Path | str, exc: Exception) -> str:
    """The one line for a log directory that cannot be set up (its salt, its segments): the flag, the directory, the
    reason and the file it concerns; ``serve`` and ``simulate`` exit 2 with it, as on a bad flag."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename is not None else ""
    return f"--log-dir {log_dir}: cannot be created or written: {reason}{where}"


def session_sampled(session_id: str, rate: float, salt: bytes) -> bool:
    """Whether a session is logged at ``rate``: the same answer in every process sharing the salt, on every day."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(session_id.encode(), key=salt, digest_size=8, person=_SAMPLE).digest()
    return int.from_bytes(digest, "little") < rate * 2.0**64


def _encoded(encode: Callable[[list[Any], bytes, float], pa.RecordBatch], item: Any, salt: bytes,
             rate: float) -> pa.RecordBatch | None:
    """One record as a batch of one; ``None`` when it cannot be encoded."""
    try:
        return encode([item], salt, rate)
    except Exception:
        return None


@dataclass(slots=True)
class _Health:
    """One kind's writer: failed attempts in a row, when to try again, since when it fails."""

    failures: int = 0
    retry_at: float = 0.0
    since: float = 0.0


class ExperienceRecorder:
    def __init__(self, root: Path, salt: bytes, options: RecorderOptions, observer: RecorderObserver | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.options = options
        self._salt = salt
        self._observer = observer
        self._clock = clock
        self._spec = FeatureSpec()  # the last served bundle's, for decisions made without one (no model loaded)
        self._queues: dict[str, collections.deque[tuple[Any, int]]] = {kind: collections.deque() for kind in KINDS}  # (record, bytes)
        self._writers = {kind: SegmentWriter(self.root, kind, options.segment_bytes, options.segment_seconds) for kind in KINDS}
        self._held = dict.fromkeys(KINDS, 0)  # records the writers hold after a failed write (they count against max_queue)
        self._held_bytes = dict.fromkeys(KINDS, 0)  # and their encoded bytes (against max_queue_bytes)
        # The queues' bytes, as two running sums each written by one thread (queued = in - out): no lock on the request path.
        self._bytes_in = dict.fromkeys(KINDS, 0)  # the request path's
        self._bytes_out = dict.fromkeys(KINDS, 0)  # the writer's
        self._health = {kind: _Health() for kind in KINDS}
        self._dropped = dict.fromkeys(KINDS, 0)  # since start, for the log line
        self._dropped_logged = dict.fromkeys(KINDS, 0)
        self._drop_log_after = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()  # a queue reached flush_rows, or close(): write now
        self._thread = threading.Thread(target=self._run, name="experience-writer", daemon=True)
        self._closed = False
        self.written = dict.fromkeys(KINDS, 0)

    @property
    def dropped(self) -> dict[str, int]:
        """Records dropped since start, per kind (a full queue, a write error, left queued at close)."""
        return dict(self._dropped)

    def start(self) -> None:
        for kind in KINDS:
            recover_abandoned(self.root, kind)
        self._thread.start()

    # --- request path --------------------------------------------------------------------
    def sampled(self, session_id: str) -> bool:
        return session_sampled(session_id, self.options.sample_rate, self._salt)

    def decision(self, request: DecisionRequest, hour: int, decision: Decision, decision_id: str,
                 spec: FeatureSpec | None = None) -> bool:
        """Queue one answered decision; False when its session is not sampled or the queue is full.

        ``spec``: the feature spec of the bundle that served it (``None``: no bundle; the last one's).
        """
        if not self.sampled(request.session_id):
            return False
        if spec is None:
            spec = self._spec
        else:
            self._spec = spec
        return self._put("decisions", LoggedDecision(request, hour, decision, decision_id, self._clock(), spec))

    def outcome(self, report: OutcomeReport) -> bool:
        if not self.sampled(report.session_id):
            return False
        return self._put("outcomes", LoggedOutcome(report, self._clock()))

    def engagement(self, report: EngagementReport) -> bool:
        if not self.sampled(report.session_id):
            return False
        return self._put("engagements", LoggedEngagement(report, self._clock()))

    def product(self, request: ProductRequest, hour: int, decision: ProductDecision, decision_id: str, spec: FeatureSpec | None) -> bool:
        """Queue one answered ``RecommendProduct`` decision (sampled by its shopper's session, as decisions are)."""
        if not self.sampled(request.shopper.session_id):
            return False
        return self._put(PRODUCTS_KIND, LoggedProduct(request, hour, decision, decision_id, self._clock(), spec or self._spec))

    def _put(self, kind: str, item: Any) -> bool:
        queue, options = self._queues[kind], self.options
        size, queued = retained_bytes(item), self.queued_bytes(kind)
        if self._closed or len(queue) + self._held[kind] >= options.max_queue or (
                queue and queued + size > options.max_queue_bytes):
            self._dropped[kind] += 1
            if self._observer is not None:
                self._observer.dropped(kind, "closed" if self._closed else "queue_full", 1)
            return False
        self._bytes_in[kind] += size
        queue.append((item, size))  # deque.append and popleft are atomic: no lock with the writer thread
        if len(queue) == options.flush_rows or queued < options.max_queue_bytes // 4 <= queued + size:
            self._wake.set()  # once as either is crossed: flush_rows records, or a quarter of the bytes
        return True

    def depth(self, kind: str) -> int:
        return len(self._queues[kind])

    def queued_bytes(self, kind: str) -> int:
        """What ``kind``'s queued records keep alive (``retained_bytes``), and the encoded records its writer holds."""
        return self._bytes_in[kind] - self._bytes_out[kind] + self._held_bytes[kind]

    def _take(self, kind: str, n: int) -> list[Any]:
        """The writer's side: the first ``n`` queued records (fewer if another thread took some: ``close()`` after a
        writer that outlived its join), their bytes counted out."""
        queue, pairs = self._queues[kind], []
        for _ in range(n):
            try:
                pairs.append(queue.popleft())
            except IndexError:
                break
        self._bytes_out[kind] += sum(size for _, size in pairs)
        return [item for item, _ in pairs]

    def degraded(self, kind: str) -> bool:
        """Whether the last attempt to write ``kind`` failed (it is retried with back-off)."""
        return self._health[kind].failures > 0

    # --- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.options.flush_seconds)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.flush()
        self._drain()

    def flush(self) -> None:
        """Write what is queued now, unless a kind waits out its back-off (the writer thread; tests once it stopped).
        A kind whose flush raises anything but the disk's errors (a bug) is logged and left for the next flush: the
        writer thread must outlive it, or every later record of every kind is dropped at the full queue."""
        now = time.monotonic()
        for kind in KINDS:
            try:
                self._flush_kind(kind, now, final=False)
            except Exception:
                log.exception("the log writer could not flush; it goes on", extra={"fields": {"kind": kind}})
        self._log_drops()

    def _flush_kind(self, kind: str, now: float, final: bool) -> None:
        queue, writer, health = self._queues[kind], self._writers[kind], self._health[kind]
        if not final and health.failures and now < health.retry_at:  # backing off: what waits grows meanwhile
            if self._observer is not None:
                self._observer.queued(kind, len(queue) + writer.held_rows)
            return
        error: OSError | None = None
        try:
            self._written(kind, writer.retry())  # what an earlier failure left held goes first
            n = len(queue)
            if n:
                batch = self._batch(kind, self._take(kind, n))
                if batch is not None:
                    held = writer.held_rows
                    try:
                        self._written(kind, writer.write(batch))
                    except OSError:
                        raise  # the writer holds the batch and retries it
                    except Exception:
                        if writer.held_rows == held:  # taken from the queue and not held for a retry: counted lost
                            self._drop(kind, "write_error", batch.num_rows)
                        raise
        except OSError as exc:
            error = exc
        if writer.due():  # finalised even while writes fail: what the segment holds becomes readable
            try:
                writer.rotate()
            except OSError as exc:
                error = error or exc
        self._drop(kind, "write_error", writer.take_lost())  # an open segment removed or replaced under the writer
        self._held[kind], self._held_bytes[kind] = writer.held_rows, writer.held_bytes
        if self._observer is not None:  # what waits now, until the next flush (the gauge read the last one's start)
            self._observer.queued(kind, len(queue) + writer.held_rows)
        if error is not None:
            self._failed(kind, error, now)
        elif health.failures:
            self._recovered(kind, now)

    def _batch(self, kind: str, items: list[Any]) -> pa.RecordBatch | None:
        """The records as a batch; ``None`` when none of them can be encoded. A record that cannot be (a bug, or a value
        the request checks let through) is dropped, counted and logged alone: the others of its flush are kept."""
        encode, salt, rate = _ENCODERS[kind], self._salt, self.options.sample_rate
        try:
            return encode(items, salt, rate)
        except Exception:
            alone = [batch for batch in (_encoded(encode, item, salt, rate) for item in items) if batch is not None]
            log.exception("could not encode log records; they are lost",
                          extra={"fields": {"kind": kind, "records": len(items) - len(alone), "of": len(items)}})
        self._drop(kind, "write_error", len(items) - len(alone))
        return pa.concat_batches(alone) if alone else None

    def _written(self, kind: str, n: int) -> None:
        if n:
            self.written[kind] += n
            if self._observer is not None:
                self._observer.written(kind, n)

    def _drop(self, kind: str, reason: str, n: int) -> None:
        if n:
            self._dropped[kind] += n
            if self._observer is not None:
                self._observer.dropped(kind, reason, n)

    def _failed(self, kind: str, exc: OSError, now: float) -> None:
        health = self._health[kind]
        health.failures += 1
        delay = min(self.options.retry_max_seconds, self.options.retry_min_seconds * 2.0 ** min(health.failures - 1, 30))
        health.retry_at = now + delay
        if self._observer is not None:
            self._observer.write_failed(kind)
        if health.failures > 1:
            return
        health.since = now
        if self._observer is not None:
            self._observer.degraded(kind, True)
        log.error("cannot write log segments; records are kept and retried with back-off (new ones queue, and are dropped "
                  "and counted once the queue is full)",
                  extra={"fields": {"kind": kind, "error": f"{type(exc).__name__}: {exc.strerror or exc}", "held": self._held[kind],
                                    "segment": str(self._writers[kind].open_path), "retry_in_s": delay}})

    def _recovered(self, kind: str, now: float) -> None:
        health = self._health[kind]
        log.warning("log segments are written again", extra={"fields": {
            "kind": kind, "failed_attempts": health.failures, "degraded_s": round(now - health.since, 3)}})
        self._health[kind] = _Health()
        if self._observer is not None:
            self._observer.degraded(kind, False)

    def _drain(self) -> None:
        """At shutdown: one last try whatever the back-off, finalise the segments, count what the disk refused."""
        now = time.monotonic()
        for kind in KINDS:
            self._flush_kind(kind, now, final=True)
            queue, writer = self._queues[kind], self._writers[kind]
            lost = writer.close()
            if self._health[kind].failures:  # the last try failed too: the queue was never taken
                lost += len(self._take(kind, len(queue)))
            self._held[kind] = self._held_bytes[kind] = 0
            if lost:
                log.error("log records could not be written before shutdown; they are lost",
                          extra={"fields": {"kind": kind, "records": lost}})
                self._drop(kind, "write_error", lost)
        self._log_drops()

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
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: write in this thread
            self._drain()
        for kind, queue in self._queues.items():  # a record that raced the close, or a writer that hung
            if queue:
                left = len(self._take(kind, len(queue)))
                log.error("log records left unwritten at close", extra={"fields": {"kind": kind, "records": left}})
                self._drop(kind, "closed", left)
