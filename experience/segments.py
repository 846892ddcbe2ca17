"""Log segments on a directory: written as Arrow IPC streams, published by rename, read column-wise.

This module reads; the writing side is ``experience.segment_writer``, all a serving process imports.

Layout: ``DIR/decisions/`` and ``DIR/outcomes/``. A writer appends record batches to a hidden
temp file (``.open-<name>``) that it holds an exclusive ``flock`` on, and finalises it by
fsync + ``os.replace`` to ``<name>.arrows`` when the segment is big enough, old enough, or
the writer closes. Readers only ever list finalised names, so they never see half a segment.
``name`` sorts by creation time (UTC, microseconds) and carries host, pid and a random token,
so several processes (``--workers``, several pods on one volume) never collide.

The IPC *stream* format (not the file format) is used on purpose: a stream is readable up to
its last complete batch, so a segment left open by a writer that was killed (SIGKILL, OOM)
is not lost: the next writer on the directory finds it (its lock is free), and finalises it
as it is. ``experience.segment_writer.recover_abandoned`` does this; a reader stops quietly at a torn last batch.

A write is all or nothing. Each batch is encoded in memory first (one IPC message), then
written at the end of the segment's complete messages; a write that fails (disk full, I/O
error) is cut back off the file and its message is *held* by the writer, to go in on the
next write, so one segment file is reused however many writes fail, and a segment never
holds half a batch. The end-of-stream marker is optional in the format, so a segment is
finalised on a full disk too (without it).
"""

from __future__ import annotations

import itertools
import logging
import os
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.fs as pafs

from core.files import UnreadableFile, open_regular
from experience.salt import read_salt
from experience.schema import ADDED_IN_V2, SCHEMA_VERSION, SCHEMAS
from experience.segment_writer import SUFFIX, segment_dir
from experience.upgrade import V1_SCHEMAS, V1Reading, segment_version, upgrade_v1
from policy.features import FeatureSpec

log = logging.getLogger(__name__)


class LogSource(Protocol):
    """Where the trainer reads logs from. A directory of segments today; a log broker could be another."""

    def batches(self, kind: str) -> Iterator[pa.RecordBatch]: ...

    def table(self, kind: str) -> pa.Table: ...


def open_local(path: str) -> pa.NativeFile:
    """A log file on the local disk, for reading: a regular file, not reached through a symbolic link at its last step.
    The listing skips links and special files, but a reader opens a segment long after it listed it (a pass reads them
    one by one), and a link renamed over a listed segment was read, a FIFO waited on for ever (an attack review,
    2026-12-06). ``FileNotFoundError``, another ``OSError`` or ``UnreadableFile`` (a link, a FIFO: ``core.files``).

    Arrow reopens the checked descriptor through ``/proc/self/fd`` (Linux), which names that open file whatever is
    at the path now; its own file keeps Arrow's reads (a Python file object would allocate whatever length a damaged
    message claims before reading it)."""
    fd = open_regular(path, follow_link=False)
    try:
        return pa.OSFile(f"/proc/self/fd/{fd}", "r")
    except FileNotFoundError:  # the descriptor is open: what is missing is /proc (not Linux, or not mounted)
        raise RuntimeError("reading the logs needs /proc/self/fd (Linux, with /proc mounted)") from None
    finally:
        os.close(fd)


def read_segment(path: Path | str, filesystem: pafs.FileSystem | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of one finalised segment (a local path, or a path in ``filesystem``); a torn last batch
    (a recovered segment) ends it quietly.

    Off the local disk a segment is fetched whole first (one sequential read, what an object store serves best), so
    a read that fails (a dropped connection) raises instead of passing for a torn end: the rest of the segment is
    not there to be skipped."""
    if filesystem is None or isinstance(filesystem, pafs.LocalFileSystem):
        try:  # (another OSError propagates: gone, compacted since it was listed, for the caller to read its parts, or
            source: pa.NativeFile = open_local(str(path))  # unreadable, the disk: as before)
        except UnreadableFile as exc:
            log.warning("skipping a log segment that a link or a special file replaced since it was listed",
                        extra={"fields": {"segment": str(path), "error": str(exc)}})
            return
    else:
        with filesystem.open_input_stream(str(path), compression=None) as remote:  # never decompressed by a name's guess
            source = pa.BufferReader(remote.read())
    with source as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowException, OSError):  # killed before the schema was written, or not a segment at all: pyarrow
            # names malformed bytes with any of its errors, OSError among them (off the local disk the bytes were
            # fetched whole above, so a failed fetch has raised already; on it, a disk error skips the file with this)
            log.warning("skipping an empty, torn or malformed log segment", extra={"fields": {"segment": str(path)}})
            return
        while True:
            try:
                batch = reader.read_next_batch()
                batch.validate(full=True)  # offsets in range, strings UTF-8: a damaged byte would fail later, anywhere
            except StopIteration:
                return
            except (pa.ArrowException, OSError):
                log.warning("a log segment ends in a torn or malformed batch; read up to it",
                            extra={"fields": {"segment": str(path)}})
                return
            yield batch


class DirectorySource:
    """Finalised segments under ``root``, oldest first, in the current schema (older versions upgraded on read).

    ``root`` is a local directory, or, with ``filesystem``, a directory of any ``pyarrow.fs``
    filesystem: S3, GCS, HDFS, Azure, or an fsspec one wrapped in ``PyFileSystem``
    (``open_logs`` makes either from a URI). Segments are listed and read through it, so the
    trainer reads logs where a shop keeps them with the same code as from the PV. ``spec``: the feature spec of the
    bundle the logs are read for, when there is one (the trainer's): rows it cannot rebuild a state from are then left
    out of a run like rows no server writes (``trainer.log_checks.spec_rows``).
    """

    def __init__(self, root: Path | str, v1: V1Reading | None = None, filesystem: pafs.FileSystem | None = None,
                 spec: FeatureSpec | None = None) -> None:
        self.fs = filesystem or pafs.LocalFileSystem()
        self.root = str(Path(root).resolve()) if self.local else str(root).rstrip("/")
        self.v1 = v1 or V1Reading()
        self.spec = spec
        self._warned = False

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def has(self, kind: str) -> bool:
        """Whether ``root`` has a directory of ``kind``."""
        return bool(self.fs.get_file_info(self._dir(kind)).type == pafs.FileType.Directory)

    def blocked(self, kind: str) -> bool:
        """Whether something other than a directory has ``kind``'s name under ``root`` (a file, a device)."""
        return self.fs.get_file_info(self._dir(kind)).type not in (pafs.FileType.Directory, pafs.FileType.NotFound)

    def segments(self, kind: str) -> list[str]:
        """The finalised segments of ``kind`` and their columnar parts (``experience.columnar``), oldest first, as paths
        in the source's filesystem; the parts of a segment that still exists are left out (a compaction cut short)."""
        from experience.columnar import stem_of

        streams, parts = self._listing(kind)
        live = {stem_of(p) for p in streams}
        return sorted(streams + [p for p in parts if stem_of(p) not in live], key=lambda p: (stem_of(p), p))  # by creation

    def _listing(self, kind: str) -> tuple[list[str], list[str]]:
        """The stream segments and the columnar parts under ``kind``'s directory (one recursive listing; on a local
        disk ``_local_listing``)."""
        from experience.columnar import HOUR_PREFIX, PART_SUFFIX

        top = self._dir(kind)
        if self.local:
            return _local_listing(top, HOUR_PREFIX, PART_SUFFIX)
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
                conformed = _conform(batch, wanted)
                unwritten = null_column(conformed, wanted, batch.schema.names)  # (read_part refuses a missing column)
                if unwritten is not None:
                    raise ValueError(f"{path}: not a log part that compact writes: {unwritten}")
                yield conformed
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
        for batch in read_segment(path, self.fs):
            try:
                version = segment_version(batch)
            except ValueError:  # a schema_version that is not a number: damaged metadata, not a newer server
                log.warning("a log segment with an unreadable schema version is skipped", extra={"fields": {"segment": path}})
                return
            if version > SCHEMA_VERSION:
                raise ValueError(f"{path}: log schema version {version}; this reader knows up to {SCHEMA_VERSION}")
            if version == 1:
                self._warn_v1(path)
            conformed = self._conformed(batch, kind, version)
            if isinstance(conformed, str):
                log.warning("a log segment's batch does not fit the log schema or holds what no server writes; read up to "
                            "it", extra={"fields": {"segment": path, "error": conformed[:300]}})
                return
            yield conformed

    def _conformed(self, batch: pa.RecordBatch, kind: str, version: int) -> pa.RecordBatch | str:
        """A stream batch of ``version`` in the current schema, or why no server wrote it (``unwritten_by_servers``, and
        ``null_column`` once conformed): damaged, or of columns of another type or layout."""
        schema = SCHEMAS[kind]
        try:
            unwritten = unwritten_by_servers(batch, kind, version)  # (before a version-1 upgrade hashes a null id)
            if unwritten is not None:
                return unwritten
            batch = upgrade_v1(batch, kind, self.v1) if version == 1 else batch
            conformed = _conform(batch, schema)
        except (pa.ArrowException, ValueError, TypeError) as exc:  # (a column name that is not UTF-8; a version-1 id
            return str(exc)  # that is not a string fails its hash)
        return null_column(conformed, schema, batch.schema.names) or conformed

    def table(self, kind: str) -> pa.Table:
        return pa.Table.from_batches(list(self.batches(kind)), schema=SCHEMAS[kind])

    def _warn_v1(self, path: str) -> None:
        if self._warned or self.v1.salt:
            return
        self._warned = True
        log.warning("reading version-1 log segments (raw ids) without the servers' salt: their ids are hashed without a "
                    "key, so a session that spans version-1 and version-2 segments counts as two",
                    extra={"fields": {"segment": str(path)}})


def unwritten_by_servers(batch: pa.RecordBatch | pa.Table, kind: str, version: int) -> str | None:
    """Why no server wrote this ``kind`` stream batch of schema ``version`` as it was read, or None: a version no server
    wrote (below 1), a column that version has had from the start missing (all but ``ADDED_IN_V2``'s), or a column its
    schema requires holding a null, in a version-1 batch, before its upgrade hashes the ids (``null_column``; any
    other version's batch is checked once conformed).

    Read on, such a batch would hold nulls where a session id, a time or a model version cannot be one: a null session
    id stopped every run of ``train``, and a batch of outcomes in the decisions' directory became the newest model
    version's window and left it no decisions."""
    if version < 1:
        return f"schema_version {version}: no server writes it"
    schema = V1_SCHEMAS.get(kind) if version == 1 else SCHEMAS[kind]
    if schema is None:
        return f"schema version 1, which had no {kind}"
    names, later = batch.schema.names, ADDED_IN_V2.get(kind, frozenset())
    missing = [f.name for f in schema if f.name not in names and f.name not in later]
    if missing:
        return f"{missing[0]}: the column is missing"
    return null_column(batch, schema, names) if version == 1 else None  # (a later version's: once conformed)


def null_column(batch: pa.RecordBatch | pa.Table, schema: pa.Schema, names: Sequence[str]) -> str | None:
    """Which of ``names`` (the columns the batch came with: not those ``_conform`` filled) holds a null where ``schema``
    has none (a value, or an element of its lists at any depth; in a nullable list column, an element), as the message
    saying so; None when none does. The reader asks it of a batch once conformed: a column of another type that casts
    to the schema's (a dictionary whose values hold a null, a large list) shows its nulls only then."""
    present = set(names)
    for field in schema:
        if field.name not in present:
            continue
        column = batch.column(field.name)
        if not field.nullable and _nulls(column):
            return f"{field.name}: null values in a column that has none"
        if field.nullable and pa.types.is_list(field.type) and any(_nulls(c.values) for c in _chunks(column)):
            return f"{field.name}: a list holding a null (the list may be null, its elements not)"
    return None


def _nulls(column: pa.Array | pa.ChunkedArray) -> bool:
    """Whether ``column`` holds a null: a value, or an element of one of its lists at any depth."""
    for chunk in _chunks(column):
        if chunk.null_count:
            return True
        if isinstance(chunk, pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray) and _nulls(chunk.values):
            return True  # (``values``: the whole child array, no compute call; a batch as read owns all of it)
    return False


def _chunks(column: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    return column.chunks if isinstance(column, pa.ChunkedArray) else [column]  # type: ignore[no-any-return]


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
    return DirectorySource(root, V1Reading(salt or b"", spec or FeatureSpec()), filesystem, spec)


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


def _local_listing(top: str, hour_prefix: str, part_suffix: str) -> tuple[list[str], list[str]]:
    """``DirectorySource._listing`` on a local disk: the segments in ``top`` and the parts in its hour directories, two
    levels and no deeper, and no symbolic link followed. The servers and the compactor write regular files in regular
    directories; a link there is someone else's, and following one sent every reader walking the whole host filesystem
    (a link to ``/``) and the compactor writing parts outside the logs volume (a linked hour directory)."""
    def entries(path: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(path) as found:
                return [e for e in found if not e.name.startswith(".") and not e.is_symlink()]
        except FileNotFoundError:
            return []

    streams, parts = [], []
    for entry in entries(top):
        if entry.is_file(follow_symlinks=False) and entry.name.endswith(SUFFIX):
            streams.append(f"{top}/{entry.name}")
        elif entry.is_dir(follow_symlinks=False) and entry.name.startswith(hour_prefix):
            parts += [f"{top}/{entry.name}/{e.name}" for e in entries(entry.path)
                      if e.is_file(follow_symlinks=False) and e.name.endswith(part_suffix)]
    return sorted(streams), sorted(parts)
