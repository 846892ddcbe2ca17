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

A write is all or nothing. Each batch is encoded in memory first (one IPC message), then
written at the end of the segment's complete messages; a write that fails (disk full, I/O
error) is cut back off the file and its message is *held* by the writer, to go in on the
next write, so one segment file is reused however many writes fail, and a segment never
holds half a batch. The end-of-stream marker is optional in the format, so a segment is
finalised on a full disk too (without it).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import secrets
import socket
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.fs as pafs

from experience.kinds import KINDS
from experience.salt import read_salt
from experience.schema import SCHEMA_VERSION, SCHEMAS
from experience.upgrade import V1_SCHEMAS, V1Reading, segment_version, upgrade_v1
from policy.features import FeatureSpec

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
        self.finalised: list[Path] = []

    @property
    def open_path(self) -> Path | None:
        return self._path

    def write(self, batch: pa.RecordBatch) -> int:
        """Append ``batch`` after what is held; returns the rows now in the file (held ones included).

        On ``OSError`` nothing is half-written: the batch is held with the others, for the next call.
        """
        if batch.num_rows:
            self._held.append(self._encoder.message(batch))
            self.held_rows += batch.num_rows
        return self.retry()

    def retry(self) -> int:
        """Write what is held; returns the rows written (``OSError``: still held)."""
        if not self._held:
            return 0
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
        rows, self._held, self.held_rows = self.held_rows, [], 0
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
        if self._size == 0:
            if not self._held:
                self._discard()
            return None
        return self._seal()

    def close(self) -> int:
        """Finalise the open segment; returns the rows still held, which are given up (0 normally).

        A segment that cannot be finalised is left as it is (complete up to its last batch):
        ``recover_abandoned`` finalises it at the next start.
        """
        try:
            self.rotate()
        except OSError as exc:
            log.error("could not finalise a log segment; it is left for recovery at the next start",
                      extra={"fields": {"segment": str(self._path), "error": str(exc)}})
        dropped, self._held, self.held_rows = self.held_rows, [], 0
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
        except FileNotFoundError:  # the volume lost the open segment: nothing to retry
            self._release()
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
        self._fd, self._path, self._size, self._torn = -1, None, 0, False


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
            fsync_path(directory)
            recovered.append(final)
            log.warning("recovered a log segment left open by a writer that did not close it", extra={"fields": {"segment": str(final)}})
        finally:
            os.close(fd)
    return recovered


class LogSource(Protocol):
    """Where the trainer reads logs from. A directory of segments today; a log broker could be another."""

    def batches(self, kind: str) -> Iterator[pa.RecordBatch]: ...

    def table(self, kind: str) -> pa.Table: ...


def read_segment(path: Path | str, filesystem: pafs.FileSystem | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of one finalised segment (a local path, or a path in ``filesystem``); a torn last batch
    (a recovered segment) ends it quietly.

    Off the local disk a segment is fetched whole first (one sequential read, what an object store serves best), so
    a read that fails (a dropped connection) raises instead of passing for a torn end: the rest of the segment is
    not there to be skipped."""
    if filesystem is None or isinstance(filesystem, pafs.LocalFileSystem):
        source: pa.NativeFile = pa.OSFile(str(path), "r")
    else:
        with filesystem.open_input_stream(str(path), compression=None) as remote:  # never decompressed by a name's guess
            source = pa.BufferReader(remote.read())
    with source as f:
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
    """Finalised segments under ``root``, oldest first, in the current schema (older versions upgraded on read).

    ``root`` is a local directory, or, with ``filesystem``, a directory of any ``pyarrow.fs``
    filesystem: S3, GCS, HDFS, Azure, or an fsspec one wrapped in ``PyFileSystem``
    (``open_logs`` makes either from a URI). Segments are listed and read through it, so the
    trainer reads logs where a shop keeps them with the same code as from the PV.
    """

    def __init__(self, root: Path | str, v1: V1Reading | None = None, filesystem: pafs.FileSystem | None = None) -> None:
        self.fs = filesystem or pafs.LocalFileSystem()
        self.root = str(Path(root).resolve()) if self.local else str(root).rstrip("/")
        self.v1 = v1 or V1Reading()
        self._warned = False

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def has(self, kind: str) -> bool:
        """Whether ``root`` has a directory of ``kind``."""
        return bool(self.fs.get_file_info(self._dir(kind)).type == pafs.FileType.Directory)

    def segments(self, kind: str) -> list[str]:
        """The finalised segments of ``kind`` and their columnar parts (``experience.columnar``), oldest first, as paths
        in the source's filesystem; the parts of a segment that still exists are left out (a compaction cut short)."""
        from experience.columnar import stem_of

        streams, parts = self._listing(kind)
        live = {stem_of(p) for p in streams}
        return sorted(streams + [p for p in parts if stem_of(p) not in live], key=lambda p: (stem_of(p), p))  # by creation

    def _listing(self, kind: str) -> tuple[list[str], list[str]]:
        """The stream segments and the columnar parts under ``kind``'s directory (one recursive listing)."""
        from experience.columnar import HOUR_PREFIX, PART_SUFFIX

        top = self._dir(kind)
        found = self.fs.get_file_info(pafs.FileSelector(top, allow_not_found=True, recursive=True))
        files = [i for i in found if i.type == pafs.FileType.File and not i.base_name.startswith(".")]
        streams = [i.path for i in files if i.base_name.endswith(SUFFIX) and i.path.rsplit("/", 1)[0] == top]
        parts = [i.path for i in files if i.base_name.endswith(PART_SUFFIX)
                 and i.path.rsplit("/", 2)[-2].startswith(HOUR_PREFIX) and i.path.rsplit("/", 2)[0] == top]
        return streams, parts

    def _dir(self, kind: str) -> str:
        return segment_dir(Path(self.root), kind).as_posix()

    def batches(self, kind: str) -> Iterator[pa.RecordBatch]:
        for path in self.segments(kind):
            yield from self.segment_batches(path, kind)

    def segment_batches(self, path: str, kind: str, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The batches of one of ``segments(kind)``, in the current schema (only ``columns``, when given: a columnar
        part reads no others, a stream segment is decoded whole and then cut)."""
        from experience.columnar import PART_SUFFIX, read_part, stem_of

        schema = SCHEMAS[kind]
        if path.endswith(PART_SUFFIX):  # written in the current schema by ``compact``
            wanted = schema if columns is None else pa.schema([schema.field(c) for c in columns])
            for batch in read_part(path, self.fs, kind, columns):
                yield _conform(batch, wanted)
            return
        batches = self._stream_batches(path, kind)
        try:
            first = next(batches, None)
        except FileNotFoundError:
            if not self.local:
                raise
            parts = self._parts_of(stem_of(path), kind)  # compacted since it was listed: its parts are all in place
            if not parts:
                raise FileNotFoundError(f"{path}: the log segment is gone and no columnar part of it exists") from None
            for part in parts:
                yield from self.segment_batches(part, kind, columns)
            return
        for batch in itertools.chain([first] if first is not None else [], batches):
            yield batch if columns is None else batch.select(list(columns))

    def _parts_of(self, stem: str, kind: str) -> list[str]:
        """The columnar parts ``compact`` made of the segment ``stem`` (written before it removed the segment)."""
        from experience.columnar import PART_SUFFIX

        return sorted(p for p in self._listing(kind)[1] if p.rsplit("/", 1)[-1] == stem + PART_SUFFIX)

    def _stream_batches(self, path: str, kind: str) -> Iterator[pa.RecordBatch]:
        schema = SCHEMAS[kind]
        for batch in read_segment(path, self.fs):
            version = segment_version(batch)
            if version == 1:
                if kind not in V1_SCHEMAS:  # engagement reports began with version 2
                    raise ValueError(f"{path}: a {kind} segment of schema version 1, which had no {kind}")
                self._warn_v1(path)
                batch = upgrade_v1(batch, kind, self.v1)
            elif version > SCHEMA_VERSION:
                raise ValueError(f"{path}: log schema version {version}; this reader knows up to {SCHEMA_VERSION}")
            yield _conform(batch, schema)

    def table(self, kind: str) -> pa.Table:
        return pa.Table.from_batches(list(self.batches(kind)), schema=SCHEMAS[kind])

    def _warn_v1(self, path: str) -> None:
        if self._warned or self.v1.salt:
            return
        self._warned = True
        log.warning("reading version-1 log segments (raw ids) without the servers' salt: their ids are hashed without a "
                    "key, so a session that spans version-1 and version-2 segments counts as two",
                    extra={"fields": {"segment": str(path)}})


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A batch in the current schema: a column it lacks gains nulls, a column the schema lacks is dropped."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    columns = []
    for field in schema:
        index = batch.schema.get_field_index(field.name)
        columns.append(batch.column(index).cast(field.type) if index >= 0 else pa.nulls(batch.num_rows, field.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def open_logs(location: str | os.PathLike[str], spec: FeatureSpec | None = None) -> DirectorySource:
    """The logs at ``location``: a local directory, or a URI. ``pyarrow.fs`` resolves its own schemes (``file://``,
    ``s3://``, ``gs://``, ``hdfs://``, ``abfs://``; credentials as each reads them, from the environment); any other
    scheme is fsspec's, when fsspec and that scheme's package are installed (``memory://``, ``sftp://``, …).
    Version-1 segments are read for ``spec``, their ids hashed as a local server's are: with the salt it kept beside
    its logs (``.user-salt``), if it did; a store they were moved to has none.

    Raises ``ValueError`` for a location no filesystem takes, ``OSError`` for one that cannot be reached now; both
    name the location without the user info and query a URI may carry (``redacted``)."""
    filesystem, root = _filesystem_of(os.fspath(location))
    salt = read_salt(Path(root)) if isinstance(filesystem, pafs.LocalFileSystem) else None
    return DirectorySource(root, V1Reading(salt or b"", spec or FeatureSpec()), filesystem)


def _filesystem_of(text: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in text:
        return pafs.LocalFileSystem(), text
    shown = redacted(text)
    try:
        return pafs.FileSystem.from_uri(text)
    except pa.ArrowInvalid as exc:  # not a scheme of pyarrow's: perhaps fsspec's
        return _fsspec(text, shown, str(exc).replace(text, shown))
    except OSError as exc:  # pyarrow's scheme, but not reachable (or its library missing): worth another try later
        raise OSError(f"{shown}: {str(exc).replace(text, shown)}") from None


def _fsspec(text: str, shown: str, pyarrow_says: str) -> tuple[pafs.FileSystem, str]:
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{shown}: not a log location pyarrow.fs can open ({pyarrow_says}); "
                         "install fsspec for its schemes") from None
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or one whose package is not installed
        raise ValueError(f"{shown}: not a log location pyarrow.fs or fsspec can open ({str(exc).replace(text, shown)})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def redacted(location: str) -> str:
    """``location`` fit to print and to record in a manifest: a URI without its user info (``key:secret@``) and
    query (``?secret_key=…``), where credentials can travel."""
    if "://" not in location:
        return location
    parts = urllib.parse.urlsplit(location)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
