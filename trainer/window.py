"""Which logs a run reads: a window of recent hours or recent model versions, whole sessions.

The CronJob appends to one log directory; a run that read all of it would train on a mixture
of every behaviour ever served, most of it far from the policy it starts from (its KL to the
behaviour is already past the trust region before any step, and the support limit stops it).
A window keeps the run on the logs of the recent behaviour; every kept record keeps its own
logged propensity, so a window that spans versions is still exact for the ratios.

- ``versions = N``: the decisions of the last ``N`` model versions, ordered by the first time
  each was logged (``time_s``, the server's clock at logging), and of the versions being served
  now (``serving``: ``cycle`` names the active bundle and a canary). Without them a canary,
  first logged after the active bundle, would push the active bundle's own sessions out of a
  one-version window, and a dropped canary or a rollback would keep them out after it.
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from experience.schema import ENGAGEMENTS
from experience.sessions import session_hashes
from trainer.session_index import SessionIndex

SAMPLE_SALT = b"session-sample"  # independent of the gate's and the guard's splits
CHOSEN_SALT = b"chosen-digest"


class NoDecisions(ValueError):
    """A window with no logged decision to train on: no logs yet (``train`` and ``cycle`` exit 2, not retried)."""


class TooFewLogs(NoDecisions):
    """Logs too few for a step that splits them (a held-out share, cross-fitting folds): not enough logs yet, as a new
    deployment's first runs have (exit 2 as ``NoDecisions``; a later run, on more logs, goes on)."""


@dataclass(frozen=True, slots=True)
class GateSessions:
    """The gate's held-out sessions of a window (``gate_sample``), and the segments none of them can be in."""

    ids: pa.ChunkedArray
    skip: frozenset[str] = frozenset()


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
    chosen: tuple[int, int] | None = None
    """The sessions chosen (window and sample, before any shard): their count and the sum of their ids' 48-bit hashes,
    so ranks that chose on their own can check that they chose the same (None: not recorded)."""
    engagements: pa.Table = field(default_factory=ENGAGEMENTS.empty_table)
    """The engagement reports of the kept sessions (``experience.engagement``; none when the logs have none)."""
    gate: GateSessions | None = None
    """The sessions the gate judges, when they are read apart from the sample (``TrainConfig.gate_sessions``)."""

    def describe(self) -> dict[str, Any]:
        """The manifest's record of what was read; ``newest_time_s`` tells later runs which sessions came after it."""
        n = self.decisions.num_rows
        sessions = len(pc.unique(self.decisions.column("session_id"))) if n else 0
        return {**self.settings, "decisions": n, "sessions": sessions,
                "sessions_in_window": sessions if self.sessions_in_window is None else self.sessions_in_window,
                "model_versions": self.versions, **({"gate_sessions": len(self.gate.ids)} if self.gate is not None else {}),
                "newest_time_s": float(pc.max(self.decisions.column("time_s")).as_py()) if n else None}


def for_config(decisions: pa.Table, outcomes: pa.Table, config: Any) -> Window:
    """``select`` with a ``TrainConfig``'s window and sample."""
    return select(decisions, outcomes, config.window_hours, config.window_versions, config.max_sessions, config.sample_key)


def settings_of(config: Any, serving: Sequence[str] = ()) -> dict[str, Any]:
    settings = {"hours": config.window_hours, "versions": config.window_versions, "max_sessions": config.max_sessions,
                "sample_key": config.sample_key}
    return settings | ({"serving": list(serving)} if serving and config.window_versions is not None else {})


def choose(index: SessionIndex, hours: float | None = None, versions: int | None = None, max_sessions: int | None = None,
           sample_key: int = 0, serving: Sequence[str] = ()) -> tuple[pa.ChunkedArray, int | None]:
    """The ids of the window's sessions after the sample, and the window's session count before the sample (None:
    no sample asked for); see the module doc. Works on the sessions' first decisions alone (``SessionIndex``)."""
    return sample_of(in_window(index, hours, versions, serving), max_sessions, sample_key)


def sample_of(ids: pa.ChunkedArray, max_sessions: int | None, sample_key: int = 0) -> tuple[pa.ChunkedArray, int | None]:
    """At most ``max_sessions`` of a window's session ``ids`` (``bottom_k``), and the window's count (None: no sample)."""
    if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1):
        raise ValueError(f"max_sessions: expected an integer >= 1 or None, got {max_sessions!r}")
    if max_sessions is None or len(ids) <= max_sessions:
        return ids, None if max_sessions is None else len(ids)
    return bottom_k(ids, max_sessions, sample_key), len(ids)


def in_window(index: SessionIndex, hours: float | None = None, versions: int | None = None,
              serving: Sequence[str] = ()) -> pa.ChunkedArray:
    """The ids of the window's sessions (by their first decisions), before any sample."""
    if hours is not None and not hours > 0:
        raise ValueError(f"window_hours: expected > 0 or None, got {hours!r}")
    if versions is not None and versions < 1:
        raise ValueError(f"window_versions: expected >= 1 or None, got {versions!r}")
    first = index.sessions
    keep = pa.array(np.ones(first.num_rows, dtype=bool))
    if hours is not None and index.newest_s is not None:
        keep = pc.and_(keep, pc.greater_equal(first.column("time_s"), index.newest_s - hours * 3600.0))
    if versions is not None:
        recent = [*index.versions_by_first_time()[-versions:], *serving]
        keep = pc.and_(keep, pc.is_in(first.column("model_version"), pa.array(recent, pa.string())))
    return first.column("session_id").filter(keep)


def bottom_k(ids: pa.ChunkedArray, k: int, sample_key: int = 0) -> pa.ChunkedArray:
    """The ``k`` of ``ids`` whose keyed sample hash is smallest (all of them when there are no more)."""
    if len(ids) <= k:
        return ids
    hashes = session_hashes(ids.to_numpy(zero_copy_only=False), SAMPLE_SALT + int(sample_key).to_bytes(8, "little", signed=True))
    return ids.take(pa.array(np.argsort(hashes, kind="stable")[:k]))


def gate_sample(window: pa.ChunkedArray, heldout: Callable[[pa.ChunkedArray], npt.NDArray[np.bool_]], k: int | None,
                sample_key: int = 0) -> pa.ChunkedArray:
    """The sessions the gate judges: of the window's (``window``, before the sample) those ``heldout`` holds out, at most
    ``k`` by the sample's own keyed hash. The same hash orders both samples, so the training sample's held-out sessions
    (its smallest-hash held-out ones) are among these whenever ``k`` is at least their number."""
    held = window.filter(pa.array(heldout(window))) if len(window) else window
    return held if k is None else bottom_k(held, k, sample_key)


def digest_of(session_ids: pa.ChunkedArray | pa.Array) -> tuple[int, int]:
    """(count, Σ 48-bit hash mod 2⁴⁸) of these session ids: equal for equal sets, whatever their order."""
    hashes = session_hashes(session_ids.to_numpy(zero_copy_only=False), CHOSEN_SALT) >> np.uint64(16)
    return len(hashes), int(hashes.sum(dtype=np.uint64) % np.uint64(1 << 48)) if len(hashes) else 0


def restrict(window: Window, keep: Callable[[pa.ChunkedArray], npt.NDArray[np.bool_]]) -> Window:
    """``window`` with only the sessions for which ``keep`` (a mask of the distinct session ids) holds."""
    ids = pc.unique(window.decisions.column("session_id"))
    kept = ids.filter(pa.array(keep(pa.chunked_array([ids]))))
    decisions, outcomes = sessions_of(window.decisions, window.outcomes, kept)
    return Window(decisions, outcomes, versions_by_first_time(decisions), window.settings, window.sessions_in_window, window.chosen,
                  of_sessions(window.engagements, kept), window.gate)


def of_sessions(table: pa.Table, session_ids: pa.Array | pa.ChunkedArray) -> pa.Table:
    """The rows of ``table`` (any log kind: it has a ``session_id``) of these sessions."""
    return table.filter(pc.is_in(table.column("session_id"), session_ids)) if table.num_rows else table


def sessions_of(decisions: pa.Table, outcomes: pa.Table, session_ids: pa.Array | pa.ChunkedArray) -> tuple[pa.Table, pa.Table]:
    """The decisions and outcomes of these sessions."""
    return of_sessions(decisions, session_ids), of_sessions(outcomes, session_ids)


def versions_by_first_time(decisions: pa.Table) -> list[str]:
    """The model versions of these decisions, by the first time each was logged (the session index's order)."""
    return SessionIndex.of([decisions]).versions_by_first_time()


def select(decisions: pa.Table, outcomes: pa.Table, hours: float | None = None, versions: int | None = None,
           max_sessions: int | None = None, sample_key: int = 0) -> Window:
    """The decisions (and their sessions' outcomes) of the window, then its sample; see the module doc."""
    settings = {"hours": hours, "versions": versions, "max_sessions": max_sessions, "sample_key": sample_key}
    index = SessionIndex.of([decisions])
    ids, in_window = choose(index, hours, versions, max_sessions, sample_key)
    decisions, outcomes = sessions_of(decisions, outcomes, ids)  # as the two-pass read: the chosen sessions' only
    return Window(decisions, outcomes, versions_by_first_time(decisions), settings, in_window)
