"""Log segments on a real directory: rotation, publish by rename, recovery after a killed writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from experience.schema import OUTCOMES, SCHEMA_VERSION
from experience.segment_writer import OPEN_PREFIX, SegmentWriter, recover_abandoned
from experience.segments import DirectorySource, read_segment
from tests.harness import ROOT, promptly


def outcome_batch(start: int, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "schema_version": [SCHEMA_VERSION] * n,
            "outcome_id": [f"o{i}" for i in range(start, start + n)],
            "decision_id": [f"d{i}" for i in range(start, start + n)],
            "session_id": ["s"] * n,
            "outcome": [2] * n,
            "value": [float(i) for i in range(start, start + n)],
            "coupon_discount": [0.0] * n,
            "event_time_s": [1.0e9 + i for i in range(start, start + n)],
            "received_s": [1.0e9] * n,
            "sample_rate": [1.0] * n,
        },
        schema=OUTCOMES,
    )


def ids(root: Path) -> list[str]:
    return DirectorySource(root).table("outcomes").column("outcome_id").to_pylist()


def test_open_segment_is_hidden_until_rotated(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    writer.write(outcome_batch(0, 3))
    assert ids(tmp_path) == []  # written, not yet published
    hidden = list((tmp_path / "outcomes").glob(f"{OPEN_PREFIX}*"))
    assert len(hidden) == 1
    final = writer.rotate()
    assert final is not None and final.exists() and not hidden[0].exists()
    assert ids(tmp_path) == ["o0", "o1", "o2"]
    writer.write(outcome_batch(3, 2))
    writer.close()
    assert ids(tmp_path) == [f"o{i}" for i in range(5)]  # segments read oldest first
    assert len(writer.finalised) == 2
    assert not list((tmp_path / "outcomes").glob(f"{OPEN_PREFIX}*"))


def test_rotates_by_size_and_by_age(tmp_path: Path) -> None:
    by_size = SegmentWriter(tmp_path / "a", "outcomes", max_bytes=1, max_seconds=3600)
    for i in range(4):
        assert by_size.write(outcome_batch(i, 1)) == 1
        assert by_size.due()  # each write crossed the size bound
        by_size.rotate()
    assert len(by_size.finalised) == 4
    by_age = SegmentWriter(tmp_path / "b", "outcomes", max_bytes=10**9, max_seconds=0.05)
    by_age.write(outcome_batch(0, 1))
    assert not by_age.due()
    time.sleep(0.06)
    assert by_age.due()  # an idle writer finalises its segment on the next flush
    by_age.rotate()
    assert ids(tmp_path / "b") == ["o0"]


def test_two_writers_share_a_directory(tmp_path: Path) -> None:
    a = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    b = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    a.write(outcome_batch(0, 2))
    b.write(outcome_batch(2, 2))
    a.close()
    b.close()
    assert sorted(ids(tmp_path)) == ["o0", "o1", "o2", "o3"]


_KILLED_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.experience.test_segments import outcome_batch
from experience.segment_writer import SegmentWriter
w = SegmentWriter(Path(sys.argv[1]), "outcomes", max_bytes=10**9, max_seconds=3600)
for i in range(3):
    w.write(outcome_batch(10 * i, 10))  # in the file when write returns
print("written", flush=True)
time.sleep(60)
"""


def test_segment_of_a_killed_writer_is_recovered(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        assert recover_abandoned(tmp_path, "outcomes") == []  # alive: its lock is held, the segment is left alone
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert ids(tmp_path) == []
    recovered = recover_abandoned(tmp_path, "outcomes")
    assert len(recovered) == 1
    assert ids(tmp_path) == [f"o{i}" for i in range(30)]  # every batch the killed writer wrote


def test_torn_last_batch_reads_up_to_it(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    writer.write(outcome_batch(0, 5))
    writer.write(outcome_batch(5, 5))
    path = writer.rotate()
    assert path is not None
    size = path.stat().st_size
    with open(path, "r+b") as f:  # cut into the second batch, as a crash mid-write would
        f.truncate(size - 40)
    batches = list(read_segment(path))
    assert [b.num_rows for b in batches] == [5]


def _with(batch: pa.RecordBatch, column: str, values: list[object]) -> pa.RecordBatch:
    index = batch.schema.get_field_index(column)
    return batch.set_column(index, batch.schema.field(index), pa.array(values, batch.schema.field(index).type))


@pytest.mark.parametrize("column", ["session_id", "decision_id", "value", "received_s"])
def test_a_batch_with_a_null_where_no_server_writes_one_ends_the_read(tmp_path: Path, column: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A null session id stopped every run of ``train`` (an IndexError deep in the session index): the batch that holds
    one is where the segment's readable rows end, as at a torn batch, with a warning naming the column."""
    writer = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    writer.write(outcome_batch(0, 5))
    writer.write(_with(outcome_batch(5, 5), column, [None, "s", "s", "s", "s"] if column.endswith("_id") else
                       [None, 1.0, 1.0, 1.0, 1.0]))
    writer.write(outcome_batch(10, 5))
    writer.close()
    with caplog.at_level("WARNING", logger="experience.segments"):
        assert ids(tmp_path) == [f"o{i}" for i in range(5)]
    assert any("no server writes" in r.getMessage() and column in r.fields["error"]  # type: ignore[attr-defined]
               for r in caplog.records)


def test_a_null_hidden_in_another_type_of_column_is_found_after_the_cast(tmp_path: Path) -> None:
    """A dictionary whose values hold a null has no null index (``null_count`` 0): cast to the schema's string, it is a
    null session id."""
    batch = outcome_batch(0, 5)
    hidden = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 0, 0], pa.int32()), pa.array(["s", None]))
    assert hidden.null_count == 0
    index = batch.schema.get_field_index("session_id")
    batch = batch.set_column(index, pa.field("session_id", hidden.type, nullable=False), hidden)
    (tmp_path / "outcomes").mkdir()
    with pa.OSFile(str(tmp_path / "outcomes" / "outcomes-x.arrows"), "wb") as sink, \
            pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(outcome_batch(10, 5).cast(batch.schema))
        writer.write_batch(batch)
    assert ids(tmp_path) == [f"o{i}" for i in range(10, 15)]


def test_a_batch_of_another_kind_is_not_read_as_this_one(tmp_path: Path) -> None:
    """Outcome rows in the engagement reports' directory: the columns an engagement report has always had are missing,
    and filled with nulls they would make reports of no one (a batch of outcomes among the decisions became the
    newest model version's whole window)."""
    directory = tmp_path / "engagements"
    directory.mkdir()
    with pa.OSFile(str(directory / "engagements-x.arrows"), "wb") as sink, pa.ipc.new_stream(sink, OUTCOMES) as writer:
        writer.write_batch(outcome_batch(0, 5))
    assert DirectorySource(tmp_path).table("engagements").num_rows == 0


@pytest.mark.parametrize("version", [0, -1, None])
def test_a_batch_of_a_version_no_server_writes_is_not_read(tmp_path: Path, version: int | None) -> None:
    """Version 0 or −1 skipped the check of the columns, and a batch without a version is taken for version 1, whose
    upgrade raised on a missing column: both end the read now, in any kind (engagement reports had no version 1)."""
    batch = outcome_batch(0, 5).drop_columns(["session_id"])
    metadata = {k: v for k, v in (batch.schema.metadata or {}).items() if k != b"schema_version"}
    if version is None:  # (the version is the schema's metadata, else the column)
        batch = batch.drop_columns(["schema_version"]).replace_schema_metadata(metadata)
    else:
        batch = batch.replace_schema_metadata({**metadata, b"schema_version": str(version).encode()})
    for kind in ("outcomes", "engagements"):
        (tmp_path / kind).mkdir()
        with pa.OSFile(str(tmp_path / kind / f"{kind}-x.arrows"), "wb") as sink, \
                pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        assert DirectorySource(tmp_path).table(kind).num_rows == 0


def test_empty_or_garbage_segment_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "outcomes"
    directory.mkdir()
    (directory / "outcomes-garbage.arrows").write_bytes(b"not arrow")
    (directory / "outcomes-empty.arrows").write_bytes(b"")
    # an IPC continuation marker and then a negative length: pyarrow says OSError, not ArrowInvalid (it stopped every
    # run that read the directory)
    (directory / "outcomes-negative.arrows").write_bytes(b"\xff\xff\xff\xff\x00\x00\x00\x80" + bytes(4088))
    random = np.random.default_rng(0)
    for i in range(20):  # and noise of any kind
        (directory / f"outcomes-noise{i}.arrows").write_bytes(random.bytes(4096))
    assert ids(tmp_path) == []


def test_a_real_segment_with_damaged_bytes_is_read_up_to_the_damage_or_skipped(tmp_path: Path) -> None:
    """One to three bytes changed in the schema and the first batch of a real segment, 400 ways: pyarrow names the
    damage with ArrowInvalid, ArrowNotImplementedError, ArrowMemoryError, OSError or a bad schema_version; every
    one is a warning and a skip (read up to it), never an error that stops a reader (and so every later run), and
    never more rows than were written."""
    from experience.columnar import compact

    good = tmp_path / "good"
    writer = SegmentWriter(good, "outcomes", max_bytes=10**9, max_seconds=3600)
    for i in range(4):
        writer.write(outcome_batch(10 * i, 10))
    writer.close()
    (segment,) = (good / "outcomes").glob("*.arrows")
    data, written = segment.read_bytes(), ids(good)
    damaged = tmp_path / "damaged"
    (damaged / "outcomes").mkdir(parents=True)
    target = damaged / "outcomes" / segment.name
    random = np.random.default_rng(1)
    for _ in range(400):
        copy = bytearray(data)
        for _ in range(int(random.integers(1, 4))):
            copy[int(random.integers(0, min(len(copy), 2000)))] = int(random.integers(0, 256))
        target.write_bytes(bytes(copy))
        assert len(ids(damaged)) <= len(written)  # up to the damage at most (a flipped value byte reads as a value)
    compact(DirectorySource(damaged), "outcomes", before_s=float("inf"))  # the compactor too: never raises for it


def test_unknown_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind: expected one of"):
        SegmentWriter(tmp_path, "clicks", 1, 1)


def test_recover_leaves_a_fifo_alone_without_waiting_on_it(tmp_path: Path) -> None:
    """A FIFO named like an abandoned open segment hung a server's start (the recorder recovers on start) past SIGTERM."""
    directory = tmp_path / "outcomes"
    directory.mkdir()
    fifo = directory / f"{OPEN_PREFIX}outcomes-x.arrows"
    os.mkfifo(fifo)
    assert promptly(lambda: recover_abandoned(tmp_path, "outcomes"), fifo=fifo) == []
    assert fifo.exists()


def test_recover_leaves_empty_orphans_out(tmp_path: Path) -> None:
    directory = tmp_path / "outcomes"
    directory.mkdir()
    orphan = directory / f"{OPEN_PREFIX}outcomes-x.arrows"
    orphan.write_bytes(b"")
    assert recover_abandoned(tmp_path, "outcomes") == []
    assert orphan.exists()  # young: it may be a writer between creating its file and locking it
    os.utime(orphan, (time.time() - 120, time.time() - 120))
    assert recover_abandoned(tmp_path, "outcomes") == []
    assert not orphan.exists() and os.listdir(directory) == []


def test_a_failed_rotate_still_releases_the_file_and_its_lock(tmp_path: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    writer = SegmentWriter(tmp_path, "outcomes", max_bytes=10**9, max_seconds=3600)
    for i in range(3):
        writer.write(outcome_batch(i, 1))
        open_segment = next((tmp_path / "outcomes").glob(f"{OPEN_PREFIX}*"))
        open_segment.rename(tmp_path / f"moved-{i}")  # the volume lost it: the rename onto the final name would fail
        assert writer.rotate() is None and writer.take_lost() == 1  # given up, its row counted lost (ee81a0f)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no file object, descriptor or flock left behind
    writer.write(outcome_batch(9, 1))  # and the writer goes on with a new segment
    writer.close()
    assert ids(tmp_path) == ["o9"]


def _swapped_after_listing(tmp_path: Path) -> tuple[DirectorySource, str, Path]:
    """A directory of two outcome segments, listed; the source, the first one's listed path and that file."""
    for start in (0, 10):
        writer = SegmentWriter(tmp_path / "logs", "outcomes", max_bytes=10**9, max_seconds=3600)
        writer.write(outcome_batch(start, 10))
        writer.close()
    source = DirectorySource(tmp_path / "logs")
    listed = source.segments("outcomes")
    assert len(listed) == 2
    return source, listed[0], Path(listed[0])


@pytest.mark.parametrize("swap", ["link", "fifo"])
def test_a_segment_swapped_after_the_listing_is_skipped_never_followed_or_waited_on(tmp_path: Path, swap: str,
                                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A pass opens its segments one by one after listing them: a link renamed over a listed segment was read, a FIFO
    blocked the reader in ``open`` for ever, the compactor holding its lock meanwhile (an attack review, 2026-12-06),
    where the listing itself skips both."""
    source, path, segment = _swapped_after_listing(tmp_path)
    replacement = tmp_path / "replacement"
    if swap == "link":
        (tmp_path / "outside.arrows").write_bytes(segment.read_bytes())
        replacement.symlink_to(tmp_path / "outside.arrows")
    else:
        os.mkfifo(replacement)
    os.replace(replacement, segment)
    assert promptly(lambda: list(source.segment_batches(path, "outcomes")), fifo=segment if swap == "fifo" else None) == []
    assert "skipping a log segment that a link or a special file replaced since it was listed" in caplog.text
    other = source.segments("outcomes")[-1]
    assert sum(b.num_rows for b in source.segment_batches(other, "outcomes")) == 10  # the rest is read


def test_an_open_error_that_is_no_swap_stops_the_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only a link or a special file is skipped: a segment this process cannot open for another reason (here its
    directory replaced by a file; EACCES for a trainer of another user) stops the run as before, not a quiet skip."""
    source, path, segment = _swapped_after_listing(tmp_path)
    directory = segment.parent
    for name in os.listdir(directory):
        os.unlink(directory / name)
    directory.rmdir()
    directory.write_bytes(b"not a directory")
    with pytest.raises(NotADirectoryError):
        list(source.segment_batches(path, "outcomes"))
    assert "skipping" not in caplog.text


def test_recovery_leaves_a_link_named_like_an_open_segment_alone(tmp_path: Path) -> None:
    """It was locked through and renamed to a finalised name, which every read then skipped."""
    directory = tmp_path / "outcomes"
    directory.mkdir()
    target = tmp_path / "target.arrows"
    target.write_bytes(b"x" * 100)
    link = directory / f"{OPEN_PREFIX}outcomes-x.arrows"
    link.symlink_to(target)
    assert recover_abandoned(tmp_path, "outcomes") == []
    assert link.is_symlink() and target.read_bytes() == b"x" * 100
