"""The log salt: the key of every hash in the logs (ids, session sampling).

Configured (``--log-user-salt``, from a Secret in the manifests), the key is derived from it
and nothing is written. Unconfigured, for local runs, a random salt is kept in
``LOG_DIR/.user-salt`` and shared by every writer on that directory: then the key lies next
to the logs it protects, so each start warns.

The file is created whole or not at all: the salt goes into a temp file in the same
directory, is fsynced, and is published with ``link``, which fails when the name exists,
so of two writers creating it at once one wins and both read the winner's salt. An empty
file (an older version created it and crashed before writing, e.g. on a full disk) holds no
salt, so no hash was ever made with it: it is replaced, under an ``flock`` so that
concurrent starters replace it once. A file with anything else in it is refused with a
message that says what to do: this code never writes one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import secrets
import string
import time
from pathlib import Path

from core.files import UnreadableFile, read_bounded

log = logging.getLogger(__name__)

SALT_FILE = ".user-salt"
_TEMP_PREFIX = SALT_FILE + ".tmp-"
_STALE_TEMP_S = 60.0
_FILL_WAIT_S = 1.0  # an older writer between its O_EXCL create and its write
_MAX_SALT_FILE_BYTES = 4096  # a salt is 64 hex digits (and a newline); anything far larger is not one


class SaltError(ValueError):
    """The salt cannot be read or created; the message says why and what to do."""


def configured_salt(configured: str) -> bytes:
    """The 32-byte key derived from a configured salt string."""
    return hashlib.blake2b(configured.encode(), digest_size=32).digest()


def resolve_salt(root: Path, configured: str) -> bytes:
    """The configured salt's key, else the random salt kept in ``root/.user-salt`` (created once, atomically)."""
    if configured:
        return configured_salt(configured)
    path = Path(root) / SALT_FILE
    log.warning("no log salt configured (--log-user-salt, SHOPPING_AGENT_LOG_USER_SALT): the key of the hashes in the "
                "logs is kept on the logs volume itself, so whoever can read the logs can test guessed ids against "
                "them; set the salt from a Secret outside development", extra={"fields": {"path": str(path)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path.parent)
    for _ in range(10):  # each pass either returns or sees the file change under it
        text = _read(path)
        if text is None:
            _publish(path)
        elif text:
            return _parse(path, text)
        elif not _filled_soon(path):
            _replace_empty(path)
    raise SaltError(f"{path}: kept changing while it was read; set --log-user-salt")


def read_salt(root: Path) -> bytes | None:
    """The salt in ``root/.user-salt`` if there is a valid one; never creates or changes anything (readers)."""
    try:
        text = _read(Path(root) / SALT_FILE)
        return _parse(Path(root) / SALT_FILE, text) if text else None
    except (SaltError, OSError):
        return None


def _read(path: Path) -> str | None:
    """The file's text; None when there is no file. Read without waiting on a writer: a FIFO in its place (the volume is
    shared) is refused, where a plain read would hang the start until a writer came."""
    try:
        data = read_bounded(path, _MAX_SALT_FILE_BYTES)
    except UnreadableFile as exc:
        if not os.path.exists(path):
            return None
        raise SaltError(f"{path}: cannot be read as the log salt ({exc}); remove it or set --log-user-salt") from None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SaltError(_foreign(path, len(data))) from None


def _parse(path: Path, text: str) -> bytes:
    if len(text) != 64 or not set(text) <= set(string.hexdigits):
        raise SaltError(_foreign(path, len(text)))
    return bytes.fromhex(text)


def _foreign(path: Path, size: int) -> str:
    return (f"{path}: not a 64-hex-digit salt ({size} bytes), and not one this server wrote (it writes the file whole); "
            "put the right salt back, or set --log-user-salt, or remove the file (hashes logged so far will not match "
            "new ones)")


def _new_temp(path: Path) -> Path:
    """A fsynced temp file next to ``path`` holding a fresh random salt."""
    temp = path.with_name(f"{_TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = secrets.token_hex(32).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a 64-byte write is cut short only by a full disk
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise SaltError(f"cannot create the log salt file {path}: {exc.strerror or exc}; free space on the logs volume "
                        "or set --log-user-salt") from None
    return temp


def _publish(path: Path) -> None:
    """Create ``path`` whole, unless another writer got there first (then its salt is the one)."""
    temp = _new_temp(path)
    try:
        os.link(temp, path)
    except FileExistsError:
        return
    except OSError as exc:
        raise SaltError(f"cannot create the log salt file {path} atomically ({exc.strerror or exc}: the volume needs hard "
                        "links); set --log-user-salt") from None
    finally:
        temp.unlink(missing_ok=True)
    _sync_dir(path)
    log.warning("created a random log salt", extra={"fields": {"path": str(path)}})


def _filled_soon(path: Path) -> bool:
    """Whether an empty ``path`` gets content (or goes away) within a moment: an older writer mid-create."""
    deadline = time.monotonic() + _FILL_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.02)
        text = _read(path)
        if text is None or text:
            return True
    return False


def _replace_empty(path: Path) -> None:
    """Replace an empty ``path`` with a fresh salt, once, however many writers try at the same time."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino) or mine.st_size:
            return  # replaced or written meanwhile: read it again
        temp = _new_temp(path)
        try:
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
        _sync_dir(path)
        log.warning("replaced an empty log salt file (left by a crash before its salt was written, so no hash used it)",
                    extra={"fields": {"path": str(path)}})
    finally:
        os.close(fd)


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise SaltError(f"cannot make the log salt file {path} durable: {exc.strerror or exc}") from None


def _remove_stale_temps(directory: Path) -> None:
    """Temp salts of writers killed between writing and publishing them (never used)."""
    for temp in directory.glob(_TEMP_PREFIX + "*"):
        try:
            if time.time() - temp.stat().st_mtime > _STALE_TEMP_S:
                temp.unlink()
        except FileNotFoundError:
            continue
