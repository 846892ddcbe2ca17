"""``shopping-agent simulate``: simulated shoppers against a running server, or in-process.

``--target HOST:PORT`` drives a server over gRPC: every page view is a RecommendAction, every
reaction a ReportOutcome and every page's engagement a ReportEngagement, so the real server writes the real logs. ``--concurrency`` threads
each run whole sessions. The server draws its own decision ids, so two runs differ in their
samples (the shoppers do not). If the server goes away mid-run (SIGTERM, crash), the run
stops, says so (``interrupted``) and exits 1; ``decisions_answered`` / ``outcomes_acknowledged`` /
``engagements_acknowledged`` count every call that got an answer, and ``--trace FILE`` lists their ids (JSON lines), so the
logs can be checked against them.

``--bundle FILE`` (or neither flag: the embedded default bundle) runs the same decision code
in-process, much faster, optionally writing the same logs to ``--log-dir``; the same seed and
bundle give the same numbers. Records the log writer dropped (a full or failing volume) are counted in ``logs_dropped``
and the run exits 1: its logs are incomplete. A ``--bundle`` that cannot be read or loaded is named in one line, exit 2 (bad usage).

``mean_return`` and its 95 % interval are over the sessions that finished: the expected
discounted return per session under the attribution rules (``experience.returns``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from core.domain import Action, EngagementReport, OutcomeReport, Source
from core.json_lines import json_line
from core.progress import Progress, progress
from experience.recorder import resolve_salt, unusable_log_dir
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc
from server.config import CEILINGS
from simulator.config import SimConfig
from simulator.drive import Trace, by_model, engagement_report_for, reports_for, run_in_process, run_logged
from simulator.world import PageView, ShopperSession, World

if TYPE_CHECKING:
    from weights.model_set import ModelSet

log = logging.getLogger(__name__)

MAX_BATCH = int(CEILINGS["max_batch"])  # as serve --max-batch: what one batch queues for the log fits its byte bound (32 MB)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "simulate", help="run simulated shoppers and report the served policy's true value",
        description="Simulated shoppers against a server (--target) or in-process (--bundle). "
                    "Exit 0 when every session finished, 1 when the server went away mid-run or (in-process) log records "
                    "were dropped, 2 on bad usage.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", help="HOST:PORT of a running server of this version (RecommendAction, ReportOutcome and "
                       "ReportEngagement over gRPC)")
    where.add_argument("--bundle", type=Path, help="decide in-process with this bundle (default: the embedded default bundle)")
    p.add_argument("--log-dir", type=Path, help="in-process: write the decision, outcome and engagement logs here (product logs with "
                   "--products), as a server would")
    p.add_argument("--sessions", type=int, default=1000, help="shopper sessions to run (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the world's seed: shoppers, items and their dice (default 0)")
    p.add_argument("--first-session", type=int, default=0, help="index of the first session (default 0)")
    p.add_argument("--concurrency", type=int, default=8, help="--target: sessions in flight, one thread each (default 8)")
    p.add_argument("--batch", type=int, default=256, help=f"in-process: sessions decided together (default 256, at most {MAX_BATCH})")
    p.add_argument("--timezone", default="UTC", help="in-process: the hour feature's timezone, as the server's --timezone")
    p.add_argument("--deadline-ms", type=float, default=2000.0, help="--target: deadline of each call (default 2000)")
    p.add_argument("--trace", type=Path, help="write the id of every answered decision and acknowledged outcome (JSON lines)")
    p.add_argument("--products", action="store_true", help="in-process: every page also offers one product, chosen by "
                   "RecommendProduct's decision (the bundle's product heads, or its rules without them), and logged with "
                   "--log-dir")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    problem = _usage_problem(args)
    if problem:
        print(f"shopping-agent simulate: {problem}", file=sys.stderr)
        return 2
    world = World(SimConfig(), args.seed)
    sessions = range(args.first_session, args.first_session + args.sessions)
    started = time.monotonic()
    if args.target:
        result = _over_grpc(world, sessions, args)
    else:
        from weights.bundle import BundleError
        from weights.model_set import LoadOptions, load_file

        try:
            model = load_file(args.bundle, LoadOptions(warmup_batch=args.batch))[1]  # None: the embedded default
        except BundleError as exc:  # a file the user named: bad usage, as `weights verify` reports it
            print(f"shopping-agent simulate: --bundle: {exc}", file=sys.stderr)
            return 2
        salt = b""
        if args.log_dir is not None:
            try:
                salt = resolve_salt(args.log_dir, "")  # creates the directory: one that cannot be is a set-up problem
            except (OSError, ValueError) as exc:
                print(f"shopping-agent simulate: {unusable_log_dir(args.log_dir, exc)}", file=sys.stderr)
                return 2
        result = _in_process(world, sessions, model, args, salt)
    result = {"seed": args.seed, **result, "elapsed_s": round(time.monotonic() - started, 3)}
    if args.json:  # an interval of one session is undefined: null, not NaN (which is not JSON)
        out.write(json_line(result) + "\n")
    else:
        out.write(_text(result))
    return 1 if result.get("interrupted") or result.get("logs_incomplete") else 0


def _usage_problem(args: argparse.Namespace) -> str:
    if args.sessions < 1 or args.first_session < 0 or args.seed < 0:
        return "--sessions must be >= 1, --first-session and --seed >= 0"
    if args.concurrency < 1 or not 1 <= args.batch <= MAX_BATCH or not 0 < args.deadline_ms <= 3_600_000:
        # --batch 8192 overflowed the log queue's bytes and a million took 4 GB to warm up for two sessions; a deadline
        # of inf or nan was taken, and every call then failed (an attack review, 2026-12-07)
        return f"--concurrency must be >= 1, --batch 1..{MAX_BATCH}, --deadline-ms a number of milliseconds in (0, 3600000]"
    if args.target and args.log_dir:
        return "--log-dir is for in-process runs; with --target the server writes its own logs (serve --log-dir)"
    if args.target and args.products:
        return "--products is for in-process runs"
    try:
        ZoneInfo(args.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        return f"--timezone: unknown IANA timezone {args.timezone!r}"
    if args.trace is not None and not _can_write(args.trace):
        return f"--trace {args.trace}: cannot be written (a directory, or in one this cannot write in)"  # not after the run
    return ""


def _can_write(path: Path) -> bool:
    """Whether ``path`` can be opened for writing: an existing file (``/dev/stdout`` too) this may write, or a new one in
    a directory this may write in."""
    if path.exists():
        return not path.is_dir() and os.access(path, os.W_OK)
    return path.parent.is_dir() and os.access(path.parent, os.W_OK | os.X_OK)


def _text(result: dict[str, Any]) -> str:
    lines = [f"{k}: {v}" for k, v in result.items()]
    return "\n".join(lines) + "\n"


def _summary(trace: Trace) -> dict[str, Any]:
    if trace.sessions_finished == 0:
        return {"sessions": 0, "mean_return": None, "ci_low": None, "ci_high": None}
    return trace.summary()


# --- in-process ------------------------------------------------------------------------------
def _in_process(world: World, sessions: range, model: ModelSet, args: argparse.Namespace, salt: bytes) -> dict[str, Any]:
    tz = ZoneInfo(args.timezone)
    written = None
    products = by_model(model) if args.products else None
    with progress("simulate", total=len(sessions), unit="session") as bar:
        if args.log_dir:
            trace, written = run_logged(world, model, sessions, tz, args.log_dir, salt, batch=args.batch,
                                        on_finished=bar.update, products=products)
        else:
            trace = run_in_process(world, model, sessions, tz, batch=args.batch, on_finished=bar.update, products=products)
    if args.trace:
        with args.trace.open("w") as f:
            for did in trace.decision_ids:
                f.write(json.dumps({"kind": "decision", "id": did}) + "\n")
            for oid in trace.outcome_ids:
                f.write(json.dumps({"kind": "outcome", "id": oid}) + "\n")
    summary = _summary(trace)
    lost = trace.logs_dropped
    if lost:  # a full or failing log volume: the run's purpose was the logs, so it is no success (exit 1)
        print(f"shopping-agent simulate: --log-dir {args.log_dir}: records were dropped, not written: {lost} (see the "
              "log lines above for why)", file=sys.stderr)
    return {"mode": "in-process", "bundle": str(args.bundle or "embedded-default"), **summary,
            "decisions_answered": len(trace.decision_ids), "outcomes_acknowledged": len(trace.outcome_ids),
            "logs_written": written, **({"logs_dropped": lost, "logs_incomplete": bool(lost)} if args.log_dir else {}),
            "interrupted": False}


# --- over gRPC -------------------------------------------------------------------------------
class _Run:
    """State shared by the client threads: the sessions to take, the merged trace, the counts."""

    def __init__(self, sessions: range, trace_file: TextIO | None, progress: Progress | None = None) -> None:
        self._next = iter(sessions)
        self.progress = progress
        self._lock = threading.Lock()
        self.trace = Trace()
        self.answered = 0
        self.acknowledged = 0
        self.logged = 0
        self.engagements_acknowledged = 0
        self.engagements_logged = 0
        self.stop = threading.Event()
        self.error = ""
        self._trace_file = trace_file

    def take(self) -> int | None:
        with self._lock:
            return None if self.stop.is_set() else next(self._next, None)

    def note(self, kind: str, ident: str, logged: bool = False) -> None:
        with self._lock:
            if kind == "decision":
                self.answered += 1
            elif kind == "engagement":
                self.engagements_acknowledged += 1
                self.engagements_logged += logged
            else:
                self.acknowledged += 1
                self.logged += logged
            if self._trace_file is not None:
                self._trace_file.write(json.dumps({"kind": kind, "id": ident}) + "\n")

    def finished(self, session: Trace) -> None:
        with self._lock:
            _merge(self.trace, session)
            if self.progress is not None:
                self.progress.update(1)

    def fail(self, message: str) -> None:
        with self._lock:
            if not self.error:
                self.error = message
        self.stop.set()


def _merge(into: Trace, part: Trace) -> None:
    for name in ("decision_ids", "decision_sessions", "decision_times", "actions", "sources", "outcome_ids",
                 "outcome_decisions", "outcome_sessions", "outcomes", "values", "discounts", "outcome_times"):
        getattr(into, name).extend(getattr(part, name))
    into.sessions_finished += part.sessions_finished
    into.engagements += part.engagements
    into.model_versions |= part.model_versions


def _timestamp(seconds: float) -> Timestamp:
    whole = int(seconds // 1)
    nanos = round((seconds - whole) * 1e9)
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, 0
    return Timestamp(seconds=whole, nanos=nanos)


def _recommend_request(session: ShopperSession, page: PageView, request_id: str) -> pb.RecommendActionRequest:
    return pb.RecommendActionRequest(
        request_id=request_id, user_id=session.user_id, session_id=session.session_id, item_id=page.item_id,
        item_embedding=page.item_embedding.tolist(), recent_behavior_ids=list(page.recent_behavior_ids),
        page_type=pb.PageType.ValueType(int(page.page_type)), event_time=_timestamp(page.event_time_s),
        cart_item_count=page.cart_item_count,
    )


def _outcome_request(report: OutcomeReport) -> pb.ReportOutcomeRequest:
    return pb.ReportOutcomeRequest(
        decision_id=report.decision_id, session_id=report.session_id, outcome_id=report.outcome_id,
        outcome=pb.Outcome.ValueType(int(report.outcome)), value=report.value, coupon_discount=report.coupon_discount,
        event_time=_timestamp(report.event_time_s),
    )


def _engagement_request(report: EngagementReport) -> pb.ReportEngagementRequest:
    return pb.ReportEngagementRequest(
        decision_id=report.decision_id, session_id=report.session_id, engagement_id=report.engagement_id,
        dwell_seconds=report.dwell_s, scroll_depth=report.scroll_depth, bounced=report.bounced,
        event_time=_timestamp(report.event_time_s),
    )


def _client(world: World, run: _Run, target: str, deadline_s: float) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ShoppingAgentStub(channel)
        while (index := run.take()) is not None:
            session, part, step = world.session(index), Trace(), 0
            try:
                while not run.stop.is_set() and (page := session.page()) is not None:
                    resp = stub.RecommendAction(_recommend_request(session, page, f"sim-{index}-{step}"), timeout=deadline_s)
                    run.note("decision", resp.decision_id)
                    part.model_versions.add(resp.model_version)
                    part.decided(session.session_id, resp.decision_id, page.event_time_s, Action(resp.action), Source(resp.source))
                    for report in reports_for(session, resp.decision_id, session.respond(Action(resp.action))):
                        ack = stub.ReportOutcome(_outcome_request(report), timeout=deadline_s)
                        run.note("outcome", report.outcome_id, ack.logged)
                        part.reported(report)
                    engaged = session.engagement()
                    if engaged is not None:
                        engagement = engagement_report_for(session, resp.decision_id, engaged)
                        ack_e = stub.ReportEngagement(_engagement_request(engagement), timeout=deadline_s)
                        run.note("engagement", engagement.engagement_id, ack_e.logged)
                        part.engagements += 1
                    step += 1
            except grpc.RpcError as exc:
                run.fail(f"{exc.code().name}: {exc.details()}")  # the server went away (or refused): stop the run
                return
            if session.ended:
                part.sessions_finished = 1
                run.finished(part)


def _over_grpc(world: World, sessions: range, args: argparse.Namespace) -> dict[str, Any]:
    trace_file = args.trace.open("w") if args.trace else None
    try:
        with progress("simulate", total=len(sessions), unit="session") as bar:
            run = _Run(sessions, trace_file, bar)
            threads = [threading.Thread(target=_client, args=(world, run, args.target, args.deadline_ms / 1000.0), daemon=True)
                       for _ in range(min(args.concurrency, len(sessions)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        if trace_file is not None:
            trace_file.close()
    summary = _summary(run.trace)
    return {"mode": "grpc", "target": args.target, **summary, "decisions_answered": run.answered,
            "outcomes_acknowledged": run.acknowledged, "outcomes_logged": run.logged,
            "engagements_acknowledged": run.engagements_acknowledged, "engagements_logged": run.engagements_logged,
            "interrupted": bool(run.error), "error": run.error or None}

