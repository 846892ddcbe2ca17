"""The window-read bench on a tiny history: its baseline directory holds the last version alone, and all three reads
give the same window (the bench asserts it) with the history's older segments really there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.window_read import main
from experience.segments import DirectorySource


def test_the_bench_reads_one_window_three_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "history"
    assert main(["--versions", "3", "--sessions", "100", "--data", str(data), "--json", str(tmp_path / "out.json")]) == 0
    history, alone = DirectorySource(data), DirectorySource(tmp_path / "history-last")
    assert len(alone.segments("decisions")) < len(history.segments("decisions"))
    versions = {v for p in alone.segments("decisions") for b in alone.segment_batches(p, "decisions", ["model_version"])
                for v in b.column("model_version").to_pylist()}
    assert versions == {"v02"}
    assert json.loads((data / "bench-info.json").read_text())["versions"] == 3
    decoded = json.loads((tmp_path / "out.json").read_text())["decoded_segments"]  # the pruning, and its baseline's lack
    assert decoded == {"alone": len(alone.segments("decisions")), "history": len(alone.segments("decisions")),
                       "every_segment": len(history.segments("decisions"))}
    assert "every segment decoded" in capsys.readouterr().out
