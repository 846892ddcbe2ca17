"""Reading a file that someone else put there: a regular file, within a size, never waiting on a writer.

Bundles on the weights volume, the store's own files beside them, certificate files: each may be replaced by
anything (a FIFO, a link to ``/dev/zero``, a directory, a huge file). The file is opened non-blocking (a FIFO does not
wait for a writer) and checked with ``fstat`` on the open descriptor, so a file swapped in between the check and the
read cannot slip past; at most ``limit`` + 1 bytes are read, so a file that grows while it is read is caught too.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Literal


class UnreadableFile(Exception):
    """Why a file was not read: ``reason`` ``io`` (it cannot be opened or read, or is not a regular file) or ``size``."""

    def __init__(self, reason: Literal["io", "size"], detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def open_regular(path: Path | str, follow_link: bool = True) -> int:
    """A descriptor of the regular file at ``path``, opened for reading without waiting on a writer; ``OSError`` as
    ``os.open`` raises it (``FileNotFoundError`` for no file), ``UnreadableFile`` (``io``) for anything but a regular
    file, checked on the open descriptor, and with ``follow_link`` false for a symbolic link at the path's last step."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_link else os.O_NOFOLLOW))
    except OSError as exc:
        if follow_link or exc.errno != errno.ELOOP:
            raise
        raise UnreadableFile("io", "a symbolic link") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise UnreadableFile("io", "not a regular file")
    return fd


def read_bounded(path: Path | str, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them; ``UnreadableFile`` otherwise."""
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise UnreadableFile("io", exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise UnreadableFile("size", f"the file is {info.st_size} bytes, more than the {limit}-byte limit")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UnreadableFile("io", exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile("size", f"the file grew past the {limit}-byte limit while being read")
    return data
