"""What one call may hold of the port: its request within a time limit, and streams within a budget.

grpc counts a call against ``--max-concurrent-rpcs`` from its HEADERS, before any message, and
a unary handler runs only once the whole request has arrived. A client that opens calls and
never sends their request therefore held those slots for as long as its connections lasted:
an attack review (2026-12-05) filled all 4,096 with 24 connections of 256 such calls (about
4 KB of frames each), and every other caller's call failed with RESOURCE_EXHAUSTED. Open
``Health/Watch`` streams, which never end by design, did nearly as much from a stock client.

So every method with a single request is served as a streaming-request handler that reads its
one message itself (the same bytes on the wire; grpc's own unary handler does the same read),
and a call whose request has not arrived ``seconds`` after its handler started is ended with
DEADLINE_EXCEEDED. One sweeper task a process ends them (a timer a call cost about 18 µs of the
event loop's time a call; a dict entry costs well under one). The timeout bounds how long a call
holds its slot, not how often a client reopens one: a review reopened 64 hung calls every 0.5 s
and 24 connections' 256 every second, and kept the slots full. So at most
``max_waiting_per_peer`` calls from one address (the peer's IP, any port) wait for their request
at once; past it a new call from there is refused with RESOURCE_EXHAUSTED before it waits. Honest
calls carry their request with their headers and hardly ever wait. Calls that stream requests or
answers (``Health/Watch``, reflection) are also held to ``max_streams`` at once a process; past
it a new one is refused with RESOURCE_EXHAUSTED and the unary methods keep their slots.

The answer has the same limit as the request. A client can send whole requests and never let the
server send their answers (an HTTP/2 flow-control window of 0, never opened): each call then stays in
progress after its handler returned. An attack review (2026-12-06) held every slot that way from one
address, with 48 connections and, per call, an 11-byte ``ReportOutcome``. So a call whose answer has
not gone out ``seconds`` after its handler returned ends its connection (``server.connections``: grpc.aio
cannot end one such call, and cancelling its task left its slot taken), which ends the client's other
calls on it too, as a proxy's send timeout would; and at most ``max_calls_per_peer`` calls from one
address are in progress at once (from their start to their answer's delivery), past which a new call
from there is refused with RESOURCE_EXHAUSTED.

``seconds`` 0 turns the receive and answer timeouts and the per-peer bounds off (the methods stay grpc's
unary handlers), for a port behind a proxy that bounds what a client holds; the streaming budget stays.

What it costs (a one-off probe: a grpc.aio echo server and client in one process, 64 calls in
flight, 3 kB messages, eight rounds, medians): 251 µs a call served as unary, 260–271 as a
streaming-request read, 262–279 with these bounds; ``bench.ab_trees`` on the real server at 64 in
flight, four runs: b/a 0.965, 1.061, 0.962 and 0.958, server CPU a request 0.99, 0.95, 1.04 and 1.05;
with ``seconds`` 0, 0.996. The answers' bookkeeping (2026-12-06, five rounds): b/a 1.033, CPU a request 0.97, i.e.
within the noise; a done callback a call, tried first to count calls in progress, cost 0.931.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from server import connections

log = logging.getLogger(__name__)

TICKS_PER_TIMEOUT = 4
"""Sweeps a receive timeout: a call is ended between ``seconds`` and ``seconds * (1 + 1/TICKS)`` after it started."""
MIN_SWEEP_SECONDS = 0.05
"""The sweeps' shortest interval, whatever the timeout (a sleep of 0 would spin the event loop)."""
ENDED_WAIT_S = 0.05
"""How long a call whose read gave EOF waits for the cancellation with which grpc ends a call it ended itself (a message
over --max-message-bytes, the client's reset, its deadline) before it is taken for one that ended without its request:
the cancellation comes from grpc's poller thread, within a few loop turns on a busy server (one turn on an idle one).
Only such calls wait."""
SCAN_SHARE = 0.1
"""The most of the CPU the descriptor scans that end stuck answers' connections may take (``server.connections``: about
9 us a descriptor, 0.1 s of CPU with 14,000 connections held): after a scan that took t of its thread's CPU the next
waits 9 t, and at most the timeout (``seconds``). Without it a client that opened a connection with a closed window
every 0.3 s made every sweep scan, and with 14,000 idle connections held beside them cut others' calls by 40 % (an
attack review, 2026-12-06). The scan's CPU, not its wall time: on a loaded server the wall time of the hop to the thread
and back grew to 0.8 s and more, which would have held a stuck connection open for tens of seconds (the re-read). A
stuck answer's connection so ends at most one timeout later than without the bound; its calls are counted as cut
(``answer_timeout``) when the scan that ends them runs. The service port's bounds and the health port's each keep their
own share."""


def _timed_shut_down(peers: set[str], local_port: int | None) -> float:
    """``connections.shut_down`` on the calling thread; the CPU it took there."""
    started = time.thread_time()
    connections.shut_down(peers, local_port)
    return time.thread_time() - started


def _release(counts: dict[str, int], host: str) -> None:
    """One of ``host``'s calls in ``counts`` is over; an address with none left leaves the map, so the per-address
    maps hold the addresses with calls in that state only, not every address that ever called."""
    left = counts[host] - 1
    if left:
        counts[host] = left
    else:
        del counts[host]


def peer_host(peer: str) -> str:
    """grpc's peer string without the port (``ipv4:10.0.0.7:41234`` → ``ipv4:10.0.0.7``; ``ipv6:[::1]:5`` → ``ipv6:[::1]``)."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer  # unix sockets and the like: the whole string


class CallBounds:
    """The receive timeout, the per-peer bound on calls waiting for their request and the streaming budget of one
    process's servers (one event loop)."""

    def __init__(self, seconds: float, max_streams: int, max_waiting_per_peer: int,
                 on_cut: Callable[[str], None] | None = None, max_calls_per_peer: int = 0,
                 max_streams_per_peer: int = 0) -> None:
        self.seconds = seconds
        self.max_streams = max_streams
        self.max_waiting_per_peer = max_waiting_per_peer
        self.max_calls_per_peer = max_calls_per_peer  # 0: no bound
        self.max_streams_per_peer = max_streams_per_peer  # 0: no bound
        self._streams_per_peer: dict[str, int] = {}
        self._on_cut = on_cut  # a counter of the calls ended here, by reason
        self._waiting: dict[asyncio.Task[Any], float] = {}  # handler task → when it started waiting (insertion order)
        self._late: set[asyncio.Task[Any]] = set()
        self._per_peer: dict[str, int] = {}  # calls waiting for their request, by the peer's address (no port)
        self._running: dict[str, int] = {}  # handlers running after their request arrived, by address
        # answers handed to grpc, by address, in time order: (since when, the call's task, the peer with its port); a
        # done task's entry is dropped at the address's next call or the next sweep (no callback a call: they cost 7 %)
        self._answers: dict[str, collections.deque[tuple[float, asyncio.Task[Any], str]]] = {}
        self._answer_cuts: set[asyncio.Task[Any]] = set()  # late answers counted as cut, their connection not yet ended
        self._closing: frozenset[str] = frozenset()  # the connections (grpc peers) a running scan is ending
        self.local_port: int | None = None  # the port the calls come in on (set once bound): the connections to end
        self._streams = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scan_after = 0.0  # the loop time before which no descriptor scan starts (``SCAN_SHARE``)

    @property
    def waiting(self) -> int:
        """Calls whose handler has started and whose request has not arrived yet."""
        return len(self._waiting)

    @property
    def answering(self) -> int:
        """Calls whose handler has returned and whose answer has not been sent yet."""
        return sum(not task.done() for answers in self._answers.values() for _, task, _ in answers)

    def calls_from(self, host: str, exact: bool = True) -> int:
        """Calls from ``host`` (``peer_host``'s form) in progress: waiting for their request, being answered, or
        their answer not yet sent. ``exact`` False: delivered answers are dropped from the front only (they end
        roughly in order), so one still pending there may hide delivered ones behind it: an upper bound, in O(1)."""
        answers = self._answers.get(host)
        if answers is not None:
            while answers and answers[0][1].done():
                answers.popleft()
            if answers and exact:
                answers = self._answers[host] = collections.deque(entry for entry in answers if not entry[1].done())
            if not answers:
                del self._answers[host]
                answers = None
        return self._per_peer.get(host, 0) + self._running.get(host, 0) + (len(answers) if answers else 0)

    def start(self) -> None:
        """On the servers' event loop, before they serve (with ``seconds`` 0 there is nothing to sweep)."""
        if self._sweeper is None and self.seconds:
            self._loop = asyncio.get_running_loop()
            self._sweeper = self._loop.create_task(self._sweep(), name="receive-timeouts")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self.seconds / TICKS_PER_TIMEOUT, MIN_SWEEP_SECONDS))
            try:
                await self._sweep_once(loop)
            except Exception:  # the sweep must outlive anything one pass meets (it bounds every call of the port)
                log.exception("call bounds: a sweep failed; sweeping on")

    async def _sweep_once(self, loop: asyncio.AbstractEventLoop) -> None:
        cutoff = loop.time() - self.seconds
        for task, since in list(self._waiting.items()):
            if since > cutoff:
                break  # the rest started later: insertion order is time order
            del self._waiting[task]
            self._late.add(task)
            task.cancel()
        stuck: set[str] = set()
        for host in list(self._answers):
            kept = collections.deque(entry for entry in self._answers[host] if not entry[1].done())
            stuck.update(peer for since, _, peer in kept if since <= cutoff)
            if kept:
                self._answers[host] = kept  # late ones stay counted until their call has ended
            else:
                del self._answers[host]
        self._answer_cuts = {task for task in self._answer_cuts if not task.done()}
        if stuck and loop.time() >= self._scan_after:  # each such call ends with its connection; the scan off the loop
            for answers in self._answers.values():  # every answer the scan ends, also those not yet past the timeout
                for _, task, peer in answers:
                    if peer in stuck:
                        self._count_answer_cut(task)
            wait = self.seconds  # a scan that fails waits the longest
            self._closing = frozenset(stuck)  # an answer these connections take on while the scan runs ends with them too
            try:
                wait = min(await asyncio.to_thread(_timed_shut_down, stuck, self.local_port) * (1 / SCAN_SHARE - 1),
                           self.seconds)
            finally:
                self._closing = frozenset()
                self._scan_after = loop.time() + wait

    def _count_answer_cut(self, task: asyncio.Task[Any]) -> None:
        if task not in self._answer_cuts:
            self._answer_cuts.add(task)
            if self._on_cut is not None:
                self._on_cut("answer_timeout")

    async def request(self, context: aio.ServicerContext[Any, Any]) -> tuple[Any, str, str]:
        """The call's one request message, the peer's address (``peer_host``) and grpc's peer string; the call is ended (``abort``) when
        ``max_calls_per_peer`` of the address's calls are in progress, when ``max_waiting_per_peer`` of them are
        waiting for their request, when it does not arrive within the timeout, or when the client ends its stream
        without one. Once it returns, the call counts as running until ``handled``. (One coroutine on
        RecommendAction's path: each frame is time of the event loop's.)"""
        peer = context.peer()
        host = peer_host(peer)
        if self.max_calls_per_peer and self.calls_from(host, exact=False) >= self.max_calls_per_peer and \
                self.calls_from(host) >= self.max_calls_per_peer:  # the bound, then the count itself
            await self._end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "peer_calls",
                            f"{self.max_calls_per_peer} calls from this address are already in progress")
        held = self._per_peer.get(host, 0)
        if held >= self.max_waiting_per_peer:
            await self._end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "peer_waiting",
                            f"{self.max_waiting_per_peer} calls from this address are already waiting for their request")
        self._per_peer[host] = held + 1
        task = asyncio.current_task()
        assert task is not None
        self._waiting[task] = (self._loop or asyncio.get_running_loop()).time()
        late = False
        try:
            request = await context.read()
        except asyncio.CancelledError:
            if task not in self._late or context.cancelled():
                raise  # the client cancelled (also in the sweep's moment: its cancel, not our cut), or the server stops
            task.uncancel()
            late = True
        finally:
            self._waiting.pop(task, None)
            self._late.discard(task)
            _release(self._per_peer, host)
        if late:
            await self._end(context, grpc.StatusCode.DEADLINE_EXCEEDED, "receive_timeout",
                            f"the request message did not arrive within {self.seconds:g} s of the call's start")
        if request is aio.EOF:
            self._per_peer[host] = self._per_peer.get(host, 0) + 1  # still a call of the address's waiting while it waits
            try:  # grpc ends a call itself when its message is over --max-message-bytes (RESOURCE_EXHAUSTED to the client),
                await asyncio.sleep(ENDED_WAIT_S)  # or the client resets it, or its deadline passes: the read gives EOF,
            except asyncio.CancelledError:  # and the call's cancellation follows within moments. The three look alike here.
                if self._on_cut is not None:  # not a call that ended without its request (a client that half-closed)
                    self._on_cut("ended_unread")
                raise
            finally:
                _release(self._per_peer, host)
            await self._end(context, grpc.StatusCode.INVALID_ARGUMENT, "no_request", "the call ended without a request message")
        self._running[host] = self._running.get(host, 0) + 1
        return request, host, peer

    def handled(self, host: str) -> None:
        """A handler that ``request`` admitted has returned or raised."""
        _release(self._running, host)

    def answer_pending(self, host: str, peer: str) -> None:
        """The running call's answer is in grpc's hands: from now it has ``seconds`` to go out (``peer``: grpc's,
        ``host``: its address)."""
        task = asyncio.current_task()
        assert task is not None
        answers = self._answers.get(host)
        if answers is None:
            answers = self._answers[host] = collections.deque()
        answers.append(((self._loop or asyncio.get_running_loop()).time(), task, peer))
        if peer in self._closing:  # its connection is being closed by a scan that is running: cut with it
            self._count_answer_cut(task)

    async def _end(self, context: aio.ServicerContext[Any, Any], code: grpc.StatusCode, reason: str, details: str) -> NoReturn:
        if self._on_cut is not None:
            self._on_cut(reason)
        await context.abort(code, details)
        raise AssertionError("abort returns by raising")  # (for the type checker: abort is typed to return)

    @contextlib.asynccontextmanager
    async def _stream(self, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """A streaming call, counted against ``max_streams`` while it runs, and against its address's share of them
        (``max_streams_per_peer``): an attack review (2026-12-06) took all 256 with one channel's ``Watch`` streams,
        and the clients that check health with ``Watch`` (docs/deploy.md) then sent the pod nothing."""
        if self._streams >= self.max_streams:
            await self._end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams",
                            f"at most {self.max_streams} streaming calls at once")
        host = peer_host(context.peer())
        held = self._streams_per_peer.get(host, 0)
        if self.max_streams_per_peer and held >= self.max_streams_per_peer:
            await self._end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams",
                            f"at most {self.max_streams_per_peer} streaming calls from one address at once")
        self._streams += 1
        self._streams_per_peer[host] = held + 1
        try:
            yield
        finally:
            self._streams -= 1
            _release(self._streams_per_peer, host)

    def bound(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with its one request read under the timeout, or (streaming) held to the budget."""
        serializers = {"request_deserializer": handler.request_deserializer,
                       "response_serializer": handler.response_serializer}
        if not handler.request_streaming and not handler.response_streaming:
            if not self.seconds:  # off (a proxy in front bounds what a client holds): grpc's own unary path
                return handler
            unary = handler.unary_unary

            async def answer(_requests: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                request, host, peer = await self.request(context)
                try:
                    response = await unary(request, context)
                finally:
                    self.handled(host)
                self.answer_pending(host, peer)
                return response

            return grpc.stream_unary_rpc_method_handler(answer, **serializers)
        if not handler.response_streaming:  # none is served: fail at start rather than serve one outside the budget
            raise ValueError("a client-streaming method: CallBounds.bound does not budget those yet")
        if handler.request_streaming:
            many_to_many = handler.stream_stream

            async def answer_all(requests: Any, context: aio.ServicerContext[Any, Any]) -> None:
                async with self._stream(context):
                    await _write_all(many_to_many(requests, context), context)

            return grpc.stream_stream_rpc_method_handler(answer_all, **serializers)
        one_to_many = handler.unary_stream
        if not self.seconds:
            async def answer_one_read(request: Any, context: aio.ServicerContext[Any, Any]) -> None:
                async with self._stream(context):
                    await _write_all(one_to_many(request, context), context)

            return grpc.unary_stream_rpc_method_handler(answer_one_read, **serializers)

        async def answer_one(_requests: Any, context: aio.ServicerContext[Any, Any]) -> None:
            async with self._stream(context):
                request, host, _ = await self.request(context)
                try:
                    await _write_all(one_to_many(request, context), context)
                finally:
                    self.handled(host)

        return grpc.stream_stream_rpc_method_handler(answer_one, **serializers)


async def _write_all(result: Any, context: aio.ServicerContext[Any, Any]) -> None:
    """A streaming behaviour's answers: an async generator's items written (reflection), or a coroutine that writes
    them itself awaited (``Health/Watch``)."""
    if inspect.isasyncgen(result):
        async for item in result:
            await context.write(item)
    else:
        await result
