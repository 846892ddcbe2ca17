"""Reading a run's logs in two passes gives the window and sample that selecting on every row gives, from real segments."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from bench.window_read import DecodeCounting
from experience.segments import DirectorySource, open_logs, read_segment, redacted
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import fresh_bundle
from trainer.cli import UsageError, _source, _window
from trainer.config import TrainConfig
from trainer.reading import read_window
from trainer.window import for_config
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two model versions, several segments each, as the CronJob finds them."""
    root = tmp_path_factory.mktemp("reading-logs")
    model = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    world = World(SimConfig(), 5)
    run_logged(world, model, range(300), ZoneInfo("UTC"), root, b"r" * 32, clock=lambda: 1_000.0, batch=64)
    later = ModelSet.load(read_bundle(make_bundle(7, "later", "2026-12-01T00:00:00Z")), LoadOptions(warmup_batch=8))
    run_logged(world, later, range(300, 600), ZoneInfo("UTC"), root, b"r" * 32, clock=lambda: 9_000.0, batch=64)
    return root


@pytest.mark.parametrize("config", [
    TrainConfig(),  # the last version
    TrainConfig(window_versions=None),  # everything
    TrainConfig(window_versions=None, max_sessions=150, sample_key=3),
    TrainConfig(window_versions=None, window_hours=1.0),
    TrainConfig(window_versions=None, max_sessions=10_000),
])
def test_two_passes_read_exactly_what_selecting_on_every_row_reads(logs: Path, config: TrainConfig) -> None:
    source = DirectorySource(logs)
    assert len(source.segments("decisions")) >= 2  # really more than one segment
    whole = for_config(source.table("decisions"), source.table("outcomes"), config)
    read = read_window(DirectorySource(logs), config)
    assert read.decisions.equals(whole.decisions) and read.outcomes.equals(whole.outcomes)
    assert read.versions == whole.versions and read.describe() == whole.describe()
    assert read.decisions.num_rows > 0


@pytest.mark.parametrize("config", [TrainConfig(), TrainConfig(window_versions=None, max_sessions=150, sample_key=3)])
def test_compacted_logs_read_as_the_same_window(logs: Path, tmp_path: Path, config: TrainConfig) -> None:
    """Columnar parts (``logs compact``) in place of some segments: the same window and sample, read column by column."""
    from experience.columnar import compact

    root = Path(shutil.copytree(logs, tmp_path / "logs"))
    assert compact(DirectorySource(root), "decisions", before_s=5_000.0).segments > 0  # the first version's segments
    assert compact(DirectorySource(root), "outcomes", before_s=float("inf")).segments > 0
    streams, parts = read_window(DirectorySource(logs), config), read_window(DirectorySource(root), config)
    for kind, key in (("decisions", "decision_id"), ("outcomes", "outcome_id")):
        assert getattr(parts, kind).sort_by(key).equals(getattr(streams, kind).sort_by(key))
    assert parts.versions == streams.versions and parts.describe() == streams.describe() and parts.chosen == streams.chosen


@pytest.fixture
def memory() -> Iterator[Any]:
    """fsspec's in-memory filesystem (one store per process), emptied after the test."""
    from fsspec.implementations.memory import MemoryFileSystem

    fs = MemoryFileSystem()
    fs.store.clear()
    yield fs
    fs.store.clear()


def _copied(logs: Path, memory: Any, root: str) -> None:
    """The log directory copied, byte for byte, into the in-memory filesystem, with a hidden open segment and a
    stray file."""
    for path in sorted(logs.rglob("*")):
        if path.is_file():
            memory.pipe_file(f"{root}/{path.relative_to(logs).as_posix()}", path.read_bytes())
    memory.pipe_file(f"{root}/decisions/.open-still-writing.arrows", b"half a segment")
    memory.pipe_file(f"{root}/decisions/notes.txt", b"not a segment")


def test_logs_on_another_filesystem_read_as_the_same_window(logs: Path, memory: Any) -> None:
    _copied(logs, memory, "/shop-logs")
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(memory))  # how any fsspec store, or a pyarrow one such as S3, is read
    remote, local = DirectorySource("/shop-logs", filesystem=fs), DirectorySource(logs)
    assert [Path(p).name for p in remote.segments("decisions")] == [Path(p).name for p in local.segments("decisions")]
    assert remote.has("decisions") and not remote.local and not DirectorySource("/nowhere", filesystem=fs).has("decisions")
    with pytest.raises(ValueError, match="kind: expected one of"):
        remote.segments("clicks")
    config = TrainConfig(window_versions=None, max_sessions=150, sample_key=3)
    read, whole = read_window(remote, config), read_window(local, config)
    assert read.decisions.equals(whole.decisions) and read.outcomes.equals(whole.outcomes)
    assert read.describe() == whole.describe() and read.decisions.num_rows > 0


def test_the_trainer_reads_a_uri_of_a_store_it_has_no_path_to(logs: Path, memory: Any) -> None:
    _copied(logs, memory, "/shop-logs")
    bundle = read_bundle(make_bundle(7, "later", "2026-12-01T00:00:00Z"))
    config = TrainConfig(window_versions=None)
    (logs / ".user-salt").write_text("ab" * 32)  # a local server's salt: read only beside a local directory
    try:
        source = _source("memory://shop-logs", bundle)  # what `train --logs memory://shop-logs` opens
        assert not source.local and source.v1.salt == b"" and _source(str(logs), bundle).v1.salt == b"\xab" * 32
    finally:
        (logs / ".user-salt").unlink()  # the module's logs are shared
    read, whole = _window("memory://shop-logs", bundle, config), read_window(DirectorySource(logs), config)
    assert read.decisions.equals(whole.decisions) and read.outcomes.equals(whole.outcomes) and read.decisions.num_rows > 0
    with pytest.raises(UsageError, match="--logs: memory://elsewhere has no decisions/ directory"):
        _source("memory://elsewhere", bundle)


def test_a_file_uri_and_a_path_are_the_same_logs(logs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_uri = open_logs(logs.as_uri())
    assert by_uri.local and by_uri.root == str(logs.resolve()) and by_uri.segments("outcomes") == DirectorySource(logs).segments("outcomes")
    monkeypatch.chdir(logs.parent)
    relative = open_logs(logs.name)  # a relative directory, as a person types it
    assert relative.local and relative.root == str(logs.resolve()) and relative.segments("decisions") == by_uri.segments("decisions")


def test_a_location_no_filesystem_takes_is_named_without_its_credentials() -> None:
    assert redacted("s3://KEY:SECRET@bucket/logs?region=x&secret_key=S2") == "s3://bucket/logs"
    assert redacted("memory:///a/b") == "memory:///a/b" and redacted("/pv/logs") == "/pv/logs" and redacted("gs://bucket/a/b") == "gs://bucket/a/b"
    with pytest.raises(ValueError, match=r"^nosuch://bucket/logs: not a log location pyarrow.fs or fsspec can open") as caught:
        open_logs("nosuch://KEY:SECRET@bucket/logs?secret_key=S2")
    assert "SECRET" not in str(caught.value) and "S2" not in str(caught.value)


def test_a_read_cut_off_before_the_end_of_a_segment_raises(logs: Path, memory: Any) -> None:
    """A torn last batch (a writer killed mid-write) ends a segment quietly; a connection dropped halfway through
    one must not: the rest of the segment is not there to be skipped."""
    import io

    from fsspec.implementations.memory import MemoryFileSystem

    class Cut(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            if self.tell() + (n if n is not None and n >= 0 else len(self.getbuffer())) > len(self.getbuffer()) // 2:
                raise ConnectionResetError("connection reset by peer")
            return super().read(n)

    class Dropping(MemoryFileSystem):  # type: ignore[misc]
        protocol = "cut-test"

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return str(MemoryFileSystem._strip_protocol(path.replace("cut-test://", "memory://", 1)))

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            return Cut(memory.cat_file(path))

    segment = DirectorySource(logs).segments("decisions")[0]
    memory.pipe_file("/cut/decisions/a.arrows", Path(segment).read_bytes())
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(Dropping()))
    with pytest.raises(OSError, match="connection reset"):
        list(read_segment("/cut/decisions/a.arrows", fs))
    import fsspec

    from server.cli import main

    fsspec.register_implementation("cut-test", Dropping, clobber=True)
    assert main(["evaluate", "default", "--logs", "cut-test:///cut", "--bootstrap", "20"]) == 1  # a failure the CronJob retries
    data = Path(segment).read_bytes()
    memory.pipe_file("/torn/decisions/a.arrows", data[: len(data) - 100])  # a killed writer's last batch, whole bytes
    torn = sum(b.num_rows for b in read_segment("/torn/decisions/a.arrows", pafs.PyFileSystem(pafs.FSSpecHandler(memory))))
    assert 0 < torn < sum(b.num_rows for b in read_segment(segment))


def test_an_empty_log_directory_reads_as_an_empty_window(tmp_path: Path) -> None:
    (tmp_path / "decisions").mkdir()
    window = read_window(DirectorySource(tmp_path), TrainConfig())
    assert window.decisions.num_rows == 0 and window.outcomes.num_rows == 0 and window.describe()["sessions"] == 0


def test_the_wide_pass_keeps_the_chosen_rows_in_order_across_segments_gathered_into_batches() -> None:
    import pyarrow as pa

    from trainer.reading import rows_of

    schema = pa.schema([("session_id", pa.string()), ("x", pa.int64())])
    segments = [pa.table({"session_id": ["a", "b", "c"], "x": [0, 1, 2]}, schema=schema),
                schema.empty_table(),  # a segment with no rows (a recovered, empty one)
                pa.table({"session_id": ["a", "d", "c", "a"], "x": [3, 4, 5, 6]}, schema=schema)]
    batches = list(rows_of(iter(segments), pa.chunked_array([["a", "c"]]), rows=2))
    assert [b.num_rows for b in batches] == [2, 3]  # at least 2 rows a batch; the last one is what is left
    assert [x for b in batches for x in b.column("x").to_pylist()] == [0, 2, 3, 5, 6]
    assert list(rows_of(iter([schema.empty_table()]), pa.chunked_array([["a"]]), rows=2)) == []


def _newest_times(source: DirectorySource) -> dict[str, float]:
    return {p: max(t for b in source.segment_batches(p, "decisions", ["time_s"]) for t in b.column("time_s").to_pylist())
            for p in source.segments("decisions")}


def test_the_wide_pass_leaves_out_the_segments_older_than_the_chosen_sessions(logs: Path) -> None:
    """The last version's window: the first version's segments (all logged at 1,000) are not decoded again; the
    whole history's window reads every segment."""
    newest = _newest_times(DirectorySource(logs))
    assert sorted(set(newest.values())) == [1_000.0, 9_000.0]
    last = DecodeCounting(logs)
    window = read_window(last, TrainConfig())
    assert sorted(last.wide) == sorted(p for p, t in newest.items() if t == 9_000.0) and window.versions == ["later"]
    everything = DecodeCounting(logs)
    read_window(everything, TrainConfig(window_versions=None))
    assert sorted(everything.wide) == sorted(newest)


def test_a_session_that_began_in_an_older_segment_keeps_all_its_rows(tmp_path: Path) -> None:
    """A clock that moves: sessions run across segments. An hours window whose start falls inside the run: the
    segments before its first chosen session are left out, and the window is still exactly the one selecting on
    every row gives, sessions that span segments whole."""
    import itertools

    from experience.recorder import ExperienceRecorder, RecorderOptions
    from simulator.drive import run_in_process

    model = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    ticks = itertools.count(0.0, 2.0)
    recorder = ExperienceRecorder(tmp_path, b"t" * 32, RecorderOptions(segment_bytes=256 * 1024), clock=lambda: next(ticks))
    try:
        run_in_process(World(SimConfig(), 6), model, range(400), ZoneInfo("UTC"), recorder, batch=32)
    finally:
        recorder.close()
    source = DirectorySource(tmp_path)
    newest = _newest_times(source)
    assert len(newest) >= 4
    config = TrainConfig(window_versions=None, window_hours=(max(newest.values()) - sorted(newest.values())[1]) / 3600.0)
    counting = DecodeCounting(tmp_path)
    read = read_window(counting, config)
    whole = for_config(source.table("decisions"), source.table("outcomes"), config)
    assert read.decisions.equals(whole.decisions) and read.outcomes.equals(whole.outcomes) and read.describe() == whole.describe()
    assert 0 < len(counting.wide) < len(newest)  # something was left out, something read
    by_segment = {p: {sid for b in source.segment_batches(p, "decisions", ["session_id"]) for sid in b.column("session_id").to_pylist()}
                  for p in counting.wide}
    kept = set(read.decisions.column("session_id").to_pylist())
    assert any(sum(s in ids for ids in by_segment.values()) > 1 for s in kept)  # a kept session spans segments



def test_a_segment_with_a_time_that_orders_nothing_is_always_read() -> None:
    """Arrow's max passes over NaN and null: such a segment's newest is +inf (never left out), an empty one's -inf, and
    a chosen session without a finite first time turns the pruning off; no chosen session leaves out everything."""
    import math

    import pyarrow as pa

    from trainer.reading import earliest_start, newest_time, older_than
    from trainer.session_index import SessionIndex

    def times(*t: float | None) -> pa.Table:
        return pa.table({"time_s": pa.array(t, pa.float64())})

    assert newest_time(times(1.0, 5.0)) == 5.0 and newest_time(times()) == -math.inf
    assert newest_time(times(float("nan"), 5.0)) == math.inf and newest_time(times(None, 5.0)) == math.inf
    assert older_than({"a": 5.0, "b": math.inf, "c": -math.inf, "d": 10.0}, 10.0) == {"a", "c"}
    assert older_than({"a": 5.0}, None) == frozenset()
    index = SessionIndex.of([pa.table({"session_id": ["s", "t", "u"], "time_s": [3.0, float("nan"), 7.0],
                                       "model_version": ["v", "v", "v"]})])
    assert earliest_start(index, pa.chunked_array([["s", "u"]])) == 3.0
    assert earliest_start(index, pa.chunked_array([["s", "t"]])) is None
    assert earliest_start(index, pa.chunked_array([pa.array([], pa.string())])) == math.inf


@pytest.mark.parametrize("config", [TrainConfig(), TrainConfig(window_versions=None, max_sessions=150, sample_key=3, gate_sessions=40)])
def test_the_gate_reads_the_windows_held_out_sessions_after_training(logs: Path, config: TrainConfig) -> None:
    """``cycle`` names the gate's sessions in the two-pass read and reads them in a third: the held-out side of the whole
    window (every row of those sessions, in log order) — when the window fits in the sample exactly the sample's own
    held-out side, as ``cycle`` judged before — and the manifest's window record says how many."""
    from trainer.data import heldout_sessions, side
    from trainer.reading import read_gate

    source = DirectorySource(logs)
    window = read_window(source, config, gate=True)
    assert window.gate is not None and read_window(source, config).gate is None  # named only when asked (cycle)
    decisions, outcomes = read_gate(source, window.gate)
    everything = for_config(source.table("decisions"), source.table("outcomes"),
                            TrainConfig(window_versions=config.window_versions, max_sessions=None))
    held = side(everything.decisions, everything.outcomes, config.heldout_fraction, config.seed, heldout=True)
    gate_ids = set(decisions.column("session_id").to_pylist())
    assert gate_ids == set(window.gate.ids.to_pylist()) and window.describe()["gate_sessions"] == len(gate_ids) > 0
    if config.gate_sessions is None or len(set(held[0].column("session_id").to_pylist())) <= config.gate_sessions:
        assert decisions.equals(held[0]) and outcomes.equals(held[1])
        if config.max_sessions is not None and window.sessions_in_window <= config.max_sessions:  # the window fits the sample
            own = side(window.decisions, window.outcomes, config.heldout_fraction, config.seed, heldout=True)
            assert decisions.equals(own[0]) and outcomes.equals(own[1])
    else:  # capped: that many whole sessions of the held-out side, with every row of theirs, the sample's own among them
        assert len(gate_ids) == config.gate_sessions
        rows = everything.decisions.filter(pa.array([s in gate_ids for s in everything.decisions.column("session_id").to_pylist()]))
        assert decisions.equals(rows)
        assert heldout_sessions(decisions.column("session_id"), config.heldout_fraction, config.seed).all()
        own = side(window.decisions, window.outcomes, config.heldout_fraction, config.seed, heldout=True)[0]
        assert set(own.column("session_id").to_pylist()) <= gate_ids
