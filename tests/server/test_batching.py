"""The MicroBatcher on its own: batching, pausing, the queue bound, shutdown, surviving a bad batch.

The model is a small stand-in for the model interface (``run(requests, contexts, decision_ids)``)
that records its calls. Batches run on the event loop, so whatever a test queues before it
next awaits is what the worker finds; requests that arrive during a pause are asked after an
``asyncio.sleep`` that lets the worker start it. Every wait is bounded, so a bug fails a test
instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from core.domain import N_ACTIONS, Action, Context, Decision, DecisionRequest, PageType, Source
from server import batching
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
    ``short_calls`` (call numbers) return one decision too few; each run takes ``run_s``."""

    def __init__(self, name: str = "m", *, fail_id: str | None = None, short_calls: Sequence[int] = (),
                 run_s: float = 0.0) -> None:
        self.name = name
        self.fail_id = fail_id
        self.short_calls = set(short_calls)
        self.run_s = run_s
        self.calls: list[list[str]] = []
        self.ended: list[float] = []  # perf_counter at the end of each run

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Context],
            decision_ids: Sequence[str]) -> list[Decision]:
        assert len(requests) == len(contexts) == len(decision_ids)
        call = len(self.calls)
        self.calls.append(list(decision_ids))
        time.sleep(self.run_s)  # a blocking model, as onnxruntime is
        self.ended.append(time.perf_counter())
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


def pausing_batcher(max_batch: int = 64, max_queue: int = 100, gap_s: float = 0.2, max_delay_s: float = 1.0) -> MicroBatcher:
    """A started batcher whose pauses are bounded by the gap and ``max_delay_s`` only (duty 0.1%)."""
    batcher = MicroBatcher(max_batch=max_batch, max_queue=max_queue, duty=0.001, max_delay_s=max_delay_s, gap_s=gap_s)
    batcher.start()
    return batcher


async def pausing_after_a_pair(model: Model, **settings: Any) -> MicroBatcher:
    """A ``pausing_batcher`` that has served a batch of two, which turns pausing on: it is now pausing."""
    batcher = pausing_batcher(**settings)
    assert [d.rule for d in await within(asyncio.gather(ask(batcher, model, "p0"), ask(batcher, model, "p1")))] == ["p0", "p1"]
    assert batcher._pausing
    return batcher


def test_concurrent_requests_share_batches_of_at_most_max_batch() -> None:
    async def main() -> None:
        heard = Recorder()
        batcher, model = MicroBatcher(max_batch=8, max_queue=100, on_batch=heard), Model()
        batcher.start()
        futures = [ask(batcher, model, f"r{i}") for i in range(21)]
        assert batcher.depth == 21
        decisions = await within(asyncio.gather(*futures))
        assert [d.rule for d in decisions] == [f"r{i}" for i in range(21)]
        assert [len(call) for call in model.calls] == [8, 8, 5]
        assert heard.batches == model.calls and heard.depths == [21, 13, 5]  # waiting when taken, batch included
        assert batcher.depth == 0
        await within(batcher.close())

    asyncio.run(main())


def test_answered_callers_resume_before_the_next_batch_runs() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=100), Model(run_s=0.01)
        batcher.start()
        resumed: list[float] = []

        async def caller(i: int) -> None:
            await ask(batcher, model, f"r{i}")
            resumed.append(time.perf_counter())

        await within(asyncio.gather(*(caller(i) for i in range(32))))  # four batches back to back
        assert len(model.ended) == 4
        assert resumed[0] < model.ended[1]  # the loop ran the first batch's callers before blocking again

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


def test_a_client_calling_one_at_a_time_is_never_paused() -> None:
    async def main() -> None:
        batcher, model = pausing_batcher(gap_s=0.5), Model(run_s=0.002)
        started = time.perf_counter()
        for i in range(10):  # each call waits for the previous answer: batches of one never turn pausing on
            assert (await within(ask(batcher, model, f"seq{i}"))).rule == f"seq{i}"
        assert time.perf_counter() - started < 0.4  # one pause would have taken 0.5 s
        assert not batcher._pausing
        await within(batcher.close())

    asyncio.run(main())


def _burn(seconds: float) -> None:
    """Hold the loop's thread on the CPU (what admitting a gRPC call does between requests)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_requests_reaching_a_busy_loop_one_by_one_are_gathered() -> None:
    """The stall of one connection: calls admitted one at a time, each while the loop is busy with the next. Each
    would run alone (a batch of one turns nothing on); the look-ahead lets a second arrive and pausing begin."""
    async def main() -> None:
        batcher = MicroBatcher(max_batch=64, max_queue=1000, duty=0.05, max_delay_s=0.005, gap_s=0.001)
        batcher.start()
        model, futures = Model(), []
        for i in range(200):  # a request every four turns of a loop that never waits
            futures.append(ask(batcher, model, f"r{i}"))
            for _ in range(4):
                _burn(0.00002)
                await asyncio.sleep(0)
        decisions = await within(asyncio.gather(*futures))
        assert [d.rule for d in decisions] == [f"r{i}" for i in range(200)]
        assert len(model.calls) < 50, [len(c) for c in model.calls]  # one look-ahead away from 200 batches of one
        assert batcher.look_aheads >= 1
        await within(batcher.close())

    asyncio.run(main())


@pytest.fixture
def always_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lone request looks ahead: for the look-ahead's own bounds, whatever else shares the machine (a loaded CI
    runner preempts the loop's thread, and its busy share falls). The gate's own tests are
    ``test_requests_reaching_a_busy_loop_one_by_one_are_gathered`` and ``test_a_lone_caller_on_an_idle_loop_does_not_look_ahead``."""
    monkeypatch.setattr(batching, "BUSY_SHARE", 0.0)


class Burner:
    """Another task on the loop that holds its thread ``turn_s`` of CPU a turn and counts its turns (a busy loop)."""

    def __init__(self, turn_s: float, on_turn: Callable[[int], None] = lambda turn: None) -> None:
        self.turns, self._turn_s, self._on_turn, self._stop = 0, turn_s, on_turn, False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._stop:
            _burn(self._turn_s)
            self.turns += 1
            self._on_turn(self.turns)
            await asyncio.sleep(0)

    async def stop(self) -> None:
        self._stop = True
        await within(self._task)


async def busy_batcher(turn_s: float, on_turn: Callable[[int], None] = lambda turn: None,
                       max_batch: int = 64) -> tuple[MicroBatcher, Model, Burner]:
    """A started batcher whose gap (5 s) outlasts any look-ahead's 8 turns, on a loop a ``Burner`` keeps busy."""
    batcher = MicroBatcher(max_batch=max_batch, max_queue=100, gap_s=5.0)
    batcher.start()
    burner = Burner(turn_s, on_turn)
    await asyncio.sleep(0)
    return batcher, Model(), burner


def test_a_look_ahead_ends_at_the_callers_deadline(always_busy: None) -> None:
    async def main() -> None:
        batcher, model, burner = await busy_batcher(0.01)
        before = burner.turns
        give_up_at = asyncio.get_running_loop().time() + 0.03
        assert (await within(batcher.decide(model, REQUEST, CONTEXT, "lone", give_up_at))).rule == "lone"
        used = burner.turns - before
        await burner.stop()
        assert batcher.look_aheads == 1 and model.calls == [["lone"]]
        assert used <= 6, used  # 30 ms of 10 ms turns, not all 8 of them
        await within(batcher.close())

    asyncio.run(main())


def test_a_look_ahead_ends_when_a_second_request_comes_and_pausing_begins(always_busy: None) -> None:
    async def main() -> None:
        second: list[asyncio.Future[Decision]] = []
        asked_at: list[int] = []

        def on_turn(turn: int) -> None:
            if asked_at and not second and turn >= asked_at[0] + 2:  # (only once the first is asked, below)
                second.append(ask(batcher, model, "second"))

        batcher, model, burner = await busy_batcher(0.005, on_turn)
        asked_at.append(burner.turns)
        assert (await within(ask(batcher, model, "first"))).rule == "first"
        used = burner.turns - asked_at[0]
        assert (await within(second[0])).rule == "second"
        await burner.stop()
        assert model.calls == [["first", "second"]] and batcher._pausing
        assert used <= 5, used  # the turn the second came, not all 8
        await within(batcher.close())

    asyncio.run(main())


def test_a_pair_found_by_a_look_ahead_right_after_a_pause_turns_pausing_back_on(always_busy: None) -> None:
    """A pause that gathers nothing turns pausing off; the lone request's look-ahead then finds a second: on again."""
    async def main() -> None:
        model = Model()
        batcher = await pausing_after_a_pair(model, gap_s=0.02)
        asked: list[asyncio.Future[Decision]] = []

        def on_turn(_turn: int) -> None:
            if not batcher._pausing and not asked:  # the pause is over and pausing is off: the look-ahead runs
                asked.append(ask(batcher, model, "second"))

        burner = Burner(0.0002, on_turn)
        assert (await within(ask(batcher, model, "lone"))).rule == "lone"
        assert (await within(asked[0])).rule == "second"
        await burner.stop()
        assert model.calls[-1] == ["lone", "second"] and batcher.look_aheads == 1
        assert batcher._pausing
        await within(batcher.close())

    asyncio.run(main())


def test_close_during_a_look_ahead_answers_the_lone_request(always_busy: None) -> None:
    async def main() -> None:
        batcher, model, burner = await busy_batcher(0.001)
        before = burner.turns
        lone = ask(batcher, model, "lone")
        await asyncio.sleep(0)  # the worker takes it and looks ahead
        await within(batcher.close())
        used = burner.turns - before
        assert (await within(lone)).rule == "lone"
        await burner.stop()
        assert batcher.look_aheads == 1 and model.calls == [["lone"]]
        assert used <= 10, used  # the look-ahead ended at close (8 turns in all here), not after its 8 (14)
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "after")

    asyncio.run(main())


def test_with_batching_off_a_lone_request_never_looks_ahead(always_busy: None) -> None:
    """``max_batch`` 1 (micro-batching off): a second request could never join, so waiting for one is only delay."""
    async def main() -> None:
        batcher, model, burner = await busy_batcher(0.0002, max_batch=1)
        decisions = await within(asyncio.gather(*(ask(batcher, model, f"r{i}") for i in range(5))))
        await burner.stop()
        assert [d.rule for d in decisions] == [f"r{i}" for i in range(5)] and batcher.look_aheads == 0
        await within(batcher.close())

    asyncio.run(main())


def test_a_lone_caller_on_an_idle_loop_does_not_look_ahead() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=64, max_queue=100), Model(run_s=0.001)
        batcher.start()
        for i in range(5):
            await asyncio.sleep(0.005)  # the loop waits for the call, as it does for a client's
            assert (await within(ask(batcher, model, f"alone{i}"))).rule == f"alone{i}"
        assert batcher.look_aheads == 0 and model.calls == [[f"alone{i}"] for i in range(5)]
        await within(batcher.close())

    asyncio.run(main())


def test_a_pause_gathers_requests_that_keep_coming_until_a_gap() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=0.2, max_delay_s=5.0)
        futures = []
        for i in range(4):  # arrivals closer together than the gap keep the pause going
            futures.append(ask(batcher, model, f"g{i}"))
            await asyncio.sleep(0.05)
        last_asked = time.perf_counter()
        assert [d.rule for d in await within(asyncio.gather(*futures))] == ["g0", "g1", "g2", "g3"]
        assert model.calls == [["p0", "p1"], ["g0", "g1", "g2", "g3"]]  # one batch, not four
        assert model.ended[-1] - last_asked < 1.0  # ended by the gap (0.2 s), long before max_delay_s
        assert batcher._pausing  # it gathered four: pausing stays on
        await within(batcher.close())

    asyncio.run(main())


def test_a_pause_ends_as_soon_as_max_batch_requests_wait() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, max_batch=3, gap_s=1.0, max_delay_s=5.0)
        first = ask(batcher, model, "f0")
        await asyncio.sleep(0.05)  # the worker is pausing, gathering
        assert not first.done()
        started = time.perf_counter()
        rest = [ask(batcher, model, f"f{i}") for i in (1, 2)]  # now max_batch wait: no reason to wait on
        await within(asyncio.gather(first, *rest))
        assert time.perf_counter() - started < 0.5  # not the 1 s gap
        assert model.calls[-1] == ["f0", "f1", "f2"]
        await within(batcher.close())

    asyncio.run(main())


async def keep_asking(batcher: MicroBatcher, model: Model, asked: list[asyncio.Future[Decision]], go_on: Callable[[], bool],
                     seconds: float, every_s: float) -> None:
    """A stream: a request every ``every_s`` while ``go_on()`` holds, for at most ``seconds`` (the futures go to ``asked``)."""
    stop = time.perf_counter() + seconds
    while go_on() and time.perf_counter() < stop:
        asked.append(ask(batcher, model, f"s{len(asked)}"))
        await asyncio.sleep(every_s)


def test_a_pause_lasts_at_most_max_delay_while_requests_keep_coming() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=1.0, max_delay_s=0.3)
        paused_from = model.ended[-1]
        asked: list[asyncio.Future[Decision]] = []
        await keep_asking(batcher, model, asked, lambda: len(model.calls) < 3, 3.0, 0.02)  # requests never stop coming
        assert len(model.calls) == 3, "the pause never ended"
        assert len(model.calls[1]) > 1  # it did gather ...
        assert 0.25 <= model.ended[1] - paused_from < 1.0  # ... until max_delay_s (0.3 s), not the stream, ended it
        await within(asyncio.gather(*asked))
        await within(batcher.close())

    asyncio.run(main())


async def learn_three_callers(batcher: MicroBatcher, model: Model, rounds: int) -> list[float]:
    """Three callers that each call again as soon as they are answered, ``rounds`` times; each round's seconds."""
    async def call(c: int, r: int) -> Decision:
        await asyncio.sleep(0.01 * c)  # they arrive one after another, during the pause, as over a network
        return await ask(batcher, model, f"c{c}r{r}")

    took = []
    for r in range(rounds):
        started = time.perf_counter()
        await within(asyncio.gather(*(call(c, r) for c in range(3))))
        took.append(time.perf_counter() - started)
    return took


def test_callers_that_come_back_together_end_the_pause_once_they_are_learnt() -> None:
    async def main() -> None:
        model = Model(run_s=0.005)
        batcher = await pausing_after_a_pair(model, gap_s=0.3, max_delay_s=5.0)
        took = await learn_three_callers(batcher, model, 6)
        assert all(len(call) == 3 for call in model.calls[1:])
        assert min(took[:2]) >= 0.25  # two pauses end in quiet (the 0.3 s gap) and agree: three callers
        assert max(took[2:]) < 0.1, took  # then a pause ends the moment all three wait
        assert batcher._population == 3
        await within(batcher.close())

    asyncio.run(main())


def test_a_stream_of_requests_is_no_population() -> None:
    async def main() -> None:
        model = Model(run_s=0.005)
        batcher = await pausing_after_a_pair(model, gap_s=0.2, max_delay_s=0.3)
        await learn_three_callers(batcher, model, 3)
        assert batcher._population == 3
        asked: list[asyncio.Future[Decision]] = []
        await keep_asking(batcher, model, asked, lambda: bool(batcher._population), 4.0, 0.01)  # requests never stop coming
        assert batcher._population == 0, "a recheck never let the stream's bound end a pause"
        forgotten_at = len(model.calls)
        started = time.perf_counter()
        await keep_asking(batcher, model, asked, lambda: batcher._population == 0, 0.8, 0.01)  # the stream goes on ...
        assert batcher._population == 0 and time.perf_counter() - started >= 0.8  # ... and nothing is learnt again
        later = [len(call) for call in model.calls[forgotten_at:]]
        assert later and min(later[:-1] or later) > 3, later  # each pause ran to its bound (0.3 s: ~25 requests)
        await within(asyncio.gather(*asked))
        await within(batcher.close())

    asyncio.run(main())


def test_a_pause_its_bound_ends_short_of_the_learnt_count_forgets_it() -> None:
    async def main() -> None:
        model = Model(run_s=0.002)
        batcher = await pausing_after_a_pair(model, gap_s=0.2, max_delay_s=0.3)
        await learn_three_callers(batcher, model, 3)
        assert batcher._population == 3

        async def call(c: int) -> Decision:  # two callers 0.15 s apart: no gap of quiet before the bound, two not three
            await asyncio.sleep(0.15 * c)
            return await ask(batcher, model, f"two{c}")

        await within(asyncio.gather(call(0), call(1)))
        assert model.calls[-1] == ["two0", "two1"]
        assert batcher._population == 0, "kept until a recheck, though the bound ended the pause short of it"
        await within(batcher.close())

    asyncio.run(main())


def test_a_window_cut_short_by_the_bound_is_not_quiet() -> None:
    async def main() -> None:
        model = Model(run_s=0.002)
        batcher = await pausing_after_a_pair(model, gap_s=0.1, max_delay_s=0.15)

        async def call(c: int, r: int) -> Decision:  # arrivals 40 ms apart keep each pause going to its bound
            await asyncio.sleep(0.01 + 0.04 * c)
            return await ask(batcher, model, f"c{c}r{r}")

        for r in range(4):
            await within(asyncio.gather(*(call(c, r) for c in range(3))))
            # the pause's last window (0.10-0.15 s) holds no request, but only 60 ms have passed since the last one
            assert batcher._population == 0, f"round {r}: a pause its bound ended was taken for quiet"
        await within(batcher.close())

    asyncio.run(main())


def test_more_callers_than_max_batch_make_the_learnt_count_forgotten() -> None:
    async def main() -> None:
        model = Model(run_s=0.002)
        batcher = await pausing_after_a_pair(model, max_batch=6, gap_s=0.2, max_delay_s=5.0)
        await learn_three_callers(batcher, model, 3)
        assert batcher._population == 3
        done = asyncio.Event()

        async def caller(c: int) -> None:  # twelve callers, each thinking 30 ms between calls
            r = 0
            while not done.is_set():
                await ask(batcher, model, f"m{c}r{r}")
                r += 1
                await asyncio.sleep(0.03)

        tasks = [asyncio.create_task(caller(c)) for c in range(12)]
        stop = time.perf_counter() + 4.0
        while batcher._population and time.perf_counter() < stop:
            await asyncio.sleep(0.01)
        assert batcher._population == 0, "the learnt count outlived a recheck that max_batch ended"
        mark = len(model.calls)
        await asyncio.sleep(0.3)
        done.set()
        await within(asyncio.gather(*tasks))
        later = [len(call) for call in model.calls[mark:-2]]
        assert later and sum(size == 6 for size in later) > len(later) / 2, later  # full batches, not threes
        await within(batcher.close())

    asyncio.run(main())


def test_a_pause_that_gathers_nothing_turns_pausing_off() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=0.2)
        assert (await within(ask(batcher, model, "only"))).rule == "only"  # waits out one gap
        assert not batcher._pausing
        started = time.perf_counter()
        assert (await within(ask(batcher, model, "next"))).rule == "next"
        assert time.perf_counter() - started < 0.15  # no pause any more
        await within(batcher.close())

    asyncio.run(main())


def test_an_idle_server_answers_at_once_after_a_burst() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=0.2, max_delay_s=0.3)
        await asyncio.sleep(0.6)  # past max_delay_s: the pause, with nothing to gather, is over
        started = time.perf_counter()
        assert (await within(ask(batcher, model, "later"))).rule == "later"
        assert time.perf_counter() - started < 0.15  # less than a gap
        await within(batcher.close())

    asyncio.run(main())


def test_a_pause_ends_in_time_for_the_most_impatient_caller() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=1.0, max_delay_s=5.0)
        patient = ask(batcher, model, "patient")
        await asyncio.sleep(0.05)  # pausing, and requests keep the gap from ending it ...
        started = time.perf_counter()
        hurried = batcher.decide(model, REQUEST, CONTEXT, "hurried", give_up_at=loop.time() + 0.2)
        assert [d.rule for d in await within(asyncio.gather(patient, hurried))] == ["patient", "hurried"]
        assert time.perf_counter() - started < 0.5  # ... but the caller giving up in 0.2 s ends it
        assert model.calls[-1] == ["patient", "hurried"]
        await within(batcher.close())

    asyncio.run(main())


def test_callers_giving_up_and_a_full_queue_during_a_pause() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, max_queue=2, gap_s=0.3)
        with pytest.raises(TimeoutError):  # a caller's deadline passes while the batch gathers
            await asyncio.wait_for(ask(batcher, model, "gave-up"), 0.05)
        kept = [ask(batcher, model, "k0"), ask(batcher, model, "k1")]
        with pytest.raises(Overloaded):  # the bound holds during a pause too
            ask(batcher, model, "k2")
        assert [d.rule for d in await within(asyncio.gather(*kept))] == ["k0", "k1"]
        assert model.calls[-1] == ["k0", "k1"]  # the one that gave up never reached the model
        await within(batcher.close())

    asyncio.run(main())


@pytest.mark.parametrize("settings", [{"duty": 0.0}, {"duty": 1.5}, {"max_delay_s": -1.0}, {"gap_s": 0.0}])
def test_pause_settings_out_of_range_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(settings))):
        MicroBatcher(max_batch=8, max_queue=8, **settings)


def test_a_full_queue_raises_overloaded_at_once() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=3), Model()
        batcher.start()
        queued = [ask(batcher, model, f"q{i}") for i in range(3)]
        with pytest.raises(Overloaded):
            ask(batcher, model, "one-too-many")  # raised by the call itself, nothing to await
        assert batcher.depth == 3
        assert len(await within(asyncio.gather(*queued))) == 3
        assert (await within(ask(batcher, model, "later"))).rule == "later"
        assert model.calls == [["q0", "q1", "q2"], ["later"]]  # "one-too-many" never queued
        await within(batcher.close())

    asyncio.run(main())


def test_close_finishes_queued_work_then_refuses_new_calls() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=2, max_queue=10), Model()
        batcher.start()
        futures = [ask(batcher, model, f"q{i}") for i in range(4)]
        closing = asyncio.ensure_future(batcher.close())
        await asyncio.sleep(0)  # close() has begun: no new calls
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "too-late")
        await within(closing)
        assert [f.result().rule for f in futures] == ["q0", "q1", "q2", "q3"]
        assert model.calls == [["q0", "q1"], ["q2", "q3"]]
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "after")
        await within(batcher.close())  # a second close is harmless

    asyncio.run(main())


def test_close_cuts_a_pause_short_and_answers_what_it_gathered() -> None:
    async def main() -> None:
        model = Model(run_s=0.01)
        batcher = await pausing_after_a_pair(model, gap_s=2.0, max_delay_s=5.0)
        gathered = ask(batcher, model, "gathered")
        await asyncio.sleep(0.05)  # the worker is in its pause
        assert not gathered.done()
        started = time.perf_counter()
        await within(batcher.close())
        assert time.perf_counter() - started < 1.0  # not the 2 s gap
        assert gathered.result().rule == "gathered"

    asyncio.run(main())


def test_a_caller_that_gave_up_is_skipped_and_not_counted() -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=2), Model()
        batcher.start()
        for i in range(10):  # a deadline storm: more callers give up than the queue holds
            ask(batcher, model, f"gave-up{i}").cancel()  # what wait_for and asyncio.timeout do on expiry
            await asyncio.sleep(0)  # (the future's done callbacks run on the next loop turn)
            assert batcher.depth == 0
        live = [ask(batcher, model, "live0"), ask(batcher, model, "live1")]  # not Overloaded
        assert batcher.depth == 2
        with pytest.raises(Overloaded):
            ask(batcher, model, "live2")  # the bound still holds for live callers
        decisions = await within(asyncio.gather(*live))
        assert [d.rule for d in decisions] == ["live0", "live1"]
        assert model.calls == [["live0", "live1"]]  # the abandoned ones never reached the model
        await within(batcher.close())

    asyncio.run(main())


def test_a_failing_batch_is_rerun_one_by_one_and_only_the_culprit_fails(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        heard = Recorder()
        batcher, model = MicroBatcher(max_batch=8, max_queue=10, on_batch=heard), Model(fail_id="bad")
        batcher.start()
        futures = [ask(batcher, model, i) for i in ("a", "bad", "c")]
        results = await within(asyncio.gather(*futures, return_exceptions=True))
        assert [r.rule for r in results if isinstance(r, Decision)] == ["a", "c"]
        assert isinstance(results[1], ValueError) and "bad" in str(results[1])
        assert model.calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
        assert heard.batches == [["a"], ["c"]]  # the reruns are counted too
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
        batcher, model = MicroBatcher(max_batch=8, max_queue=10), Model(short_calls=[0])
        batcher.start()
        batch = [ask(batcher, model, f"b{i}") for i in range(3)]
        results = await within(asyncio.gather(*batch, return_exceptions=True))
        for failed in results:
            assert isinstance(failed, RuntimeError) and "2 decisions for 3 requests" in str(failed)
        assert (await within(ask(batcher, model, "next"))).rule == "next"
        assert model.calls == [["b0", "b1", "b2"], ["next"]]  # failed, not rerun
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
        futures = [ask(batcher, old, "old0")]
        for i in range(1, 4):  # a hot swap mid-stream: callers alternate between the two model sets
            futures += [ask(batcher, old, f"old{i}"), ask(batcher, new, f"new{i}")]
        decisions = await within(asyncio.gather(*futures))
        assert old.calls == [["old0", "old1", "old2", "old3"]]
        assert new.calls == [["new1", "new2", "new3"]]
        assert all(d.rule.startswith(d.model_version) for d in decisions)
        await within(batcher.close())

    asyncio.run(main())


def test_a_cancelled_worker_fails_waiting_callers_and_close_still_returns(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        batcher, model = MicroBatcher(max_batch=8, max_queue=10), Model()
        batcher.start()
        await asyncio.sleep(0)  # the worker is waiting for work
        futures = [ask(batcher, model, "queued0"), ask(batcher, model, "queued1")]
        task = batcher._task
        assert task is not None
        task.cancel()
        results = await within(asyncio.gather(*futures, return_exceptions=True))
        assert all(isinstance(r, BatcherClosed) for r in results)
        assert model.calls == []
        with pytest.raises(BatcherClosed):
            ask(batcher, model, "after")
        await within(batcher.close())

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
