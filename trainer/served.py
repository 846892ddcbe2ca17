"""The served distribution in torch: the sampled-majority decoder, differentiable in the policy.

The target policy of the update is what the new bundle would serve: the policy network under
the bundle's guardrails, the (already trained, frozen) guard's veto, the K-sample majority
with its vote minimum and rule-engine fallback, and ε-exploration — ``policy.decoder``'s
procedure, whose probability of serving ``a`` is (``policy/decoder.py``)::

    P(a) = ε·q_T(a) + (1-ε)·( Σ_{c decisive, win(c)=a} Mult(c; K, q) + [r = a]·Σ_{c not decisive} Mult(c; K, q) )

with q = softmax(z + g) restricted to the allowed actions and renormalised (z the policy
logits, g the log guardrail weights) and q_T ∝ q^(1/T).

How the decoder enters the gradient: Mult(c; K, q) = K!/∏c_i! · ∏ q_i^c_i is a polynomial in
q, so P(a) is differentiable in q, hence in θ, through every count vector. The winner of a
count vector depends on q only through the *order* of q (the tie rule), which is piecewise
constant: its derivative is zero almost everywhere, so it is computed without gradient
(``win`` below) and the gradient flows through the multinomial probabilities and through
q_T. The importance ratio of a logged step is then P_θ(a_t | s_t) / μ(a_t | s_t), with μ the
logged propensity of the same procedure. Rows where the guard vetoed every permitted action
are served by the rule engine with certainty: their P is constant (0 or 1), no gradient.

The count vectors, their coefficients, the vote minimum and the winner rule come from the
``MajorityDecoder`` itself, so this module and the server cannot disagree on them; a test
checks that both give the same probabilities.
"""

from __future__ import annotations

import numpy as np
import torch

from policy.decoder import MajorityDecoder


def distinct_rows(rows: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)`` for small non-negative integer rows (each entry < ``base``),
    up to the order of the keys: each row read as one integer in base ``base``, so the sort is of integers, not of
    rows (``axis=0`` sorts a void view of the rows, about 10 times slower on a cycle's 100,000 rows)."""
    codes = rows.astype(np.int64) @ (base ** np.arange(rows.shape[1], dtype=np.int64))
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    return rows[first], inverse.reshape(-1)


class TorchDecoder:
    """``MajorityDecoder.served_batch`` in torch, for a batch of rows."""

    def __init__(self, decoder: MajorityDecoder, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> None:
        self.decoder = decoder
        self.n = decoder.n_actions
        self.epsilon = decoder.epsilon
        self.temperature = decoder.temperature
        counts = decoder._counts  # (C, A) every composition of K into A parts
        self.counts_np = counts
        self.counts = torch.as_tensor(counts, dtype=dtype, device=device)
        self.log_coef = torch.as_tensor(decoder._log_coef, dtype=dtype, device=device)
        self.decisive = torch.as_tensor(decoder._decisive, device=device)
        self.dtype, self.device = dtype, device
        # Winner of every count vector for every order of the actions (the tie rule), built
        # lazily per order seen: (C,) action index.
        self._winners: dict[tuple[int, ...], torch.Tensor] = {}
        self._support: dict[tuple[bool, ...], torch.Tensor] = {}

    def _winner_table(self, order: tuple[int, ...]) -> torch.Tensor:
        table = self._winners.get(order)
        if table is None:
            orders = np.broadcast_to(np.array(order), (len(self.counts_np), self.n))
            winners = self.decoder.winners(self.counts_np, orders)
            table = self._winners[order] = torch.as_tensor(winners, dtype=torch.long, device=self.device)
        return table

    def masked_q(self, logits: torch.Tensor, log_weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q = softmax(z + g) over the allowed actions (zeros elsewhere); rows without any allowed action are all zero."""
        z = torch.where(allowed, logits.to(self.dtype) + torch.where(allowed, log_weights, 0.0), -torch.inf)
        top = z.max(dim=1, keepdim=True).values
        e = torch.exp(z - torch.where(torch.isfinite(top), top, 0.0))
        total = e.sum(dim=1, keepdim=True)
        return torch.where(total > 0, e / torch.where(total > 0, total, 1.0), 0.0)

    def _support_rows(self, support: tuple[bool, ...]) -> torch.Tensor:
        """Indices of the count vectors that put no vote on an unsupported action (cached per support)."""
        rows = self._support.get(support)
        if rows is None:
            unsupported = ~np.array(support)
            valid = ~(self.counts_np[:, unsupported] > 0).any(axis=1)
            rows = self._support[support] = torch.as_tensor(np.flatnonzero(valid), device=self.device)
        return rows

    def served(self, q: torch.Tensor, fallback: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """(N, A): probability of serving each action. ``q`` from ``masked_q``; ``fallback`` the rule
        engine's index per row; ``ok`` false where the rules answer with certainty.

        Rows are grouped by support (the actions with q > 0; exit is banned by default, so most
        rows have 4): a count vector voting for an unsupported action has probability 0, so
        each group only needs the count vectors on its support (286 of 1,001 for 4 actions).
        """
        safe_q = torch.where(ok[:, None], q, 1.0 / self.n)  # rows the rules answer: any valid q, discarded below
        with torch.no_grad():
            support_np = (safe_q > 0).cpu().numpy()
            order = torch.argsort(-safe_q, dim=1, stable=True).cpu().numpy()
            keys, inverse = distinct_rows(support_np, 2)
        parts: list[torch.Tensor] = []
        index: list[torch.Tensor] = []
        for g, key in enumerate(keys):
            members = torch.as_tensor(np.flatnonzero(inverse == g), device=q.device)
            cols = self._support_rows(tuple(bool(x) for x in key))
            parts.append(self._decided(safe_q[members], order[members.cpu().numpy()], cols, fallback[members]))
            index.append(members)
        decided = torch.cat(parts)[torch.argsort(torch.cat(index))]
        served = (1.0 - self.epsilon) * decided
        if self.epsilon > 0:
            qt = torch.where(safe_q > 0, safe_q, 0.0) ** (1.0 / self.temperature)
            served = served + self.epsilon * qt / qt.sum(dim=1, keepdim=True)
        certain = torch.nn.functional.one_hot(fallback, self.n).to(self.dtype)
        return torch.where(ok[:, None], served, certain)

    def _decided(self, q: torch.Tensor, order: np.ndarray, cols: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """Σ_c Mult(c; K, q)·(decisive one-hot of the winner, or the fallback) for rows sharing a support."""
        counts, log_coef, decisive = self.counts[cols], self.log_coef[cols], self.decisive[cols]
        log_q = torch.log(torch.clamp(q, min=torch.finfo(self.dtype).tiny))
        mult = torch.exp(log_coef[None, :] + log_q @ counts.T)  # (n, C_support): every count lives on the support
        with torch.no_grad():
            keys, inverse = distinct_rows(order, self.n)
            tables = torch.stack([self._winner_table(tuple(int(x) for x in k)) for k in keys])[:, cols]
            win = tables[torch.as_tensor(inverse, device=q.device)]
        decided = torch.zeros(len(q), self.n, dtype=self.dtype, device=q.device)
        decided = decided.scatter_add(1, win, torch.where(decisive[None, :], mult, 0.0))
        low = torch.where(decisive[None, :], 0.0, mult).sum(dim=1)
        return decided + low[:, None] * torch.nn.functional.one_hot(fallback, self.n).to(self.dtype)

    def served_of(self, logits: torch.Tensor, log_weights: torch.Tensor, allowed: torch.Tensor, fallback: torch.Tensor,
                  ok: torch.Tensor) -> torch.Tensor:
        return self.served(self.masked_q(logits, log_weights, allowed), fallback, ok)
