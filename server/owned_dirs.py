"""Temporary directories that say whether their owner still runs, so a later run can remove an abandoned one.

``--workers`` keeps prometheus_client's multiprocess files in a directory of its own under the temp dir. A supervisor
that exits removes it; one killed outright (SIGKILL, an OOM kill) cannot, and the workers it leaves drain and exit
without knowing it is theirs to remove. Each such directory therefore holds ``OWNER_LOCK``, a file on which the
owner holds an exclusive ``flock`` from before the name appears until it exits. The lock belongs to the open file
description, which the workers inherit (``pass_fds``), so it is held while the supervisor *or any of its workers*
lives, and the kernel releases it when the last of them exits however it ends. A PID would not do: PIDs are reused,
and a process in another PID namespace sharing the temp dir (a container on the same node) has another number.

``sweep_abandoned`` removes the directories of this user, with this prefix, whose lock it can take: nobody holds it,
so nobody uses them. It takes only what ``owned_dir`` makes, and leaves alone:

- a directory without the lock file (made by an older version, or killed before its lock was in place: the lock
  file is renamed into place only once locked, so a sweep never takes a directory still being made);
- a link, another user's directory, one that others may write to (``mkdtemp`` makes ``0700``), and one whose lock is
  not a regular file of this user with one link (a planted FIFO would block the open, a planted file would look free);
- a directory holding a directory (``owned_dir``'s hold only files: prometheus_client's and the lock).

The directory is opened once, and its lock and its files are reached through that descriptor, so what is locked and
emptied is the directory that was checked even where others may rename entries of the temp dir (a Kubernetes
``emptyDir`` is ``0777`` without the sticky bit); only the final ``rmdir`` goes by name, and it removes nothing but
an empty directory.

It is for a local file system. On NFS the kernel emulates ``flock`` with POSIX locks, which belong to a process and
are not inherited, so a killed supervisor's draining workers would not hold the lock; a file system without locks
makes ``owned_dir`` return no lock (the directory is then never swept) and the sweep skip what it cannot lock. No
failure here stops a server from starting: the caller logs it and goes on.
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


def owned_dir(prefix: str) -> tuple[Path, int | None]:
    """A new directory under the temp dir and the descriptor of its lock, held until it and every copy are closed
    (None where the file system cannot lock: the directory works, a later sweep just never takes it)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        fd = os.open(path / _LOCKING, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else has opened: never blocks
    except OSError:
        os.close(fd)
        (path / _LOCKING).unlink()
        return path, None
    try:
        os.rename(path / _LOCKING, path / OWNER_LOCK)  # visible to a sweep only once held
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def _is_ours(info: os.stat_result, kind: int) -> bool:
    return stat.S_IFMT(info.st_mode) == kind and info.st_uid == os.getuid()


def sweep_abandoned(prefix: str, root: Path | None = None) -> list[Path]:
    """Remove this user's ``prefix*`` directories under ``root`` (default: the temp dir) whose owner lock is free."""
    base = Path(tempfile.gettempdir()) if root is None else root
    return [path for path in sorted(base.glob(f"{prefix}*")) if _removed_if_abandoned(path)]


def _removed_if_abandoned(path: Path) -> bool:
    with contextlib.ExitStack() as opened:
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # a link, a file, gone
        opened.callback(os.close, dir_fd)
        info = os.fstat(dir_fd)
        if not _is_ours(info, stat.S_IFDIR) or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            return False  # another user's, or one others may write to: not ours to judge
        try:
            fd = os.open(OWNER_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False  # no lock file (not made by owned_dir, or already being removed), a link, not ours
        opened.callback(os.close, fd)
        lock = os.fstat(fd)
        if not _is_ours(lock, stat.S_IFREG) or lock.st_nlink != 1:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held (its owner or one of its workers still runs), or a file system that cannot say
        if not _emptied(dir_fd):
            return False
        with contextlib.suppress(OSError):
            os.rmdir(path)  # by name: empty, or it fails (renamed meanwhile: a directory with files stays)
        return not os.path.lexists(path)


def _emptied(dir_fd: int) -> bool:
    """Unlink the files of the directory open at ``dir_fd``; False (nothing unlinked) if it holds a directory."""
    try:
        names = os.listdir(dir_fd)
        if any(stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode) for name in names):
            return False
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True
