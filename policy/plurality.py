"""The sampled-majority decoder over a candidate set of any size, with exact served probabilities.

``RecommendProduct``'s layers (categories, SKUs, price bands) choose among as many candidates as
the request offers, so the count-vector table of ``policy.decoder`` (C(K + n − 1, n − 1) rows:
352,716 for 12 candidates) does not scale. The procedure is the same as ``MajorityDecoder``'s —
ε-exploration from ``q_T ∝ q^(1/T)``, else ``K`` draws from ``q``, the most-voted candidate wins
(ties: the larger ``q``, then the lower index), the rule engine's candidate when the winner has
fewer than ``min_votes`` — and so are the uniforms (``policy.decoder.uniforms``), so a logged
decision replays exactly. Its probabilities come from exponential generating functions instead
of enumeration. With ``e_L(x) = Σ_{j ≤ L} x^j / j!`` (a truncated exponential, in ``t``):

    P(a wins with c votes) = K!/c! · q_a^c · [t^(K−c)] ∏_{b stronger than a} e_{c−1}(q_b t) · ∏_{b weaker} e_c(q_b t)
    P(no candidate has m votes) = K! · [t^K] ∏_b e_{m−1}(q_b t)

(a multinomial's probability of counts ``c`` is ``K! ∏ q_b^{c_b} / c_b!``; a stronger candidate must
have fewer votes than the winner, a weaker one at most as many). The products over "all but
``a``" come from prefix and suffix products in strength order: O(n · K²) per request
(``served``), exact to rounding, and equal to ``MajorityDecoder``'s for five candidates (tested).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from core.domain import FloatArray
from policy.decoder import check_settings, tempered, uniforms

IntArray = npt.NDArray[np.int64]


def _truncated_exp(q: FloatArray, top: int, degree: int) -> FloatArray:
    """Per candidate, the coefficients of ``e_top(q t)`` up to ``t^degree``: shape (n, degree + 1)."""
    j = np.arange(degree + 1)
    log_fact = np.array([math.lgamma(k + 1) for k in j])
    with np.errstate(divide="ignore", invalid="ignore"):  # q = 0: log −inf, and 0 · −inf at j = 0 (set below)
        terms = np.exp(j[None, :] * np.log(q)[:, None] - log_fact[None, :])
    terms[:, 0] = 1.0  # q^0 = 1, also where q = 0
    terms[:, j > top] = 0.0
    return terms


@functools.cache
def _lags(width: int) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """For a truncated product of ``width`` coefficients: ``[d, j] → d − j`` (clipped at 0) and where it is ≥ 0."""
    lag = np.arange(width)[:, None] - np.arange(width)[None, :]
    return np.clip(lag, 0, None), lag >= 0


def _times_batch(a: FloatArray, b: FloatArray) -> FloatArray:
    """Row by row, the product of two polynomials (rows of coefficients, lowest first), truncated to their length."""
    lag, causal = _lags(a.shape[1])
    toeplitz = np.where(causal, b[:, lag], 0.0)  # (rows, d, j) = b[d − j]
    return np.einsum("rj,rdj->rd", a, toeplitz)


@dataclass(frozen=True, slots=True)
class PluralityDraw:
    """One run of the procedure: the served index, or None when the rule engine must answer."""

    index: int | None
    explored: bool
    counts: IntArray


class PluralityDecoder:
    """Sampled majority with a vote minimum and ε-exploration over ``n`` candidates; exact served probabilities."""

    def __init__(self, samples: int = 10, min_votes: int = 4, epsilon: float = 0.05, temperature: float = 1.2) -> None:
        check_settings(samples, min_votes, epsilon, temperature)
        self.samples, self.min_votes, self.epsilon, self.temperature = samples, min_votes, epsilon, temperature
        self._log_k_fact = math.lgamma(samples + 1)

    @staticmethod
    def _checked(q: FloatArray | Sequence[float]) -> FloatArray:
        q = np.asarray(q, dtype=np.float64)
        if q.ndim != 1 or len(q) == 0 or not np.isfinite(q).all() or (q < 0).any() or not q.sum() > 0:
            raise ValueError("q: expected a non-empty vector of finite, non-negative probabilities with a positive sum")
        return q / q.sum()

    def order(self, q: FloatArray) -> IntArray:
        """Candidates from strongest to weakest under the tie rule (larger ``q``, then lower index)."""
        return np.argsort(-q, kind="stable")

    def explore(self, q: FloatArray) -> FloatArray:
        """``q_T ∝ q^(1/T)``: the temperature-scaled distribution of the exploration draw."""
        return tempered(q, self.temperature)

    def decided(self, q: FloatArray | Sequence[float]) -> tuple[FloatArray, float]:
        """Without exploration: P(each candidate wins with at least ``min_votes``), and P(no candidate does).

        Every winning count ``c`` at once: the truncated exponentials of all candidates for all ``c`` are one array
        (C, n, K + 1), and the prefix (stronger) and suffix (weaker) products run over the candidates in strength order,
        one batched truncated polynomial product (``_times_batch``) per candidate and direction."""
        q = self._checked(q)
        k, m, n = self.samples, self.min_votes, len(q)
        order = self.order(q)
        qs = q[order]
        j = np.arange(k + 1)
        terms = _truncated_exp(qs, k, k)  # (n, k + 1): q^j / j!
        cs = np.arange(m, k + 1)  # the winner's possible counts
        below = np.where(j[None, None, :] <= (cs - 1)[:, None, None], terms[None], 0.0)  # stronger: fewer than c votes
        upto = np.where(j[None, None, :] <= cs[:, None, None], terms[None], 0.0)  # weaker: at most c
        one = np.zeros((len(cs), k + 1))
        one[:, 0] = 1.0
        prefix = np.empty((len(cs), n, k + 1))
        running = one
        for i in range(n):
            prefix[:, i] = running
            running = _times_batch(running, below[:, i])
        suffix = np.empty((len(cs), n, k + 1))
        running = one
        for i in range(n - 1, -1, -1):
            suffix[:, i] = running
            running = _times_batch(running, upto[:, i])
        # [t^(k − c)] prefix · suffix, for each c and candidate
        d = j[None, :]
        other = (k - cs)[:, None] - d  # (C, k + 1): the suffix's degree paired with the prefix's d
        valid = other >= 0
        paired = np.take_along_axis(suffix, np.where(valid, other, 0)[:, None, :], axis=2)  # (C, n, k + 1)
        coefficient = (prefix * np.where(valid[:, None, :], paired, 0.0)).sum(axis=2)  # (C, n)
        with np.errstate(divide="ignore"):
            log_head = self._log_k_fact - np.array([math.lgamma(c + 1) for c in cs])[:, None] + cs[:, None] * np.log(qs)[None, :]
        wins_sorted = np.where(qs[None, :] > 0, np.exp(log_head) * coefficient, 0.0).sum(axis=0)
        low = _truncated_exp(qs, m - 1, k)  # every candidate below the vote minimum
        product = one[:1]
        for row in low:
            product = _times_batch(product, row[None, :])
        wins = np.zeros(n)
        wins[order] = wins_sorted
        return wins, float(math.exp(self._log_k_fact) * product[0, k])

    def served(self, q: FloatArray | Sequence[float], fallback: int) -> FloatArray:
        """Exact probability of serving each candidate; ``fallback``: the rule engine's candidate."""
        q = self._checked(q)
        if not 0 <= fallback < len(q):
            raise ValueError(f"fallback: expected a candidate index in 0..{len(q) - 1}, got {fallback}")
        wins, low = self.decided(q)
        wins[fallback] += low
        out: FloatArray = (1.0 - self.epsilon) * wins
        if self.epsilon > 0:
            out += self.epsilon * self.explore(q)
        return out

    def draw_with(self, q: FloatArray | Sequence[float], u: FloatArray) -> PluralityDraw:
        """Run the procedure once with ``samples + 2`` uniforms: ``u[0]`` explores or not, ``u[1]`` picks the exploration
        draw, the rest are the votes; each draw an inverse-CDF lookup (as ``MajorityDecoder.draw_batch``)."""
        q = self._checked(q)
        last = len(q) - 1
        if u[0] < self.epsilon:
            cdf = np.cumsum(self.explore(q))
            return PluralityDraw(min(int((u[1] * cdf[-1] >= cdf).sum()), last), True, np.zeros(len(q), dtype=np.int64))
        cdf = np.cumsum(q)
        picks = np.minimum((u[2:, None] * cdf[-1] >= cdf[None, :]).sum(axis=1), last)
        counts = np.bincount(picks, minlength=len(q)).astype(np.int64)
        rank = np.empty(len(q), dtype=np.int64)
        rank[self.order(q)] = np.arange(len(q) - 1, -1, -1)
        winner = int(np.argmax(counts * len(q) + rank))
        return PluralityDraw(winner if counts[winner] >= self.min_votes else None, False, counts)

    def draw(self, q: FloatArray | Sequence[float], decision_id: str) -> PluralityDraw:
        """Run the procedure once with uniforms derived from the decision id (replayable)."""
        return self.draw_with(q, uniforms(decision_id, self.samples + 2))
