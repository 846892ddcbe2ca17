"""Discounted Monte Carlo returns over variable-length episodes, reward normalisation, mean_return.

Episodes are flat per-step arrays cut by ``starts`` / ``lengths`` (``Episodes`` from
``experience.sessions``), never padded. Within an episode of length ``L``:

    G_t     = r_t + γ G_{t+1},   G_{L-1} = r_{L-1}                 (full-episode return)
    G_t^(n) = Σ_{k < min(n, L-t)} γ^k r_{t+k}                       (n-step, cut at the episode end)

**mean_return** — the one definition of "expected discounted return per session", used by the
trainer's reports, the simulator and the offline estimators (which the gate runs with γ = 1 on
the objective's rewards, ``experience.objective``): the mean over episodes of ``G_0``,
the return from each session's first step, computed with the *raw* attributed rewards
(``Episodes.rewards``, currency units, terminal adjustment included; never the normalised ones)
and ``γ = GAMMA = 0.85``::

    mean_return = (1 / E) Σ_e G_0(e),    G_0(e) = Σ_{k < L_e} γ^k r_{e,k}

``session_returns`` gives the per-episode ``G_0``; ``mean_return`` its mean with a 95 %
normal-approximation confidence interval (mean ± 1.96 · s / √E, s the sample std, ddof 1).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from core.domain import FloatArray
from experience.sessions import Episodes

IntArray = npt.NDArray[np.int64]

GAMMA = 0.85
Z_95 = 1.959963984540054


def _check(rewards: FloatArray, starts: IntArray, lengths: IntArray, gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if starts.shape != lengths.shape or starts.ndim != 1 or rewards.ndim != 1:
        raise ValueError("rewards, starts and lengths must be 1-d; starts and lengths of equal length")
    if len(starts) and (lengths.min() < 0 or starts.min() < 0 or (starts + lengths).max() > len(rewards)):
        raise ValueError("every episode must lie within the rewards array (starts >= 0, lengths >= 0)")


def discounted_returns(rewards: FloatArray, starts: IntArray, lengths: IntArray, gamma: float = GAMMA) -> FloatArray:
    """Full-episode returns ``G_t = r_t + γ G_{t+1}`` for every step, episodes given by ``starts`` / ``lengths``.

    Vectorised over episodes by distance from the episode end: sort the episodes by length
    once (longest first); for ``d = 0 … max_len - 1`` the steps at distance ``d`` from their
    episode's end are ``ends[:k_d] - d`` (``k_d`` = episodes longer than ``d``) and one numpy
    update computes all their returns from those at distance ``d - 1``. O(steps) work in
    O(max_len) numpy calls; only products by γ ≤ 1, so nothing overflows on long episodes.
    Steps outside every episode get 0.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    _check(rewards, starts, lengths, gamma)
    returns = np.zeros(len(rewards), dtype=np.float64)
    if len(starts) == 0 or lengths.max() == 0:
        return returns
    position, k = _by_length(starts, lengths)
    carry = rewards[position[: k[0]]]  # G at distance d from the end, for the first k[d] episodes
    returns[position[: k[0]]] = carry
    buffer = np.empty(len(carry), dtype=np.float64)
    for d in range(1, len(k)):
        n = int(k[d])
        at = position[:n]
        at -= 1  # in place: position[:n] now holds the steps at distance d
        g = carry[:n]
        g *= gamma
        g += np.take(rewards, at, out=buffer[:n])
        returns[at] = g
    return returns


def _by_length(starts: IntArray, lengths: IntArray) -> tuple[IntArray, IntArray]:
    """The episodes' last steps, longest episode first (stable), and ``k[d]`` = #episodes longer than d."""
    by_length = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[by_length]
    k = np.searchsorted(-sorted_lengths, -np.arange(sorted_lengths[0]), side="left").astype(np.int64)
    return (starts + lengths - 1)[by_length], k


def n_step_returns(rewards: FloatArray, starts: IntArray, lengths: IntArray, n: int, gamma: float = GAMMA) -> FloatArray:
    """n-step returns ``G_t^(n) = Σ_{k < n} γ^k r_{t+k}``, the sum cut at the episode end.

    Summed directly, term by term: pass ``k`` adds ``γ^k r_{t+k}`` to every step whose episode
    still has a ``k``-th successor, as one shifted, masked array operation; ``min(n, max_len)``
    passes, O(steps · min(n, max_len)) work. Not derived as ``G_t − γ^n G_{t+n}``: that
    difference cancels for sparse rewards (a step n or more steps before an order gets ±1e-14
    instead of 0). With ``n ≥`` the longest episode this is the full return (up to rounding).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    rewards = np.asarray(rewards, dtype=np.float64)
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    _check(rewards, starts, lengths, gamma)
    if len(starts) == 0 or lengths.max() == 0:
        return np.zeros(len(rewards), dtype=np.float64)
    last, k = _by_length(starts, lengths)
    remaining = np.zeros(len(rewards), dtype=np.int64)  # steps left in the episode, this one included; 0 outside
    for d in range(len(k)):
        remaining[last[: k[d]] - d] = d + 1
    returns = np.where(remaining > 0, rewards, 0.0)
    discount = 1.0
    for j in range(1, min(n, len(k))):
        discount *= gamma
        returns[:-j] += discount * np.where(remaining[:-j] > j, rewards[j:], 0.0)
    return returns


def episode_returns(episodes: Episodes, gamma: float = GAMMA, n: int | None = None, rewards: FloatArray | None = None) -> FloatArray:
    """Per-step returns of ``episodes``: full-episode (``n`` None) or n-step; ``rewards`` default to the episodes'."""
    r = episodes.rewards if rewards is None else rewards
    if n is None:
        return discounted_returns(r, episodes.starts, episodes.lengths, gamma)
    return n_step_returns(r, episodes.starts, episodes.lengths, n, gamma)


def session_returns(episodes: Episodes, rewards: FloatArray | None = None, gamma: float = GAMMA) -> FloatArray:
    """Per episode: ``G_0``, the discounted return from its first step (the summand of mean_return).

    ``rewards`` default to ``episodes.rewards``, the raw attributed rewards that mean_return is
    defined on; pass others (a simulator's, a re-weighted set) only for the same steps.
    """
    return episode_returns(episodes, gamma, rewards=rewards)[episodes.starts]


@dataclass(frozen=True, slots=True)
class MeanReturn:
    """mean_return with its 95 % normal-approximation confidence interval."""

    mean: float
    stderr: float
    """Sample std (ddof 1) / √n; NaN when n < 2."""
    low: float
    high: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def mean_return(session_g0: FloatArray) -> MeanReturn:
    """Mean of per-session returns (``session_returns``) and ``mean ± 1.96 · stderr``."""
    g = np.asarray(session_g0, dtype=np.float64)
    if len(g) == 0:
        raise ValueError("mean_return of no sessions")
    mean = float(g.mean())
    stderr = float(g.std(ddof=1) / math.sqrt(len(g))) if len(g) > 1 else math.nan
    return MeanReturn(mean=mean, stderr=stderr, low=mean - Z_95 * stderr, high=mean + Z_95 * stderr, n=len(g))


@dataclass(frozen=True, slots=True)
class RewardScale:
    """Quantile normalisation parameters: ``r ↦ r / scale`` (``clip``: ``clip(r, low, high) / scale``) for r ≠ 0, zeros stay 0.

    Record ``to_dict()`` with the trained policy; ``apply`` the same parameters to new rewards.
    By default the rewards are only divided by one positive number, so the policy that is best
    for the normalised rewards is the one best for the raw ones, which the gate judges. With
    ``clip`` a non-zero reward below ``low`` becomes ``low`` whatever its sign, and one above
    ``high`` becomes ``high``: the trainer then optimises something the gate does not see (a
    large order counts as a typical one), so it is an option, not the default.
    """

    low: float
    """The ``lower_q`` quantile of the non-zero rewards (0 when there are none)."""
    high: float
    """The ``upper_q`` quantile of the non-zero rewards (0 when there are none)."""
    scale: float
    """``max(high - low, min_scale)``."""
    lower_q: float
    upper_q: float
    n_nonzero: int
    """How many non-zero rewards the quantiles were taken over."""
    clip: bool = False
    """Clip to [low, high] before scaling."""

    def apply(self, rewards: FloatArray) -> FloatArray:
        r = np.asarray(rewards, dtype=np.float64)
        return np.where(r != 0.0, (np.clip(r, self.low, self.high) if self.clip else r) / self.scale, 0.0)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def fit_reward_scale(rewards: FloatArray, lower_q: float = 0.05, upper_q: float = 0.95, min_scale: float = 1.0, *,
                     clip: bool = False) -> RewardScale:
    """Quantiles of the **non-zero** rewards (linear interpolation, ``np.quantile``'s default).

    Rewards are sparse: most steps are 0, so quantiles over all steps would be 0 and 0. Taking
    them over the non-zero rewards and leaving zeros at 0 (no centring: 0 still means "nothing
    happened") keeps the scale that of actual outcomes. ``min_scale`` (reward units) floors the
    spread ``high - low`` so constant or absent rewards do not blow up.
    """
    if not 0.0 <= lower_q <= upper_q <= 1.0:
        raise ValueError(f"need 0 <= lower_q <= upper_q <= 1, got {lower_q!r}, {upper_q!r}")
    if not min_scale > 0:
        raise ValueError(f"min_scale must be > 0, got {min_scale!r}")
    r = np.asarray(rewards, dtype=np.float64)
    nonzero = r[r != 0.0]
    low, high = (float(q) for q in np.quantile(nonzero, [lower_q, upper_q])) if len(nonzero) else (0.0, 0.0)
    return RewardScale(low=low, high=high, scale=max(high - low, min_scale), lower_q=lower_q, upper_q=upper_q, n_nonzero=len(nonzero),
                       clip=clip)


def normalize_rewards(
    rewards: FloatArray, lower_q: float = 0.05, upper_q: float = 0.95, min_scale: float = 1.0, *, clip: bool = False
) -> tuple[FloatArray, RewardScale]:
    """``fit_reward_scale`` then ``apply``: the normalised rewards and the parameters to record (no clipping by default)."""
    scale = fit_reward_scale(rewards, lower_q, upper_q, min_scale, clip=clip)
    return scale.apply(rewards), scale
