"""The store on the weights volume: real files, real renames, real locks, in a temporary directory."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness import promptly, trainer_in_process, variant_bytes
from weights import store as store_module
from weights.bundle import Bundle, BundleError, npy_bytes, read_bundle, sha256
from weights.initial import make_bundle
from weights.store import ACTIVE_NAME, HISTORY_DIR, INDEX_NAME, STALE_TMP_S, StoreError, WeightsStore, check_version_name
from weights.validate import verify as verify_in_child

verify = partial(verify_in_child, limits=None)  # in-process: these tests are about the store, not the sandbox

CREATED = "2026-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def bundles() -> dict[str, bytes]:
    """Four valid bundles, v1..v4, built once (each takes ~0.1 s)."""
    return {f"v{seed}": make_bundle(seed, f"v{seed}", CREATED) for seed in range(1, 5)}


@pytest.fixture
def store(tmp_path: Path) -> WeightsStore:
    return WeightsStore(tmp_path / "pv", verify)


@pytest.fixture
def put(tmp_path: Path) -> Callable[[bytes], Path]:
    """Write bundle bytes to a fresh file outside the store (where a trainer would leave it)."""
    counter = iter(range(1_000_000))

    def write(data: bytes) -> Path:
        path = tmp_path / f"candidate-{next(counter)}.bundle"
        path.write_bytes(data)
        return path

    return write


def snapshot(store: WeightsStore) -> dict[str, Any]:
    """Everything a publish could change: the active file's bytes and inode, the history's files."""
    active = store.active_path
    history = store.directory / HISTORY_DIR
    return {
        "active": (active.read_bytes(), active.stat().st_ino) if active.exists() else None,
        "history": {p.name: p.read_bytes() for p in sorted(history.iterdir())} if history.exists() else None,
    }


def temp_files(store: WeightsStore) -> list[Path]:
    return sorted(store.directory.rglob(".tmp-*"))


def versions(store: WeightsStore) -> list[str]:
    return [e.model_version for e in store.history()]


# --- publish -----------------------------------------------------------------------------------


def test_publish_makes_the_active_file_the_bundle_and_records_it(store: WeightsStore, bundles: dict[str, bytes],
                                                                  put: Callable[[bytes], Path]) -> None:
    result = store.publish(put(bundles["v1"]))
    assert (result.status, result.model_version, result.previous) == ("published", "v1", None)
    assert (store.directory / ACTIVE_NAME).read_bytes() == bundles["v1"]
    assert (store.directory / HISTORY_DIR / "v1.bundle").read_bytes() == bundles["v1"]
    [entry] = json.loads((store.directory / HISTORY_DIR / INDEX_NAME).read_text())
    assert entry["model_version"] == "v1" and entry["sha256"] == result.sha256 == store.active_sha256()
    assert abs(datetime.fromisoformat(entry["published_at"]).timestamp() - time.time()) < 60
    assert store.active() == read_bundle(bundles["v1"]).manifest
    assert temp_files(store) == []

    result = store.publish(put(bundles["v2"]))
    assert (result.status, result.model_version, result.previous) == ("published", "v2", "v1")
    assert store.active_path.read_bytes() == bundles["v2"]
    assert versions(store) == ["v1", "v2"]


def test_publishing_the_active_bundle_again_changes_nothing(store: WeightsStore, bundles: dict[str, bytes],
                                                             put: Callable[[bytes], Path]) -> None:
    store.publish(put(bundles["v1"]))
    before = snapshot(store)
    result = store.publish(put(bundles["v1"]))
    assert (result.status, result.model_version) == ("unchanged", "v1")
    assert snapshot(store) == before
    assert temp_files(store) == []


def truncated(data: bytes, **_: Any) -> bytes:
    return data[: len(data) // 2]


def flipped(data: bytes, **_: Any) -> bytes:
    out = bytearray(data)
    out[len(out) // 3] ^= 0xFF
    return bytes(out)


def nan_table(_: bytes, rebuild: Callable[..., bytes], default_bundle: Bundle, **__: Any) -> bytes:
    table = default_bundle.array("behavior_table.npy").copy()
    table[3, 5] = np.nan
    return rebuild(**{"behavior_table.npy": npy_bytes(table)})


def future_format(_: bytes, members: dict[str, bytes], raw_zip: Callable[[dict[str, bytes]], bytes], **__: Any) -> bytes:
    manifest = json.loads(members["manifest.json"])
    manifest["format_version"] = 99
    return raw_zip({**members, "manifest.json": json.dumps(manifest).encode()})


@pytest.mark.parametrize(("damage", "reasons"), [
    (truncated, {"format"}),
    (flipped, {"format", "checksum"}),
    (nan_table, {"nonfinite"}),
    (future_format, {"format_version"}),
])
def test_a_bad_bundle_never_touches_the_active_file_or_the_history(
        damage: Callable[..., bytes], reasons: set[str], store: WeightsStore, bundles: dict[str, bytes],
        put: Callable[[bytes], Path], rebuild: Callable[..., bytes], default_bundle: Bundle,
        members: dict[str, bytes], raw_zip: Callable[[dict[str, bytes]], bytes]) -> None:
    store.publish(put(bundles["v1"]))
    before = snapshot(store)
    bad = damage(bundles["v2"], rebuild=rebuild, default_bundle=default_bundle, members=members, raw_zip=raw_zip)
    with pytest.raises(BundleError) as info:
        store.publish(put(bad))
    assert info.value.reason in reasons
    assert snapshot(store) == before
    assert temp_files(store) == []


def test_a_missing_file_is_an_io_error(store: WeightsStore, tmp_path: Path) -> None:
    with pytest.raises(BundleError) as info:
        store.publish(tmp_path / "nope.bundle")
    assert info.value.reason == "io"
    assert not store.directory.exists()


def test_the_active_file_is_only_replaced_by_rename(store: WeightsStore, bundles: dict[str, bytes],
                                                    put: Callable[[bytes], Path]) -> None:
    store.publish(put(bundles["v1"]))
    with open(store.active_path, "rb") as reader:
        old_inode = os.fstat(reader.fileno()).st_ino
        head = reader.read(1000)
        store.publish(put(bundles["v2"]))
        assert store.active_path.stat().st_ino != old_inode
        assert head + reader.read() == bundles["v1"]  # the old file, whole, for whoever holds it open
    assert store.active_path.read_bytes() == bundles["v2"]


def test_a_model_version_is_immutable(store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    store.publish(put(bundles["v1"]))
    store.publish(put(bundles["v2"]))
    before = snapshot(store)
    with pytest.raises(StoreError) as info:
        store.publish(put(make_bundle(7, "v1", CREATED)))  # same version string, other weights
    assert info.value.reason == "immutable"
    assert "immutable" in str(info.value) and "v1" in str(info.value)
    assert snapshot(store) == before


def test_republishing_a_kept_version_activates_it_and_moves_it_last(store: WeightsStore, bundles: dict[str, bytes],
                                                                    put: Callable[[bytes], Path]) -> None:
    for v in ("v1", "v2"):
        store.publish(put(bundles[v]))
    result = store.publish(put(bundles["v1"]))
    assert (result.status, result.previous) == ("published", "v2")
    assert store.active_path.read_bytes() == bundles["v1"]
    assert versions(store) == ["v2", "v1"]


def test_a_publish_judged_against_another_active_bundle_is_refused(store: WeightsStore, bundles: dict[str, bytes],
                                                                    put: Callable[[bytes], Path]) -> None:
    """``replacing`` names the active bundle the caller judged against (a trainer run); once another is active (an
    operator's publish or rollback meanwhile), publishing would undo it unseen: refused, nothing touched."""
    with pytest.raises(StoreError) as info:  # judged against an active bundle that is gone
        store.publish(put(bundles["v1"]), replacing="0" * 64)
    assert info.value.reason == "moved" and not store.active_path.exists()
    assert store.publish(put(bundles["v1"]), replacing=None).status == "published"  # judged against none: none it is
    judged = store.active_sha256()
    store.publish(put(bundles["v2"]))  # the operator's, without replacing: whatever is active
    before = snapshot(store)
    for data in (bundles["v3"], bundles["v1"]):
        with pytest.raises(StoreError) as info:
            store.publish(put(data), replacing=judged)
        assert info.value.reason == "moved" and "changed" in str(info.value)
    assert snapshot(store) == before
    assert store.publish(put(bundles["v2"]), replacing=judged).status == "unchanged"  # what is active already: nothing to undo
    assert store.publish(put(bundles["v3"]), replacing=store.active_sha256()).status == "published"


def test_a_version_that_cannot_name_a_file_is_refused(store: WeightsStore, put: Callable[[bytes], Path]) -> None:
    with pytest.raises(BundleError) as info:  # the bundle itself is refused: no server would load it either
        store.publish(put(make_bundle(1, "../escape", CREATED)))
    assert info.value.reason == "schema" and "model_version" in str(info.value)
    assert not store.directory.exists()
    with pytest.raises(StoreError) as named:  # a version given by hand (weights CLI) is checked by the same rule
        check_version_name("../escape")
    assert named.value.reason == "version"


def test_keep_prunes_the_oldest_versions(tmp_path: Path, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    store = WeightsStore(tmp_path / "pv", verify, keep=2)
    for v in ("v1", "v2", "v3"):
        store.publish(put(bundles[v]))
    assert versions(store) == ["v2", "v3"]
    assert sorted(p.name for p in (store.directory / HISTORY_DIR).iterdir()) == [INDEX_NAME, "v2.bundle", "v3.bundle"]


def test_pruning_never_drops_the_active_version(tmp_path: Path, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    store = WeightsStore(tmp_path / "pv", verify, keep=2)
    for v in ("v1", "v2"):
        store.publish(put(bundles[v]))
    store.rollback()  # v1 active, the oldest; v2 marked as rolled back from
    store.publish(put(bundles["v3"]))  # v1 was active while v3 was written: kept; v2, rolled back from, pruned first
    assert versions(store) == ["v1", "v3"]
    store.publish(put(bundles["v4"]))
    assert versions(store) == ["v3", "v4"]
    assert not (store.directory / HISTORY_DIR / "v1.bundle").exists()


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt("SIGTERM")], ids=["full", "sigterm"])
def test_a_failed_write_leaves_no_temp_file_and_the_old_active_file(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path], monkeypatch: pytest.MonkeyPatch,
        error: BaseException) -> None:
    store.publish(put(bundles["v1"]))
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        if Path(dst).name == ACTIVE_NAME:
            raise error
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(type(error)) as info:
        store.publish(put(bundles["v2"]))
    if isinstance(error, OSError):  # the message says which file
        assert info.value.errno == 28 and info.value.filename == str(store.active_path)  # type: ignore[attr-defined]
    monkeypatch.undo()
    assert store.active_path.read_bytes() == bundles["v1"]
    assert temp_files(store) == []
    assert versions(store) == ["v1"] and not (store.history_dir / "v2.bundle").exists()  # the history as it was
    assert store.publish(put(bundles["v2"])).status == "published"  # the retry of the CronJob succeeds
    assert store.active_path.read_bytes() == bundles["v2"]
    assert versions(store) == ["v1", "v2"]


def test_a_failure_after_the_rename_landed_keeps_the_history_that_names_it(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The active file was replaced and the directory's fsync failed (EIO): the new bundle serves, so the history that
    names it stays (putting the old one back would leave the served version in neither)."""
    store.publish(put(bundles["v1"]))
    real_fsync_dir = store_module.fsync_dir

    def failing(directory: Path) -> None:
        if Path(directory) == store.directory:
            raise OSError(5, "Input/output error")
        real_fsync_dir(directory)

    monkeypatch.setattr(store_module, "fsync_dir", failing)
    with pytest.raises(OSError, match="Input/output"):
        store.publish(put(bundles["v2"]))
    monkeypatch.undo()
    assert store.active_path.read_bytes() == bundles["v2"]
    assert versions(store) == ["v1", "v2"] and (store.history_dir / "v2.bundle").read_bytes() == bundles["v2"]


def test_stale_temp_files_of_a_killed_writer_are_swept(store: WeightsStore, bundles: dict[str, bytes],
                                                       put: Callable[[bytes], Path]) -> None:
    fresh = store.directory / ".tmp-writing"
    stale = [d / ".tmp-killed" for d in (store.directory, store.history_dir, store.pending_path.parent, store.canary_path.parent)]
    for path in (fresh, *stale):  # every directory a store writes in: a kill can leave one in each
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a bundle")
    old = time.time() - STALE_TMP_S - 60
    for path in stale:
        os.utime(path, (old, old))
    store.publish(put(bundles["v1"]))
    assert temp_files(store) == [fresh]


# --- rollback ----------------------------------------------------------------------------------


def test_rollback_steps_back_through_the_history_and_to_a_named_version(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    for v in ("v1", "v2", "v3"):
        store.publish(put(bundles[v]))
    inode = store.active_path.stat().st_ino
    result = store.rollback()
    assert (result.status, result.model_version, result.previous) == ("rolled_back", "v2", "v3")
    assert store.active_path.read_bytes() == bundles["v2"]
    assert store.active_path.stat().st_ino != inode  # renamed into place, like a publish
    assert store.rollback().model_version == "v1"
    with pytest.raises(StoreError, match="nothing to roll back to: v1 is the oldest") as info:
        store.rollback()
    assert info.value.reason == "nothing_to_roll_back"
    assert store.rollback(to="v3").model_version == "v3"
    assert store.active_path.read_bytes() == bundles["v3"]
    assert store.rollback(to="v3").status == "unchanged"
    with pytest.raises(StoreError, match="'v9' is not in the history") as info:
        store.rollback(to="v9")
    assert info.value.reason == "unknown_version"
    assert versions(store) == ["v1", "v2", "v3"]  # rollback changes what is active, not the history
    assert temp_files(store) == []


def test_a_second_rollback_does_not_step_back_to_the_version_rolled_back_from(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    """v2 rolled back to v1, then v3 published: the next plain rollback went to v2, the version just rolled back from
    (a documented trap until 2026-12-06). The index marks a version a rollback left for an older one."""
    for v in ("v1", "v2"):
        store.publish(put(bundles[v]))
    assert store.rollback().model_version == "v1"
    store.publish(put(bundles["v3"]))
    assert [(e.model_version, e.rolled_back_at is not None) for e in store.history()] == [("v1", False), ("v2", True), ("v3", False)]
    result = store.rollback()
    assert (result.model_version, result.previous) == ("v1", "v3") and store.active_path.read_bytes() == bundles["v1"]
    with pytest.raises(StoreError, match="nothing to roll back to: v1 is the oldest"):
        store.rollback()
    assert store.rollback(to="v2").model_version == "v2"  # --to reaches a marked version, and clears its mark
    assert [(e.model_version, e.rolled_back_at is not None) for e in store.history()] == [("v1", False), ("v2", False), ("v3", True)]
    # Going back past several versions withdraws each of them; the versions rolled back from are pruned first.
    store.rollback(to="v3")  # forward: nothing marked, v3's mark cleared
    store.publish(put(bundles["v4"]))
    assert store.rollback(to="v1").model_version == "v1"  # from v4, past v2 and v3
    assert [e.rolled_back_at is not None for e in store.history()] == [False, True, True, True]
    with pytest.raises(StoreError, match="v1 is the oldest"):
        store.rollback()
    short = WeightsStore(store.directory, verify, keep=2)
    short.publish(put(bundles["v2"]))  # v2 again: its mark cleared; keep 2 prunes v3 and v4 (marked) before v1
    assert [(e.model_version, e.rolled_back_at) for e in short.history()] == [("v1", None), ("v2", None)]


def test_marks_written_by_hand_null_or_empty_are_read_and_honoured(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    for v in ("v1", "v2", "v3"):
        store.publish(put(bundles[v]))
    rows = json.loads(store.index_path.read_text())
    rows[0]["rolled_back_at"], rows[1]["rolled_back_at"] = "2026-12-06T00:00:00+00:00", None  # null: no mark, as ""
    store.index_path.write_text(json.dumps(rows))
    assert store.rollback().model_version == "v2"  # v2's null is no mark: a plain rollback takes it
    rows = json.loads(store.index_path.read_text())
    rows[1]["rolled_back_at"] = ""  # read as no mark, as weights show reads it
    store.index_path.write_text(json.dumps(rows))
    assert store.history()[1].rolled_back_at is None
    store.active_path.write_bytes(bundles["v4"])  # put there by hand: the newest unmarked published version, not v3
    rows = json.loads(store.index_path.read_text())
    rows[1]["rolled_back_at"] = "2026-12-06T00:00:00+00:00"
    store.index_path.write_text(json.dumps(rows))
    with pytest.raises(StoreError, match=r"every version before the active file was rolled back from \(v1, v2, v3\)"):
        store.rollback()
    rows[1]["rolled_back_at"] = 5
    store.index_path.write_text(json.dumps(rows))
    with pytest.raises(StoreError, match="rolled_back_at"):
        store.history()


@pytest.mark.parametrize("fails", ["after the rename", "before it"])
def test_a_rollback_that_fails_part_way_keeps_the_marks_exactly_when_it_landed(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path], monkeypatch: pytest.MonkeyPatch,
        fails: str) -> None:
    """A re-read: the active file's directory fsync failing after its rename (the rollback landed) put the unmarked index
    back, the old trap again; and an interrupt was not an OSError, leaving marks for a rollback that never happened.
    The index is restored (the store rewrites the entries it read) only when the target did not become active.
    (os.replace and fsync_dir stand in for the disk's failures at those two points, the one simulated part.)"""
    import weights.store as store_module

    for v in ("v1", "v2", "v3"):
        store.publish(put(bundles[v]))
    index = store.index_path.read_bytes()
    real_replace = os.replace

    def replace_fails(src: Any, dst: Any) -> None:
        if Path(dst).name == ACTIVE_NAME:
            raise KeyboardInterrupt("SIGTERM")  # a signal between the index and the active file
        real_replace(src, dst)

    real_fsync_dir = store_module.fsync_dir

    def fsync_fails(directory: Path) -> None:  # the active file's directory only (the index is in history/)
        if Path(directory) == store.directory:
            raise OSError(errno.EIO, "I/O error")
        real_fsync_dir(directory)

    if fails == "before it":
        monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(KeyboardInterrupt if fails == "before it" else OSError):
        if fails == "after the rename":
            monkeypatch.setattr(store_module, "fsync_dir", fsync_fails)
        store.rollback()
    monkeypatch.undo()
    if fails == "before it":  # nothing changed: the index as it was, byte for byte
        assert store.active_path.read_bytes() == bundles["v3"] and store.index_path.read_bytes() == index
    else:  # v2 serves: its rollback's mark stays, so the next plain rollback does not return to v3
        assert store.active_path.read_bytes() == bundles["v2"]
        assert [e.rolled_back_at is not None for e in store.history()] == [False, False, True]


def test_a_rollback_the_disk_cannot_take_leaves_the_active_file_and_the_marks_as_they_were(
        tmp_path: Path, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    """The marks are written before the active file and put back when it cannot be: a rollback that lands has them,
    one that does not leaves none (a real 16 MiB tmpfs, the kernel's ENOSPC)."""
    import contextlib

    from tests.small_disk import mounted

    with contextlib.contextmanager(mounted)(tmp_path, "16m") as disk:
        store = WeightsStore(disk.path / "pv", verify)
        for v in ("v1", "v2"):
            store.publish(put(bundles[v]))
        index = store.index_path.read_bytes()
        room = disk.path / "room"
        room.write_bytes(b"\0" * 64 * 1024)  # room for the index, not for a bundle
        disk.fill()
        room.unlink()
        with pytest.raises(OSError) as info:
            store.rollback()
        assert info.value.errno == errno.ENOSPC
        assert store.active_path.read_bytes() == bundles["v2"] and store.index_path.read_bytes() == index
        disk.free()
        assert store.rollback().model_version == "v1" and store.history()[1].rolled_back_at is not None


def test_rollback_with_no_history_says_so(store: WeightsStore) -> None:
    with pytest.raises(StoreError, match="nothing to roll back to"):
        store.rollback()
    store.directory.mkdir()
    (store.directory / HISTORY_DIR).mkdir()
    with pytest.raises(StoreError, match="nothing to roll back to: no published versions"):
        store.rollback()


def test_rollback_validates_the_kept_file_first(store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    for v in ("v1", "v2"):
        store.publish(put(bundles[v]))
    kept = store.directory / HISTORY_DIR / "v1.bundle"
    kept.write_bytes(flipped(bundles["v1"]))
    with pytest.raises(BundleError) as info:
        store.rollback()
    assert info.value.reason == "checksum"
    assert store.active_path.read_bytes() == bundles["v2"]


def test_rollback_from_a_bundle_the_store_did_not_publish_goes_to_the_newest(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    for v in ("v1", "v2"):
        store.publish(put(bundles[v]))
    store.active_path.write_bytes(bundles["v3"])  # put there by hand
    assert store.rollback().model_version == "v2"


# --- reading -----------------------------------------------------------------------------------


def test_an_empty_store_has_no_active_bundle_and_no_history(store: WeightsStore) -> None:
    assert store.active() is None and store.active_sha256() is None and store.history() == []


def test_a_damaged_index_is_reported(store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    store.publish(put(bundles["v1"]))
    (store.directory / HISTORY_DIR / INDEX_NAME).write_text("[{")
    with pytest.raises(StoreError) as info:
        store.history()
    assert info.value.reason == "index"


def odd_file(path: Path, kind: str) -> None:
    """Leave at ``path`` what a crashed writer or a hostile one might: a FIFO (no writer: an open for reading would
    wait for one), a symlink to an endless device, or a directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "endless":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "endless", "directory"])
def test_an_odd_active_file_is_reported_and_a_publish_replaces_it(store: WeightsStore, bundles: dict[str, bytes],
                                                                   put: Callable[[bytes], Path], kind: str) -> None:
    odd_file(store.active_path, kind)
    with pytest.raises(BundleError) as info:
        promptly(store.active)
    assert info.value.reason == "io"
    assert promptly(store.active_sha256) is None  # no bundle the store could have written
    if kind == "directory":  # a rename cannot replace a directory with a file: the publish fails, and says where
        with pytest.raises(OSError):
            promptly(lambda: store.publish(put(bundles["v1"])))
        return
    result = promptly(lambda: store.publish(put(bundles["v1"])))
    assert result.status == "published" and store.active_path.read_bytes() == bundles["v1"]
    active = promptly(store.active)
    assert active is not None and active["model_version"] == "v1"


@pytest.mark.parametrize("kind", ["fifo", "endless", "directory"])
def test_an_odd_history_index_is_a_damaged_index(store: WeightsStore, bundles: dict[str, bytes],
                                                  put: Callable[[bytes], Path], kind: str) -> None:
    store.publish(put(bundles["v1"]))
    odd_file(store.index_path, kind)
    for call in (store.history, lambda: store.publish(put(bundles["v2"])), store.rollback):
        with pytest.raises(StoreError) as info:
            promptly(call)
        assert info.value.reason == "index"
    assert store.active_path.read_bytes() == bundles["v1"]  # nothing changed on the volume


@pytest.mark.parametrize("kind", ["fifo", "endless", "directory"])
def test_odd_canary_and_pending_files_are_refused_without_waiting(store: WeightsStore, bundles: dict[str, bytes],
                                                                  put: Callable[[bytes], Path], kind: str) -> None:
    store.publish(put(bundles["v1"]))
    version = store.start_canary(variant_bytes("canary-1", canary=0.1))
    odd_file(store.looks_path, kind)
    assert promptly(lambda: store.canary_looks(version)) == 0  # an unreadable count is no count, as a damaged one is
    if kind != "directory":
        assert promptly(lambda: store.count_canary_look(version)) == 1  # and the next look writes a good one over it
    for path, read in ((store.canary_path, store.canary), (store.pending_path, store.pending)):
        odd_file(path, kind)
        with pytest.raises(BundleError) as info:
            promptly(read)
        assert info.value.reason == "io"


def test_a_dangling_link_is_no_file_and_an_oversized_index_is_named(store: WeightsStore, bundles: dict[str, bytes],
                                                                      put: Callable[[bytes], Path]) -> None:
    store.directory.mkdir(parents=True)
    store.active_path.symlink_to("gone.bundle")  # a link whose target was removed: as no active file, as before
    assert store.active() is None and store.active_sha256() is None and store.pending() is None
    store.publish(put(bundles["v1"]))
    store.index_path.write_bytes(b" " * (2 * 1024 * 1024))  # JSON whitespace, past the index's limit
    with pytest.raises(StoreError) as info:
        store.history()
    assert info.value.reason == "index" and "history index" in str(info.value) and str(store.index_path) in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "endless"])
def test_rollback_to_an_odd_kept_file_is_refused_without_waiting(store: WeightsStore, bundles: dict[str, bytes],
                                                                 put: Callable[[bytes], Path], kind: str) -> None:
    store.publish(put(bundles["v1"]))
    store.publish(put(bundles["v2"]))
    odd_file(store.history_dir / "v1.bundle", kind)
    with pytest.raises(BundleError) as info:
        promptly(store.rollback)
    assert info.value.reason == "io"
    assert store.active_path.read_bytes() == bundles["v2"]


# --- concurrency -------------------------------------------------------------------------------


def test_concurrent_publishers_both_complete_and_leave_one_valid_active_file(
        store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    paths = {v: put(bundles[v]) for v in ("v1", "v2", "v3", "v4")}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def publisher(version: str) -> None:
        try:
            start.wait()
            for _ in range(3):
                WeightsStore(store.directory, verify).publish(paths[version])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(v,)) for v in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    active = store.active_path.read_bytes()
    assert active in bundles.values()
    assert verify(active).model_version == versions(store)[-1]  # the last one recorded is the one active
    assert sorted(versions(store)) == ["v1", "v2", "v3", "v4"]
    assert temp_files(store) == []


def test_a_publisher_waits_for_the_lock(store: WeightsStore, bundles: dict[str, bytes], put: Callable[[bytes], Path]) -> None:
    path = put(bundles["v1"])
    with store.lock():
        publisher = threading.Thread(target=WeightsStore(store.directory, verify).publish, args=(path,))
        publisher.start()
        publisher.join(timeout=0.5)
        assert publisher.is_alive() and not store.active_path.exists()
    publisher.join(timeout=30)
    assert store.active_path.read_bytes() == bundles["v1"]


UNPARSEABLE = {"nested": "[" * 300_000 + "]" * 300_000, "huge-number": "1" * 5_000}
"""JSON that Python's parser refuses past its limits (within the store's size limit): RecursionError, ValueError."""


@pytest.mark.parametrize("text", [*UNPARSEABLE.values(),
                                  '[{"model_version": "../x", "sha256": "' + "0" * 64 + '", "published_at": "t"}]',
                                  '[{"model_version": "v1", "sha256": "xyz", "published_at": "t"}]'],
                         ids=[*UNPARSEABLE, "path-version", "bad-sha"])
def test_an_index_the_json_parser_or_the_names_refuse_is_a_damaged_index(store: WeightsStore, bundles: dict[str, bytes],
                                                                         put: Callable[[bytes], Path], text: str) -> None:
    """Nested past the parser's recursion (within the size limit) or a 5,000-digit number went out as RecursionError or
    ValueError: a traceback from `weights show`, and `cycle` failed at its publish after a whole training run (exit 1,
    retried). A version that is not one (``../x``) would have been joined onto ``history/`` by a rollback."""
    store.publish(put(bundles["v1"]))
    (store.directory / HISTORY_DIR / INDEX_NAME).write_text(text)
    with pytest.raises(StoreError) as info:
        store.history()
    assert info.value.reason == "index"
    with pytest.raises(StoreError) as info:
        store.publish(put(bundles["v2"]))
    assert info.value.reason == "index" and store.active_path.read_bytes() == bundles["v1"]


def test_a_look_count_the_json_parser_refuses_reads_as_no_looks(store: WeightsStore) -> None:
    """It dropped a serving canary ("no canary look: RecursionError") instead of counting from 0."""
    store.looks_path.parent.mkdir(parents=True)
    for text in UNPARSEABLE.values():
        store.looks_path.write_text(text)
        assert store.canary_looks("v1") == 0


@pytest.mark.parametrize("linked", [HISTORY_DIR, "pending", "canary"])
def test_nothing_is_written_or_removed_through_a_linked_store_directory(store: WeightsStore, bundles: dict[str, bytes],
                                                                        put: Callable[[bytes], Path], tmp_path: Path,
                                                                        linked: str) -> None:
    """A publish through a linked history/ removed every unlisted ``*.bundle`` where it pointed and wrote its index
    there; dropping a canary removed the looks file there (an attack review, 2026-12-06)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bundle").write_bytes(b"not the store's")
    (outside / "looks.json").write_text("{}")
    store.directory.mkdir(parents=True, exist_ok=True)
    (store.directory / linked).symlink_to(outside, target_is_directory=True)
    for write in (store.ensure_writable, lambda: store.publish(put(bundles["v1"])), lambda: store.hold(bundles["v1"]),
                  store.drop_pending,
                  lambda: store.start_canary(variant_bytes("canary-1", canary=0.1)), store.drop_canary,
                  lambda: store.count_canary_look("v1")):
        with pytest.raises(StoreError) as info:
            write()
        assert info.value.reason == "layout" and linked in str(info.value)
    assert sorted(p.name for p in outside.iterdir()) == ["looks.json", "precious.bundle"]
    assert not store.active_path.exists()


def test_the_lock_file_is_never_created_through_a_link(store: WeightsStore, tmp_path: Path) -> None:
    """A dangling link named .lock made the first thing `cycle` does create the link's target."""
    store.directory.mkdir(parents=True, exist_ok=True)
    (store.directory / ".lock").symlink_to(tmp_path / "lock-target")
    with pytest.raises(OSError) as info:
        store.ensure_writable()
    assert info.value.errno == errno.ELOOP and not (tmp_path / "lock-target").exists()


def test_cycle_stops_before_its_work_on_a_linked_store_directory(tmp_path: Path) -> None:
    """It trained for a whole run and failed only at the publish (exit 1, retried); now bad usage, before any log."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (weights / HISTORY_DIR).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    code, _, err = trainer_in_process("cycle", "--logs", str(tmp_path / "no-logs-read"), "--weights-dir", str(weights),
                                      "--device", "cpu")
    assert code == 2 and f"--weights-dir {weights}: " in err and "a symbolic link where the store's own directory" in err, err


def test_a_candidate_held_for_a_second_look_is_neither_published_nor_started_as_a_canary(store: WeightsStore,
                                                                                          bundles: dict[str, bytes]) -> None:
    """Signed or not, a held candidate (``weights.held``) is one the gate refused: the store will not make it the active
    bundle or the canary (a security review, 2026-12-06: moved to the active name, every server took it)."""
    from weights.held import marked
    from weights.signing import keypair_pem, load_private_key, load_public_keys, sign

    store.publish(bundles["v1"])
    private, public = keypair_pem()
    keys = Path(store.directory)
    (keys / "k.pem").write_bytes(private)
    (keys / "k.pub").write_bytes(public)
    signing = WeightsStore(store.directory, lambda data: verify_in_child(data, load_public_keys(keys / "k.pub")))
    held_release = sign(_rebuilt("v-held", marked), load_private_key(keys / "k.pem"))
    held_canary = sign(_rebuilt("c-held", lambda m: marked({**m, "canary": {"fraction": 0.1}})), load_private_key(keys / "k.pem"))
    for data, make_it_served in ((held_release, signing.publish), (held_canary, signing.start_canary)):
        with pytest.raises(BundleError, match="held for a second look, not a release") as info:
            make_it_served(data)
        assert info.value.reason == "held"
        assert signing.hold(data) == read_bundle(data).model_version  # where it belongs, it is kept
    assert store.active_path.read_bytes() == bundles["v1"] and not store.canary_path.exists()
    # Nor does a rollback make one active: planted in the history with its index entry (an attack on the fix, 2026-12-06).
    store.publish(bundles["v2"])
    (store.history_dir / "v-held.bundle").write_bytes(held_release)
    index = json.loads(store.index_path.read_text())
    store.index_path.write_text(json.dumps([{"model_version": "v-held", "sha256": sha256(held_release),
                                             "published_at": "2026-12-06T00:00:00+00:00"}, *index]))
    with pytest.raises(BundleError, match="held for a second look, not a release"):
        signing.rollback(to="v-held")
    assert store.active_path.read_bytes() == bundles["v2"]


def _rebuilt(version: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> bytes:
    """The untrained bundle as ``version``, its manifest changed by ``change``."""
    import io

    from weights.bundle import PARTS, write_bundle

    base = read_bundle(make_bundle(1, version, "2026-12-06T00:00:00Z"))
    out = io.BytesIO()
    write_bundle(out, change({k: v for k, v in base.manifest.items() if k not in ("format", "format_version", "parts")}),
                 {p: base.parts[p] for p in PARTS})
    return out.getvalue()


def test_a_promotion_publishes_the_bytes_judged_not_the_file_read_again(store: WeightsStore, bundles: dict[str, bytes]) -> None:
    """The trainer judges a canary for minutes of log reading before it promotes it: a file swapped meanwhile for another
    bundle is not what gets published (an attack review, 2026-12-06)."""
    store.publish(bundles["v1"])
    judged = variant_bytes("canary-1", canary=0.1)
    store.start_canary(judged)
    store.canary_path.write_bytes(variant_bytes("swapped-in", canary=0.1))
    assert store.promote_canary(judged=judged).status == "published"
    assert store.active_path.read_bytes() == judged and not store.canary_path.exists()
