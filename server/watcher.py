"""The weights watcher: sees the active bundle change on the volume and loads it off the hot path.

A ``stat`` poll (inode, size, mtime, ctime) is the source of truth, so a volume where inotify never
fires (NFS, a file written from another node) still works; a watchdog observer on the
directory only wakes the poll sooner. ``os.stat`` follows symlinks, so the Kubernetes
ConfigMap pattern (a ``..data`` symlink swapped under a stable name) is seen as a change too.

On a change the watcher waits until the file has been still for the debounce time (a
burst of publishes loads only the last), then reads, validates and warms up a new
``ModelSet`` on its own thread and hands it to ``on_loaded``; the server swaps one
reference. A rejected file is reported and not retried until it changes again (a ``chmod``
changes its ctime), except when the reason may pass by itself (``RETRIED``: a read error of a
regular file, such as an NFS hiccup, or the validating process's time or memory on a busy node):
then it is tried again after ``RETRY_FIRST_S``, twice as long after each failure, ``RETRY_TRIES``
times (about five minutes in all; a bundle too heavy for the limits is not validated forever). A
deleted file leaves the current model serving, and is reported to ``on_missing`` (the server's watchers: the canary's
ends the canary; both clear the file's ``shopping_agent_weights_refused``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weights.bundle import BundleError

log = logging.getLogger(__name__)

Signature = tuple[int, int, int, int]
RETRIED = frozenset({"io", "limits"})
"""Rejection reasons that can pass without the file changing: tried again after a back-off."""
RETRY_FIRST_S = 5.0
RETRY_TRIES = 6  # after 5, 10, 20, 40, 80 and 160 s


def signature(path: Path) -> Signature | None:
    """(inode, size, mtime_ns, ctime_ns) of what ``path`` resolves to, or None when it is absent. The ctime moves
    on a ``chmod`` or ``chown`` too, so a file refused as unreadable is read again once its mode is mended. A name that
    cannot be resolved for another cause (a link loop, ELOOP; a directory it may not search, EACCES) is there but
    unreadable: ``(-1, -1, -1, errno)``, which its load refuses as ``io`` (an attack review, 2026-12-06: a link to
    itself raised here, and the server started with no model and logged a traceback every second)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return (-1, -1, -1, exc.errno or 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WeightsWatcher:
    def __init__(self, path: Path, load: Callable[[Path], Any], on_loaded: Callable[[Any, float], None],
                 on_rejected: Callable[[BundleError, float], None], poll_interval_s: float = 1.0,
                 debounce_s: float = 0.05, use_inotify: bool = True, seen: Signature | None = None,
                 on_missing: Callable[[], None] | None = None, rejected: BundleError | None = None,
                 retry_first_s: float = RETRY_FIRST_S, retry_tries: int = RETRY_TRIES) -> None:
        """``seen``: the signature of the file already loaded (or refused) at start; ``rejected``: why it was refused,
        so that a refusal that may pass is retried as one seen here is."""
        self.path = path
        self._on_missing = on_missing
        self._load = load
        self._on_loaded = on_loaded
        self._on_rejected = on_rejected
        self._poll_interval_s = poll_interval_s
        self._debounce_s = debounce_s
        self._use_inotify = use_inotify
        self._seen = seen
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weights-watcher-{path.name}", daemon=True)
        self._observer: Any = None
        self._retry_at: float | None = None
        self._retry_first_s, self._retry_tries = retry_first_s, retry_tries
        self._retry_s, self._retries_left = retry_first_s, retry_tries
        if rejected is not None:
            self._schedule_retry(rejected)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)
        self._stop_observer()

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self._poll_interval_s
            try:
                if self._use_inotify and self._observer is None:
                    self._start_observer()
                current = signature(self.path)
                if current != self._seen or (self._retry_at is not None and time.monotonic() >= self._retry_at):
                    self._changed(current)
                if self._retry_at is not None:
                    wait = max(0.0, min(wait, self._retry_at - time.monotonic()))
            except Exception:  # ESTALE on NFS, a permission error, a bug: keep polling (a poll apart), never die silently
                log.exception("weights watcher error; polling on", extra={"fields": {"path": str(self.path)}})
            self._wake.wait(wait)
            self._wake.clear()

    def _changed(self, current: Signature | None) -> None:
        # Debounce: wait until the file stops changing, so a burst loads only its last bundle.
        while not self._stop.is_set():
            self._stop.wait(self._debounce_s)
            settled = signature(self.path)
            if settled == current:
                break
            current = settled
        if current != self._seen:  # a new file starts a new back-off
            self._reset_retries()
        self._seen, self._retry_at = current, None
        if current is None:
            if self._on_missing is not None:
                self._on_missing()
            else:
                log.warning("the active bundle is missing; the current model keeps serving", extra={"fields": {"path": str(self.path)}})
            return
        started = time.perf_counter()
        try:
            model = self._load(self.path)
        except BundleError as exc:
            log.error("bundle rejected; the current model keeps serving",
                      extra={"fields": {"path": str(self.path), "reason": exc.reason, "error": str(exc)}})
            self._on_rejected(exc, time.perf_counter() - started)
            self._schedule_retry(exc)
            return
        self._reset_retries()
        self._on_loaded(model, time.perf_counter() - started)

    def _reset_retries(self) -> None:
        self._retry_s, self._retries_left = self._retry_first_s, self._retry_tries

    def _schedule_retry(self, exc: BundleError) -> None:
        if exc.reason not in RETRIED or self._retries_left == 0 or not self._regular():
            return
        self._retry_at = time.monotonic() + self._retry_s
        log.info("the bundle will be read again", extra={"fields": {"path": str(self.path), "in_s": self._retry_s}})
        self._retry_s, self._retries_left = 2 * self._retry_s, self._retries_left - 1

    def _regular(self) -> bool:
        """Whether the path is a regular file (a FIFO, a device or a directory stays what it is: not worth a retry);
        True when even ``stat`` fails, which is the kind of error that passes."""
        try:
            return stat.S_ISREG(os.stat(self.path).st_mode)
        except OSError:
            return True

    def _start_observer(self) -> None:
        if not self.path.parent.is_dir():
            return
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        wake = self._wake

        class Wake(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                wake.set()

        observer = Observer()
        try:
            observer.schedule(Wake(), str(self.path.parent), recursive=False)
            observer.start()
        except OSError as exc:  # e.g. inotify limits: the poll still works
            log.warning("inotify unavailable; polling only", extra={"fields": {"error": str(exc)}})
            self._use_inotify = False
            return
        self._observer = observer

    def _stop_observer(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(5)
            self._observer = None
