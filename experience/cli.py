"""``shopping-agent logs cat DIR_OR_URI [--kind decisions|outcomes]``: the log records as JSON lines;
``shopping-agent logs compact DIR [--older-than-hours H]``: finalised segments older than ``H`` hours rewritten as
columnar parts partitioned by hour (``experience.columnar``), one JSON line of what it did.

For people debugging and for any tool that wants the records without our reader: one JSON
object per record, oldest segment first, with a ``kind`` key added, in the current schema
(version-1 segments upgraded on read, see ``experience.upgrade``). The logs are a directory or a
URI (``s3://bucket/logs``, as the trainer's ``--logs``: ``experience.segments.open_logs``). ``--fields``: those
columns of each printed kind that has any of them. Exit 0; 2 when the location is not a log directory or no filesystem
takes it, or a field is a column of no printed kind; 1 when it cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from core.progress import progress
from experience.kinds import KINDS
from experience.schema import SCHEMAS
from experience.segments import open_logs, redacted


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("logs", help="read the decision, outcome, engagement and product logs",
                                   description="Read the decision, outcome, engagement and product logs that `serve --log-dir` writes.")
    sub = parser.add_subparsers(dest="logs_command", required=True)
    p = sub.add_parser("cat", help="print log records as JSON lines")
    p.add_argument("dir", metavar="DIR_OR_URI", help="the --log-dir of the server(s), or a URI of where the logs were moved")
    p.add_argument("--kind", choices=KINDS, help="only this kind (default: decisions, outcomes, engagements, then products)")
    p.add_argument("--fields", help="comma-separated columns to print (default: all)")
    p.set_defaults(logs_handler=_cat)
    c = sub.add_parser("compact", help="rewrite finalised segments older than a cut-off as columnar parts by hour",
                       description="Rewrite the finalised log segments whose records are all older than --older-than-hours "
                                   "as Arrow IPC file parts under <kind>/utc_hour=YYYY-MM-DDTHH/, so readers decode only the "
                                   "columns they need. Crash-safe; servers may keep writing; one compaction of a directory "
                                   "at a time. A segment that does not read whole is left as it is. Exit 0 done, 1 failed "
                                   "or another compaction running (try later), 2 bad usage.")
    c.add_argument("dir", metavar="DIR", help="a local log directory (the --log-dir of the servers)")
    c.add_argument("--older-than-hours", type=float, default=1.0, help="compact records older than this (default 1)")
    c.set_defaults(logs_handler=_compact)


def run(args: argparse.Namespace) -> int:
    return int(args.logs_handler(args))


def _cat(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        source = open_logs(args.dir)
        if not any(source.has(kind) for kind in KINDS):
            print(f"shopping-agent logs: {redacted(args.dir)} holds none of the directories {', '.join(f'{k}/' for k in KINDS)}",
                  file=sys.stderr)
            return 2
    except ValueError as exc:
        print(f"shopping-agent logs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # out of reach: worth another try
        print(f"shopping-agent logs: {exc}", file=sys.stderr)
        return 1
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    try:
        return _print(source, args.kind, fields, out)
    except BrokenPipeError:  # `logs cat … | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's final flush is quiet too
        return 0
    except ValueError as exc:  # a damaged part or segment, named
        print(f"shopping-agent logs: {exc}", file=sys.stderr)
        return 1


def _print(source: Any, only: str | None, fields: list[str] | None, out: TextIO) -> int:
    kinds = (only,) if only else tuple(kind for kind in KINDS if source.has(kind))
    if fields is not None:
        # a field some printed kind has is printed for that kind; one that none of them has is a typo
        columns = list(dict.fromkeys(name for kind in kinds for name in SCHEMAS[kind].names))
        unknown = [f for f in fields if f not in columns]
        if unknown:
            print(f"shopping-agent logs: --fields: no column {unknown[0]!r} in {', '.join(kinds)}; "
                  f"{'its' if len(kinds) == 1 else 'their'} columns: {', '.join(columns)}", file=sys.stderr)
            return 2
        kinds = tuple(kind for kind in kinds if set(fields) & set(SCHEMAS[kind].names))  # not a bare {"kind": …} a record
    for kind in kinds:
        paths = source.segments(kind)
        with progress(f"logs.{kind}", total=len(paths), unit="segment") as bar:
            for path in paths:
                rows = 0
                for batch in source.segment_batches(path, kind):
                    if fields is not None:
                        batch = batch.select([f for f in fields if f in batch.schema.names])
                    for record in batch.to_pylist():
                        out.write(json.dumps({"kind": kind, **record}, allow_nan=False) + "\n")
                    rows += batch.num_rows
                bar.update(1, rows=rows)
    return 0


def _compact(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    import math
    import time

    from experience.columnar import CompactionBusy, compact

    hours = args.older_than_hours
    if not (math.isfinite(hours) and hours >= 0):
        print(f"shopping-agent logs compact: --older-than-hours: expected a finite number >= 0, got {hours}", file=sys.stderr)
        return 2
    if "://" in args.dir and not args.dir.startswith("file://"):  # before any filesystem is reached: usage, not a retry
        print(f"shopping-agent logs compact: {redacted(args.dir)}: compaction needs a local directory (an object store has no "
              "atomic rename)", file=sys.stderr)
        return 2
    try:
        source = open_logs(args.dir)
        if not source.local or not any(source.has(kind) for kind in KINDS):
            print(f"shopping-agent logs compact: {redacted(args.dir)} is not a local log directory (decisions/, outcomes/)",
                  file=sys.stderr)
            return 2
        before = time.time() - hours * 3600.0
        done = {kind: compact(source, kind, before).to_dict() for kind in KINDS if source.has(kind)}
    except CompactionBusy as exc:
        print(f"shopping-agent logs compact: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"shopping-agent logs compact: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk: what was compacted stays so, the segment being written stays a segment
        print(f"shopping-agent logs compact: failed: {exc}", file=sys.stderr)
        return 1
    out.write(json.dumps({"compacted": done, "older_than_hours": hours}) + "\n")
    return 0
