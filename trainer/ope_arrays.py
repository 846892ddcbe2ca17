"""Checked float64/int64 arrays for off-policy evaluation, and the flat layout of episodes' steps."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.domain import N_ACTIONS, FloatArray
from experience.sessions import Episodes

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

WORK = 1 << 22
"""Elements per bootstrap or regression work array (32 MiB of float64)."""
PROB_SUM_TOL = 1e-4
"""How far a row of ``target_probs`` may sum from 1 (float32 softmax outputs)."""


def check_vector(values: Any, n: int, name: str) -> FloatArray:
    x = np.asarray(values, dtype=np.float64)
    if x.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: {int((~np.isfinite(x)).sum())} non-finite value(s)")
    return x


def check_matrix(values: Any, n: int, name: str) -> FloatArray:
    x = np.asarray(values, dtype=np.float64)
    if x.shape != (n, N_ACTIONS):
        raise ValueError(f"{name}: expected shape ({n}, {N_ACTIONS}), got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: {int((~np.isfinite(x)).sum())} non-finite value(s)")
    return x


def check_actions(values: Any, n: int, name: str = "actions") -> IntArray:
    a = np.asarray(values)
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integer action indices, got dtype {a.dtype}")
    if n and (a.min() < 0 or a.max() >= N_ACTIONS):
        raise ValueError(f"{name}: action indices must be in 0..{N_ACTIONS - 1}, got {int(a.min())}..{int(a.max())}")
    return a.astype(np.int64)


def check_target_probs(values: Any, n: int) -> FloatArray:
    p = check_matrix(values, n, "target_probs")
    if (p < 0).any():
        raise ValueError(f"target_probs: {int((p < 0).sum())} negative value(s)")
    off = np.abs(p.sum(axis=1) - 1.0) > PROB_SUM_TOL
    if off.any():
        raise ValueError(f"target_probs: {int(off.sum())} row(s) do not sum to 1 (first: row {int(np.argmax(off))})")
    return p


def check_behavior_prob(values: Any, n: int) -> FloatArray:
    mu = check_vector(values, n, "behavior_prob")
    bad = (mu <= 0) | (mu > 1 + 1e-6)
    if bad.any():
        raise ValueError(f"behavior_prob: {int(bad.sum())} value(s) outside (0, 1] (first: step {int(np.argmax(bad))})")
    return mu


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """Episodes as flat steps: ``starts`` / ``lengths`` per episode, episode and in-episode index per step."""

    rewards: FloatArray
    starts: IntArray
    lengths: IntArray
    episode: IntArray
    t: IntArray

    @property
    def n_steps(self) -> int:
        return len(self.rewards)

    @property
    def n_episodes(self) -> int:
        return len(self.starts)

    def fingerprint(self) -> str:
        """A hash of the episode structure and rewards: equal for reports of the same logs."""
        digest = hashlib.sha256()
        for a in (self.lengths, self.rewards):
            digest.update(np.ascontiguousarray(a).tobytes())
        return digest.hexdigest()[:16]


def layout(episodes: Episodes) -> Layout:
    rewards = np.asarray(episodes.rewards, dtype=np.float64)
    starts = np.asarray(episodes.starts, dtype=np.int64)
    lengths = np.asarray(episodes.lengths, dtype=np.int64)
    if rewards.ndim != 1 or starts.ndim != 1 or starts.shape != lengths.shape:
        raise ValueError("episodes: rewards, starts and lengths must be 1-d, starts and lengths of equal length")
    if len(starts) == 0:
        raise ValueError("episodes: no episodes")
    tiled = starts[0] == 0 and lengths.min() >= 1 and np.array_equal(starts[1:], starts[:-1] + lengths[:-1])
    if not tiled or starts[-1] + lengths[-1] != len(rewards):
        raise ValueError("episodes: starts / lengths must tile the steps in order (starts[0] == 0, every length >= 1)")
    if not np.isfinite(rewards).all():
        raise ValueError(f"episodes: {int((~np.isfinite(rewards)).sum())} non-finite reward(s)")
    episode = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    return Layout(rewards=rewards, starts=starts, lengths=lengths, episode=episode, t=np.arange(len(rewards)) - starts[episode])


