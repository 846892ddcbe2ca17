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

- ``max_sessions = K``: then at most ``K`` of the window's sessions, a sample keyed by
  ``sample_key``: the ``K`` whose ``blake2b_64(session id, key)`` is smallest (bottom-k), so
  the same logs and key give the same sample on every rerun and every rank, each session's
  draw depends on its id alone, and the sample is uniform over the window's sessions.

``for_config`` reads all four from a ``TrainConfig``; the manifest records them
(``Window.describe``) with the session counts before and after the sample.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from experience.sessions import session_hashes

SAMPLE_SALT = b"session-sample"  # independent of the gate's and the guard's splits


@dataclass(frozen=True, slots=True)
class Window:
    decisions: pa.Table
    outcomes: pa.Table
    versions: list[str]
    """The model versions of the kept decisions, oldest first."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What selected it: hours, versions, max_sessions, sample_key."""
    sessions_in_window: int | None = None
    """Sessions in the window before the sample (None: no sample was taken)."""

    def describe(self) -> dict[str, Any]:
        """The manifest's record of what was read; ``newest_time_s`` tells later runs which sessions came after it."""
        n = self.decisions.num_rows
        sessions = len(pc.unique(self.decisions.column("session_id"))) if n else 0
        return {**self.settings, "decisions": n, "sessions": sessions,
                "sessions_in_window": sessions if self.sessions_in_window is None else self.sessions_in_window,
                "model_versions": self.versions,
                "newest_time_s": float(pc.max(self.decisions.column("time_s")).as_py()) if n else None}


def for_config(decisions: pa.Table, outcomes: pa.Table, config: Any) -> Window:
    """``select`` with a ``TrainConfig``'s window and sample."""
    return select(decisions, outcomes, config.window_hours, config.window_versions, config.max_sessions, config.sample_key)


def sample_sessions(window: Window, max_sessions: int, key: int) -> Window:
    """At most ``max_sessions`` of the window's sessions, bottom-k by keyed hash (see the module doc)."""
    if window.decisions.num_rows == 0:
        return window
    distinct = pc.unique(window.decisions.column("session_id"))
    if len(distinct) <= max_sessions:
        return dataclasses.replace(window, sessions_in_window=len(distinct))
    ids = distinct.to_numpy(zero_copy_only=False)
    hashes = session_hashes(ids, SAMPLE_SALT + int(key).to_bytes(8, "little", signed=True))
    keep = np.argsort(hashes, kind="stable")[:max_sessions]
    d, o = sessions_of(window.decisions, window.outcomes, pa.array(ids[keep]))
    return Window(d, o, _versions_by_first_time(d), window.settings, len(distinct))


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


def select(decisions: pa.Table, outcomes: pa.Table, hours: float | None = None, versions: int | None = None,
           max_sessions: int | None = None, sample_key: int = 0) -> Window:
    """The decisions (and their sessions' outcomes) of the window, then its sample; see the module doc."""
    if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1):
        raise ValueError(f"max_sessions: expected an integer >= 1 or None, got {max_sessions!r}")
    window = _window(decisions, outcomes, hours, versions)
    settings = {"hours": hours, "versions": versions, "max_sessions": max_sessions, "sample_key": sample_key}
    window = dataclasses.replace(window, settings=settings)
    return window if max_sessions is None else sample_sessions(window, max_sessions, sample_key)


def _window(decisions: pa.Table, outcomes: pa.Table, hours: float | None, versions: int | None) -> Window:
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
