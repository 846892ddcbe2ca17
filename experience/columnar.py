"""Columnar log parts: finalised stream segments rewritten in Arrow's IPC file format, by hour, read column by column.

An Arrow IPC stream segment (``experience.segments``) can only be read whole: the trainer's
narrow pass, which needs three columns of every decision, decodes all thirty, the item
embedding (95 % of the bytes) among them. ``compact`` rewrites each finalised segment whose rows
are all older than a cut-off into parts in the IPC *file* format (Feather v2)::

    DIR/<kind>/hour=YYYY-MM-DDTHH/<segment name>.arrow

one part per hour its rows fall in (``time_s`` for decisions, ``received_s`` for outcomes: the
server's clock; Hive-style names, so ``pyarrow.dataset`` reads the tree as it is), rows sorted by
session id, zstd, record batches of ``ROW_GROUP`` rows, in the current schema (version-1 segments
are upgraded on the way, as any read does). The file format has a footer that locates every
column's buffers, so a reader decodes only the columns it asks for (``read_part``, through
``IpcReadOptions.included_fields``), and the narrow pass reads a few bytes a decision instead of
all of them; a wide read decodes the same Arrow buffers as a stream does. (Parquet, the other
format issue 15 names, was tried first: the narrow pass as fast, the whole read 1.4 times the
stream's, from decoding the list of float16 embeddings: ``bench.compact``.)

**Crash safety.** Each part is written under a hidden name, fsynced and renamed; the segment is
removed only once every part of it is in place. A reader skips the parts of a segment that still
exists (``DirectorySource.segments``), so every row is read exactly once at any moment: from the
segment until it is removed, from its parts afterwards. A compaction cut short (a crash, a full
disk) leaves the segment and perhaps some of its parts; the next compaction rewrites them.

**Who may run at the same time.** Servers may: they only write their own open segments and
finalise new ones, and compaction takes only finalised segments older than its cut-off (by
default an hour: ``logs compact --older-than-hours``). Readers may: a segment listed before a
compaction removed it is read from its parts instead (``DirectorySource.segment_batches``), which
were all in place before it went. Two compactions at once may not (they would write the same
parts); the CronJob that runs it allows one at a time. Local directories only: an object store
has no atomic rename.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from experience.schema import SCHEMAS
from experience.segments import SUFFIX, DirectorySource, fsync_path

log = logging.getLogger(__name__)

PART_SUFFIX = ".arrow"
HOUR_PREFIX = "hour="
ROW_GROUP = 65_536
TIME_COLUMN = {"decisions": "time_s", "outcomes": "received_s"}
_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


@dataclass(frozen=True, slots=True)
class Compacted:
    """What one ``compact`` of a kind did."""

    segments: int
    """Segments rewritten into parts (and removed)."""
    parts: int
    rows: int
    kept: int
    """Finalised segments left as they are: a row at or after the cut-off."""

    def to_dict(self) -> dict[str, int]:
        return {"segments": self.segments, "parts": self.parts, "rows": self.rows, "kept": self.kept}


def hour_of(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H")


def stem_of(path: str) -> str:
    """A part's or a segment's name without its directory and suffix: the segment it came from."""
    name = path.rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0]


def read_part(path: str, filesystem: pafs.FileSystem, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of one part, only ``columns`` when given (the others are never read)."""
    with filesystem.open_input_file(path) as f:
        names = pa.ipc.open_file(f).schema.names
        wanted = None if columns is None else [names.index(c) for c in columns]
        reader = pa.ipc.open_file(f, options=pa.ipc.IpcReadOptions(included_fields=wanted))
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _write_part(table: pa.Table, final: Path) -> None:
    """``table`` as an IPC file at ``final``, whole or not at all (hidden name, fsync, rename, fsync of the directory)."""
    final.parent.mkdir(exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=_OPTIONS) as writer:
            for batch in table.to_batches(max_chunksize=ROW_GROUP):
                writer.write_batch(batch)
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(final.parent)


def compact_segment(table: pa.Table, kind: str, segment: Path) -> int:
    """Write ``table`` (one segment's rows, current schema) as its hour parts, then remove ``segment``; the parts."""
    hours = np.array([hour_of(t) for t in table.column(TIME_COLUMN[kind]).to_numpy()]) if table.num_rows else np.array([])
    for hour in sorted(set(hours.tolist())):
        part = table.filter(pa.array(hours == hour)).sort_by([("session_id", "ascending"), (TIME_COLUMN[kind], "ascending")])
        _write_part(part, segment.parent / f"{HOUR_PREFIX}{hour}" / f"{stem_of(str(segment))}{PART_SUFFIX}")
    segment.unlink()
    fsync_path(segment.parent)
    return len(set(hours.tolist()))


def compact(source: DirectorySource, kind: str, before_s: float) -> Compacted:
    """Rewrite every finalised ``kind`` segment of ``source`` (a local ``DirectorySource``) whose rows are all older than
    ``before_s`` (the server's clock) into hour parts (module doc)."""
    if not isinstance(source, DirectorySource) or not source.local:
        raise ValueError("compact: the logs must be a local directory (an object store has no atomic rename)")
    segments = parts = rows = kept = 0
    for path in source.segments(kind):
        if not path.endswith(SUFFIX):
            continue  # a part already
        table = pa.Table.from_batches(list(source.segment_batches(path, kind)), schema=SCHEMAS[kind])
        if table.num_rows and float(pc.max(table.column(TIME_COLUMN[kind])).as_py()) >= before_s:
            kept += 1
            continue
        parts += compact_segment(table, kind, Path(path))
        segments, rows = segments + 1, rows + table.num_rows
        log.info("compacted a log segment", extra={"fields": {"segment": path, "rows": table.num_rows}})
    return Compacted(segments, parts, rows, kept)
