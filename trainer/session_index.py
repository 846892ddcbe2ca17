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
        index = cls(_empty(), _empty().select(["model_version", "time_s"]), None)
        pending: list[pa.Table] = []
        held = 0
        for batch in batches:
            pending.append((batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])).select(list(NARROW)))
            held += pending[-1].num_rows
            if held >= max(merge_rows, index.sessions.num_rows):  # geometric: each row re-reduced O(log n) times
                index, pending, held = index._merged(pending), [], 0
        return index._merged(pending)

    def _merged(self, pending: list[pa.Table]) -> SessionIndex:
        """This index with ``pending``'s rows reduced into it."""
        rows = pa.concat_tables([_empty(), *pending], promote_options="permissive")
        if rows.num_rows == 0:
            return self
        sessions = _firsts(pa.concat_tables([self.sessions, rows]), "session_id", ("time_s", "model_version"))
        versions = _firsts(pa.concat_tables([self.versions, rows.select(["model_version", "time_s"])]), "model_version",
                           ("time_s",))
        top = float(pc.max(rows.column("time_s")).as_py())
        return SessionIndex(sessions, versions, top if self.newest_s is None else max(self.newest_s, top))

    def versions_by_first_time(self) -> list[str]:
        ordered = self.versions.sort_by([("time_s", "ascending"), ("model_version", "ascending")])  # ties: by name
        return [str(v) for v in ordered.column("model_version").to_pylist()]


def _empty() -> pa.Table:
    return pa.table({"session_id": pa.array([], pa.string()), "time_s": pa.array([], pa.float64()),
                     "model_version": pa.array([], pa.string())})
