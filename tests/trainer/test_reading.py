"""Reading a run's logs in two passes gives the window and sample that selecting on every row gives, from real segments."""

from __future__ import annotations

from pathlib import Path
from zoneinfo import ZoneInfo

import pyarrow.fs as pafs
import pytest

from experience.segments import DirectorySource, open_source
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import fresh_bundle
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


def _in_memory(logs: Path, root: str) -> pafs.FileSystem:
    """The log directory copied, byte for byte, into an fsspec in-memory filesystem seen through ``pyarrow.fs``
    (how any fsspec store, or a pyarrow one such as S3, is read); with a hidden open segment and a stray file."""
    from fsspec.implementations.memory import MemoryFileSystem

    memory = MemoryFileSystem()
    for path in sorted(logs.rglob("*")):
        if path.is_file():
            memory.pipe_file(f"{root}/{path.relative_to(logs).as_posix()}", path.read_bytes())
    memory.pipe_file(f"{root}/decisions/.open-still-writing.arrows", b"half a segment")
    memory.pipe_file(f"{root}/decisions/notes.txt", b"not a segment")
    return pafs.PyFileSystem(pafs.FSSpecHandler(memory))


def test_logs_on_another_filesystem_read_as_the_same_window(logs: Path) -> None:
    fs = _in_memory(logs, "/shop-logs-test")
    remote, local = DirectorySource("/shop-logs-test", filesystem=fs), DirectorySource(logs)
    assert [Path(p).name for p in remote.segments("decisions")] == [Path(p).name for p in local.segments("decisions")]
    assert remote.has("decisions") and remote.local_root is None and not DirectorySource("/nowhere", filesystem=fs).has("decisions")
    config = TrainConfig(window_versions=None, max_sessions=150, sample_key=3)
    read, whole = read_window(remote, config), read_window(local, config)
    assert read.decisions.equals(whole.decisions) and read.outcomes.equals(whole.outcomes)
    assert read.describe() == whole.describe() and read.decisions.num_rows > 0


def test_a_file_uri_and_a_path_are_the_same_logs(logs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_uri = open_source(logs.as_uri())
    assert by_uri.local_root == logs.resolve() and by_uri.segments("outcomes") == DirectorySource(logs).segments("outcomes")
    monkeypatch.chdir(logs.parent)
    relative = open_source(logs.name)  # a relative directory, as a person types it
    assert relative.local_root == logs.resolve() and relative.segments("decisions") == by_uri.segments("decisions")
    with pytest.raises(ValueError, match=r"nosuch://bucket/logs: not a log location pyarrow.fs can open"):
        open_source("nosuch://bucket/logs")


def test_an_empty_log_directory_reads_as_an_empty_window(tmp_path: Path) -> None:
    (tmp_path / "decisions").mkdir()
    window = read_window(DirectorySource(tmp_path), TrainConfig())
    assert window.decisions.num_rows == 0 and window.outcomes.num_rows == 0 and window.describe()["sessions"] == 0


def test_the_wide_pass_keeps_the_chosen_rows_in_order_across_segments_gathered_into_batches() -> None:
    import pyarrow as pa

    from trainer.reading import _rows_of

    schema = pa.schema([("session_id", pa.string()), ("x", pa.int64())])
    segments = [pa.table({"session_id": ["a", "b", "c"], "x": [0, 1, 2]}, schema=schema),
                schema.empty_table(),  # a segment with no rows (a recovered, empty one)
                pa.table({"session_id": ["a", "d", "c", "a"], "x": [3, 4, 5, 6]}, schema=schema)]
    batches = list(_rows_of(iter(segments), pa.chunked_array([["a", "c"]]), rows=2))
    assert [b.num_rows for b in batches] == [2, 3]  # at least 2 rows a batch; the last one is what is left
    assert [x for b in batches for x in b.column("x").to_pylist()] == [0, 2, 3, 5, 6]
    assert list(_rows_of(iter([schema.empty_table()]), pa.chunked_array([["a"]]), rows=2)) == []
