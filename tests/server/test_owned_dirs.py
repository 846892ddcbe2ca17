"""Temporary directories whose owner lock says whether anyone still uses them (server.owned_dirs): real processes,
real flock, real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from server.owned_dirs import OWNER_LOCK, owned_dir, sweep_abandoned
from tests.harness import ROOT, threads_gone, until

PREFIX = "sa-test-"
# Makes an owned directory, prints it, and with "hand" passes its lock to a child that outlives it (a worker).
_OWNER = """
import subprocess, sys, time
from server.owned_dirs import owned_dir
path, fd = owned_dir(sys.argv[1])
if sys.argv[2] == "hand":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(fd,))
    print(child.pid, flush=True)
print(path, flush=True)
time.sleep(60)
"""


def _owner(tmp: Path, hand: bool = False) -> tuple[subprocess.Popen[str], Path, int | None]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, PREFIX, "hand" if hand else "keep"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, cwd=ROOT)
    assert proc.stdout is not None
    child = int(proc.stdout.readline()) if hand else None
    return proc, Path(proc.stdout.readline().strip()), child


def _killed(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def _gone(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    until(lambda: threads_gone(pid), f"process {pid} to exit")


def test_an_owned_directory_holds_its_lock_from_before_its_name_appears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path, fd = owned_dir(PREFIX)
    try:
        assert path.parent == tmp_path and path.name.startswith(PREFIX)
        assert sorted(p.name for p in path.iterdir()) == [OWNER_LOCK]  # the lock under its final name only
        assert sweep_abandoned(PREFIX, tmp_path) == [] and path.is_dir()  # held by this process
    finally:
        os.close(fd)
    assert sweep_abandoned(PREFIX, tmp_path) == [path] and not path.exists()  # released: abandoned


def test_a_killed_owners_directory_is_removed_once_nobody_it_handed_the_lock_to_runs(tmp_path: Path) -> None:
    alive, alive_dir, _ = _owner(tmp_path)
    dead, dead_dir, _ = _owner(tmp_path)
    handed, handed_dir, worker = _owner(tmp_path, hand=True)
    assert worker is not None
    try:
        _killed(dead)
        _killed(handed)  # its worker still runs, with the lock's description
        legacy = tmp_path / f"{PREFIX}legacy"  # an older version's: no lock file
        legacy.mkdir()
        other = tmp_path / "not-ours-dir"  # another prefix, its lock free
        other.mkdir()
        (other / OWNER_LOCK).touch()
        link = tmp_path / f"{PREFIX}link"
        link.symlink_to(dead_dir)
        assert sweep_abandoned(PREFIX, tmp_path) == [dead_dir]
        assert not dead_dir.exists()
        assert alive_dir.is_dir() and handed_dir.is_dir() and legacy.is_dir() and other.is_dir() and link.is_symlink()
        _gone(worker)
        assert sweep_abandoned(PREFIX, tmp_path) == [handed_dir]
        assert alive_dir.is_dir()
    finally:
        _killed(alive)
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert sweep_abandoned(PREFIX, tmp_path) == [alive_dir]


def _abandoned(base: Path, name: str) -> Path:
    """A directory as owned_dir leaves it once its owner is gone: 0700, a free lock file."""
    path = base / name
    path.mkdir(mode=0o700)
    (path / OWNER_LOCK).touch(mode=0o600)
    return path


def test_only_what_owned_dir_makes_is_swept_and_nothing_planted_blocks_or_fools_it(tmp_path: Path) -> None:
    """A FIFO for a lock would block a plain open (the sweep, and the server's start, would hang); a lock that is a link,
    a hard link, or in a directory others may write to could be planted by another user: each is left alone."""
    plain = _abandoned(tmp_path, f"{PREFIX}plain")
    fifo = tmp_path / f"{PREFIX}fifo"
    fifo.mkdir(mode=0o700)
    os.mkfifo(fifo / OWNER_LOCK, 0o600)
    linked = tmp_path / f"{PREFIX}linked"
    linked.mkdir(mode=0o700)
    (tmp_path / "target").touch(mode=0o600)  # a free lock of this user's, one link: only the link itself is wrong
    (linked / OWNER_LOCK).symlink_to(tmp_path / "target")
    (tmp_path / "elsewhere").touch(mode=0o600)
    hard = tmp_path / f"{PREFIX}hard"
    hard.mkdir(mode=0o700)
    os.link(tmp_path / "elsewhere", hard / OWNER_LOCK)
    shared = _abandoned(tmp_path, f"{PREFIX}shared")
    shared.chmod(0o777)
    assert sweep_abandoned(PREFIX, tmp_path) == [plain]
    assert fifo.is_dir() and linked.is_dir() and hard.is_dir() and shared.is_dir()


def test_a_temp_dir_anyone_may_write_to_is_swept_through_the_checked_directory(tmp_path: Path) -> None:
    """A Kubernetes emptyDir is 0777 without the sticky bit (the pod's /tmp): the sweep must work there, and it reaches
    the lock and the files through the directory it opened, so a rename of the name cannot redirect what it empties.
    A directory holding a directory is not one owned_dir made: left whole."""
    base = tmp_path / "tmp"
    base.mkdir()
    base.chmod(0o777)
    abandoned = _abandoned(base, f"{PREFIX}x")
    for n in (1, 2):
        (abandoned / f"counter_{n}.db").write_bytes(b"\0" * 64)
    nested = _abandoned(base, f"{PREFIX}nested")
    (nested / "inner").mkdir()
    (nested / "counter_3.db").write_bytes(b"\0")
    assert sweep_abandoned(PREFIX, base) == [abandoned]
    assert not abandoned.exists()
    assert sorted(p.name for p in nested.iterdir()) == ["counter_3.db", "inner", OWNER_LOCK]


def test_a_file_system_that_cannot_lock_gets_a_directory_without_a_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked: a file system without flock (some FUSE and network ones) cannot be had here. The directory still works;
    a later sweep never takes it."""
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    path, fd = owned_dir(PREFIX)
    assert fd is None and path.is_dir() and list(path.iterdir()) == []
    assert sweep_abandoned(PREFIX, tmp_path) == [] and path.is_dir()
