"""Which logs a run reads: a window of recent hours or recent model versions, whole sessions.

The CronJob appends to one log directory; a run that read all of it would train on a mixture
of every behaviour ever served, most of it far from the policy it starts from (its KL to the
behaviour is already past the trust region before any step, and the support limit stops it).
A window keeps the run on the logs of the recent behaviour; every kept record keeps its own
logged propensity, so a window that spans versions is still exact for the ratios.

- ``versions = N``: the decisions of the last ``N`` model versions, ordered by the first time
  each was logged (``time_s``, the server's clock at logging).
- ``hours = H``: the decisions logged within ``H`` hours of the newest one.

Both may be given (a decision must pass both); ``None`` turns one off. A session is kept or
dropped whole, by its first decision, so no episode loses its start; its outcomes follow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True, slots=True)
class Window:
    decisions: pa.Table
    outcomes: pa.Table
    versions: list[str]
    """The model versions of the kept decisions, oldest first."""

    def describe(self, hours: float | None, versions: int | None) -> dict[str, Any]:
        return {"hours": hours, "versions": versions, "decisions": self.decisions.num_rows,
                "sessions": len(pc.unique(self.decisions.column("session_id"))) if self.decisions.num_rows else 0,
                "model_versions": self.versions}


def _versions_by_first_time(decisions: pa.Table) -> list[str]:
    grouped = decisions.group_by("model_version").aggregate([("time_s", "min")]).sort_by("time_s_min")
    return [str(v) for v in grouped.column("model_version").to_pylist()]


def select(decisions: pa.Table, outcomes: pa.Table, hours: float | None = None, versions: int | None = None) -> Window:
    """The decisions (and their sessions' outcomes) of the window; see the module doc."""
    if hours is not None and not hours > 0:
        raise ValueError(f"window_hours: expected > 0 or None, got {hours!r}")
    if versions is not None and versions < 1:
        raise ValueError(f"window_versions: expected >= 1 or None, got {versions!r}")
    if decisions.num_rows == 0 or (hours is None and versions is None):
        return Window(decisions, outcomes, _versions_by_first_time(decisions) if decisions.num_rows else [])
    keep = np.ones(decisions.num_rows, dtype=bool)
    times = decisions.column("time_s").to_numpy()
    if hours is not None:
        keep &= times >= times.max() - hours * 3600.0
    if versions is not None:
        recent = _versions_by_first_time(decisions)[-versions:]
        keep &= pc.is_in(decisions.column("model_version"), pa.array(recent)).to_numpy(zero_copy_only=False)
    # whole sessions, by their first decision
    order = np.lexsort((times, decisions.column("session_id").to_numpy(zero_copy_only=False)))
    sessions = decisions.column("session_id").to_numpy(zero_copy_only=False)[order]
    first = np.concatenate([[True], sessions[1:] != sessions[:-1]])
    kept_sessions = pa.array(sessions[first][keep[order][first]])
    d = decisions.filter(pc.is_in(decisions.column("session_id"), kept_sessions))
    o = outcomes.filter(pc.is_in(outcomes.column("session_id"), kept_sessions)) if outcomes.num_rows else outcomes
    return Window(d, o, _versions_by_first_time(d) if d.num_rows else [])
