"""Compacting finalised segments into hour-partitioned IPC-file parts: the same rows, each read once, by column."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest

from experience.columnar import (
    HOUR_PREFIX,
    LOCK_NAME,
    PART_SUFFIX,
    TIME_COLUMN,
    TMP_PREFIX,
    CompactionBusy,
    compact,
    hour_of,
    read_part,
)
from experience.schema import DECISIONS
from experience.segment_writer import SUFFIX
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import ROOT, fresh_bundle, promptly
from tests.log_tables import with_value
from tests.small_disk import SmallDisk
from weights.model_set import LoadOptions, ModelSet

IDS = {"decisions": "decision_id", "outcomes": "outcome_id", "engagements": "engagement_id"}
NARROW = ["session_id", "time_s", "model_version"]


def _log(root: Path, sessions: range) -> Path:
    model = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    # two clock readings three hours apart: segments in more than one hour
    run_logged(World(SimConfig(), 3), model, sessions, ZoneInfo("UTC"), root, b"c" * 32, clock=lambda: 7_000.0, batch=32)
    run_logged(World(SimConfig(), 3), model, range(sessions.stop, sessions.stop + len(sessions)), ZoneInfo("UTC"), root,
               b"c" * 32, clock=lambda: 18_000.0, batch=32)
    return root


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _log(tmp_path_factory.mktemp("columnar-logs"), range(120))


def _rows(root: Path, kind: str) -> pa.Table:
    return DirectorySource(root).table(kind).sort_by(IDS[kind])


def _copy(logs: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(logs, tmp_path / "logs"))


def _set_first_row(segment: Path, column: str, value: object) -> pa.Table:
    """Rewrite ``segment`` with its first row's ``column`` set to ``value``, in the segment's own schema; the table."""
    with pa.OSFile(str(segment), "rb") as f:
        table = with_value(pa.ipc.open_stream(f).read_all(), column, 0, value)
    with pa.OSFile(str(segment), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return table


def test_compacted_logs_read_as_the_same_rows_and_a_part_reads_only_its_columns(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    streams = {kind: len(list((root / kind).glob(f"*{SUFFIX}"))) for kind in IDS}
    assert streams["decisions"] >= 2
    for kind in IDS:
        done = compact(DirectorySource(root), kind, before_s=float("inf"))
        assert done.segments == streams[kind] and done.kept == 0 and done.rows == _rows(logs, kind).num_rows
        assert not list((root / kind).glob(f"*{SUFFIX}"))  # every segment replaced by its parts
        assert _rows(root, kind).equals(_rows(logs, kind))  # the same rows, as the same types
        parts = sorted((root / kind).glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
        assert len({p.parent.name for p in parts}) >= 2 and done.parts == len(parts)
        for part in parts:  # each part holds its hour's rows only, sorted by session
            table = pa.ipc.open_file(part).read_all()
            assert {hour_of(t) for t in table.column(TIME_COLUMN[kind]).to_pylist()} == {part.parent.name[len(HOUR_PREFIX):]}
            assert table.column("session_id").to_pylist() == sorted(table.column("session_id").to_pylist())
    source = DirectorySource(root)
    path = source.segments("decisions")[0]
    assert path.endswith(PART_SUFFIX)
    batches = list(source.segment_batches(path, "decisions", NARROW))
    assert batches and all(b.schema.names == NARROW for b in batches)
    assert sum(b.num_rows for b in batches) == pa.ipc.open_file(path).read_all().num_rows
    # the part reader itself decodes only those columns (not all of them, cut afterwards)
    raw = list(read_part(path, source.fs, "decisions", NARROW))
    assert all(b.schema.names == NARROW for b in raw)
    assert sum(b.nbytes for b in raw) < 0.1 * sum(b.nbytes for b in read_part(path, source.fs, "decisions"))


COMPACT_AND_MEASURE = """
import sys
from core.peak_memory import peak_rss_kb
from experience.columnar import compact
from experience.segments import DirectorySource

before = peak_rss_kb()
done = compact(DirectorySource(sys.argv[1]), "outcomes", before_s=float("inf"))
print(done.rows, done.kept, peak_rss_kb() - before)
"""


def test_a_segment_of_many_empty_batches_compacts_to_its_rows_in_bounded_memory(logs: Path, tmp_path: Path) -> None:
    """An attack review (2026-12-07): 30 rows followed by 30,000 empty batches (a valid 60 MB segment) took `logs compact`
    to 605 MB, 200,000 of them to 3.5 GB, past the Job's 2Gi: every batch was held (40,000 held 172 MB more). Empty ones
    are now left behind as they are read (6 MB more); the rows are the same. Measured in a process of its own."""
    root = _copy(logs, tmp_path)
    segment = sorted((root / "outcomes").glob(f"*{SUFFIX}"))[0]
    with pa.ipc.open_stream(segment) as reader:
        schema, batches = reader.schema, list(reader)
    empty = pa.RecordBatch.from_pylist([], schema=schema)
    with pa.ipc.new_stream(segment, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
        for _ in range(40_000):
            writer.write_batch(empty)
    before = _rows(root, "outcomes")
    run = subprocess.run([sys.executable, "-c", COMPACT_AND_MEASURE, str(root)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    rows, kept, grown_kb = map(int, run.stdout.split())
    assert rows == before.num_rows > 0 and kept == 0 and _rows(root, "outcomes").equals(before)
    assert grown_kb < 64 * 1024, grown_kb  # every empty batch held: about 172 MB


def test_a_compaction_cut_short_reads_every_row_once_and_the_next_one_finishes_it(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    segment = sorted((root / "decisions").glob(f"*{SUFFIX}"))[0]
    kept = segment.read_bytes()
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    segment.write_bytes(kept)  # as if the run died after writing the parts, before removing the segment
    assert _rows(root, "decisions").equals(_rows(logs, "decisions"))  # its parts are ignored: no row twice
    again = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert again.segments == 1 and not segment.exists()
    assert _rows(root, "decisions").equals(_rows(logs, "decisions"))


def test_only_segments_wholly_older_than_the_cutoff_are_compacted(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    n = len(list((root / "decisions").glob(f"*{SUFFIX}")))
    assert compact(DirectorySource(root), "decisions", before_s=0.0).to_dict() == {"segments": 0, "parts": 0, "rows": 0, "kept": n,
                                                                                     "unreadable": 0}
    split = compact(DirectorySource(root), "decisions", before_s=10_000.0)  # the first clock reading's segments only
    assert 0 < split.segments < n and split.kept == n - split.segments
    assert _rows(root, "decisions").equals(_rows(logs, "decisions"))


def test_a_full_disk_leaves_the_logs_as_they_were(small_disk: SmallDisk) -> None:
    root = _log(small_disk.path / "logs", range(15))
    before = _rows(root, "decisions")
    small_disk.fill()
    with pytest.raises(OSError):
        compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert _rows(root, "decisions").equals(before)
    assert not list((root / "decisions").rglob(".tmp-*"))  # no half-written part left behind
    small_disk.free()
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert _rows(root, "decisions").equals(before) and not list((root / "decisions").glob(f"*{SUFFIX}"))


def test_symbolic_links_in_the_logs_are_neither_followed_nor_written_through(logs: Path, tmp_path: Path) -> None:
    """A link to / (readers walked the whole host filesystem) or to a segment elsewhere is not listed; an hour directory
    that is a link is not compacted into (the part would land outside the logs volume) and its segment stays."""
    root = _copy(logs, tmp_path)
    before = _rows(root, "decisions")
    outside = tmp_path / "outside"
    outside.mkdir()
    elsewhere = next((root / "decisions").glob(f"*{SUFFIX}"))
    shutil.copy(elsewhere, outside / f"copy{SUFFIX}")
    (root / "decisions" / f"{HOUR_PREFIX}1970-01-01T00").symlink_to("/")
    (root / "decisions" / f"linked{SUFFIX}").symlink_to(outside / f"copy{SUFFIX}")
    assert _rows(root, "decisions").equals(before)  # neither link read: no row twice, no walk of /
    (outside / f"{TMP_PREFIX}not-ours").write_bytes(b"someone else's")  # what a killed compaction's leftover is named
    hour = hour_of(7_000.0)  # the first run's segments fall in this hour
    (root / "decisions" / f"{HOUR_PREFIX}{hour}").symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError, match="a symbolic link where an hour directory belongs"):
        compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert not list(outside.glob(f"*{PART_SUFFIX}")) and _rows(root, "decisions").equals(before)
    assert (outside / f"{TMP_PREFIX}not-ours").exists()  # the sweep of leftovers did not reach through the link either


def test_a_kind_directory_that_is_a_link_is_not_compacted_through(logs: Path, tmp_path: Path) -> None:
    """The compactor wrote parts where the link pointed and removed the segments there (an attack review, 2026-12-06).
    Readers read through it, as the servers write through it: whoever can put a link in the logs volume can put
    segments there too."""
    elsewhere = _copy(logs, tmp_path)
    root = tmp_path / "linked"
    root.mkdir()
    (root / "outcomes").symlink_to(elsewhere / "outcomes", target_is_directory=True)
    before = sorted(p.name for p in (elsewhere / "outcomes").iterdir())
    assert _rows(root, "outcomes").equals(_rows(logs, "outcomes"))
    with pytest.raises(ValueError, match=r"linked/outcomes: a symbolic link where a log kind's directory belongs"):
        compact(DirectorySource(root), "outcomes", before_s=float("inf"))
    assert sorted(p.name for p in (elsewhere / "outcomes").iterdir()) == before  # nothing written or removed


@pytest.mark.parametrize("time_s", [float("nan"), -1e20, 1e20])
def test_a_segment_with_a_time_no_clock_wrote_is_left_and_the_others_compacted(logs: Path, tmp_path: Path,
                                                                               time_s: float) -> None:
    """One such row used to stop every compaction of the directory (exit 2 for NaN, 1 for -1e20)."""
    root = _copy(logs, tmp_path)
    segments = sorted((root / "decisions").glob(f"*{SUFFIX}"))
    _set_first_row(segments[0], "time_s", time_s)
    done = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert done.unreadable == 1 and done.segments == len(segments) - 1
    assert sorted((root / "decisions").glob(f"*{SUFFIX}")) == segments[:1]  # left as it is


def test_a_segment_with_a_null_session_id_is_left_and_a_part_with_one_refused_by_name(logs: Path, tmp_path: Path) -> None:
    """The reader stops at such a batch (``experience.segments.unwritten_by_servers``); compacting it would have made a
    part the reader could not tell from the compactor's own."""
    root = _copy(logs, tmp_path)
    segments = sorted((root / "decisions").glob(f"*{SUFFIX}"))
    table = _set_first_row(segments[0], "session_id", None)
    assert table.schema.equals(DECISIONS, check_metadata=False)  # the schema says "not null"; the data has one
    done = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert done.unreadable == 1 and sorted((root / "decisions").glob(f"*{SUFFIX}")) == segments[:1]
    segments[0].unlink()
    part = next((root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match=r"not a log part that compact writes: session_id: null values"):
        _rows(root, "decisions")


@pytest.mark.parametrize("column", ["item_embedding", "behavior_bucket_indices"])
def test_a_null_inside_a_list_ends_the_segments_read_too(logs: Path, tmp_path: Path, column: str) -> None:
    """A null element of an embedding stopped `evaluate` (NaN from the model), of the behaviour buckets `train`."""
    root = _copy(logs, tmp_path)
    segment = sorted((root / "decisions").glob(f"*{SUFFIX}"))[0]
    whole = _rows(root, "decisions").num_rows
    in_segment = pa.ipc.open_stream(pa.memory_map(str(segment))).read_all().num_rows
    _set_first_row(segment, column, [None])  # a list whose one element is null
    assert _rows(root, "decisions").num_rows == whole - in_segment  # the segment is one batch: none of it is read


def test_the_compact_command(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "server", "logs", "compact", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)

    done = run(str(root), "--older-than-hours", "0")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["compacted"]["decisions"]["segments"] >= 2 and report["compacted"]["outcomes"]["kept"] == 0
    assert not list(root.rglob(f"*{SUFFIX}"))
    assert run(str(tmp_path / "nowhere")).returncode == 2
    bad = run(str(root), "--older-than-hours", "-1")
    assert bad.returncode == 2 and "--older-than-hours" in bad.stderr
    remote = run("s3://bucket/logs")  # refused before any network: a usage error, not one to retry
    assert remote.returncode == 2 and "local directory" in remote.stderr

    # `logs cat` on the parts: a reader that stops early (| head) ends it quietly; a broken part is named, exit 1
    cat = subprocess.Popen([sys.executable, "-m", "server", "logs", "cat", str(root), "--kind", "decisions"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert cat.stdout is not None and json.loads(cat.stdout.readline())["kind"] == "decisions"
    cat.stdout.close()
    _, err = cat.communicate(timeout=60)
    assert cat.returncode == 0 and "Traceback" not in err, err
    next((root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}")).write_bytes(b"torn")
    broken = subprocess.run([sys.executable, "-m", "server", "logs", "cat", str(root)], capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert broken.returncode == 1 and "not a readable log part" in broken.stderr and "Traceback" not in broken.stderr


def test_logs_cat_fields_a_typo_is_named_and_a_field_of_one_kind_prints_that_kind_alone(logs: Path) -> None:
    def cat(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "server", "logs", "cat", str(logs), *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)

    typo = cat("--fields", "decision_id,nosuchfield")  # once printed a bare {"kind": …} per record, exit 0
    assert typo.returncode == 2 and typo.stdout == "", typo.stderr
    assert "no column 'nosuchfield' in decisions, outcomes" in typo.stderr and "columns: " in typo.stderr
    assert "outcome_id" in typo.stderr.split("columns: ")[1]  # the valid ones, of every kind printed
    one_kind = cat("--fields", "outcome_id")  # a column outcomes have: their records, not a bare line per decision
    assert one_kind.returncode == 0, one_kind.stderr
    lines = [json.loads(line) for line in one_kind.stdout.splitlines()]
    assert lines and {line["kind"] for line in lines} == {"outcomes"} and all(set(line) == {"kind", "outcome_id"} for line in lines)
    assert cat("--kind", "outcomes", "--fields", "action").returncode == 2  # a decision's column, but only outcomes print


def test_a_reader_that_listed_a_segment_before_it_was_compacted_reads_its_parts(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    source = DirectorySource(root)
    listed = source.segments("decisions")  # a trainer's listing, then a compaction runs before it reads
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert all(p.endswith(SUFFIX) and not Path(p).exists() for p in listed)
    rows = pa.Table.from_batches([b for p in listed for b in source.segment_batches(p, "decisions")])
    assert rows.sort_by("decision_id").equals(_rows(logs, "decisions"))


def test_a_segment_spanning_hours_becomes_one_part_an_hour(tmp_path: Path) -> None:
    ticks = iter(range(3_000, 10_000_000, 7))  # the clock moves 7 s a record: the segments cross hour boundaries
    root = tmp_path / "logs"
    model = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    run_logged(World(SimConfig(), 4), model, range(80), ZoneInfo("UTC"), root, b"c" * 32, clock=lambda: float(next(ticks)),
               batch=32)
    before = _rows(root, "decisions")
    done = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert done.parts > done.segments  # some segment went into more than one hour's part
    assert _rows(root, "decisions").equals(before)
    stems = [p.name for p in (root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}")]
    assert len(stems) > len(set(stems))  # one name, several hours


def test_a_segment_that_does_not_read_whole_is_never_replaced(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    segments = sorted((root / "decisions").glob(f"*{SUFFIX}"))
    damaged, whole = segments[0], segments[1:]
    data = bytearray(damaged.read_bytes())
    source, starts = pa.BufferReader(bytes(data)), []
    messages = pa.ipc.MessageReader.open_stream(source)
    while True:  # where each message starts
        starts.append(source.tell())
        try:
            messages.read_next_message()
        except StopIteration:
            break
    assert len(starts) > 4
    cut = starts[len(starts) // 2]
    data[cut : cut + 8] = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an end-of-stream mark midway: a reader stops there
    damaged.write_bytes(bytes(data))
    readable = _rows(root, "decisions")  # an ordinary read stops quietly at the damage
    assert readable.num_rows < _rows(logs, "decisions").num_rows
    done = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert done.unreadable == 1 and done.segments == len(whole)
    assert damaged.exists() and bytes(data) == damaged.read_bytes()  # kept, byte for byte: nothing lost
    assert _rows(root, "decisions").equals(readable)


def test_one_compaction_at_a_time_and_a_killed_ones_temp_files_are_swept(logs: Path, tmp_path: Path) -> None:
    import fcntl

    root = _copy(logs, tmp_path)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another compaction holds the directory
    try:
        with pytest.raises(CompactionBusy, match="another compaction"):
            compact(DirectorySource(root), "decisions", before_s=float("inf"))
        assert len(list((root / "decisions").glob(f"*{SUFFIX}"))) > 0  # it touched nothing
    finally:
        os.close(fd)
    stale = root / "decisions" / f"{HOUR_PREFIX}2026-01-01T00" / ".tmp-dead-beef.arrow"
    stale.parent.mkdir()
    stale.write_bytes(b"half a part")
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert not stale.exists() and _rows(root, "decisions").equals(_rows(logs, "decisions"))
    part = next((root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    assert part.stat().st_mode & 0o777 == 0o640  # as private as the segments it replaced


def test_a_part_that_is_not_a_log_part_of_its_kind_is_refused_by_name(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    compact(DirectorySource(root), "outcomes", before_s=float("inf"))
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    hour = next((root / "decisions").glob(f"{HOUR_PREFIX}*"))
    foreign = next((root / "outcomes").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    shutil.copy(foreign, hour / "z-an-outcomes-part.arrow")  # in a decisions hour
    with pytest.raises(ValueError, match=r"z-an-outcomes-part\.arrow: not a decisions log part"):
        _rows(root, "decisions")
    (hour / "z-an-outcomes-part.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match=r"z-an-outcomes-part\.arrow: not a readable log part"):
        _rows(root, "decisions")


def test_a_part_missing_a_column_is_refused_by_name_unless_the_column_came_later(logs: Path, tmp_path: Path) -> None:
    """Only the columns added within the schema version (``experience.schema.ADDED_IN_V2``) may be missing from a part."""
    root = _copy(logs, tmp_path)
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    part = next((root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    table = pa.ipc.open_file(pa.memory_map(str(part))).read_all().drop_columns(["propensity"])
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match=r"the log part has no column 'propensity'"):
        _rows(root, "decisions")


def _bad_offsets(table: pa.Table) -> pa.Table:
    """``table``'s first two rows with the session ids' string offsets out of order and past their data: what a crafted
    file holds (with an offset of 2,000,000,000 every reader crashed, SIGSEGV: an attack review, 2026-12-06)."""
    head = table.slice(0, 2).combine_chunks()
    offsets = pa.py_buffer(np.array([0, 5, 2], dtype=np.int32).tobytes())
    bad = pa.StringArray.from_buffers(2, offsets, pa.py_buffer(b"ab"))
    return head.set_column(head.schema.get_field_index("session_id"), head.schema.field("session_id"), bad)


def test_a_part_with_offsets_past_its_data_is_refused_by_name(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    compact(DirectorySource(root), "decisions", before_s=float("inf"))
    part = next((root / "decisions").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    bad = _bad_offsets(pa.ipc.open_file(pa.memory_map(str(part))).read_all())
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_file(sink, bad.schema) as writer:
        writer.write_table(bad)
    for columns in (None, NARROW):  # the wide pass and the narrow one
        with pytest.raises(ValueError, match=rf"{part.name}: not a readable log part: .*[Oo]ffset"):
            list(DirectorySource(root).segment_batches(str(part), "decisions", columns))


def test_a_part_with_damaged_bytes_is_refused_by_name_whatever_the_damage(logs: Path, tmp_path: Path) -> None:
    """One to three bytes changed past a real part's first 8 bytes, 300 ways: each read either gives the part's rows or
    raises the ``ValueError`` that names the file. pyarrow names the damage with several errors (``OSError``, its memory
    and not-implemented errors went out unnamed), and some of it it does not check unless asked (a reader crashed)."""
    root = _copy(logs, tmp_path)
    compact(DirectorySource(root), "outcomes", before_s=float("inf"))
    part = next((root / "outcomes").glob(f"{HOUR_PREFIX}*/*{PART_SUFFIX}"))
    data = part.read_bytes()
    rows = pa.ipc.open_file(pa.BufferReader(data)).read_all().num_rows
    random = np.random.default_rng(2)
    refused = 0
    for _ in range(300):
        copy = bytearray(data)
        for _ in range(int(random.integers(1, 4))):
            copy[int(random.integers(8, len(copy)))] = int(random.integers(0, 256))
        part.write_bytes(bytes(copy))
        try:
            batches = list(DirectorySource(root).segment_batches(str(part), "outcomes"))
        except ValueError as exc:
            assert str(exc).startswith(f"{part}: "), exc
            refused += 1
            continue
        for batch in batches:  # a damaged value byte reads as a value; a damaged offset never reads at all
            batch.validate(full=True)
        assert sum(b.num_rows for b in batches) == rows
    assert 50 < refused < 250  # (with seed 2: most damage reads as values or is refused by name, some only by the check)


def test_a_segment_with_offsets_past_its_data_is_left_as_it_is(logs: Path, tmp_path: Path) -> None:
    """The readers stop at such a batch; the compactor read it without the full check and wrote a part of whatever
    lay past the data (or crashed), then removed the segment."""
    root = _copy(logs, tmp_path)
    segments = sorted((root / "decisions").glob(f"*{SUFFIX}"))
    with pa.OSFile(str(segments[0]), "rb") as f:
        bad = _bad_offsets(pa.ipc.open_stream(f).read_all())
    with pa.OSFile(str(segments[0]), "wb") as sink, pa.ipc.new_stream(sink, bad.schema) as writer:
        writer.write_table(bad)
    kept = segments[0].read_bytes()
    done = compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert done.unreadable == 1 and done.segments == len(segments) - 1
    assert segments[0].read_bytes() == kept


@pytest.mark.parametrize("swap", ["link", "fifo"])
def test_a_part_swapped_after_the_listing_is_refused_by_name_never_followed_or_waited_on(logs: Path, tmp_path: Path,
                                                                                        swap: str) -> None:
    root = _copy(logs, tmp_path)
    compact(DirectorySource(root), "outcomes", before_s=float("inf"))
    source = DirectorySource(root)
    part = next(p for p in source.segments("outcomes") if p.endswith(PART_SUFFIX))
    replacement = tmp_path / "replacement"
    if swap == "link":
        (tmp_path / "outside.arrow").write_bytes(Path(part).read_bytes())
        replacement.symlink_to(tmp_path / "outside.arrow")
    else:
        os.mkfifo(replacement)
    os.replace(replacement, part)
    with pytest.raises(ValueError, match=rf"{part}: not a readable log part"):
        promptly(lambda: list(source.segment_batches(part, "outcomes")), fifo=Path(part) if swap == "fifo" else None)


def test_the_compactions_lock_is_never_created_through_a_link(logs: Path, tmp_path: Path) -> None:
    root = _copy(logs, tmp_path)
    (root / LOCK_NAME).symlink_to(tmp_path / "lock-target")
    with pytest.raises(OSError) as info:
        compact(DirectorySource(root), "decisions", before_s=float("inf"))
    assert info.value.errno == errno.ELOOP and not (tmp_path / "lock-target").exists()
