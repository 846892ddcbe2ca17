"""core.progress: JSON lines a stage in a job's log (periodic and final, with an ETA), a tqdm bar on a terminal."""

from __future__ import annotations

import io
import json

import pytest

from core.progress import mode_for, progress
from tests.clock import ManualClock


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_come_every_interval_and_at_the_end_with_counts_and_eta() -> None:
    out, clock = io.StringIO(), ManualClock(100.0)
    with progress("read.narrow", total=10, unit="segment", stream=out, mode="json", every_s=5.0, clock=clock) as bar:
        for _ in range(4):
            clock.now += 2.0  # 2 s a segment
            bar.update(1, rows=256)
    lines = _lines(out)
    assert [line["final"] for line in lines] == [False, True]  # one line at 6 s (past the 5 s interval), one at the end
    first, last = lines
    assert first == {"progress": "read.narrow", "done": 3, "total": 10, "unit": "segment", "rows": 768, "elapsed_s": 6.0,
                     "eta_s": 14.0, "final": False}  # 7 segments left at 2 s each
    assert last["done"] == 4 and last["rows"] == 1024 and last["elapsed_s"] == 8.0 and last["eta_s"] == 12.0


def test_without_a_total_there_is_no_eta_and_an_exception_still_writes_the_final_line() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), progress("simulate", stream=out, mode="json", clock=ManualClock(100.0)) as bar:
        bar.update(2)
        raise RuntimeError("boom")
    (line,) = _lines(out)
    assert line["done"] == 2 and line["total"] is None and line["eta_s"] is None and line["final"] is True


def test_on_a_terminal_tqdm_draws_the_bar_and_no_json_is_written() -> None:
    out = io.StringIO()
    with progress("train.updates", total=3, unit="step", stream=out, mode="bar") as bar:
        for _ in range(3):
            bar.update(1, rows=10)
    text = out.getvalue()
    assert "train.updates" in text and "3/3" in text and "rows=30" in text
    assert not any(line.startswith("{") for line in text.replace("\r", "\n").splitlines())


def test_off_writes_nothing_and_the_mode_follows_the_stream_or_the_environment() -> None:
    out = io.StringIO()
    with progress("x", total=1, stream=out, mode="off") as bar:
        bar.update()
    assert out.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert mode_for(io.StringIO(), {}) == "json" and mode_for(Tty(), {}) == "bar"
    assert mode_for(Tty(), {"SHOPPING_AGENT_PROGRESS": "off"}) == "off"
    assert mode_for(io.StringIO(), {"SHOPPING_AGENT_PROGRESS": "loud"}) == "json"  # a typo warns, never fails a cycle
