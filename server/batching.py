"""Micro-batching: concurrent requests share one encode, one inference call and one vectorised decision.

The batch runs on the event loop itself, as one synchronous call. After a batch of two or
more, the worker pauses so that requests can gather for the next one: for at most
``t * (1 / duty - 1)`` after a batch that took ``t`` seconds, and at most ``max_delay_s``.
The pause ends early when ``max_batch`` requests wait, on close, when a waiting caller's
deadline would otherwise be missed, or once a whole ``gap_s`` passes without a new request
(so one to two gaps after the last one). A pause that gathers fewer than two requests turns
pausing off until a batch of two or more turns it back on: a client calling one at a time,
alone, is never held, and an idle server answers at once. Under load, inference so gets a
bounded share of the loop's time, and the rest goes to what only the loop can do: accepting
calls, parsing, answering.

A pause also ends as soon as the callers it has learnt are all back. When two pauses in a row
end in quiet (a gap without a request) with the same number waiting, that number is taken for
a population of callers who each call again as soon as they are answered, and later pauses
end the moment that many wait instead of waiting out another gap (4 such callers: p50 about 4.2 →
2.0 ms, docs/performance.md). Every ``POPULATION_RECHECK``-th pause drops it and must find it
again by a quiet end; a pause that ends any other way than in quiet or at the learnt count (its
bound while requests kept coming, ``max_batch``, a deadline) forgets it: a stream is no
population, and a learnt count must not keep its batches small. Quiet means a whole gap since
the latest request, not a window that the bound cut short.

A lone request looks ahead before it runs alone when the event loop has been busy since the last
batch: gRPC admits a connection's calls one at a time through the same loop
(``server/transport.py``), so a stream of calls on one connection can reach the batcher one by one
while the rest wait in grpc-core, unseen. Each would then run alone, each batch of one would hold
up the next admission, and the server settled at about 1,250 calls a second while 2,400 arrived:
p99 33-72 ms at half its capacity on one connection in a probe's runs, for a hundred milliseconds
at a time until two requests happened to meet (docs/performance.md). So when the loop's thread
spent at least ``BUSY_SHARE`` of the time since the last batch on the CPU (it never waited for the
network: something else is in progress), the worker gives the loop up to ``LOOKAHEAD_TURNS``
turns, and at most one gap, to bring a second request; one that comes makes a batch of two, which
turns pausing on (also right after a pause that turned it off). A lone client over a network
leaves the loop waiting for its next call, so its requests rarely look ahead (1.3 % of them in a
probe); with ``max_batch`` 1 (batching off) none does.

Why not a thread: onnxruntime releases the GIL, but everything around it (encoding, the
decision, every GIL handoff) makes an inference thread and the gRPC threads take turns at
the GIL, and on 2 vCPUs each turn is a futex wake and a context switch. Measured with
h2load (``docs/performance.md``): 61-64 % of a bare gRPC server's throughput with paced batches
on the loop, against 41-46 % with the thread and 34 % on the loop without pauses.

A batch only ever holds requests that read the same model set, so a hot swap never mixes
models in one call. A full queue raises ``Overloaded`` at once; the caller degrades to the
rule engine rather than queueing without bound. Only callers still waiting count toward
the bound: a request whose caller gave up (deadline, cancellation) leaves the count at once.
If a batch fails, its requests are rerun one by one, so only a request that fails on its
own gets the error.

The worker survives whatever one batch does (a model that raises or returns the wrong
number of decisions, an ``on_batch`` callback that raises): that batch's callers get the
error and the next batch runs. Should the worker task end anyway (cancelled, or a bug in
the loop itself), everything waiting fails with ``BatcherClosed`` and so does every later
call, rather than hanging.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from core.domain import Context

log = logging.getLogger(__name__)

LOOKAHEAD_TURNS = 8  # loop turns a lone request may wait for a second one while the loop is busy (the module doc)
BUSY_SHARE = 0.95  # the share of wall time on the loop thread's CPU since the last batch that counts as busy
POPULATION_RECHECK = 16  # every this many pauses, one drops the learnt count: a quiet end must find it again
_QUIET_SHARE = 0.99  # a timer may fire a hair early: this much of a gap since the last request counts as the gap
_CALLBACK_LOG_INTERVAL_S = 60.0  # a broken on_batch is logged (with its traceback) at most this often


class Overloaded(RuntimeError):
    """The inference queue is full."""


class BatcherClosed(RuntimeError):
    """The batcher is shutting down (or its worker stopped)."""


Req = TypeVar("Req")
Out = TypeVar("Out")
Req_contra = TypeVar("Req_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)


class BatchModel(Protocol[Req_contra, Out_co]):
    """What a batch runs on: ``RecommendAction``'s ``ModelSet.run``, or ``RecommendProduct``'s ``ProductBatches``."""

    def run(self, requests: Sequence[Req_contra], contexts: Sequence[Context],
            decision_ids: Sequence[str]) -> Sequence[Out_co]: ...


@dataclass(slots=True)
class _Item(Generic[Req, Out]):
    model: BatchModel[Req, Out]
    request: Req
    context: Context
    decision_id: str
    future: asyncio.Future[Out]


def _run(model: BatchModel[Req, Out], items: Sequence[_Item[Req, Out]]) -> Sequence[Out]:
    return model.run([i.request for i in items], [i.context for i in items], [i.decision_id for i in items])


def _fail(items: Sequence[_Item[Req, Out]], exc: BaseException) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(exc)


class MicroBatcher(Generic[Req, Out]):
    """``on_batch(decisions, seconds, queue_depth)`` hears of every model run with the decisions
    actually delivered (metrics count them once per run, not once per call), the one-by-one
    reruns after a failed batch included; ``queue_depth`` is how many callers waited when the
    batch was taken, its own included (nothing can arrive while a batch runs on the loop). ``on_idle()`` hears that the
    queue has emptied, so a depth reported under load is not left standing on an idle server."""

    def __init__(self, max_batch: int, max_queue: int,
                 on_batch: Callable[[list[Out], float, int], None] | None = None,
                 duty: float = 1.0, max_delay_s: float = 0.0, gap_s: float = 0.001,
                 on_idle: Callable[[], None] | None = None) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty: expected 0 < duty <= 1, got {duty}")
        if not (max_delay_s >= 0.0 and gap_s > 0.0):
            raise ValueError(f"max_delay_s must be >= 0 and gap_s > 0, got {max_delay_s} and {gap_s}")
        self._on_batch = on_batch
        self._on_idle = on_idle
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._pause_per_run_s = 1.0 / duty - 1.0  # seconds of pause per second of inference
        self.max_delay_s = max_delay_s
        self.gap_s = gap_s
        self._next_at = 0.0  # loop time until which the pause after the last batch may last
        self._pausing = False  # whether pauses have been gathering requests lately
        self._arrivals = 0  # requests queued so far (a counter, to see whether any came)
        self._give_up_at = math.inf  # earliest caller deadline since the last batch was taken
        self._last_run_s = 0.0  # how long the last batch took
        self._population = 0  # callers that come back together, learnt from two quiet pauses in a row (0: none)
        self._pauses = 0
        self._quiet_count = 0  # how many waited when the last pause ended in quiet (0: it did not)
        self._last_arrival = 0.0  # loop time of the latest request
        # Queue order lives in the deque; who still waits lives in the set. A caller that gives
        # up leaves the set at once (a done callback) and the deque when the worker reaches it.
        self._pending: collections.deque[_Item[Req, Out]] = collections.deque()
        self._waiting: set[asyncio.Future[Out]] = set()
        self._running: list[_Item[Req, Out]] = []  # the batch being decided now
        self._wake = asyncio.Event()
        self._nudge = asyncio.Event()  # wakes a pause to check whether it should end (max_batch, a deadline, close)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._closed_why = "shutting down"
        self._callback_failures = 0
        self._callback_log_after = 0.0
        self._ended_at = self._ended_cpu = 0.0  # perf_counter and the thread's CPU time when the last batch ended
        self.look_aheads = 0  # lone requests that waited for a second one (a statistic, for tests and probes)

    @property
    def depth(self) -> int:
        """Requests queued whose callers still wait."""
        return len(self._waiting)

    def start(self) -> None:
        self._ended_at, self._ended_cpu = time.perf_counter(), time.thread_time()  # the busy share counts from here
        self._task = asyncio.get_running_loop().create_task(self._worker(), name="micro-batcher")
        self._task.add_done_callback(self._worker_ended)

    def decide(self, model: BatchModel[Req, Out], request: Req, context: Context,
               decision_id: str, give_up_at: float | None = None) -> asyncio.Future[Out]:
        """The decision for one request, computed in a batch with its neighbours: await the future.

        Raises ``BatcherClosed`` or ``Overloaded`` here, at call time. Cancelling the future
        (``asyncio.wait_for`` does on timeout) withdraws the request. ``give_up_at`` (loop
        time) is when the caller will stop waiting: a pause never runs past it.
        """
        if self._closed:
            raise BatcherClosed(self._closed_why)
        waiting = self._waiting
        if len(waiting) >= self.max_queue:
            raise Overloaded(f"{len(waiting)} requests already waiting for inference")
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        waiting.add(future)
        future.add_done_callback(waiting.discard)
        pending = self._pending
        pending.append(_Item(model, request, context, decision_id, future))
        if len(pending) > 2 * self.max_queue:  # mostly abandoned items: drop them (amortised O(1))
            self._pending = collections.deque(i for i in pending if not i.future.done())
        self._arrivals += 1
        self._last_arrival = future.get_loop().time()
        self._wake.set()
        if give_up_at is not None and give_up_at < self._give_up_at:
            self._give_up_at = give_up_at
            self._nudge.set()
        if len(waiting) >= self.max_batch or len(waiting) == self._population:
            self._nudge.set()
        return future

    def _dequeue(self, item: _Item[Req, Out]) -> None:
        self._waiting.discard(item.future)
        item.future.remove_done_callback(self._waiting.discard)

    def _take(self) -> list[_Item[Req, Out]]:
        """The oldest waiting request and those behind it on the same model, up to max_batch."""
        pending = self._pending
        model: BatchModel[Req, Out] | None = None
        batch: list[_Item[Req, Out]] = []
        keep: list[_Item[Req, Out]] = []
        while pending and len(batch) < self.max_batch:
            item = pending.popleft()
            if item.future.done():  # the caller gave up (deadline or cancellation)
                self._dequeue(item)
                continue
            if model is None:
                model = item.model
            if item.model is model:
                self._dequeue(item)
                batch.append(item)
            else:
                keep.append(item)
        pending.extendleft(reversed(keep))
        return batch

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closed:
                    return
                if self._on_idle is not None:
                    self._tell(self._on_idle)
                self._wake.clear()
                await self._wake.wait()
                continue
            paused = self._pausing
            await self._pause(loop)
            looked = False
            if self.max_batch >= 2 and not self._pausing and len(self._waiting) == 1 and self._loop_was_busy():
                looked = await self._look_ahead(loop)
            depth = len(self._waiting)  # before the take: the batch's own requests included
            self._give_up_at = math.inf  # (requests kept back for another model set mid-swap lose
            batch = self._take()  # theirs: at worst they wait out one bounded pause)
            if not batch:
                continue
            if (looked or not paused) and len(batch) >= 2:
                self._pausing = True  # requests arrive together: pausing can gather more of them
            self._running = batch
            started = time.perf_counter()
            try:
                await self._serve(batch, depth)
            except Exception as exc:  # a broken model contract or a bug: this batch fails, the worker goes on
                log.exception("micro-batch failed", extra={"fields": {"batch_size": len(batch), "error": repr(exc)[:300]}})
                _fail(batch, exc)
            self._running = []  # (left set if the worker is cancelled during one-by-one reruns)
            self._ended_at, self._ended_cpu = time.perf_counter(), time.thread_time()
            self._last_run_s = self._ended_at - started
            self._next_at = loop.time() + min(self.max_delay_s, self._last_run_s * self._pause_per_run_s)
            await asyncio.sleep(0)  # let the answered callers respond before the next batch blocks the loop

    def _loop_was_busy(self) -> bool:
        """Whether the loop's thread has been on the CPU for ``BUSY_SHARE`` of the time since the last batch ended."""
        return time.thread_time() - self._ended_cpu >= BUSY_SHARE * (time.perf_counter() - self._ended_at)

    async def _look_ahead(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Give the loop a few turns to bring a second request (the module doc), within a gap and the callers' time;
        whether one came (its batch of two turns pausing on, even right after a pause that turned it off)."""
        self.look_aheads += 1
        until = min(loop.time() + self.gap_s, self._give_up_at - self._last_run_s)
        for _ in range(LOOKAHEAD_TURNS):
            await asyncio.sleep(0)
            if len(self._waiting) != 1 or self._closed or loop.time() >= until:
                break
        return len(self._waiting) >= 2

    async def _pause(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a batch, let requests gather for the next one, while they keep coming (see the module doc)."""
        if not self._pausing:
            return
        arrivals_before = self._arrivals
        self._pauses += 1
        if self._pauses % POPULATION_RECHECK == 0:
            self._population = 0  # a recheck: only a quiet end that finds the same count again restores it
        quiet = False
        while not self._closed and len(self._waiting) < min(self._population or self.max_batch, self.max_batch):
            # leave the next batch time to finish before the most impatient caller gives up
            left = min(self._next_at, self._give_up_at - self._last_run_s) - loop.time()
            if left <= 0:  # cut off while requests may still come (a stream is no population): forgotten below
                break
            arrivals = self._arrivals
            self._nudge.clear()
            try:
                async with asyncio.timeout(min(self.gap_s, left)):
                    await self._nudge.wait()
                continue  # nudged: check the end again
            except TimeoutError:
                pass
            if self._arrivals == arrivals and loop.time() - self._last_arrival >= _QUIET_SHARE * self.gap_s:
                quiet = True  # a whole gap without a request (not a window the bound cut short)
                break
        if quiet:  # everyone who calls again is here: learnt when two pauses in a row find the same count
            seen = len(self._waiting)
            self._population = seen if seen >= 2 and seen == self._quiet_count else 0
            self._quiet_count = seen
        elif not (self._population and len(self._waiting) >= self._population):
            self._population = self._quiet_count = 0  # max_batch, the bound, a deadline, close: learn afresh
        self._pausing = self._arrivals - arrivals_before >= 2

    async def _serve(self, batch: list[_Item[Req, Out]], depth: int) -> None:
        started = time.perf_counter()
        try:
            decisions = _run(batch[0].model, batch)
        except Exception as exc:
            # One line per batch, no traceback: the servicer logs each request that ends up failing.
            log.warning("inference failed for a batch", extra={"fields": {"batch_size": len(batch), "error": repr(exc)[:300]}})
            if len(batch) == 1:
                _fail(batch, exc)
                return
            for item in batch:  # isolate the request that broke it: rerun one by one ...
                self._run_one(item, depth)
                await asyncio.sleep(0)  # ... letting the loop breathe between runs
            return
        self._deliver(batch, decisions, started, depth)

    def _run_one(self, item: _Item[Req, Out], depth: int) -> None:
        if item.future.done():
            return
        started = time.perf_counter()
        try:
            decisions = _run(item.model, [item])
            self._deliver([item], decisions, started, depth)
        except Exception as exc:
            _fail([item], exc)

    def _deliver(self, batch: list[_Item[Req, Out]], decisions: Sequence[Out], started: float, depth: int) -> None:
        """Hand each caller still waiting its decision, then tell ``on_batch``."""
        if len(decisions) != len(batch):
            raise RuntimeError(f"the model returned {len(decisions)} decisions for {len(batch)} requests")
        delivered: list[Out] = []
        for item, decision in zip(batch, decisions, strict=True):
            if not item.future.done():
                item.future.set_result(decision)
                delivered.append(decision)
        self._report(delivered, time.perf_counter() - started, depth)

    def _report(self, delivered: list[Out], seconds: float, depth: int) -> None:
        if self._on_batch is not None:
            self._tell(self._on_batch, delivered, seconds, depth)

    def _tell(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:  # metrics must never stop decisions; log now and then, not every batch
            self._callback_failures += 1
            now = time.monotonic()
            if now >= self._callback_log_after:
                self._callback_log_after = now + _CALLBACK_LOG_INTERVAL_S
                log.exception("a batch callback failed; the decisions were served",
                              extra={"fields": {"failures": self._callback_failures}})

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        """The worker task ended: after ``close()`` that is normal; otherwise fail everyone waiting."""
        if task.cancelled():
            log.error("the inference worker was cancelled; inference is off until restart")
            why = "the inference worker was cancelled"
        else:
            exc = task.exception()
            if exc is None:
                why = "shutting down"
            else:
                log.error("the inference worker died; inference is off until restart", exc_info=exc)
                why = f"the inference worker died: {exc!r}"
        if not self._closed:
            self._closed, self._closed_why = True, why
        self._fail_all(BatcherClosed(why))

    def _fail_all(self, exc: BatcherClosed) -> None:
        items = [*self._running, *self._pending]
        self._running = []
        self._pending.clear()
        for item in items:
            self._dequeue(item)
        _fail(items, exc)

    async def close(self) -> None:
        """Finish what is queued (without pausing), then stop the worker. Never raises for a dead worker."""
        self._closed = True
        self._wake.set()
        self._nudge.set()
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait((task,))  # does not raise what the task raised
        self._fail_all(BatcherClosed(self._closed_why))  # nothing, unless the worker never ran or died
