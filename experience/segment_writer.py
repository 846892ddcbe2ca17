"""Log segments on a directory, the writing side: Arrow IPC streams appended and published by rename.

What a serving process needs to log, and no more: it imports neither ``pyarrow.fs`` nor the readers
(``experience.segments``), whose filesystem layer (S3, GCS, HDFS, Azure bindings and Arrow's dataset
libraries) would add about 5 MB to every serving process (docs/performance.md). The layout, the
stream format and why a write is all or nothing: ``experience.segments``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from core.files import UnreadableFile, open_regular
from experience.kinds import KINDS
from experience.schema import SCHEMAS

log = logging.getLogger(__name__)

SUFFIX = ".arrows"
OPEN_PREFIX = ".open-"
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the IPC stream's end-of-stream marker: continuation, length 0


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def segment_dir(root: Path, kind: str) -> Path:
    if kind not in SCHEMAS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return root / kind


def _stream(schema: pa.Schema, batches: list[pa.RecordBatch]) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=_IPC_OPTIONS) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


class _Encoder:
    """A batch as the bytes it adds to a stream: a stream is the schema, then its batches' messages, then EOS."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        empty = _stream(schema, []).to_pybytes()
        if not empty.endswith(_EOS):
            raise RuntimeError("pyarrow wrote an IPC stream without its end-of-stream marker")
        self.header = empty[: -len(_EOS)]

    def message(self, batch: pa.RecordBatch) -> pa.Buffer:
        data = _stream(self.schema, [batch])
        start, end = len(self.header), data.size - len(_EOS)
        if data[:start].to_pybytes() != self.header or data[end:].to_pybytes() != _EOS:
            raise RuntimeError("pyarrow wrote an IPC stream that is not its schema, its batch and EOS")
        return data[start:end]  # a view: no copy


def _write_at(fd: int, data: bytes | pa.Buffer, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (a full disk may take part of it, then fail); returns the offset after it."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    return offset


class SegmentWriter:
    """Appends record batches of one kind to rotating segments under ``root/kind``.

    Not thread-safe: one writer thread owns it. ``write`` appends (or holds, when the write
    fails: ``held_rows``); ``due`` says when to ``rotate``; ``close`` finalises the open
    segment. Every finalised segment is complete.
    """

    def __init__(self, root: Path, kind: str, max_bytes: int, max_seconds: float) -> None:
        self.dir = segment_dir(root, kind)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.schema = SCHEMAS[kind]
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self._encoder = _Encoder(self.schema)
        self._tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._seq = 0
        self._fd = -1
        self._path: Path | None = None
        self._size = 0  # bytes of complete messages in the open segment (0: not even the schema yet)
        self._torn = False  # a failed write could not be cut off again: append nothing more to this file
        self._opened_at = 0.0
        self._held: list[pa.Buffer] = []  # messages not yet in the file
        self.held_rows = 0
        self.held_bytes = 0  # their size, encoded (what the recorder's byte budget counts of them)
        self._rows = 0  # rows written into the open segment
        self.lost_rows = 0  # rows of open segments removed or replaced under this writer (``take_lost``)
        self.finalised: list[Path] = []

    @property
    def open_path(self) -> Path | None:
        return self._path

    def write(self, batch: pa.RecordBatch) -> int:
        """Append ``batch`` after what is held; returns the rows now in the file (held ones included).

        On ``OSError`` nothing is half-written: the batch is held with the others, for the next call.
        """
        if batch.num_rows:
            message = self._encoder.message(batch)
            self._held.append(message)
            self.held_rows += batch.num_rows
            self.held_bytes += message.size
        return self.retry()

    def take_lost(self) -> int:
        """The rows of open segments that were removed or replaced under this writer since the last call (``_vanished``):
        they were written, and are gone."""
        lost, self.lost_rows = self.lost_rows, 0
        return lost

    def _vanished(self) -> bool:
        """Whether the open segment's name no longer leads to the file this writer writes: removed (``rm`` on the volume,
        a cleanup) or replaced. Writing on would put every later row of the segment into a file no reader can find, and
        its rename at rotation then failed, all of them lost and none counted (an attack review, 2026-12-07: 7,645
        answered decisions, none on disk). So the file is given up, its rows counted lost, and a new segment opened."""
        if self._fd < 0 or self._path is None:
            return False
        try:
            named = os.stat(self._path)
        except FileNotFoundError:
            return True
        except OSError:  # cannot tell (the volume failing): the write or the rename will say
            return False
        mine = os.fstat(self._fd)
        return (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino)

    def _lose_open(self) -> None:
        """Give up the open segment (``_vanished``): its rows are counted lost; the name is not touched (another file may
        have it now)."""
        self.lost_rows += self._rows
        log.error("the open log segment was removed or replaced while being written; its records are lost",
                  extra={"fields": {"kind": self.kind, "segment": str(self._path), "records": self._rows}})
        self._release()

    def retry(self) -> int:
        """Write what is held; returns the rows written (``OSError``: still held)."""
        if not self._held:
            return 0
        if self._vanished():
            self._lose_open()
        if self._torn:  # finalise what the torn file holds; the held messages start a new one
            if self._size:
                self._seal()
            else:
                self._discard()
        if self._fd < 0:
            self._open()
        parts: list[bytes | pa.Buffer] = [self._encoder.header] if self._size == 0 else []
        end = self._size
        try:
            for part in parts + self._held:
                end = _write_at(self._fd, part, end)
        except OSError:
            self._cut()
            raise
        self._size = end
        rows, self._held, self.held_rows, self.held_bytes = self.held_rows, [], 0, 0
        self._rows += rows
        return rows

    def due(self) -> bool:
        """Whether the open segment is big or old enough to finalise (with or without new records)."""
        return self._size > 0 and (self._size >= self.max_bytes or time.monotonic() - self._opened_at >= self.max_seconds)

    def rotate(self) -> Path | None:
        """Finalise the open segment (if it holds records); the next write opens a new one.

        Held messages go in first when they can; when they cannot, the segment is finalised
        without them and they wait for the next one. ``OSError`` (fsync, rename): the
        segment stays open, complete, for another try.
        """
        if self._fd < 0:
            return None
        try:
            self.retry()
        except OSError:
            pass
        if self._vanished():
            self._lose_open()
            return None
        if self._size == 0:
            if not self._held:
                self._discard()
            return None
        return self._seal()

    def close(self) -> int:
        """Finalise the open segment; returns the rows still held, which are given up, and those of open segments lost
        (``take_lost``) since they were last taken (0 normally).

        A segment that cannot be finalised is left as it is (complete up to its last batch):
        ``recover_abandoned`` finalises it at the next start.
        """
        try:
            self.rotate()
        except OSError as exc:
            log.error("could not finalise a log segment; it is left for recovery at the next start",
                      extra={"fields": {"segment": str(self._path), "error": str(exc)}})
        dropped, self._held, self.held_rows, self.held_bytes = self.held_rows + self.take_lost(), [], 0, 0
        if self._fd >= 0:
            if self._size == 0:
                self._discard()
            else:
                self._release()
        return dropped

    # --- the open file ---------------------------------------------------------------------
    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        path = self.dir / f"{OPEN_PREFIX}{self.kind}-{stamp}-{self._tag}-{self._seq:06d}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self._path, self._size, self._torn = fd, path, 0, False
        self._opened_at = time.monotonic()

    def _cut(self) -> None:
        """After a failed write: the file back to its complete messages (truncating frees space, so it works on a full disk)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self._torn = True  # readers stop at the torn batch; what follows goes to a new segment

    def _seal(self) -> Path:
        assert self._path is not None
        if not self._torn:
            try:
                _write_at(self._fd, _EOS, self._size)
            except OSError:  # full disk: the marker is optional, the stream ends at its last message
                self._cut()
        os.fsync(self._fd)
        final = self.dir / self._path.name.removeprefix(OPEN_PREFIX)
        try:
            os.replace(self._path, final)
        except FileNotFoundError:  # removed between the check and the rename: nothing to retry, its rows are lost
            self._lose_open()
            raise
        self._release()
        try:
            fsync_path(self.dir)
        except OSError:
            log.warning("could not fsync a log directory", extra={"fields": {"dir": str(self.dir)}})
        self.finalised.append(final)
        return final

    def _discard(self) -> None:
        """Remove the open segment, which holds nothing (not even the schema)."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        self._release()

    def _release(self) -> None:
        os.close(self._fd)  # and with it the flock
        self._fd, self._path, self._size, self._torn, self._rows = -1, None, 0, False, 0


def recover_abandoned(root: Path, kind: str) -> list[Path]:
    """Finalise open segments whose writer is gone (their flock is free): a killed writer's data.

    A segment in use by a live writer stays locked and is left alone.
    """
    recovered: list[Path] = []
    directory = segment_dir(root, kind)
    if not directory.is_dir():
        return recovered
    for path in sorted(directory.glob(f"{OPEN_PREFIX}*{SUFFIX}")):
        try:  # without waiting on a writer: a FIFO under that name would hang the start (the volume is shared)
            fd = open_regular(path, follow_link=False)
        except FileNotFoundError:  # finalised meanwhile
            continue
        except UnreadableFile:  # a link or a special file
            log.warning("left alone: not a regular file where a log segment was open", extra={"fields": {"path": str(path)}})
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            if not path.exists():
                continue
            final = directory / path.name.removeprefix(OPEN_PREFIX)
            info = os.fstat(fd)
            if info.st_size == 0:
                if time.time() - info.st_mtime > 60:  # a young empty file may be a writer between create and lock
                    path.unlink()
                continue
            os.replace(path, final)
            fsync_path(directory)
            recovered.append(final)
            log.warning("recovered a log segment left open by a writer that did not close it", extra={"fields": {"segment": str(final)}})
        finally:
            os.close(fd)
    return recovered
