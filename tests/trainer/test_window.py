"""The window of logs a run reads: recent model versions or hours, whole sessions, outcomes following them."""

from __future__ import annotations

import pyarrow as pa
import pytest

from trainer.config import TrainConfig
from trainer.session_index import SessionIndex
from trainer.window import choose, select


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


def test_the_versions_being_served_are_in_a_versions_window_whatever_their_age() -> None:
    d, _ = logs()  # v3 first logged last (a canary beside v1, or a rollback to v1): v1 still serves, its sessions stay
    index = SessionIndex.of([d])
    ids, _ = choose(index, versions=1, serving=("v1",))
    assert sorted(ids.to_pylist()) == ["a", "b", "e"]
    assert sorted(choose(index, versions=1)[0].to_pylist()) == ["e"]
    assert sorted(choose(index, serving=("v1",))[0].to_pylist()) == ["a", "b", "c", "d", "e"]  # no versions window: all


def test_hours_count_back_from_the_newest_decision() -> None:
    d, o = logs()
    assert sessions(select(d, o, hours=2.0).decisions) == ["c", "d", "e"]  # 7310 − 7200 = 110: c (110) is in, b (90) is not
    assert sessions(select(d, o, hours=1.0).decisions) == ["e"]
    both = select(d, o, hours=2.0, versions=1)
    assert sessions(both.decisions) == ["e"] and both.describe()["sessions"] == 1
    assert both.describe()["hours"] == 2.0 and both.describe()["versions"] == 1


def test_the_edge_of_an_hours_window_is_inclusive() -> None:
    d, o = logs()
    assert "c" in sessions(select(d, o, hours=(7310.0 - 110.0) / 3600.0).decisions)


@pytest.mark.parametrize(("kwargs", "field"), [({"hours": 0.0}, "window_hours"), ({"versions": 0}, "window_versions"),
                                               ({"max_sessions": 0}, "max_sessions")])
def test_bad_windows_name_the_field(kwargs: dict, field: str) -> None:
    d, o = logs()
    with pytest.raises(ValueError, match=field):
        select(d, o, **kwargs)
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: next(iter(kwargs.values()))})


def many(n: int, version: str = "v1") -> tuple[pa.Table, pa.Table]:
    ids = [f"s{i}" for i in range(n) for _ in range(3)]
    decisions = pa.table({"session_id": ids, "time_s": [float(i) for i in range(len(ids))], "model_version": [version] * len(ids)})
    outcomes = pa.table({"session_id": [f"s{i}" for i in range(0, n, 2)]})
    return decisions, outcomes


def test_a_sample_keeps_whole_sessions_the_same_on_every_rerun_and_another_with_another_key() -> None:
    d, o = many(1000)
    a = select(d, o, max_sessions=100)
    assert len(sessions(a.decisions)) == 100 and a.decisions.num_rows == 300  # whole sessions: all three rows each
    assert set(sessions(a.outcomes)) <= set(sessions(a.decisions))  # outcomes follow their sessions
    assert sessions(select(d, o, max_sessions=100).decisions) == sessions(a.decisions)  # a rerun: the same sample
    other = select(d, o, max_sessions=100, sample_key=1)
    assert len(set(sessions(other.decisions)) & set(sessions(a.decisions))) < 40  # about 10 of 100 by chance
    record = a.describe()
    assert record["max_sessions"] == 100 and record["sample_key"] == 0
    assert record["sessions"] == 100 and record["sessions_in_window"] == 1000


def test_a_sessions_draw_depends_on_its_id_alone() -> None:
    # bottom-k: a session sampled from the larger logs is sampled from any part of them that contains it
    d, o = many(1000)
    big = set(sessions(select(d, o, max_sessions=100).decisions))
    half = d.filter(pa.compute.is_in(d.column("session_id"), pa.array([f"s{i}" for i in range(500)])))
    small = set(sessions(select(half, o, max_sessions=100).decisions))
    assert big & {f"s{i}" for i in range(500)} <= small


def test_a_sample_no_smaller_than_the_window_keeps_it_and_says_so() -> None:
    d, o = many(50)
    w = select(d, o, max_sessions=100)
    assert w.decisions.num_rows == d.num_rows and w.describe()["sessions_in_window"] == 50
    assert select(d, o).describe()["max_sessions"] is None


def test_the_sample_is_taken_after_the_window() -> None:
    d1, _ = many(200, "v1")
    d2, _ = many(200, "v2")
    d2 = d2.set_column(0, "session_id", pa.array([f"t{s}" for s in d2.column("session_id").to_pylist()]))
    d2 = d2.set_column(1, "time_s", pa.array([t + 10_000.0 for t in d2.column("time_s").to_pylist()]))
    d = pa.concat_tables([d1, d2])
    w = select(d, pa.table({"session_id": pa.array([], pa.string())}), versions=1, max_sessions=30)
    assert w.versions == ["v2"] and len(sessions(w.decisions)) == 30 and w.describe()["sessions_in_window"] == 200


def _reference(decisions: pa.Table, hours: float | None, versions: int | None, max_sessions: int | None,
               key: int) -> tuple[set[str], list[str]]:
    """The module doc's rules, row by row in plain Python: the sessions kept and the versions, oldest first."""
    from experience.sessions import session_hashes
    from trainer.window import SAMPLE_SALT

    rows = list(zip(*(decisions.column(c).to_pylist() for c in ("session_id", "time_s", "model_version")), strict=True))
    version_first: dict[str, float] = {}
    for _, t, v in rows:
        version_first[v] = min(t, version_first.get(v, t))
    recent = sorted(version_first, key=lambda v: (version_first[v], v))[-versions:] if versions else None
    newest = max(t for _, t, _ in rows)
    first: dict[str, tuple[float, str]] = {}
    for s, t, v in rows:
        if s not in first or t < first[s][0]:
            first[s] = (t, v)
    kept = [s for s, (t, v) in first.items()
            if (hours is None or t >= newest - hours * 3600.0) and (recent is None or v in recent)]
    if max_sessions is not None and len(kept) > max_sessions:
        hashes = session_hashes(kept, SAMPLE_SALT + key.to_bytes(8, "little", signed=True))
        kept = [kept[i] for i in sorted(range(len(kept)), key=lambda i: int(hashes[i]))[:max_sessions]]
    chosen = set(kept)
    times = {v: min(t for s, t, w in rows if s in chosen and w == v) for _, _, v in rows if any(
        s in chosen and w == v for s, _, w in rows)}
    return chosen, sorted(times, key=lambda v: (times[v], v))


@pytest.mark.parametrize("seed", range(6))
def test_selection_matches_the_rules_row_by_row_on_random_logs_ties_included(seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    n = 300
    times = rng.integers(0, 40, n).astype(float) * 900.0 if seed % 2 else rng.permutation(n) * 60.0  # odd seeds: many ties
    decisions = pa.table({"session_id": [f"s{i}" for i in rng.integers(0, 60, n)], "time_s": times,
                          "model_version": [f"v{i}" for i in rng.integers(0, 4, n)]})
    outcomes = pa.table({"session_id": [f"s{i}" for i in rng.integers(0, 70, 80)], "outcome_id": [f"o{i}" for i in range(80)]})
    for hours, versions, max_sessions in [(None, None, None), (None, 1, None), (None, 2, 10), (3.0, None, None),
                                          (5.0, 3, 7), (None, None, 25)]:
        w = select(decisions, outcomes, hours, versions, max_sessions, sample_key=seed)
        chosen, ordered = _reference(decisions, hours, versions, max_sessions, seed)
        assert set(w.decisions.column("session_id").to_pylist()) == chosen
        assert w.decisions.num_rows == sum(1 for s in decisions.column("session_id").to_pylist() if s in chosen)  # whole sessions
        assert set(w.outcomes.column("session_id").to_pylist()) == chosen & set(outcomes.column("session_id").to_pylist())
        assert w.versions == ordered


@pytest.mark.parametrize("bad", [0, -5, True, 2.5])
def test_a_bad_gate_sessions_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="gate_sessions"):
        TrainConfig(gate_sessions=bad)  # type: ignore[arg-type]


def test_the_gate_sample_is_the_windows_held_out_share_and_holds_the_samples_own() -> None:
    """Of the whole window (not the training sample) the sessions the gate's split holds out, at most k of them by the
    sample's own hash: so the training sample's held-out sessions are among them, and none it trains on."""
    from trainer.data import heldout_sessions
    from trainer.window import gate_sample

    d, _ = many(4000)
    index = SessionIndex.of([d])
    window_ids = index.sessions.column("session_id")
    sample, _ = choose(index, max_sessions=500, sample_key=2)
    held = lambda ids: heldout_sessions(ids, 0.2, 0)  # noqa: E731
    every = set(gate_sample(window_ids, held, None, 2).to_pylist())
    assert every == {s for s, h in zip(window_ids.to_pylist(), held(window_ids), strict=True) if h}
    assert 600 < len(every) < 1000  # about a fifth of 4,000
    capped = gate_sample(window_ids, held, 300, 2).to_pylist()
    assert len(capped) == 300 and set(capped) <= every
    sample_held = {s for s, h in zip(sample.to_pylist(), held(sample), strict=True) if h}
    sample_trained = set(sample.to_pylist()) - sample_held
    assert 60 < len(sample_held) < 140 and sample_held <= set(capped)  # the sample's held-out ≈ 100 ≤ 300: all in
    assert not sample_trained & every  # never a session the run trains on
    assert gate_sample(window_ids, held, 300, 2).to_pylist() == capped  # a rerun: the same sessions
    assert gate_sample(window_ids.slice(0, 0), held, 300, 2).to_pylist() == []
