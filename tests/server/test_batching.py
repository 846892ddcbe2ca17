"""The MicroBatcher on its own: batching, the queue bound, shutdown, and surviving a bad batch.

The model is a small stand-in for the model interface (``run(requests, contexts, decision_ids)``)
that records its calls and can be held on a gate, so a test decides what is queued behind a
running batch. Every wait is bounded, so a bug fails a test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from policy.domain import N_ACTIONS, Action, Context, Decision, DecisionRequest, PageType, Source
from server.batching import BatcherClosed, MicroBatcher, Overloaded

T = TypeVar("T")
WAIT_S = 2.0
REQUEST = DecisionRequest("user", "session", "item", np.zeros(4, dtype=np.float32), (), PageType.SEARCH, 0.0, 0)
CONTEXT = Context(PageType.SEARCH, 0, 12, 0)


def _decision(model_version: str, decision_id: str) -> Decision:
    p = np.full(N_ACTIONS, 1.0 / N_ACTIONS)
    return Decision(Action.VIEW_DETAIL, Source.POLICY, float(p[0]), 1, 1, p, p, p, np.zeros(N_ACTIONS, dtype=bool),
                    model_version, rule=decision_id)  # the rule carries the id: each caller must get its own


class Model:
    """Answers each request with a decision naming it; ``fail_id`` makes any call holding it raise,
    ``short_calls`` (call numbers) return one decision too few; ``gate`` holds runs while clear."""

    def __init__(self, name: str = "m", *, fail_id: str | None = None, short_calls: Sequence[int] = ()) -> None:
        self.name = name
        self.fail_id = fail_id
        self.short_calls = set(short_calls)
        self.calls: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Context],
            decision_ids: Sequence[str]) -> list[Decision]:
        assert len(requests) == len(contexts) == len(decision_ids)
        call = len(self.calls)
        self.calls.append(list(decision_ids))
        if not self.gate.wait(5):
            raise RuntimeError("the test never opened the gate")
        if self.fail_id in decision_ids:
            raise ValueError(f"cannot decide {self.fail_id}")
        out = [_decision(self.name, i) for i in decision_ids]
        return out[:-1] if call in self.short_calls else out


class Recorder:
    """An ``on_batch`` that remembers what it heard."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.depths: list[int] = []

    def __call__(self, decisions: list[Decision], seconds: float, depth: int) -> None:
        assert seconds >= 0
        self.batches.append([d.rule for d in decisions])
        self.depths.append(depth)


def ask(batcher: MicroBatcher, model: Model, decision_id: str) -> asyncio.Future[Decision]:
    return batcher.decide(model, REQUEST, CONTEXT, decision_id)


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, WAIT_S)


async def until(condition: Callable[[], Any]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the worker"
        await asyncio.sleep(0.001)


async def hold_first(batcher: MicroBatcher, model: Model, decision_id: str = "r0") -> asyncio.Future[Decision]:
    """Start a run of ``decision_id`` alone and keep it on the thread until ``model.gate`` opens."""
    model.gate.clear()
    first = ask(batcher, model, decision_id)
    await until(lambda: model.calls)
    assert batcher.depth == 0
    return first


def test_concurrent_requests_share_batches_of_at_most_max_batch() -> None:
    async def main() -> None:
        heard = Recorder()
        batcher, model = MicroBatcher(max_batch=8, max_queue=100, on_batch=heard), Model()
        batcher.start()
        try:
            first = await hold_first(batcher, model)
            rest = [ask(batcher, model, f"r{i}") for i in range(1, 21)]
            assert batcher.depth == 20
            model.gate.set()
            decisions = await within(asyncio.gather(first, *rest))
        finally:
            model.gate.set()
        assert [d.rule for d in decisions] == [f"r{i}" for i in range(21)]
        assert [len(call) for call in model.calls] == [1, 8, 8, 4]
        assert heard.batches == model.calls and heard.depths == [20, 12, 4, 0]
        assert batcher.depth == 0
        await within(batcher.close())

    asyncio.run(main())


def test_a_lone_request_is_not_delayed() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=64, max_queue=100), Model()
        batcher.start()
        for i in range(3):
            started = time.perf_counter()
            assert (await within(ask(batcher, model, f"alone{i}"))).rule == f"alone{i}"
            assert time.perf_counter() - started < 0.1
            await asyncio.sleep(0.01)  # the worker goes idle in between
        assert model.calls == [["alone0"], ["alone1"], ["alone2"]]
        await within(batcher.close())

    asyncio.run(main())


def test_a_full_queue_raises_overloaded_at_once() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=3), Model()
        batcher.start()
        try:
            first = await hold_first(batcher, model)  # taken off the queue: does not count
            queued = [ask(batcher, model, f"q{i}") for i in range(3)]
            with pytest.raises(Overloaded):
                ask(batcher, model, "one-too-many")  # raised by the call itself, nothing to await
            assert batcher.depth == 3
            model.gate.set()
            assert len(await within(asyncio.gather(first, *queued))) == 4
        finally:
            model.gate.set()
        assert (await within(ask(batcher, model, "later"))).rule == "later"
        assert model.calls == [["r0"], ["q0", "q1", "q2"], ["later"]]  # "one-too-many" never queued
        await within(batcher.close())

    asyncio.run(main())


def test_close_finishes_queued_work_then_refuses_new_calls() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=2, max_queue=10), Model()
        batcher.start()
        try:
            futures = [await hold_first(batcher, model)] + [ask(batcher, model, f"q{i}") for i in range(3)]
            closing = asyncio.ensure_future(batcher.close())
            await asyncio.sleep(0.01)
            assert not closing.done()  # still working through the queue
            with pytest.raises(BatcherClosed):
                ask(batcher, model, "too-late")
            model.gate.set()
            await within(closing)
        finally:
            model.gate.set()
        assert [f.result().rule for f in futures] == ["r0", "q0", "q1", "q2"]
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "after")
        await within(batcher.close())  # a second close is harmless

    asyncio.run(main())


def test_a_caller_that_gave_up_is_skipped_and_not_counted() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=2), Model()
        batcher.start()
        try:
            first = await hold_first(batcher, model)
            for i in range(10):  # a deadline storm: more callers give up than the queue holds
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(ask(batcher, model, f"gave-up{i}"), 0.001)
                assert batcher.depth == 0
            live = [ask(batcher, model, "live0"), ask(batcher, model, "live1")]  # not Overloaded
            assert batcher.depth == 2
            with pytest.raises(Overloaded):
                ask(batcher, model, "live2")  # the bound still holds for live callers
            model.gate.set()
            decisions = await within(asyncio.gather(first, *live))
        finally:
            model.gate.set()
        assert [d.rule for d in decisions] == ["r0", "live0", "live1"]
        assert model.calls == [["r0"], ["live0", "live1"]]  # the abandoned ones never reached the model
        await within(batcher.close())

    asyncio.run(main())


def test_a_failing_batch_is_rerun_one_by_one_and_only_the_culprit_fails(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        heard = Recorder()
        batcher, model = MicroBatcher(max_batch=8, max_queue=10, on_batch=heard), Model(fail_id="bad")
        batcher.start()
        try:
            futures = [await hold_first(batcher, model)] + [ask(batcher, model, i) for i in ("a", "bad", "c")]
            model.gate.set()
            results = await within(asyncio.gather(*futures, return_exceptions=True))
        finally:
            model.gate.set()
        assert [r.rule for r in results if isinstance(r, Decision)] == ["r0", "a", "c"]
        assert isinstance(results[2], ValueError) and "bad" in str(results[2])
        assert model.calls == [["r0"], ["a", "bad", "c"], ["a"], ["bad"], ["c"]]
        assert heard.batches == [["r0"], ["a"], ["c"]]  # the reruns are counted too
        assert (await within(ask(batcher, model, "next"))).rule == "next"
        await within(batcher.close())

    with caplog.at_level(logging.WARNING, logger="server.batching"):
        asyncio.run(main())
    records = [r for r in caplog.records if r.name == "server.batching"]
    assert len(records) == 1  # one line for the batch, none per request (the servicer logs those)
    assert records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert records[0].fields["batch_size"] == 3  # type: ignore[attr-defined]


def test_a_wrong_number_of_decisions_fails_that_batch_and_the_worker_goes_on() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=10), Model(short_calls=[1])
        batcher.start()
        try:
            first = await hold_first(batcher, model)
            batch = [ask(batcher, model, f"b{i}") for i in range(3)]
            model.gate.set()
            results = await within(asyncio.gather(first, *batch, return_exceptions=True))
        finally:
            model.gate.set()
        assert isinstance(results[0], Decision)
        for failed in results[1:]:
            assert isinstance(failed, RuntimeError) and "2 decisions for 3 requests" in str(failed)
        assert (await within(ask(batcher, model, "next"))).rule == "next"
        assert model.calls == [["r0"], ["b0", "b1", "b2"], ["next"]]  # failed, not rerun
        await within(batcher.close())

    asyncio.run(main())


def test_an_on_batch_that_raises_breaks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def broken(decisions: list[Decision], seconds: float, depth: int) -> None:
        calls.append(len(decisions))
        raise RuntimeError("metrics are broken")

    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=10, on_batch=broken), Model()
        batcher.start()
        for i in range(3):
            assert (await within(ask(batcher, model, f"r{i}"))).rule == f"r{i}"
        await within(batcher.close())

    with caplog.at_level(logging.ERROR, logger="server.batching"):
        asyncio.run(main())
    assert calls == [1, 1, 1]
    assert len([r for r in caplog.records if r.name == "server.batching"]) == 1  # logged, but not every batch


def test_two_models_are_never_mixed_in_one_run() -> None:
    async def main() -> None:
        batcher, old, new = MicroBatcher(max_batch=8, max_queue=20), Model("old"), Model("new")
        batcher.start()
        try:
            futures = [await hold_first(batcher, old, "old0")]
            for i in range(1, 4):  # a hot swap mid-stream: callers alternate between the two model sets
                futures += [ask(batcher, old, f"old{i}"), ask(batcher, new, f"new{i}")]
            old.gate.set()
            decisions = await within(asyncio.gather(*futures))
        finally:
            old.gate.set()
        assert old.calls == [["old0"], ["old1", "old2", "old3"]]
        assert new.calls == [["new1", "new2", "new3"]]
        assert all(d.rule.startswith(d.model_version) for d in decisions)
        await within(batcher.close())

    asyncio.run(main())


def test_a_cancelled_worker_fails_waiting_callers_and_close_still_returns(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=10), Model()
        batcher.start()
        try:
            futures = [await hold_first(batcher, model), ask(batcher, model, "queued")]
            task = batcher._task
            assert task is not None
            task.cancel()
            results = await within(asyncio.gather(*futures, return_exceptions=True))
            assert all(isinstance(r, BatcherClosed) for r in results)
            with pytest.raises(BatcherClosed):
                ask(batcher, model, "after")
            await within(batcher.close())  # the model is still stuck on the thread: close must not wait for it
        finally:
            model.gate.set()

    with caplog.at_level(logging.ERROR, logger="server.batching"):
        asyncio.run(main())
    assert any("cancelled" in r.getMessage() for r in caplog.records)


def test_a_worker_that_died_fails_waiting_callers_and_close_does_not_raise(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=10), Model()

        def broken_take() -> list[Any]:
            raise RuntimeError("a bug in the worker loop")

        monkeypatch.setattr(batcher, "_take", broken_take)  # the one step outside the per-batch guard
        batcher.start()
        with pytest.raises(BatcherClosed, match="died"):
            await within(ask(batcher, model, "r0"))
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "after")
        await within(batcher.close())
        assert model.calls == []

    with caplog.at_level(logging.ERROR, logger="server.batching"):
        asyncio.run(main())
    died = [r for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and died[0].exc_info is not None
