"""The log salt file: created whole and once, agreed on by concurrent creators, never bricked by an empty leftover."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experience.salt import SALT_FILE, SaltError, configured_salt, read_salt, resolve_salt
from tests.harness import ROOT, promptly, spawn_server
from tests.small_disk import SmallDisk

_RESOLVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from experience.salt import resolve_salt
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
print(resolve_salt(Path(sys.argv[1]), "").hex(), flush=True)
"""


def resolve_at_once(root: Path, n: int) -> tuple[list[str], str]:
    """``resolve_salt`` in ``n`` processes let go at the same moment; each one's answer, and what they logged."""
    go = root.parent / f"go-{root.name}"
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(root), str(ROOT), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    time.sleep(1.0)  # all started and waiting
    go.touch()
    answers, logged = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        answers.append(out.strip())
        logged.append(err)
    return answers, "".join(logged)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(SALT_FILE) and p.name != SALT_FILE)


def test_created_once_private_and_stable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = resolve_salt(tmp_path, "")
    assert len(first) == 32 and resolve_salt(tmp_path, "") == first
    path = tmp_path / SALT_FILE
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text()) == 64
    assert not leftovers(tmp_path)  # the temp file it was written to is gone
    assert resolve_salt(tmp_path, "configured") == configured_salt("configured") != first
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "no log salt configured" in r.getMessage()]
    assert len(warnings) == 2  # every start without a configured salt says where the key lies


def test_a_configured_salt_writes_nothing(tmp_path: Path) -> None:
    resolve_salt(tmp_path / "logs", "from-a-secret")
    assert not (tmp_path / "logs").exists()


def test_concurrent_creators_agree(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    root.mkdir()
    answers, logged = resolve_at_once(root, 8)
    assert len(set(answers)) == 1 and len(answers[0]) == 64
    assert logged.count("created a random log salt") == 1  # one won the link; the others read its salt
    assert (root / SALT_FILE).read_text() == answers[0]
    assert not leftovers(root)


def test_an_empty_salt_file_left_by_a_crash_is_replaced_once(tmp_path: Path) -> None:
    """An older version created the file, then crashed before writing (a full disk): no hash was made with it."""
    root = tmp_path / "logs"
    root.mkdir()
    (root / SALT_FILE).write_bytes(b"")
    answers, logged = resolve_at_once(root, 6)  # several replicas restart at once: one replaces it, all agree
    assert len(set(answers)) == 1 and (root / SALT_FILE).read_text() == answers[0]
    assert logged.count("replaced an empty log salt file") == 1
    assert resolve_salt(root, "").hex() == answers[0]  # and the next restart keeps it
    assert not leftovers(root)


def test_a_file_with_something_else_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / SALT_FILE
    path.write_text("0123abcd")  # not ours: this code writes the file whole
    with pytest.raises(SaltError, match=r"not a 64-hex-digit salt \(8 bytes\).*set --log-user-salt"):
        resolve_salt(tmp_path, "")
    assert path.read_text() == "0123abcd"  # left for a person to decide
    assert read_salt(tmp_path) is None


def test_a_fifo_in_place_of_the_salt_is_refused_without_waiting(tmp_path: Path) -> None:
    """The logs volume is shared: a FIFO named .user-salt hung the server's start in a read until a writer came."""
    path = tmp_path / SALT_FILE
    os.mkfifo(path)
    with pytest.raises(SaltError, match=r"\.user-salt: cannot be read as the log salt \(not a regular file\)"):
        promptly(lambda: resolve_salt(tmp_path, ""), fifo=path)
    assert promptly(lambda: read_salt(tmp_path), fifo=path) is None


def test_sixty_four_characters_that_are_not_hex_are_no_salt(tmp_path: Path) -> None:
    (tmp_path / SALT_FILE).write_text("z" * 64)
    with pytest.raises(SaltError, match=r"not a 64-hex-digit salt \(64 bytes\)"):
        resolve_salt(tmp_path, "")
    assert read_salt(tmp_path) is None


def test_readers_never_create(tmp_path: Path) -> None:
    assert read_salt(tmp_path) is None and not list(tmp_path.iterdir())
    salt = resolve_salt(tmp_path, "")
    assert read_salt(tmp_path) == salt


def test_stale_temp_files_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"{SALT_FILE}.tmp-1-deadbeef"  # a creator killed between writing and publishing
    stale.write_text("f" * 64)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    young = tmp_path / f"{SALT_FILE}.tmp-2-cafebabe"  # may be a creator at work right now
    young.write_text("e" * 64)
    resolve_salt(tmp_path, "")
    assert not stale.exists() and young.exists()


def test_full_disk_fails_clearly_and_leaves_nothing_behind(small_disk: SmallDisk) -> None:
    root = small_disk.path / "logs"
    root.mkdir()
    small_disk.fill()
    with pytest.raises(SaltError, match="free space on the logs volume or set --log-user-salt"):
        resolve_salt(root, "")
    assert list(root.iterdir()) == []  # no empty salt file to brick the next start
    small_disk.free()
    salt = resolve_salt(root, "")  # space is back: the next start just works
    assert resolve_salt(root, "") == salt


def test_a_server_on_a_full_disk_without_a_salt_can_start_once_there_is_room(small_disk: SmallDisk) -> None:
    root = small_disk.path / "logs"
    root.mkdir()
    small_disk.fill()
    cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", "0", "--no-metrics", "--log-dir", str(root)]
    env = {k: v for k, v in os.environ.items() if k != "SHOPPING_AGENT_LOG_USER_SALT"}
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert failed.returncode != 0 and "free space on the logs volume or set --log-user-salt" in failed.stderr
    assert not (root / SALT_FILE).exists()
    small_disk.free()
    with spawn_server("--log-dir", str(root), env=env) as server:
        assert server.proc.poll() is None
    assert read_salt(root) is not None
