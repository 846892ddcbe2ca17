"""A real small file system for the disk-full tests: a 1 MiB tmpfs, mounted for the test and filled on demand.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused the tests that need it skip and say
why. No fake: the kernel's own ENOSPC, short writes included.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallDisk:
    """A tmpfs of ``size`` bytes at ``path``; ``fill()`` takes every free byte, ``free()`` gives them back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / "filler"

    def fill(self) -> None:
        chunk = b"\0" * 4096
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            for size in (512, 64, 1):  # the last partial page too
                try:
                    while True:
                        os.write(fd, chunk[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def is_full(self) -> bool:
        stat = os.statvfs(self.path)
        return stat.f_bavail == 0


def mounted(tmp_path: Path, size: str = "1m", mount_point: Path | None = None) -> Iterator[SmallDisk]:
    """A tmpfs of ``size`` (1 MiB) at ``mount_point`` (``tmp_path/small-disk``, made if missing) for the length of a
    test (the body of a fixture)."""
    mount_point = mount_point or tmp_path / "small-disk"
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield SmallDisk(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)
