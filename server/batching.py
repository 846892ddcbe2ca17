"""Micro-batching: concurrent requests share one inference call.

Opportunistic, not timed: the worker takes everything waiting (up to ``max_batch``) the
moment the previous batch finishes, so a lone request waits for nothing and a busy server
amortises each onnxruntime call over many requests. Inference runs on a dedicated thread
(onnxruntime releases the GIL), so the event loop keeps parsing and answering meanwhile.

A batch only ever holds requests that read the same model set, so a hot swap never mixes
models in one call. A full queue raises ``Overloaded`` at once; the caller degrades to the
rule engine rather than queueing without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)
F32 = npt.NDArray[np.float32]


class Overloaded(RuntimeError):
    """The inference queue is full."""


class BatcherClosed(RuntimeError):
    """The batcher is shutting down."""


class Inferable(Protocol):
    def infer(self, states: F32) -> tuple[F32, F32]: ...


_Item = tuple[Inferable, F32, "asyncio.Future[tuple[F32, F32]]"]


class MicroBatcher:
    def __init__(self, max_batch: int, max_queue: int) -> None:
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
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def infer(self, model: Inferable, state: F32) -> tuple[F32, F32]:
        """Policy logits and guard allow-probabilities for one state, batched with its neighbours."""
        if self._closed:
            raise BatcherClosed("shutting down")
        if len(self._pending) >= self.max_queue:
            raise Overloaded(f"{len(self._pending)} requests already waiting for inference")
        future: asyncio.Future[tuple[F32, F32]] = asyncio.get_running_loop().create_future()
        self._pending.append((model, state, future))
        self._wake.set()
        return await future

    def _take(self) -> tuple[Inferable, list[_Item]]:
        """The oldest waiting request and those behind it on the same model, up to max_batch."""
        model = self._pending[0][0]
        batch: list[_Item] = []
        keep: list[_Item] = []
        while self._pending and len(batch) < self.max_batch:
            item = self._pending.popleft()
            if item[2].done():  # the caller gave up (deadline or cancellation)
                continue
            (batch if item[0] is model else keep).append(item)
        self._pending.extendleft(reversed(keep))
        return model, batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            model, batch = self._take()
            if not batch:
                continue
            states = np.stack([item[1] for item in batch])
            try:
                logits, allow = await loop.run_in_executor(self._executor, model.infer, states)
            except Exception as exc:
                if len(batch) > 1:  # isolate the request that broke it: rerun one by one
                    self._pending.extendleft(reversed([(m, s, f) for m, s, f in batch]))
                    await self._run_singly(loop, len(batch))
                    continue
                log.error("inference failed", extra={"fields": {"error": repr(exc)[:300]}})
                if not batch[0][2].done():
                    batch[0][2].set_exception(exc)
                continue
            self.batches += 1
            for i, (_, _, future) in enumerate(batch):
                if not future.done():
                    future.set_result((logits[i], allow[i]))

    async def _run_singly(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        """Infer the next ``count`` waiting requests one at a time, failing only those that fail."""
        for _ in range(count):
            model, state, future = self._pending.popleft()
            if future.done():
                continue
            try:
                logits, allow = await loop.run_in_executor(self._executor, model.infer, state[None, :])
            except Exception as exc:
                log.error("inference failed", extra={"fields": {"error": repr(exc)[:300]}})
                if not future.done():
                    future.set_exception(exc)
                continue
            if not future.done():
                future.set_result((logits[0], allow[0]))

    async def close(self) -> None:
        """Finish what is queued, then stop the worker and its thread."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)
