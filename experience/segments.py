"""Log segments on a directory: written as Arrow IPC streams, published by rename, read column-wise.

Layout: ``DIR/decisions/`` and ``DIR/outcomes/``. A writer appends record batches to a hidden
temp file (``.open-<name>``) that it holds an exclusive ``flock`` on, and finalises it by
fsync + ``os.replace`` to ``<name>.arrows`` when the segment is big enough, old enough, or
the writer closes. Readers only ever list finalised names, so they never see half a segment.
``name`` sorts by creation time (UTC, microseconds) and carries host, pid and a random token,
so several processes (``--workers``, several pods on one volume) never collide.

The IPC *stream* format (not the file format) is used on purpose: a stream is readable up to
its last complete batch, so a segment left open by a writer that was killed (SIGKILL, OOM)
is not lost: the next writer on the directory finds it (its lock is free), and finalises it
as it is. ``recover_abandoned`` does this; a reader stops quietly at a torn last batch.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from experience.kinds import KINDS
from experience.schema import SCHEMAS

log = logging.getLogger(__name__)

SUFFIX = ".arrows"
OPEN_PREFIX = ".open-"
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def segment_dir(root: Path, kind: str) -> Path:
    if kind not in SCHEMAS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return root / kind


class SegmentWriter:
    """Appends record batches of one kind to rotating segments under ``root/kind``.

    Not thread-safe: one writer thread owns it. ``write`` rotates by size and age;
    ``close`` finalises the open segment. Every finalised segment is complete.
    """

    def __init__(self, root: Path, kind: str, max_bytes: int, max_seconds: float) -> None:
        self.dir = segment_dir(root, kind)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.schema = SCHEMAS[kind]
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self._tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._seq = 0
        self._file: pa.NativeFile | None = None
        self._fd = -1
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self.finalised: list[Path] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self._stream is None:
            self._open()
        assert self._stream is not None and self._file is not None
        self._stream.write_batch(batch)
        if self._file.tell() >= self.max_bytes or time.monotonic() - self._opened_at >= self.max_seconds:
            self.rotate()

    def rotate(self) -> Path | None:
        """Finalise the open segment (if any); the next write opens a new one."""
        if self._stream is None or self._path is None or self._file is None:
            return None
        stream, file, path, fd = self._stream, self._file, self._path, self._fd
        self._stream, self._file, self._path, self._fd = None, None, None, -1
        try:
            stream.close()
            file.flush()
            os.fsync(fd)
            final = self.dir / (path.name.removeprefix(OPEN_PREFIX))
            os.replace(path, final)
            _fsync_dir(self.dir)
        finally:  # a failed close (disk full) still releases the file and its lock; recovery finds the segment
            file.close()
            os.close(fd)
        self.finalised.append(final)
        return final

    def close(self) -> None:
        self.rotate()

    def due(self) -> bool:
        """Whether the open segment is old enough to finalise even without new records."""
        return self._stream is not None and time.monotonic() - self._opened_at >= self.max_seconds

    def _open(self) -> None:
        self._seq += 1
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        path = self.dir / f"{OPEN_PREFIX}{self.kind}-{stamp}-{self._tag}-{self._seq:06d}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd, self._path = fd, path
        self._file = pa.OSFile(str(path), "w")  # ``fd`` stays open only to hold the lock (and to fsync)
        self._stream = pa.ipc.new_stream(self._file, self.schema, options=_IPC_OPTIONS)
        self._opened_at = time.monotonic()


def recover_abandoned(root: Path, kind: str) -> list[Path]:
    """Finalise open segments whose writer is gone (their flock is free): a killed writer's data.

    A segment in use by a live writer stays locked and is left alone.
    """
    recovered: list[Path] = []
    directory = segment_dir(root, kind)
    if not directory.is_dir():
        return recovered
    for path in sorted(directory.glob(f"{OPEN_PREFIX}*{SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # finalised meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            if not path.exists():
                continue
            final = directory / path.name.removeprefix(OPEN_PREFIX)
            stat = os.fstat(fd)
            if stat.st_size == 0:
                if time.time() - stat.st_mtime > 60:  # a young empty file may be a writer between create and lock
                    path.unlink()
                continue
            os.replace(path, final)
            _fsync_dir(directory)
            recovered.append(final)
            log.warning("recovered a log segment left open by a writer that did not close it", extra={"fields": {"segment": str(final)}})
        finally:
            os.close(fd)
    return recovered


class LogSource(Protocol):
    """Where the trainer reads logs from. A directory of segments today; a log broker could be another."""

    def batches(self, kind: str) -> Iterator[pa.RecordBatch]: ...

    def table(self, kind: str) -> pa.Table: ...


def read_segment(path: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of one finalised segment; a torn last batch (a recovered segment) ends it quietly."""
    with pa.OSFile(str(path), "r") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid:  # killed before the schema was written
            log.warning("skipping an empty or torn log segment", extra={"fields": {"segment": str(path)}})
            return
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError):
                log.warning("a log segment ends in a torn batch; read up to it", extra={"fields": {"segment": str(path)}})
                return
            yield batch


class DirectorySource:
    """Finalised segments under ``root``, oldest first."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def segments(self, kind: str) -> list[Path]:
        directory = segment_dir(self.root, kind)
        if not directory.is_dir():
            return []
        return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))

    def batches(self, kind: str) -> Iterator[pa.RecordBatch]:
        schema = SCHEMAS[kind]
        for path in self.segments(kind):
            for batch in read_segment(path):
                yield _conform(batch, schema)

    def table(self, kind: str) -> pa.Table:
        return pa.Table.from_batches(list(self.batches(kind)), schema=SCHEMAS[kind])


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A batch in the current schema: columns only ever get added, so an older segment gains nulls."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    columns = []
    for field in schema:
        index = batch.schema.get_field_index(field.name)
        columns.append(batch.column(index).cast(field.type) if index >= 0 else pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(columns, names=schema.names)
