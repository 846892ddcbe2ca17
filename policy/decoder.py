"""The sampled-majority decoder and the exact probability of what it serves.

Procedure for one request, given the final masked distribution ``q`` (guardrails applied,
vetoed actions removed, renormalised) and a seed:

1. With probability ``epsilon`` explore: serve one draw from ``q_T ∝ q^(1/T)`` (the
   temperature-``T`` softmax of the masked logits).
2. Otherwise draw ``K`` samples from ``q`` and count votes ``c`` (a composition of ``K``
   into ``n`` parts). The action with the most votes wins; **tie rule**: among tied actions
   the one with the larger ``q`` wins, and an exact tie in ``q`` goes to the lower action
   number. If the winner has fewer than ``min_votes`` votes, the rule engine's action ``r``
   is served instead.

Because the winner is a function of ``c`` alone (given ``q``), the probability of serving
``a`` is exact and cheap: with 5 actions and 10 draws there are C(14, 4) = 1,001 count
vectors, each with multinomial probability ``K! / ∏ c_i! · ∏ q_i^c_i``::

    P(a) = ε·q_T(a) + (1-ε)·( Σ_{c : win(c)=a, max c ≥ m} Mult(c; K, q) + [r = a]·Σ_{c : max c < m} Mult(c; K, q) )

This is the behaviour policy the trainer's importance weights and the offline estimators
need, not the policy softmax.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import numpy.typing as npt

from core.domain import N_ACTIONS, FloatArray

IntArray = npt.NDArray[np.int64]


def compositions(total: int, parts: int) -> IntArray:
    """All vectors of ``parts`` non-negative integers summing to ``total`` (stars and bars)."""
    rows = []
    for bars in combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *bars, total + parts - 1)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(parts)])
    return np.array(rows, dtype=np.int64)


def uniform_bytes(decision_id: str, n: int) -> bytes:
    """The raw material of ``n`` uniforms: SHAKE-256 of the decision id, ``8n`` bytes."""
    return hashlib.shake_256(decision_id.encode()).digest(8 * n)


def uniforms_batch(decision_ids: Sequence[str], n: int) -> FloatArray:
    """(len(ids), n) uniforms in [0, 1): 53-bit floats from the 64-bit words of ``uniform_bytes``.

    Derived from the decision id alone, so any logged decision replays exactly; cheaper than
    seeding a numpy Generator per request (about 1 µs against 50 µs). A prefix of the
    stream does not depend on ``n``.
    """
    words = np.frombuffer(b"".join(uniform_bytes(d, n) for d in decision_ids), dtype="<u8").reshape(len(decision_ids), n)
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniforms(decision_id: str, n: int) -> FloatArray:
    return uniforms_batch([decision_id], n)[0]


def tempered(q: FloatArray, temperature: float) -> FloatArray:
    """``q^(1/T)`` normalised along the last axis, in log space: at a small ``T`` the powers of every ``q`` < 1 underflow to
    0 in linear space (0/0: NaN, and an exploration draw past every mask), while here the largest ``q`` keeps weight 1
    and a banned (``q`` = 0) action stays at exactly 0."""
    positive = q > 0
    log_q = np.where(positive, np.log(np.where(positive, q, 1.0)), -np.inf)  # (no log of 0: no divide warning to silence)
    weights = np.exp((log_q - log_q.max(axis=-1, keepdims=True)) / temperature)
    return weights / weights.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def check_settings(samples: int, min_votes: int, epsilon: float, temperature: float) -> None:
    """``ValueError`` naming the decoder setting out of range."""
    if samples < 1:
        raise ValueError(f"samples: expected >= 1, got {samples}")
    if not 1 <= min_votes <= samples:
        raise ValueError(f"min_votes: expected 1..{samples}, got {min_votes}")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"exploration_epsilon: expected 0..1, got {epsilon}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"exploration_temperature: expected > 0, got {temperature}")


@dataclass(frozen=True, slots=True)
class Draw:
    """One run of the procedure: the served index, or ``None`` when the rule engine must answer."""

    index: int | None
    explored: bool
    counts: IntArray


class MajorityDecoder:
    """Sampled majority with a vote minimum and ε-exploration; exact served probabilities."""

    def __init__(self, samples: int = 10, min_votes: int = 4, epsilon: float = 0.05,
                 temperature: float = 1.2, n_actions: int = N_ACTIONS) -> None:
        check_settings(samples, min_votes, epsilon, temperature)
        self.samples = samples
        self.min_votes = min_votes
        self.epsilon = epsilon
        self.temperature = temperature
        self.n_actions = n_actions
        self._counts = compositions(samples, n_actions)
        log_coef = math.lgamma(samples + 1) - np.array(
            [sum(math.lgamma(c + 1) for c in row) for row in self._counts]
        )
        self._log_coef = log_coef
        self._decisive = self._counts.max(axis=1) >= min_votes
        self._actions = np.arange(n_actions)
        self._supports: dict[tuple[bool, ...], _Support] = {}
        self._tied: dict[tuple[tuple[bool, ...], tuple[int, ...]], tuple[IntArray, FloatArray]] = {}

    def order(self, q: FloatArray) -> IntArray:
        """Per row, actions from strongest to weakest under the tie rule (larger ``q``, then lower index)."""
        return np.argsort(-q, axis=-1, kind="stable")

    def _support(self, support: tuple[bool, ...]) -> _Support:
        """The count vectors whose votes all fall on the supported actions, and where their probability goes (cached).

        A count vector with a unique largest count has the same winner whatever the order of ``q``; with the vote
        minimum it goes to that winner, below it to the rule engine's column (``n_actions``): ``fixed``, one matrix
        product for every row. Only a decisive vector whose largest count is shared (70 of 1,001 for 5 actions, 10
        votes and a minimum of 4) needs the row's order to pick its winner: ``tied``, resolved per order by ``_tied_winners``.
        """
        table = self._supports.get(support)
        if table is None:
            mask = np.array(support)
            rows = ~(self._counts[:, ~mask] > 0).any(axis=1)
            counts = self._counts[rows]
            top = counts.max(axis=1)
            decisive = top >= self.min_votes
            tied = decisive & ((counts == top[:, None]).sum(axis=1) > 1)
            untied = decisive & ~tied
            fixed = np.zeros((len(counts), self.n_actions + 1))
            fixed[np.flatnonzero(untied), counts.argmax(axis=1)[untied]] = 1.0
            fixed[~decisive, self.n_actions] = 1.0
            table = self._supports[support] = _Support(
                mask=mask, counts_t=np.ascontiguousarray(counts[:, mask].T.astype(np.float64)), log_coef=self._log_coef[rows],
                fixed=fixed, tied=np.flatnonzero(tied), tied_counts=counts[tied])
        return table

    def _tied_winners(self, support: tuple[bool, ...], order: tuple[int, ...]) -> tuple[IntArray, FloatArray]:
        """The winners of the support's tied count vectors under the tie rule, for actions in this ``order``: indices,
        and the same as rows of an (n_actions + 1)-column one-hot matrix (cached: at most 326 (support, order) pairs for
        5 actions)."""
        key = (support, order)
        winners = self._tied.get(key)
        if winners is None:
            counts = self._support(support).tied_counts
            index = self._winners(counts, np.broadcast_to(np.array(order), counts.shape))
            winners = self._tied[key] = (index, np.eye(self.n_actions + 1)[index])
        return winners

    def winner(self, counts: Sequence[int] | IntArray, q: Sequence[float] | FloatArray) -> int:
        """Majority action of one count vector under the tie rule (no vote minimum)."""
        return int(self._winners(np.asarray([counts]), self.order(np.asarray([q], dtype=np.float64)))[0])

    def winners(self, counts: IntArray, order: IntArray) -> IntArray:
        """Majority action per row of ``counts`` given each row's action ``order`` (``order()``), no vote minimum."""
        return self._winners(counts, order)

    def _winners(self, counts: IntArray, order: IntArray) -> IntArray:
        # ``order.argsort`` is each action's place in the order (0: strongest), a permutation's inverse: more votes win,
        # then an earlier place (counts times n_actions outweighs any difference of places)
        return (counts * self.n_actions - order.argsort(axis=1)).argmax(axis=1)  # type: ignore[no-any-return]

    def explore_batch(self, q: FloatArray) -> FloatArray:
        """``q_T ∝ q^(1/T)`` per row: the temperature-scaled masked distribution."""
        return tempered(q, self.temperature)

    def explore_distribution(self, q: FloatArray | Sequence[float]) -> FloatArray:
        return self.explore_batch(np.asarray([q], dtype=np.float64))[0]

    def served_and_drawn(self, q: FloatArray, fallback: IntArray, u: FloatArray) -> tuple[FloatArray, DrawBatch]:
        """``served_batch`` and ``draw_batch`` of the same rows, sharing their order and exploration distribution (what
        a decision needs: about a fifth of the decoder's time for a batch of one)."""
        order, explore = self.order(q), self.explore_batch(q)  # (the draw needs q_T whatever epsilon is)
        return self._served(q, fallback, order, explore if self.epsilon > 0 else None), self._drawn(q, u, order, explore)

    def served_batch(self, q: FloatArray, fallback: IntArray) -> FloatArray:
        """Exact probability of serving each action, per row of ``q`` (N, n_actions).

        ``fallback[i]`` is the rule engine's action index for row ``i`` (``ValueError`` outside 0..n_actions − 1). Rows
        that share a support share their count vectors: a batch costs a few matrix products per support (``_served``).
        """
        fallback = np.asarray(fallback)
        if fallback.shape != (len(q),) or (len(q) and not (0 <= fallback.min() and fallback.max() < self.n_actions)):
            raise ValueError(f"fallback: expected one action index in 0..{self.n_actions - 1} per row, got {fallback.tolist()}")
        return self._served(q, fallback, self.order(q), self.explore_batch(q) if self.epsilon > 0 else None)

    def _served(self, q: FloatArray, fallback: IntArray, order: IntArray, explore: FloatArray | None) -> FloatArray:
        """Per support, one matrix product gives every row's probabilities of the count vectors on it and another sends
        them to their winners (``_support``); the few tied ones go by the rows' order: one more product when the rows
        share one, else a ``bincount`` by each row's own. ``fallback`` must hold valid action indices (the rule engine's;
        ``served_batch`` checks them)."""
        n, a = len(q), self.n_actions
        groups: dict[tuple[bool, ...], list[int]] = {}
        for i, key in enumerate(map(tuple, (q > 0).tolist())):
            groups.setdefault(key, []).append(i)
        whole = len(groups) == 1  # every row on one support (a batch of one always): its shares are the result
        decided = None if whole else np.empty((n, a))  # else filled support by support
        orders = list(map(tuple, order.tolist()))
        for support, members in groups.items():
            t = self._support(support)
            m = len(members)
            mult = np.exp(t.log_coef + np.log((q if whole else q[members])[:, t.mask]) @ t.counts_t)  # (m, count vectors)
            shares = mult @ t.fixed  # (m, a + 1): each action's decisive share, then the rule engine's
            if len(t.tied):
                keys = [orders[i] for i in members]
                if keys.count(keys[0]) == m:  # one order (a single row, or alike rows): a product with its winners
                    shares += mult[:, t.tied] @ self._tied_winners(support, keys[0])[1]
                else:
                    bins = np.array([self._tied_winners(support, k)[0] for k in keys]) + (a + 1) * np.arange(m)[:, None]
                    shares += np.bincount(bins.ravel(), weights=mult[:, t.tied].ravel(),
                                          minlength=(a + 1) * m).reshape(m, a + 1)
            shares[np.arange(m), fallback if whole else fallback[members]] += shares[:, a]
            if decided is not None:
                decided[members] = shares[:, :a]
        served: FloatArray = (1.0 - self.epsilon) * (shares[:, :a] if decided is None else decided)
        if explore is not None:
            served += self.epsilon * explore
        return served

    def served_distribution(self, q: FloatArray | Sequence[float], fallback: int) -> FloatArray:
        """Exact probability of serving each action for one request."""
        return self.served_batch(np.asarray([q], dtype=np.float64), np.array([fallback]))[0]

    def draw_batch(self, q: FloatArray, u: FloatArray) -> DrawBatch:
        """Run the procedure once per row with the row's uniforms ``u`` (N, samples + 2).

        ``u[:, 0]`` decides exploration, ``u[:, 1]`` picks the exploration draw, the rest are
        the K votes; each draw is an inverse-CDF lookup (the count of CDF entries ≤ u·total).
        """
        return self._drawn(q, u, self.order(q), self.explore_batch(q))

    def _drawn(self, q: FloatArray, u: FloatArray, order: IntArray, explore: FloatArray) -> DrawBatch:
        n, last = len(q), self.n_actions - 1
        if q.shape != (n, self.n_actions):  # the lookup below would count any width of CDF without complaint
            raise ValueError(f"q: expected (N, {self.n_actions}) probabilities, got {q.shape}")
        if u.shape != (n, self.samples + 2):  # the draw's contract: exploration, its draw, then ``samples`` votes a row
            raise ValueError(f"u: expected ({n}, {self.samples + 2}) uniforms, got {u.shape}")
        explored = u[:, 0] < self.epsilon
        cdf = q.cumsum(axis=1)
        # A vote lands past action j (j < last) iff it is at least cdf[j] (the CDF never falls), so the number of such j
        # is the action it lands on, the lookup's clamp at the last action included: (N, K) actions, then votes per action.
        voted = (u[:, 2:, None] * cdf[:, None, -1:] >= cdf[:, None, :last]).sum(axis=2)
        counts = (voted[:, :, None] == self._actions).sum(axis=1)
        winners = self._winners(counts, order)
        decisive = counts.max(axis=1) >= self.min_votes  # the winner's count is the largest
        if explored.any():
            at = np.flatnonzero(explored)
            explore_cdf = np.cumsum(explore[at], axis=1)
            winners[at] = np.minimum((u[at, 1:2] * explore_cdf[:, -1:] >= explore_cdf).sum(axis=1), last)
            decisive[at] = True
            counts[at] = 0
        return DrawBatch(index=winners, explored=explored, decisive=decisive, counts=counts)

    def draw(self, q: FloatArray | Sequence[float], decision_id: str) -> Draw:
        """Run the procedure once with uniforms derived from the decision id (replayable)."""
        batch = self.draw_batch(np.asarray([q], dtype=np.float64), uniforms(decision_id, self.samples + 2)[None, :])
        index = int(batch.index[0])
        return Draw(index=index if batch.decisive[0] else None, explored=bool(batch.explored[0]), counts=batch.counts[0])


@dataclass(frozen=True, slots=True)
class DrawBatch:
    """One run of the procedure per row. Where ``decisive`` is false the rule engine answers."""

    index: IntArray  # (N,) served index (the majority winner, or the exploration draw)
    explored: npt.NDArray[np.bool_]  # (N,)
    decisive: npt.NDArray[np.bool_]  # (N,) explored, or the winner has at least min_votes
    counts: IntArray  # (N, n_actions) votes; zeros when explored


@dataclass(frozen=True, slots=True)
class _Support:
    """The count vectors of one support (``MajorityDecoder._support``)."""

    mask: npt.NDArray[np.bool_]  # (n_actions,) actions with q > 0
    counts_t: FloatArray  # (|support|, vectors): votes on the supported actions of every count vector on the support
    log_coef: FloatArray  # (vectors,) their log multinomial coefficients
    fixed: FloatArray  # (vectors, n_actions + 1) one-hot: the winner, or the rule engine's column; zero where tied
    tied: IntArray  # decisive vectors whose largest count is shared (their winner depends on the order)
    tied_counts: IntArray  # (len(tied), n_actions) those vectors
