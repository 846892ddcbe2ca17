"""Each logged session's first decision, built batch by batch: what a window and a sample are chosen on.

A window keeps or drops a session whole, by its first decision (``trainer.window``): its time,
its model version, and the first time each version was logged. So the narrow pass of a read
(``trainer.reading``) reduces every chunk of ``session_id, time_s, model_version`` rows to one
row per session (its earliest decision) and one row per version (its earliest time), merging
the partial results as it goes: what it holds grows with the number of sessions, not with the
decisions they logged, and it never turns an id into a Python object. All of it is Arrow
compute (sort, then the first row of each group).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

NARROW = ("session_id", "time_s", "model_version")
MERGE_ROWS = 1 << 18  # rows gathered before they are reduced (and partial results merged), at least as many as reduced


def _firsts(rows: pa.Table, key: str, columns: tuple[str, ...]) -> pa.Table:
    """One row per ``key``: the values of ``columns`` at its earliest ``time_s`` (ties: the earlier row)."""
    ordered = rows.sort_by([(key, "ascending"), ("time_s", "ascending")])
    grouped = ordered.group_by(key, use_threads=False).aggregate([(c, "first") for c in columns])
    return pa.table({key: grouped.column(key), **{c: grouped.column(f"{c}_first") for c in columns}})


@dataclass(frozen=True, slots=True)
class SessionIndex:
    sessions: pa.Table
    """``session_id``, ``time_s`` (of its first decision), ``model_version`` (of that decision): one row a session."""
    versions: pa.Table
    """``model_version``, ``time_s`` (the first time it was logged): one row a version."""
    newest_s: float | None
    """The newest decision's ``time_s`` (None: no decisions)."""

    @classmethod
    def of(cls, batches: Iterable[pa.RecordBatch | pa.Table], merge_rows: int = MERGE_ROWS) -> SessionIndex:
        """The index of these decision rows (batches holding at least the ``NARROW`` columns)."""
        sessions: list[pa.Table] = []
        versions: list[pa.Table] = []
        pending: list[pa.Table] = []
        held, reduced, newest = 0, 0, None
        for batch in batches:
            table = (batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])).select(list(NARROW))
            if table.num_rows:
                top = float(pc.max(table.column("time_s")).as_py())
                newest = top if newest is None else max(newest, top)
            pending.append(table)
            held += table.num_rows
            if held >= max(merge_rows, reduced):  # geometric: each row is re-reduced O(log n) times, not once a merge
                sessions, versions = cls._merge(sessions, versions, pending)
                pending, held, reduced = [], 0, sessions[0].num_rows
        if pending or not sessions:
            sessions, versions = cls._merge(sessions, versions, pending)
        return cls(sessions[0], versions[0], newest)

    @staticmethod
    def _merge(sessions: list[pa.Table], versions: list[pa.Table], pending: list[pa.Table]) -> tuple[list[pa.Table], list[pa.Table]]:
        rows = pa.concat_tables([_empty(), *pending], promote_options="permissive")
        s = _firsts(pa.concat_tables([*sessions, rows]), "session_id", ("time_s", "model_version"))
        v = _firsts(pa.concat_tables([*versions, rows.select(["model_version", "time_s"])]), "model_version", ("time_s",))
        return [s], [v]

    def versions_by_first_time(self) -> list[str]:
        ordered = self.versions.sort_by([("time_s", "ascending"), ("model_version", "ascending")])  # ties: by name
        return [str(v) for v in ordered.column("model_version").to_pylist()]


def _empty() -> pa.Table:
    return pa.table({"session_id": pa.array([], pa.string()), "time_s": pa.array([], pa.float64()),
                     "model_version": pa.array([], pa.string())})
