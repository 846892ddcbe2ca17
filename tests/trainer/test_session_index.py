"""The session index: each session's first decision and each version's first time, merged chunk by chunk."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trainer.session_index import SessionIndex


def _rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    sessions = [f"s{int(i)}" for i in rng.integers(0, n // 4, n)]
    times = rng.permutation(n).astype(np.float64) * 0.5  # distinct: the first decision is unambiguous
    versions = [f"v{int(i)}" for i in rng.integers(0, 5, n)]
    return pa.table({"session_id": sessions, "time_s": times, "model_version": versions, "other": np.arange(n)})


def _brute(table: pa.Table) -> tuple[dict[str, tuple[float, str]], dict[str, float]]:
    first: dict[str, tuple[float, str]] = {}
    versions: dict[str, float] = {}
    for s, t, v in zip(*(table.column(c).to_pylist() for c in ("session_id", "time_s", "model_version")), strict=True):
        if s not in first or t < first[s][0]:
            first[s] = (t, v)
        versions[v] = min(t, versions.get(v, t))
    return first, versions


def test_merged_chunk_by_chunk_it_is_each_sessions_first_decision() -> None:
    table = _rows(2000, 3)
    index = SessionIndex.of(table.to_batches(max_chunksize=37), merge_rows=100)  # sessions span many merges
    first, versions = _brute(table)
    got = index.sessions.to_pydict()
    assert len(got["session_id"]) == len(first)  # one row a session
    assert {s: (t, v) for s, t, v in zip(got["session_id"], got["time_s"], got["model_version"], strict=True)} == first
    assert dict(zip(index.versions.column("model_version").to_pylist(), index.versions.column("time_s").to_pylist(),
                    strict=True)) == versions
    assert index.versions_by_first_time() == sorted(versions, key=versions.__getitem__)
    assert index.newest_s == max(table.column("time_s").to_pylist())
    whole = SessionIndex.of([table])
    assert whole.sessions.sort_by("session_id").equals(index.sessions.sort_by("session_id"))


def test_no_rows_give_an_empty_index() -> None:
    index = SessionIndex.of([])
    assert index.sessions.num_rows == 0 and index.versions.num_rows == 0 and index.newest_s is None
    assert index.versions_by_first_time() == []
