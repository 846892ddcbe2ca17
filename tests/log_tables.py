"""Small decision tables for the join and attribution tests, with just the columns they read."""

from __future__ import annotations

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
