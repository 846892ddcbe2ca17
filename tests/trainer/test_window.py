"""The window of logs a run reads: recent model versions or hours, whole sessions, outcomes following them."""

from __future__ import annotations

import pyarrow as pa
import pytest

from trainer.config import TrainConfig
from trainer.window import select


def logs() -> tuple[pa.Table, pa.Table]:
    # session a: v1 only; b: starts under v1 at t=90, goes on under v2; c, d: v2; e: v3, logged last
    rows = [("a", 0.0, "v1"), ("a", 10.0, "v1"), ("b", 90.0, "v1"), ("b", 100.0, "v2"), ("c", 110.0, "v2"),
            ("d", 3000.0, "v2"), ("e", 7300.0, "v3"), ("e", 7310.0, "v3")]
    decisions = pa.table({"session_id": [r[0] for r in rows], "time_s": [r[1] for r in rows], "model_version": [r[2] for r in rows],
                          "decision_id": [f"d{i}" for i in range(len(rows))]})
    outcomes = pa.table({"session_id": ["a", "b", "e", "e"], "outcome_id": ["o1", "o2", "o3", "o4"]})
    return decisions, outcomes


def sessions(t: pa.Table) -> list[str]:
    return sorted(set(t.column("session_id").to_pylist()))


def test_no_window_keeps_everything_and_orders_versions_by_first_log() -> None:
    d, o = logs()
    w = select(d, o)
    assert w.decisions.num_rows == d.num_rows and w.outcomes.num_rows == o.num_rows
    assert w.versions == ["v1", "v2", "v3"]


def test_the_last_versions_keep_whole_sessions_by_their_first_decision() -> None:
    d, o = logs()
    w = select(d, o, versions=2)
    assert sessions(w.decisions) == ["c", "d", "e"]  # b started under v1: dropped whole, its v2 step too
    assert sessions(w.outcomes) == ["e"]
    assert w.versions == ["v2", "v3"]
    assert select(d, o, versions=1).versions == ["v3"]
    b = select(d, o, versions=3)
    assert b.decisions.num_rows == d.num_rows


def test_hours_count_back_from_the_newest_decision() -> None:
    d, o = logs()
    assert sessions(select(d, o, hours=2.0).decisions) == ["c", "d", "e"]  # 7310 − 7200 = 110: c (110) is in, b (90) is not
    assert sessions(select(d, o, hours=1.0).decisions) == ["e"]
    both = select(d, o, hours=2.0, versions=1)
    assert sessions(both.decisions) == ["e"] and both.describe(2.0, 1)["sessions"] == 1


def test_the_edge_of_an_hours_window_is_inclusive() -> None:
    d, o = logs()
    assert "c" in sessions(select(d, o, hours=(7310.0 - 110.0) / 3600.0).decisions)


@pytest.mark.parametrize(("kwargs", "field"), [({"hours": 0.0}, "window_hours"), ({"versions": 0}, "window_versions")])
def test_bad_windows_name_the_field(kwargs: dict, field: str) -> None:
    d, o = logs()
    with pytest.raises(ValueError, match=field):
        select(d, o, **kwargs)
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: next(iter(kwargs.values()))})
