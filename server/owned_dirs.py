"""Temporary directories that say whether their owner still runs, so a later run can remove an abandoned one.

``--workers`` keeps prometheus_client's multiprocess files in a directory of its own under the temp dir. A supervisor
that exits removes it; one killed outright (SIGKILL, an OOM kill) cannot, and the workers it leaves drain and exit
without knowing it is theirs to remove. Each such directory therefore holds ``OWNER_LOCK``, a file on which the
owner holds an exclusive ``flock`` from before the name appears until it exits. The lock belongs to the open file
description, which the workers inherit (``pass_fds``), so it is held while the supervisor *or any of its workers*
lives, and the kernel releases it when the last of them exits however it ends. A PID would not do: PIDs are reused,
and a process in another PID namespace sharing the temp dir (a container on the same node) has another number.

``sweep_abandoned`` removes the directories of this user, with this prefix, whose lock it can take: nobody holds it,
so nobody uses them. A directory without the lock file (made by an older version, or not by this code) is left alone,
and the lock file is renamed into place only once locked, so a sweep never takes a directory still being made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

OWNER_LOCK = "owner.lock"
_LOCKING = ".owner.lock.new"


def owned_dir(prefix: str) -> tuple[Path, int]:
    """A new directory under the temp dir and the descriptor of its lock, held until it and every copy are closed."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        fd = os.open(path / _LOCKING, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else has opened: never blocks
        os.rename(path / _LOCKING, path / OWNER_LOCK)  # visible to a sweep only once held
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def sweep_abandoned(prefix: str, root: Path | None = None) -> list[Path]:
    """Remove this user's ``prefix*`` directories under ``root`` (default: the temp dir) whose owner lock is free."""
    base = Path(tempfile.gettempdir()) if root is None else root
    removed: list[Path] = []
    try:
        candidates = sorted(base.glob(f"{prefix}*"))
    except OSError:
        return removed
    for path in candidates:
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue  # a link, a file, or another user's: not ours to judge
        try:
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file: not made by owned_dir, or already being removed
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner or one of its workers still runs
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed
