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
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True, slots=True)
class Window:
    decisions: pa.Table
    outcomes: pa.Table
    versions: list[str]
    """The model versions of the kept decisions, oldest first."""

    def describe(self, hours: float | None, versions: int | None) -> dict[str, Any]:
        """The manifest's record of what was read; ``newest_time_s`` tells later runs which sessions came after it."""
        n = self.decisions.num_rows
        return {"hours": hours, "versions": versions, "decisions": n,
                "sessions": len(pc.unique(self.decisions.column("session_id"))) if n else 0,
                "model_versions": self.versions,
                "newest_time_s": float(pc.max(self.decisions.column("time_s")).as_py()) if n else None}


def first_times(decisions: pa.Table) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.float64]]:
    """Each session's id and the ``time_s`` of its first logged decision."""
    grouped = decisions.group_by("session_id").aggregate([("time_s", "min")])
    return (grouped.column("session_id").to_numpy(zero_copy_only=False),
            np.asarray(grouped.column("time_s_min").to_numpy(), dtype=np.float64))


def sessions_of(decisions: pa.Table, outcomes: pa.Table, session_ids: pa.Array) -> tuple[pa.Table, pa.Table]:
    """The decisions and outcomes of these sessions."""
    d = decisions.filter(pc.is_in(decisions.column("session_id"), session_ids))
    o = outcomes.filter(pc.is_in(outcomes.column("session_id"), session_ids)) if outcomes.num_rows else outcomes
    return d, o


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
    d, o = sessions_of(decisions, outcomes, pa.array(sessions[first][keep[order][first]]))
    return Window(d, o, _versions_by_first_time(d) if d.num_rows else [])
