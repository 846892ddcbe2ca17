"""Small decision and outcome tables for the join, attribution, label and objective tests, with just the columns they read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa


def decisions(*rows: tuple[str, str, float, int]) -> pa.Table:
    """Rows of (decision_id, session_id, event_time_s, action)."""
    ids, sessions, times, actions = zip(*rows, strict=True) if rows else ((), (), (), ())
    return pa.table(
        {
            "decision_id": pa.array(ids, pa.string()),
            "session_id": pa.array(sessions, pa.string()),
            "event_time_s": pa.array(times, pa.float64()),
            "action": pa.array(actions, pa.int8()),
        }
    )


_OUTCOME_COLUMNS = {
    "outcome_id": pa.string(), "decision_id": pa.string(), "session_id": pa.string(), "outcome": pa.int8(),
    "value": pa.float64(), "coupon_discount": pa.float64(), "event_time_s": pa.float64(), "received_s": pa.float64(),
}
_OUTCOME_DEFAULTS = {"decision_id": "?", "session_id": "s", "value": 0.0, "coupon_discount": 0.0, "event_time_s": 0.0}


def outcome_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Outcome records from dicts of their columns; unset ones are filler, ``received_s`` 1 s after the event."""
    full = [{**_OUTCOME_DEFAULTS, **row} for row in rows]
    for row in full:
        row.setdefault("received_s", row["event_time_s"] + 1.0)
        row["outcome"] = int(row["outcome"])
    return pa.table({name: pa.array([row[name] for row in full], typ) for name, typ in _OUTCOME_COLUMNS.items()})


def with_value(table: pa.Table, column: str, row: int, value: Any) -> pa.Table:
    """``table`` with one cell replaced, in the column's own field (its type and nullability)."""
    values = table.column(column).to_pylist()
    values[row] = value
    return with_column(table, column, values)


def with_column(table: pa.Table, column: str, values: Any) -> pa.Table:
    """``table`` with one column's values replaced, in the column's own field (its type and nullability)."""
    field = table.schema.field(column)
    return table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type))


def copies(rows: pa.Table, n: int, session: str) -> pa.Table:
    """``n`` rows cycling through ``rows``, all in ``session``, each with its own ``decision_id`` (what one caller's
    session of repeated requests logs)."""
    out = pa.concat_tables([rows] * (n // rows.num_rows + 1)).slice(0, n)
    return with_column(with_column(out, "session_id", [session] * n), "decision_id", [f"{k:032x}" for k in range(n)])
