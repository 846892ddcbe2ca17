"""Columnar log parts: finalised stream segments rewritten in Arrow's IPC file format, by hour, read column by column.

An Arrow IPC stream segment (``experience.segments``) can only be read whole: the trainer's
narrow pass, which needs three columns of every decision, decodes all thirty, the item
embedding (95 % of the bytes) among them. ``compact`` rewrites each finalised segment whose rows
are all older than a cut-off into parts in the IPC *file* format (Feather v2)::

    DIR/<kind>/utc_hour=YYYY-MM-DDTHH/<segment name>.arrow

one part per UTC hour its rows fall in (``time_s`` for decisions, ``received_s`` for outcomes and engagement reports: the
server's clock; not ``hour=``, which is a decisions column, the shopper's local hour), rows
sorted by session id, zstd, record batches of ``ROW_GROUP`` rows, in the current schema, with the
segments' mode (0640). The file format has a footer that locates every column's buffers, so a
reader decodes only the columns it asks for (``read_part``, through
``IpcReadOptions.included_fields``), and the narrow pass reads a few bytes a decision instead of
all of them; a wide read decodes the same Arrow buffers as a stream does. (Parquet, the other
format issue 15 names, was tried first: the narrow pass as fast, the whole read 1.4 times the
stream's, from decoding the list of float16 embeddings; a one-off run of ``bench.compact``.) Each
segment becomes its own parts: segments of one hour are not merged.

**Only what reads whole is replaced.** A segment is compacted only if it reads cleanly to its end
in the current schema (``_read_whole``): a torn or corrupt one (which an ordinary read stops at
quietly), an empty one, a version-1 one (upgraded on read for the reader's own feature spec) or
a newer one stays as it is, counted as ``unreadable``.

**Crash safety.** Each part is written to a hidden temp file of its own, fsynced and renamed; the
segment is removed only once every part of it is in place. A reader skips the parts of a segment
that still exists (``DirectorySource.segments``), so every row is read exactly once at any moment:
from the segment until it is removed, from its parts afterwards. A compaction cut short (a crash,
a full disk) leaves the segment and perhaps some of its parts; the next compaction rewrites them
and removes the temp files a killed one left.

**Who may run at the same time.** Servers may: they only write their own open segments and
finalise new ones, and compaction takes only finalised segments older than its cut-off (by
default an hour: ``logs compact --older-than-hours``). Readers on the same machine may: a segment
listed before a compaction removed it is read from its parts instead
(``DirectorySource.segment_batches``), which were all in place before it went. Readers of a
shared volume on other machines rely on its listings being consistent (NFS may cache a
directory's listing: such a reader could briefly miss a just-compacted segment's rows; run the
trainer after the compactor, not beside it, there). Two compactions of one directory may not:
the second finds the first's lock (``DIR/.compact.lock``) and stops. Local directories only: an
object store has no atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from core.domain import TIMESTAMP_MAX_S, TIMESTAMP_MIN_S
from core.files import UnreadableFile
from experience.schema import ADDED_IN_V2, SCHEMA_VERSION, SCHEMAS
from experience.segment_writer import SUFFIX, fsync_path
from experience.segments import DirectorySource, null_column, open_local

log = logging.getLogger(__name__)

PART_SUFFIX = ".arrow"
HOUR_PREFIX = "utc_hour="  # not "hour=": the decisions have an ``hour`` column (the shopper's local hour)
TMP_PREFIX = ".tmp-"
LOCK_NAME = ".compact.lock"
ROW_GROUP = 65_536
TIME_COLUMN = {"decisions": "time_s", "outcomes": "received_s", "engagements": "received_s", "products": "time_s"}
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
    unreadable: int = 0
    """Segments left as they are because they do not read cleanly to their end in the current schema (torn,
    corrupt, empty, version 1, newer) or hold a time no clock wrote (NaN, outside years 1-9999): only a segment read
    whole is ever removed."""

    def to_dict(self) -> dict[str, int]:
        return {"segments": self.segments, "parts": self.parts, "rows": self.rows, "kept": self.kept,
                "unreadable": self.unreadable}


def hour_of(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H")


def stem_of(path: str) -> str:
    """A part's or a segment's name without its directory and suffix: the segment it came from."""
    name = path.rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0]


def read_part(path: str, filesystem: pafs.FileSystem, kind: str, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of one ``kind`` part, only ``columns`` when given (the others are never decoded). A file that
    is not a part of this kind in the current schema raises ``ValueError`` naming it; a column added within the schema
    version after the part was written (``experience.schema.ADDED_IN_V2``) is simply not in its batches (the reader's
    ``_conform`` gives it nulls)."""
    try:
        with open_local(path) if isinstance(filesystem, pafs.LocalFileSystem) else filesystem.open_input_file(path) as f:
            reader = pa.ipc.open_file(f)
            metadata = reader.schema.metadata or {}
            if metadata.get(b"kind") != kind.encode() or metadata.get(b"schema_version") != str(SCHEMA_VERSION).encode():
                raise ValueError(f"{path}: not a {kind} log part of schema version {SCHEMA_VERSION} "
                                 f"(kind {metadata.get(b'kind')!r}, version {metadata.get(b'schema_version')!r})")
            names, later = reader.schema.names, ADDED_IN_V2.get(kind, frozenset())
            missing = [c for c in (columns or SCHEMAS[kind].names) if c not in names and c not in later]
            if missing:
                raise ValueError(f"{path}: the log part has no column {missing[0]!r}")
            if columns is not None:
                present = [c for c in columns if c in names]
                reader = pa.ipc.open_file(f, options=pa.ipc.IpcReadOptions(included_fields=[names.index(c) for c in present]))
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                batch.validate(full=True)  # offsets in range: a crafted part's crashed every reader (SIGSEGV) without it
                yield batch if columns is None else batch.select(present)  # in the order asked for
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError, UnreadableFile) as exc:  # malformed bytes, whichever error names them
        raise ValueError(f"{path}: not a readable log part: {exc}") from exc


def _read_whole(path: str, kind: str) -> pa.Table | None:
    """The segment's rows if it reads cleanly to its end-of-stream in the current schema, else None (never a prefix:
    a torn or corrupt segment, whose reader would stop quietly at the damage, must not be replaced by what came
    before it)."""
    try:
        with open_local(path) as f:
            reader = pa.ipc.open_stream(f)
            batches = []
            for batch in reader:  # offsets in range: a crafted segment crashed the compactor, or became a part of garbage
                batch.validate(full=True)
                if batch.num_rows:  # 200,000 empty batches held 3.5 GB, past the compactor's 2Gi (a review, 2026-12-07)
                    batches.append(batch)
            table = pa.Table.from_batches(batches, schema=reader.schema)
            whole = f.tell() == f.size()  # nothing after the last message: not a read that stopped early
    except (pa.ArrowException, OSError, ValueError, UnreadableFile):  # malformed bytes, whichever error pyarrow names them with
        return None
    metadata = table.schema.metadata or {}
    if not whole or metadata.get(b"schema_version") != str(SCHEMA_VERSION).encode() or table.num_rows == 0:
        return None  # version 1 (upgraded on read, with the reader's spec) and newer versions stay as they are
    if not table.schema.equals(SCHEMAS[kind], check_metadata=False):
        return None  # another layout: left as it is
    if null_column(table, SCHEMAS[kind], table.schema.names) is not None:
        return None  # a null where no server writes one: a part may hold no such row
    return table


def _write_part(table: pa.Table, final: Path) -> None:
    """``table`` as an IPC file at ``final``, whole or not at all (a hidden temp file of its own, created exclusively
    with the segments' mode 0640, fsync, rename, fsync of the directory)."""
    final.parent.mkdir(mode=0o750, exist_ok=True)
    if final.parent.is_symlink():  # not a directory a compaction made: a part written through it would land elsewhere
        raise OSError(f"{final.parent}: a symbolic link where an hour directory belongs; nothing is written through it")
    tmp = final.with_name(f"{TMP_PREFIX}{secrets.token_hex(6)}-{final.name}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
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
    """Write ``table`` (one segment's rows, current schema, at least one) as its hour parts, then remove ``segment``;
    the number of parts."""
    hours = np.array([hour_of(t) for t in table.column(TIME_COLUMN[kind]).to_numpy()])
    distinct = sorted(set(hours.tolist()))
    for hour in distinct:
        part = table.filter(pa.array(hours == hour)).sort_by([("session_id", "ascending"), (TIME_COLUMN[kind], "ascending")])
        _write_part(part, segment.parent / f"{HOUR_PREFIX}{hour}" / f"{stem_of(str(segment))}{PART_SUFFIX}")
    segment.unlink()
    fsync_path(segment.parent)
    return len(distinct)


def compact(source: DirectorySource, kind: str, before_s: float) -> Compacted:
    """Rewrite every finalised ``kind`` segment of ``source`` (a local ``DirectorySource``) whose rows are all older than
    ``before_s`` (the server's clock) into hour parts (module doc). One compaction of a directory at a time (an
    exclusive ``flock`` on ``DIR/.compact.lock``: ``CompactionBusy`` when another holds it); a segment that does not
    read whole is left as it is and counted. An ``OSError`` while writing (a full disk) ends the run; what was
    compacted before it stays compacted, the segment being written stays a segment."""
    if not isinstance(source, DirectorySource) or not source.local:
        raise ValueError("compact: the logs must be a local directory (an object store has no atomic rename)")
    kind_dir = Path(source._dir(kind))
    if kind_dir.is_symlink():  # parts would be written, and segments removed, wherever it points (an attack review)
        raise ValueError(f"{kind_dir}: a symbolic link where a log kind's directory belongs; nothing is compacted "
                         "through it")
    with _locked(Path(source.root)):
        _sweep(kind_dir)
        segments = parts = rows = kept = unreadable = 0
        for path in source.segments(kind):
            if not path.endswith(SUFFIX):
                continue  # a part already
            table = _read_whole(path, kind)
            if table is None:
                unreadable += 1
                log.warning("a log segment that does not read whole is left as it is",
                            extra={"fields": {"segment": path}})
                continue
            times = np.asarray(table.column(TIME_COLUMN[kind]).to_numpy(), dtype=np.float64)
            if not (np.isfinite(times).all() and (times >= TIMESTAMP_MIN_S).all() and (times <= TIMESTAMP_MAX_S).all()):
                unreadable += 1  # (no server's clock wrote it: it cannot be placed in an hour, nor left to stop every run)
                log.warning("a log segment with times outside years 1-9999 is left as it is",
                            extra={"fields": {"segment": path}})
                continue
            if float(times.max()) >= before_s:
                kept += 1
                continue
            parts += compact_segment(table, kind, Path(path))
            segments, rows = segments + 1, rows + table.num_rows
            log.info("compacted a log segment", extra={"fields": {"segment": path, "rows": table.num_rows}})
    return Compacted(segments, parts, rows, kept, unreadable)


class CompactionBusy(RuntimeError):
    """Another compaction holds the directory's lock."""


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)  # (never through a link)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CompactionBusy(f"{root}: another compaction is running (it holds {LOCK_NAME})") from None
        yield
    finally:
        os.close(fd)


def _sweep(kind_dir: Path) -> None:
    """Remove temp files a killed compaction left (under the lock, none is being written), in the hour directories the
    compaction made: never through a symbolic link (``glob`` follows them; ``compact`` refuses a linked ``kind_dir``)."""
    if not kind_dir.is_dir():
        return
    for hour in os.scandir(kind_dir):
        if hour.name.startswith(HOUR_PREFIX) and hour.is_dir(follow_symlinks=False):
            for leftover in os.scandir(hour.path):
                if leftover.name.startswith(TMP_PREFIX):  # (a link so named is removed itself, not what it names)
                    Path(leftover.path).unlink(missing_ok=True)
