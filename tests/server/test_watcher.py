"""The weights watcher on a real file: what it reads again without a change, and what it leaves alone.

A read error that passes by itself (an NFS hiccup, a validating process starved on a busy node) cannot be made on
this machine without changing the file, and the tests run as root, for whom a ``chmod`` does not make a file
unreadable. So the loader here is the real ``read_bundle`` on a real file, failing its first calls with the reason
such an error gives: that failure is the one simulated part.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.watcher import RETRIED, WeightsWatcher, signature
from tests.harness import until
from weights.bundle import Bundle, BundleError, read_bundle
from weights.embedded import default_bundle_bytes

FIRST_S = 0.2  # the watcher's first back-off in these tests (5 s in a server)


class Loader:
    """``read_bundle`` on the file, failing the first ``failures`` calls with ``reason``; every call's time kept."""

    def __init__(self, failures: int, reason: str) -> None:
        self.failures, self.reason = failures, reason
        self.calls: list[float] = []
        self.loaded = threading.Event()
        self.rejected: list[str] = []

    def __call__(self, path: Path) -> Bundle:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise BundleError(self.reason, f"cannot read bundle {path}: simulated")
        return read_bundle(path)


@pytest.fixture
def active(tmp_path: Path) -> Path:
    path = tmp_path / "weights_active.bundle"
    path.write_bytes(default_bundle_bytes())
    return path


@contextlib.contextmanager
def watching(path: Path, loader: Loader, **kwargs: Any) -> Iterator[WeightsWatcher]:
    watcher = WeightsWatcher(path, load=loader, on_loaded=lambda model, s: loader.loaded.set(),
                             on_rejected=lambda exc, s: loader.rejected.append(exc.reason), poll_interval_s=0.05,
                             debounce_s=0.001, use_inotify=False, retry_first_s=FIRST_S, **kwargs)
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop()


def test_a_chmod_changes_the_signature(active: Path) -> None:
    before = signature(active)
    for mode in (0o600, 0o640):  # a second chmod a second later, for file systems whose ctime ticks in seconds
        os.chmod(active, mode)
        if signature(active) != before:
            break
        time.sleep(1.1)
    assert signature(active) != before


@pytest.mark.parametrize("reason", sorted(RETRIED))
def test_a_refusal_that_may_pass_is_read_again_without_a_change(active: Path, reason: str) -> None:
    loader = Loader(failures=2, reason=reason)
    seen = signature(active)
    with watching(active, loader):
        assert loader.loaded.wait(10), "the file was never read again"
    assert signature(active) == seen  # nothing changed on disk
    assert loader.rejected == [reason, reason] and len(loader.calls) == 3
    first, second = loader.calls[1] - loader.calls[0], loader.calls[2] - loader.calls[1]
    assert first >= FIRST_S and second >= 2 * FIRST_S  # a back-off that doubles


def test_a_refusal_for_the_bundle_itself_is_not_read_again(active: Path) -> None:
    loader = Loader(failures=1, reason="schema")
    with watching(active, loader):
        until(lambda: loader.rejected == ["schema"])
        time.sleep(4 * FIRST_S)  # past several back-offs: still one read
        assert len(loader.calls) == 1 and not loader.loaded.is_set()
        active.write_bytes(active.read_bytes())  # a new write is a change: read again
        assert loader.loaded.wait(10)


def test_a_refusal_at_start_that_may_pass_is_read_again(active: Path) -> None:
    loader = Loader(failures=0, reason="io")  # the server's own start read it and was refused
    with watching(active, loader, seen=signature(active), rejected=BundleError("io", "at start: simulated")):
        assert loader.loaded.wait(10), "the file refused at start was never read again"
    assert len(loader.calls) == 1


def test_without_a_refusal_at_start_the_file_seen_is_not_read_again(active: Path) -> None:
    loader = Loader(failures=0, reason="io")
    with watching(active, loader, seen=signature(active)):
        time.sleep(4 * FIRST_S)
    assert loader.calls == []


def test_retries_stop_after_their_count_and_a_new_file_gets_its_own(active: Path) -> None:
    loader = Loader(failures=100, reason="limits")  # a bundle too heavy for the limits fails every time
    with watching(active, loader, retry_tries=2):
        until(lambda: len(loader.calls) == 3)  # the read, then two retries after 0.2 and 0.4 s
        time.sleep(8 * FIRST_S)  # past where a third retry would have come
        assert len(loader.calls) == 3
        active.write_bytes(active.read_bytes())  # the next publish: its refusal may pass too, so it is retried afresh
        until(lambda: len(loader.calls) == 6, "the new file's read and its two retries")
        time.sleep(8 * FIRST_S)
        assert len(loader.calls) == 6
    assert loader.calls[4] - loader.calls[3] >= FIRST_S and loader.calls[5] - loader.calls[4] >= 2 * FIRST_S


def test_a_fifo_refused_as_unreadable_is_not_read_again(tmp_path: Path) -> None:
    path = tmp_path / "weights_active.bundle"
    os.mkfifo(path)
    loader = Loader(failures=0, reason="io")  # read_bundle itself refuses it: not a regular file
    with watching(path, loader):
        until(lambda: loader.calls != [])
        time.sleep(4 * FIRST_S)
    assert len(loader.calls) == 1 and loader.rejected == ["io"]  # read_bundle's own refusal, not retried


def test_a_name_stat_cannot_resolve_while_a_retry_is_due_is_refused_without_spinning(active: Path,
                                                                                     caplog: pytest.LogCaptureFixture) -> None:
    loader = Loader(failures=1, reason="io")
    with caplog.at_level(logging.ERROR, logger="server.watcher"), watching(active, loader):
        until(lambda: loader.rejected == ["io"])  # a retry is scheduled FIRST_S on
        active.unlink()
        active.symlink_to(active.name)  # a link to itself: stat raises ELOOP, as it raises ESTALE or EIO on a bad volume
        time.sleep(1.0)  # the retry falls due in here
    # It once raised in the watcher's stat (an error logged each poll); now the name is a file that cannot be read.
    assert not [r for r in caplog.records if r.getMessage().startswith("weights watcher error")]
    # read on the change, then again on the retries' doubling back-off from FIRST_S: not once a poll (20 a second)
    assert loader.rejected[-1] == "io" and len(loader.calls) <= 6
