"""The store on the weights volume: the active bundle the servers load, and a history for rollback.

Layout of the directory (nothing else is required; servers read only the active file)::

    DIR/weights_active.bundle          what every server replica loads
    DIR/history/<model_version>.bundle every published version still kept (the last ``keep``)
    DIR/history/index.json             [{model_version, sha256, published_at}, …], oldest first
    DIR/.lock                          flock'd by publish and rollback, so two publishers queue
    DIR/pending/candidate.bundle       a candidate the gate refused, kept for one second look
                                       (``trainer.second_look``); never served
    DIR/canary/canary.bundle           a candidate served on a share of the sessions next to the
                                       active one (``weights.canary``, judged by ``trainer.canary``)
    DIR/canary/looks.json              {model_version, looks}: how often the trainer judged it

Every write goes the same way: the bytes into ``.tmp-*`` in the target's directory, flush,
fsync, ``os.replace`` onto the final name, fsync the directory. A reader therefore sees the
old file or the new one, never half of one, and a reader holding the old file open keeps
reading it whole. A bundle is fully validated (container, schema, shapes, NaN, golden
self-test) before anything on the volume changes; the bytes validated are the bytes written.

Model versions are immutable: a version already in the history with other bytes is refused.
The history is ordered by publish; rollback steps back one entry from the active one (or
goes to a named version) through the same atomic path, re-validating the kept file first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import EllipsisType
from typing import Any, Literal

from weights.bundle import MAX_BUNDLE_BYTES, MODEL_VERSION, MODEL_VERSION_RULE, Bundle, BundleError, read_bundle, read_file, sha256
from weights.canary import requested_fraction
from weights.held import refuse_held

log = logging.getLogger(__name__)

ACTIVE_NAME = "weights_active.bundle"
PENDING_DIR = "pending"
PENDING_NAME = "candidate.bundle"
CANARY_DIR = "canary"
CANARY_NAME = "canary.bundle"
LOOKS_NAME = "looks.json"
HISTORY_DIR = "history"
INDEX_NAME = "index.json"
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
BUNDLE_SUFFIX = ".bundle"
MAX_INDEX_BYTES = 1024 * 1024
"""The canary's look count and the history index are small JSON files: larger is not one the store wrote (the index's
limit grows by ``INDEX_ENTRY_BYTES`` a kept version, so that any ``keep`` fits)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
INDEX_ENTRY_BYTES = 512  # one entry: a version of at most 200 characters, a sha256, a time, the JSON around them
STALE_TMP_S = 3600.0
"""A ``.tmp-*`` file older than this, seen under the lock, was left by a killed writer: removed."""


class StoreError(Exception):
    """A publish or rollback the store refuses (or cannot do). ``reason`` is a short label.

    Reasons: ``immutable`` (the version exists with other bytes), ``version`` (the version
    cannot name a file), ``nothing_to_roll_back``, ``unknown_version``, ``index`` (the
    history index is unreadable), ``canary`` (a bundle that cannot be a canary), ``no_canary``,
    ``moved`` (another bundle became active since the caller judged against the one it expected), ``layout`` (one of the
    store's own directories is a symbolic link: nothing is written or removed through it).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ActiveMoved(StoreError):
    """Another bundle is active than the one the caller judged against (``replacing``): reason ``moved``."""

    def __init__(self, replacing: str | None, now: str | None) -> None:
        super().__init__("moved", f"the active bundle changed after it was judged against (sha256 {_short(replacing)}, "
                                  f"now {_short(now)}): nothing published; the next run judges against the one now active")


@dataclass(frozen=True)
class HistoryEntry:
    model_version: str
    sha256: str
    published_at: str
    rolled_back_at: str | None = None
    """When a rollback to an older version left this one (a plain rollback skips it; ``--to`` or a publish clears it)."""

    @property
    def file_name(self) -> str:
        return self.model_version + BUNDLE_SUFFIX


@dataclass(frozen=True)
class PublishResult:
    """What publish or rollback did; ``previous`` is the version active before, when known."""

    status: Literal["published", "unchanged", "rolled_back"]
    model_version: str
    sha256: str
    previous: str | None = None


def atomic_write(path: Path, data: bytes, mode: int = 0o644, replace: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temp file, fsync, rename, fsync dir): whole or not at all.
    ``mode``: the file's (0644: servers may run as another user). ``replace`` False: never replace an existing file
    (``FileExistsError``; the temp file is linked into place, and a link fails where the name exists)."""
    directory = path.parent
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # a write or fsync error names no file: say which one
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (a no-op where the file system can't)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def read_store_file(path: Path, limit: int = MAX_BUNDLE_BYTES, what: str = "bundle") -> bytes | None:
    """A store file's bytes, None when it does not exist (a dangling link included). Read as a bundle file is
    (``read_file``: a regular file within ``limit`` bytes, opened non-blocking), so a FIFO, a device or a directory left
    on the volume is refused (``BundleError``) instead of hanging a publisher that holds the lock, or filling its
    memory."""
    try:
        return read_file(path, limit, what)
    except BundleError:
        if not os.path.exists(path):  # absent, or gone between: as before, no file
            return None
        raise


def file_sha256(path: Path) -> str | None:
    """The sha256 of a bundle file; None when it does not exist or is no bundle the store could have written (not a
    regular file, or past the bundle size limit): a publish then replaces it, as it replaces any other bytes. A read
    error of a regular file (EIO, a permission) raises ``BundleError``, so that no caller takes it for "no file"."""
    try:
        data = read_store_file(path)
    except BundleError as exc:
        with contextlib.suppress(OSError):  # stat never opens: a FIFO does not block it
            if exc.reason == "size" or not stat.S_ISREG(os.stat(path).st_mode):
                return None
        raise
    return None if data is None else sha256(data)


def _short(digest: str | None) -> str:
    return "(none)" if digest is None else digest[:12] + "…"


def check_version_name(version: str) -> None:
    """A model version names a history file: letters, digits and ``. _ : + @ = -``, not hidden."""
    if not MODEL_VERSION.fullmatch(version):
        raise StoreError(
            "version",
            f"model_version {version!r} cannot name a history file: use {MODEL_VERSION_RULE}",
        )


Validator = Callable[[bytes], Bundle]  # full validation of a bundle's bytes; raises BundleError


class WeightsStore:
    """The active bundle and its history in ``directory``; keeps the last ``keep`` published versions.

    ``validate`` judges a bundle before it is published or rolled back to (the server's own
    check is ``weights.validate.verify``); the store itself only reads manifests.
    """

    def __init__(self, directory: Path | str, validate: Validator, keep: int = 10) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.validate = validate
        self.keep = keep

    @property
    def active_path(self) -> Path:
        return self.directory / ACTIVE_NAME

    @property
    def history_dir(self) -> Path:
        return self.directory / HISTORY_DIR

    @property
    def index_path(self) -> Path:
        return self.history_dir / INDEX_NAME

    @property
    def pending_path(self) -> Path:
        return self.directory / PENDING_DIR / PENDING_NAME

    @property
    def canary_path(self) -> Path:
        return self.directory / CANARY_DIR / CANARY_NAME

    @property
    def looks_path(self) -> Path:
        return self.directory / CANARY_DIR / LOOKS_NAME

    # --- reading ---------------------------------------------------------------------------

    def active(self) -> dict[str, Any] | None:
        """The active bundle's manifest; None when there is none. Raises ``BundleError`` if unreadable."""
        data = self.active_bytes()
        return None if data is None else read_bundle(data).manifest

    def active_bytes(self) -> bytes | None:
        """The active file's bytes (``read_store_file``); None when there is none."""
        return read_store_file(self.active_path)

    def expect_active(self, replacing: str | None) -> None:
        """``ActiveMoved`` unless the active bundle's sha256 is ``replacing`` (None: none is active)."""
        now = self.active_sha256()
        if now != replacing:
            raise ActiveMoved(replacing, now)

    def active_sha256(self) -> str | None:
        return file_sha256(self.active_path)

    def history(self) -> list[HistoryEntry]:
        """Published versions still kept, oldest first."""
        try:
            data = read_store_file(self.index_path, MAX_INDEX_BYTES + INDEX_ENTRY_BYTES * (self.keep + 1), "history index")
            if data is None:
                return []
            raw = json.loads(data)
        except BundleError as exc:
            raise StoreError("index", str(exc)) from None
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested past the parser, a 5,000-digit number
            raise StoreError("index", f"{self.index_path}: not valid JSON ({str(exc)[:200]})") from None
        fields = ("model_version", "sha256", "published_at")
        if not isinstance(raw, list) or not all(
            isinstance(e, dict) and all(isinstance(e.get(k), str) for k in fields) and isinstance(e.get("rolled_back_at"), str | None)
            for e in raw
        ):
            raise StoreError("index", f"{self.index_path}: expected a list of {{model_version, sha256, published_at[, "
                                      "rolled_back_at]}}")
        for e in raw:  # a version names a file in history/ (``../x`` must not), and both are printed by ``weights show``
            if not (MODEL_VERSION.fullmatch(e["model_version"]) and _SHA256.fullmatch(e["sha256"])):
                raise StoreError("index", f"{self.index_path}: an entry whose model_version is not a version "
                                          f"({MODEL_VERSION_RULE}) or whose sha256 is not 64 hex digits")
        return [HistoryEntry(**{k: e[k] for k in fields}, rolled_back_at=e.get("rolled_back_at") or None) for e in raw]  # "": none

    # --- writing ---------------------------------------------------------------------------

    def _open_lock_file(self) -> int:
        """The directory made if need be (its parent must exist: a mistyped ``--dir`` made a whole tree no server watches,
        and the publish reported success, an attack review, 2026-12-07), and a new file description of its lock file
        (never through a link put in its place: ``O_CREAT`` would create the link's target wherever it points)."""
        self.directory.mkdir(exist_ok=True)
        return os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)

    def ensure_writable(self) -> None:
        """What ``lock`` opens, without waiting for the lock; ``OSError`` when this process cannot write the volume (a
        run can fail before its work instead of at its publish)."""
        os.close(self._open_lock_file())
        if not os.access(self.directory, os.W_OK | os.X_OK):  # new files (a publish's temporary one) need both
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.directory))
        self._own_directories()  # ``StoreError`` (``layout``) now, not at the publish

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive across processes and threads (each call opens its own file description)."""
        fd = self._open_lock_file()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._own_directories()
            yield
        finally:
            os.close(fd)  # releases the lock

    def _own_directories(self) -> None:
        """``StoreError`` (``layout``) when ``history/``, ``pending/`` or ``canary/`` is a symbolic link: a publish pruned
        every ``*.bundle`` it found through a linked ``history/`` and wrote its index there (an attack review, 2026-12-06).
        Checked under the lock, by every writer."""
        for directory in (self.history_dir, self.pending_path.parent, self.canary_path.parent):
            if directory.is_symlink():
                raise StoreError("layout", f"{directory}: a symbolic link where the store's own directory belongs; "
                                           "nothing is written or removed through it")

    def publish(self, source: Path | str | bytes, replacing: str | EllipsisType | None = ...) -> PublishResult:
        """Validate the bundle at ``source`` (a path, or the bytes), keep it in the history and make it the active one.

        Idempotent: the bundle already active gives ``unchanged`` and touches nothing.
        ``replacing``: the sha256 of the active bundle the caller judged this one against (None: there was none); if
        another is active by now (an operator's publish or rollback while a trainer ran), the publish is refused
        (``ActiveMoved``) rather than undo it with a bundle never compared with it. ``...``: whatever is active.
        Raises ``BundleError`` for a bundle that must not be served and ``StoreError`` for a
        refusal; in both cases the active file and the history are untouched.
        """
        data = source if isinstance(source, bytes) else read_file(source)
        where = "the bundle" if isinstance(source, bytes) else str(source)
        version = self._release(data, where).model_version  # a name a history file can take (weights.bundle.MODEL_VERSION)
        digest = sha256(data)
        with self.lock():
            active_digest = self.active_sha256()
            if replacing is not ... and active_digest != replacing and digest != active_digest:
                raise ActiveMoved(replacing, active_digest)
            entries = self.history()
            previous = next((e.model_version for e in entries if e.sha256 == active_digest), None)
            if digest == active_digest:
                return PublishResult("unchanged", version, digest, version)
            clash = next((e for e in entries if e.model_version == version and e.sha256 != digest), None)
            if clash is not None:
                raise StoreError(
                    "immutable",
                    f"model version {version} was already published with other bytes (sha256 {_short(clash.sha256)}, "
                    f"this file {_short(digest)}); model versions are immutable: publish it under a new version",
                )
            self._sweep_stale_tmp()
            before, entries = entries, [e for e in entries if e.model_version != version]
            entries.append(HistoryEntry(version, digest, datetime.now(UTC).isoformat(timespec="seconds")))
            entries = self._pruned(entries, active_digest)
            index_written = False
            try:
                self._store_in_history(version, data, digest)
                self._write_index(entries)
                index_written = True
                atomic_write(self.active_path, data)
            except BaseException:  # a full disk, most likely, or SIGTERM: the history as it was, naming no version not served
                self._restore(before, index_written, digest)
                raise
            self._remove_unlisted(entries)
        log.debug("published %s (sha256 %s) in %s", version, digest, self.directory)
        return PublishResult("published", version, digest, previous)

    def _release(self, data: bytes, where: str) -> Bundle:
        """``data`` validated as something the servers may serve (publish, rollback, canary): not a candidate held for a
        second look (``weights.held``), which only ``hold`` takes."""
        bundle = self.validate(data)
        refuse_held(bundle.manifest, where)
        return bundle

    def hold(self, data: bytes) -> str:
        """Keep a refused candidate for a second look: validated as a publish is, written atomically; its version.

        One candidate at a time (a new one replaces the old). Servers never read it.
        """
        version = self.validate(data).model_version
        with self.lock():
            self.pending_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.pending_path, data)
        return version

    def pending(self) -> bytes | None:
        """The kept candidate's bytes, None when there is none; validate them before use.

        Read as a bundle file is (``read_file``: a regular file within the size limit, a FIFO never
        waited on), so anything else there raises ``BundleError``.
        """
        return read_store_file(self.pending_path)

    def drop_pending(self) -> None:
        with self.lock():
            with contextlib.suppress(FileNotFoundError):
                self.pending_path.unlink()
                fsync_dir(self.pending_path.parent)

    def start_canary(self, data: bytes) -> str:
        """Serve ``data`` as the canary from the servers' next poll: validated as a publish is, written atomically; its version.

        Its manifest names its share (``canary.fraction`` > 0). One canary at a time: a new one
        replaces the old, with no looks yet. The bundle already active cannot be a canary.
        """
        bundle = self._release(data, "the canary")
        version = bundle.model_version
        try:
            requested_fraction(bundle.manifest)
        except ValueError as exc:
            raise StoreError("canary", f"not a canary: {exc}") from None
        with self.lock():
            if sha256(data) == self.active_sha256():
                raise StoreError("canary", f"{version} is the active bundle: it cannot also be its canary")
            self.canary_path.parent.mkdir(parents=True, exist_ok=True)
            self._write_looks(version, 0)  # before the bundle: a canary is never seen with another's count
            atomic_write(self.canary_path, data)
        return version

    def canary(self) -> bytes | None:
        """The canary's bytes, None when there is none (read as ``pending`` is; validate them before use)."""
        return read_store_file(self.canary_path)

    def canary_looks(self, version: str) -> int:
        """How often the trainer has judged the canary ``version`` (0 when unrecorded, or recorded for another)."""
        try:
            raw = json.loads(read_store_file(self.looks_path, MAX_INDEX_BYTES, "look count") or b"null")
        except (BundleError, ValueError, RecursionError):  # not JSON, not UTF-8, nested past the parser, a huge number
            return 0
        looks = raw.get("looks") if isinstance(raw, dict) and raw.get("model_version") == version else None
        return looks if isinstance(looks, int) and not isinstance(looks, bool) and looks >= 0 else 0

    def count_canary_look(self, version: str) -> int:
        """One more look at the canary ``version``; the count after it."""
        with self.lock():
            looks = self.canary_looks(version) + 1
            self._write_looks(version, looks)
        return looks

    def drop_canary(self) -> None:
        """Stop the canary: servers serve the active bundle to every session from their next poll."""
        with self.lock():
            removed = False
            for path in (self.canary_path, self.looks_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed = True
            if removed:
                fsync_dir(self.canary_path.parent)

    def promote_canary(self, replacing: str | EllipsisType | None = ..., judged: bytes | None = None) -> PublishResult:
        """Publish the canary's very bytes as the active bundle (``replacing``: as for ``publish``), then drop it.

        ``judged``: the bytes the caller read and judged (the trainer's canary look), published rather than the file
        read again: minutes of reading logs lie between, in which the file could be swapped for another signed bundle
        (an attack review, 2026-12-06). In that order: a crash between the two leaves a canary equal to the active
        bundle, which servers never route to and the next trainer run drops.
        """
        data = judged if judged is not None else self.canary()
        if data is None:
            raise StoreError("no_canary", f"no canary to promote: {self.canary_path} does not exist")
        result = self.publish(data, replacing)
        self.drop_canary()
        return result

    def rollback(self, to: str | None = None) -> PublishResult:
        """Activate the newest version published before the active one that was not itself rolled back from, or the
        version ``to``.

        A rollback to an older version marks the one it leaves and every one between (``rolled_back_at``, written before
        the active file and put back if that fails): after a rollback from v4 to v3 and a publish of v5, a second
        rollback goes to v3, not back to v4 (it did, a known trap until 2026-12-06). ``to`` reaches any kept version
        and clears its mark, as publishing it again does. The kept file is checked against
        its sha256 and validated again before it is activated. Raises ``StoreError`` when there is nothing to roll back
        to or ``to`` is not in the history, ``BundleError`` when the kept file is no longer valid.
        """
        if not self.history_dir.is_dir():
            raise StoreError("nothing_to_roll_back", f"nothing to roll back to: {self.history_dir} does not exist")
        with self.lock():
            entries = self.history()
            if not entries:
                raise StoreError("nothing_to_roll_back", f"nothing to roll back to: no published versions in {self.history_dir}")
            active_digest = self.active_sha256()
            position = next((i for i, e in enumerate(entries) if e.sha256 == active_digest), None)
            current = entries[position].model_version if position is not None else None
            if to is not None:
                target = next((e for e in entries if e.model_version == to), None)
                if target is None:
                    known = ", ".join(e.model_version for e in entries)
                    raise StoreError("unknown_version", f"version {to!r} is not in the history (kept: {known})")
            elif position == 0:
                raise StoreError(
                    "nothing_to_roll_back", f"nothing to roll back to: {current} is the oldest version in the history"
                )
            else:  # the newest before the active one (any, when the active file is not one the store published)
                before = entries if position is None else entries[:position]
                older = [e for e in before if e.rolled_back_at is None]
                if not older:
                    left = ", ".join(e.model_version for e in before)
                    raise StoreError("nothing_to_roll_back", f"nothing to roll back to: every version before "
                                                             f"{current or 'the active file'} was rolled back from ({left}); "
                                                             "give --to to choose one")
                target = older[-1]
            if target.sha256 == active_digest:
                return PublishResult("unchanged", target.model_version, target.sha256, current)
            data = read_file(self.history_dir / target.file_name)
            if sha256(data) != target.sha256:
                raise BundleError("checksum", f"{HISTORY_DIR}/{target.file_name}: sha256 does not match the history index")
            self._release(data, f"{HISTORY_DIR}/{target.file_name}")
            marked = self._marked(entries, position, target)
            index_written = marked != entries
            if index_written:  # the marks first: a rollback that lands always has them (one that does not is undone)
                self._write_index(marked)
            try:
                atomic_write(self.active_path, data)
            except BaseException:  # a full disk, a failed fsync, SIGTERM
                self._restore(entries, index_written, target.sha256)
                raise
        log.debug("rolled back from %s to %s in %s", current, target.model_version, self.directory)
        return PublishResult("rolled_back", target.model_version, target.sha256, current)

    # --- helpers (called with the lock held) -----------------------------------------------

    def _restore(self, before: list[HistoryEntry], index_written: bool, digest: str) -> None:
        """After a publish or a rollback failed part way: the index and the history files as ``before`` (best effort),
        unless the bundle ``digest`` is active after all (the rename landed, and what failed came after it): then they
        already name it (and a rollback's marks stay)."""
        with contextlib.suppress(OSError, BundleError):
            if file_sha256(self.active_path) == digest:
                return
        with contextlib.suppress(OSError):
            if index_written:  # the index on disk names the new version: put the old one back before removing its file
                self._write_index(before)
            self._remove_unlisted(before)

    def _store_in_history(self, version: str, data: bytes, digest: str) -> None:
        if not self.history_dir.is_dir():
            self.history_dir.mkdir()
            fsync_dir(self.directory)
        path = self.history_dir / (version + BUNDLE_SUFFIX)
        if file_sha256(path) != digest:  # absent, or left by an interrupted publish
            atomic_write(path, data)

    def _write_looks(self, version: str, looks: int) -> None:
        atomic_write(self.looks_path, (json.dumps({"model_version": version, "looks": looks}) + "\n").encode())

    def _pruned(self, entries: list[HistoryEntry], active_digest: str | None) -> list[HistoryEntry]:
        """The newest ``keep`` entries, those rolled back from pruned first, plus the active one if it is not among
        them (until the new one is active): a rollback in an incident finds versions it may step to."""
        newest_first = sorted(range(len(entries)), key=lambda i: (entries[i].rolled_back_at is not None, -i))
        kept = set(newest_first[: self.keep])
        return [e for i, e in enumerate(entries) if i in kept or e.sha256 == active_digest]

    def _write_index(self, entries: list[HistoryEntry]) -> None:
        rows = [{k: v for k, v in asdict(e).items() if v is not None} for e in entries]  # no mark: the fields of before
        atomic_write(self.index_path, (json.dumps(rows, indent=2) + "\n").encode())

    def _marked(self, entries: list[HistoryEntry], position: int | None, target: HistoryEntry) -> list[HistoryEntry]:
        """The history once ``target`` is active: when it is older than the version left, that version and every one
        between them marked as rolled back from (an operator who goes back from v4 to v2 withdraws v3 too), and
        ``target``'s own mark cleared."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        first = entries.index(target)
        withdrawn = range(first + 1, position + 1) if position is not None and first < position else range(0)
        return [replace(e, rolled_back_at=now) if i in withdrawn and e.rolled_back_at is None
                else replace(e, rolled_back_at=None) if i == first else e for i, e in enumerate(entries)]

    def _remove_unlisted(self, entries: list[HistoryEntry]) -> None:
        """Delete kept bundles no longer in the index: the pruned ones and any orphan of a crash."""
        listed = {e.file_name for e in entries}
        removed = False
        for path in self.history_dir.glob("*" + BUNDLE_SUFFIX):
            if path.name not in listed:
                try:
                    path.unlink()
                    removed = True
                    log.debug("pruned %s", path)
                except OSError as exc:
                    log.warning("cannot prune %s: %s", path, exc)
        if removed:
            fsync_dir(self.history_dir)

    def _sweep_stale_tmp(self) -> None:
        """Remove temp files that a killed writer left behind (a live writer's is seconds old)."""
        cutoff = time.time() - STALE_TMP_S
        for directory in (self.directory, self.history_dir, self.pending_path.parent, self.canary_path.parent):
            for path in directory.glob(TMP_PREFIX + "*") if directory.is_dir() else ():
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        log.warning("removed a stale temp file %s", path)
