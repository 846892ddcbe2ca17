"""Micro-batching: concurrent requests share one encode, one inference call and one vectorised decision.

Opportunistic, not timed: the worker takes everything waiting (up to ``max_batch``) the
moment the previous batch finishes, so a lone request waits for nothing and a busy server
amortises each onnxruntime call and each numpy operation over many requests. The batch
runs on a dedicated thread (onnxruntime and numpy release the GIL), so the event loop keeps
parsing and answering meanwhile.

A batch only ever holds requests that read the same model set, so a hot swap never mixes
models in one call. A full queue raises ``Overloaded`` at once; the caller degrades to the
rule engine rather than queueing without bound. If a batch fails, its requests are rerun
one by one, so only a request that fails on its own gets the error.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from policy.domain import Context, Decision, DecisionRequest

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """The inference queue is full."""


class BatcherClosed(RuntimeError):
    """The batcher is shutting down."""


class BatchModel(Protocol):
    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Context],
            decision_ids: Sequence[str]) -> list[Decision]: ...


@dataclass(slots=True)
class _Item:
    model: BatchModel
    request: DecisionRequest
    context: Context
    decision_id: str
    future: asyncio.Future[Decision]


def _run(model: BatchModel, items: Sequence[_Item]) -> list[Decision]:
    return model.run([i.request for i in items], [i.context for i in items], [i.decision_id for i in items])


class MicroBatcher:
    """``on_batch(decisions, seconds, queue_depth)`` hears of every batch run with the decisions
    actually delivered (metrics count them once per batch, not once per call)."""

    def __init__(self, max_batch: int, max_queue: int,
                 on_batch: Callable[[list[Decision], float, int], None] | None = None) -> None:
        self._on_batch = on_batch
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._pending: collections.deque[_Item] = collections.deque()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0

    @property
    def depth(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._worker(), name="micro-batcher")

    async def decide(self, model: BatchModel, request: DecisionRequest, context: Context, decision_id: str) -> Decision:
        """The decision for one request, computed in a batch with its neighbours."""
        if self._closed:
            raise BatcherClosed("shutting down")
        if len(self._pending) >= self.max_queue:
            raise Overloaded(f"{len(self._pending)} requests already waiting for inference")
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._pending.append(_Item(model, request, context, decision_id, future))
        self._wake.set()
        return await future

    def _take(self) -> list[_Item]:
        """The oldest waiting request and those behind it on the same model, up to max_batch."""
        model = self._pending[0].model
        batch: list[_Item] = []
        keep: list[_Item] = []
        while self._pending and len(batch) < self.max_batch:
            item = self._pending.popleft()
            if item.future.done():  # the caller gave up (deadline or cancellation)
                continue
            (batch if item.model is model else keep).append(item)
        self._pending.extendleft(reversed(keep))
        return batch

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take()
            if not batch:
                continue
            started = time.perf_counter()
            try:
                decisions = await loop.run_in_executor(self._executor, _run, batch[0].model, batch)
            except Exception as exc:
                if len(batch) > 1:  # isolate the request that broke it: rerun one by one
                    for item in batch:
                        await self._run_one(loop, item)
                    continue
                self._fail(batch[0], exc)
                continue
            self.batches += 1
            delivered = []
            for item, decision in zip(batch, decisions, strict=True):
                if not item.future.done():
                    item.future.set_result(decision)
                    delivered.append(decision)
            if self._on_batch is not None:
                self._on_batch(delivered, time.perf_counter() - started, len(self._pending))

    async def _run_one(self, loop: asyncio.AbstractEventLoop, item: _Item) -> None:
        if item.future.done():
            return
        try:
            (decision,) = await loop.run_in_executor(self._executor, _run, item.model, [item])
        except Exception as exc:
            self._fail(item, exc)
            return
        if not item.future.done():
            item.future.set_result(decision)

    @staticmethod
    def _fail(item: _Item, exc: Exception) -> None:
        log.error("inference failed", extra={"fields": {"decision_id": item.decision_id, "error": repr(exc)[:300]}})
        if not item.future.done():
            item.future.set_exception(exc)

    async def close(self) -> None:
        """Finish what is queued, then stop the worker and its thread."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)
