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
from numpy.lib.stride_tricks import sliding_window_view

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


_WINDOW_ROWS = 128  # from this many rows on, the sliding window's matrix product beats the gathered Toeplitz matrix


@functools.cache
def _lags(width: int) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """For a truncated product of ``width`` coefficients: ``[d, j] → d − j`` (clipped at 0) and where it is ≥ 0."""
    lag = np.arange(width)[:, None] - np.arange(width)[None, :]
    return np.clip(lag, 0, None), lag >= 0


def _times_batch(a: FloatArray, b: FloatArray) -> FloatArray:
    """Row by row, the product of two polynomials (rows of coefficients, lowest first), truncated to their length:
    ``out[r, d] = Σ_j a[r, j] · b[r, d − j]``. A few rows (one request's layer): a gathered Toeplitz matrix, the least
    overhead per call. A micro-batch's hundreds: a batched matrix product over a sliding window of ``b``, a view with
    no gathered copy, 4-8x faster there and about 2x slower at 7 rows (measured with 11 coefficients)."""
    w = a.shape[1]
    if len(a) < _WINDOW_ROWS:
        lag, causal = _lags(w)
        toeplitz = np.where(causal, b[:, lag], 0.0)  # (rows, d, j) = b[d − j]
        return np.einsum("rj,rdj->rd", a, toeplitz)  # type: ignore[no-any-return]
    padded = np.concatenate([np.zeros((len(b), w - 1)), b], axis=1)
    window = sliding_window_view(padded, w, axis=1)  # [r, d, i] = b[r, d − (w − 1) + i]
    return np.matmul(window, a[:, ::-1, None])[:, :, 0]  # type: ignore[no-any-return]


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
    def _row(q: FloatArray | Sequence[float]) -> FloatArray:
        """One request's ``q`` as a batch of one row (the batch methods check and normalise it)."""
        q = np.asarray(q, dtype=np.float64)
        if q.ndim != 1:
            raise ValueError(f"q: expected a vector of probabilities, got shape {q.shape}")
        return q[None, :]

    def order(self, q: FloatArray) -> IntArray:
        """Candidates from strongest to weakest under the tie rule (larger ``q``, then lower index)."""
        return np.argsort(-q, kind="stable")

    def explore(self, q: FloatArray) -> FloatArray:
        """``q_T ∝ q^(1/T)``: the temperature-scaled distribution of the exploration draw."""
        return tempered(q, self.temperature)

    @staticmethod
    def _checked_rows(q: FloatArray | Sequence[Sequence[float]]) -> FloatArray:
        q = np.asarray(q, dtype=np.float64)
        if q.ndim != 2 or q.shape[1] == 0 or not np.isfinite(q).all() or (q < 0).any() or not (q.sum(axis=1) > 0).all():
            raise ValueError("q: expected rows of finite, non-negative probabilities, each with a positive sum")
        return q / q.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]

    def decided(self, q: FloatArray | Sequence[float]) -> tuple[FloatArray, float]:
        """Without exploration: P(each candidate wins with at least ``min_votes``), and P(no candidate does)."""
        wins, low = self.decided_batch(self._row(q))
        return wins[0], float(low[0])

    def decided_batch(self, q: FloatArray | Sequence[Sequence[float]]) -> tuple[FloatArray, FloatArray]:
        """``decided`` for each row of ``q`` (B, n) at once. Rows with fewer candidates are padded with 0: a candidate of
        probability 0 wins nothing and its truncated exponential is the polynomial 1, so padding changes no product.

        Every winning count ``c`` at once: the truncated exponentials of all rows' candidates for all ``c`` are one
        array (B, C, n, K + 1), and the prefix (stronger) and suffix (weaker) products run over the candidates in
        strength order, one batched truncated polynomial product (``_times_batch``) per position and direction."""
        return self._decided(self._checked_rows(q))

    def _decided(self, q: FloatArray) -> tuple[FloatArray, FloatArray]:
        """``decided_batch`` of rows already checked and normalised (``_checked_rows``)."""
        k, m = self.samples, self.min_votes
        b, n = q.shape
        order = np.argsort(-q, axis=1, kind="stable")  # each row strongest first (``order``'s tie rule)
        qs = np.take_along_axis(q, order, axis=1)
        j = np.arange(k + 1)
        terms = _truncated_exp(qs.ravel(), k, k).reshape(b, n, k + 1)  # q^j / j!
        cs = np.arange(m, k + 1)  # the winner's possible counts
        c = len(cs)
        below = np.where(j <= (cs - 1)[:, None, None], terms[:, None], 0.0)  # (B, C, n, k+1) stronger: fewer than c votes
        upto = np.where(j <= cs[:, None, None], terms[:, None], 0.0)  # weaker: at most c
        one = np.zeros((b * c, k + 1))
        one[:, 0] = 1.0
        prefix = np.empty((b, c, n, k + 1))
        running = one
        for i in range(n):
            prefix[:, :, i] = running.reshape(b, c, k + 1)
            running = _times_batch(running, below[:, :, i].reshape(b * c, k + 1))
        suffix = np.empty((b, c, n, k + 1))
        running = one
        for i in range(n - 1, -1, -1):
            suffix[:, :, i] = running.reshape(b, c, k + 1)
            running = _times_batch(running, upto[:, :, i].reshape(b * c, k + 1))
        # [t^(k − c)] prefix · suffix, for each row, c and candidate
        other = (k - cs)[:, None] - j[None, :]  # (C, k + 1): the suffix's degree paired with the prefix's d
        valid = other >= 0
        index = np.broadcast_to(np.where(valid, other, 0)[None, :, None, :], suffix.shape)
        paired = np.take_along_axis(suffix, index, axis=3)  # (B, C, n, k + 1)
        coefficient = (prefix * np.where(valid[None, :, None, :], paired, 0.0)).sum(axis=3)  # (B, C, n)
        log_c_fact = np.array([math.lgamma(x + 1) for x in cs])
        with np.errstate(divide="ignore"):
            log_head = self._log_k_fact - log_c_fact[None, :, None] + cs[None, :, None] * np.log(qs)[:, None, :]
        wins_sorted = np.where(qs[:, None, :] > 0, np.exp(log_head) * coefficient, 0.0).sum(axis=1)  # (B, n)
        low = _truncated_exp(qs.ravel(), m - 1, k).reshape(b, n, k + 1)  # every candidate below the vote minimum
        product = np.zeros((b, k + 1))
        product[:, 0] = 1.0
        for i in range(n):
            product = _times_batch(product, low[:, i])
        wins = np.zeros((b, n))
        np.put_along_axis(wins, order, wins_sorted, axis=1)
        return wins, math.exp(self._log_k_fact) * product[:, k]

    def served(self, q: FloatArray | Sequence[float], fallback: int) -> FloatArray:
        """Exact probability of serving each candidate; ``fallback``: the rule engine's candidate."""
        return self.served_batch(self._row(q), [fallback])[0]

    def served_batch(self, q: FloatArray | Sequence[Sequence[float]], fallback: IntArray | Sequence[int]) -> FloatArray:
        """``served`` for each row of ``q`` (B, n; shorter rows padded with 0) and its rule's candidate ``fallback[b]``."""
        return self._served(self._checked_rows(q), fallback)

    def served_and_drawn(self, q: FloatArray | Sequence[Sequence[float]], fallback: IntArray | Sequence[int], u: FloatArray,
                         sizes: Sequence[int]) -> tuple[FloatArray, list[PluralityDraw]]:
        """``served_batch`` and ``draw_batch`` of the same rows, checked once (a layer of a micro-batch needs both)."""
        q = self._checked_rows(q)
        return self._served(q, fallback), self._drawn(q, u, sizes)

    def _served(self, q: FloatArray, fallback: IntArray | Sequence[int]) -> FloatArray:
        fallback = np.asarray(fallback, dtype=np.int64)
        if fallback.shape != (len(q),) or (fallback < 0).any() or (fallback >= q.shape[1]).any():
            raise ValueError(f"fallback: expected one candidate index in 0..{q.shape[1] - 1} per row, got {fallback.tolist()}")
        wins, low = self._decided(q)
        wins[np.arange(len(q)), fallback] += low
        out: FloatArray = (1.0 - self.epsilon) * wins
        if self.epsilon > 0:
            out += self.epsilon * self.explore(q)
        return out

    def draw_with(self, q: FloatArray | Sequence[float], u: FloatArray) -> PluralityDraw:
        """Run the procedure once with ``samples + 2`` uniforms: ``u[0]`` explores or not, ``u[1]`` picks the exploration
        draw, the rest are the votes; each draw an inverse-CDF lookup (as ``MajorityDecoder.draw_batch``)."""
        row = self._row(q)
        return self.draw_batch(row, np.asarray(u, dtype=np.float64)[None, :], [row.shape[1]])[0]

    def draw_batch(self, q: FloatArray | Sequence[Sequence[float]], u: FloatArray,
                   sizes: Sequence[int]) -> list[PluralityDraw]:
        """``draw_with`` for each row of ``q`` (B, n), row ``b`` holding ``sizes[b]`` candidates and 0 after them, with
        the uniforms ``u[b]``. A padded 0 is never drawn (its step of the CDF is empty), and a lookup past a row's last
        step, which rounding in ``u · total`` can give, is its last candidate, as alone."""
        return self._drawn(self._checked_rows(q), u, sizes)

    def _drawn(self, q: FloatArray, u: FloatArray, sizes: Sequence[int]) -> list[PluralityDraw]:
        b, n = q.shape
        last = np.asarray(sizes, dtype=np.int64) - 1
        if u.shape != (b, self.samples + 2) or last.shape != (b,) or (last < 0).any() or (last >= n).any():
            raise ValueError(f"u and sizes: expected ({b}, {self.samples + 2}) uniforms and {b} sizes in 1..{n}")
        cdf = np.cumsum(self.explore(q), axis=1)
        explored_at = np.minimum((u[:, 1:2] * cdf[:, -1:] >= cdf).sum(axis=1), last)
        cdf = np.cumsum(q, axis=1)
        picks = np.minimum((u[:, 2:, None] * cdf[:, None, -1:] >= cdf[:, None, :]).sum(axis=2), last[:, None])  # (B, K)
        counts = (picks[:, :, None] == np.arange(n)).sum(axis=1, dtype=np.int64)  # (B, n)
        rank = np.empty((b, n), dtype=np.int64)
        np.put_along_axis(rank, np.argsort(-q, axis=1, kind="stable"), np.arange(n - 1, -1, -1)[None, :], axis=1)
        winner = np.argmax(counts * n + rank, axis=1)  # most votes, then the stronger (``order``'s tie rule)
        draws = []
        for i in range(b):
            if u[i, 0] < self.epsilon:
                draws.append(PluralityDraw(int(explored_at[i]), True, np.zeros(last[i] + 1, dtype=np.int64)))
            else:
                w = int(winner[i])
                draws.append(PluralityDraw(w if counts[i, w] >= self.min_votes else None, False, counts[i, :last[i] + 1]))
        return draws

    def draw(self, q: FloatArray | Sequence[float], decision_id: str) -> PluralityDraw:
        """Run the procedure once with uniforms derived from the decision id (replayable)."""
        return self.draw_with(q, uniforms(decision_id, self.samples + 2))
