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

    def served(self, q: torch.Tensor, fallback: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """(N, A): probability of serving each action. ``q`` from ``masked_q``; ``fallback`` the rule
        engine's index per row; ``ok`` false where the rules answer with certainty."""
        n = len(q)
        safe_q = torch.where(ok[:, None], q, 1.0 / self.n)  # rows the rules answer: any valid q, discarded below
        log_q = torch.log(torch.clamp(safe_q, min=torch.finfo(self.dtype).tiny))
        support = safe_q > 0
        # log Mult(c; K, q) for every row and count vector; count vectors voting for an
        # unsupported action have probability 0 (their log_q term is ≈ -700 × c).
        log_mult = self.log_coef[None, :] + log_q @ self.counts.T  # (N, C)
        bad = (~support).to(self.dtype) @ self.counts.T > 0
        mult = torch.where(bad, 0.0, torch.exp(log_mult))
        with torch.no_grad():
            order = torch.argsort(-safe_q, dim=1, stable=True).cpu().numpy()
            keys, inverse = np.unique(order, axis=0, return_inverse=True)
            win = torch.stack([self._winner_table(tuple(int(x) for x in k)) for k in keys])[torch.as_tensor(inverse.reshape(-1))]
        decisive = self.decisive[None, :]
        decided = torch.zeros(n, self.n, dtype=self.dtype, device=q.device).scatter_add(1, win, torch.where(decisive, mult, 0.0))
        low = torch.where(decisive, 0.0, mult).sum(dim=1)
        decided = decided + low[:, None] * torch.nn.functional.one_hot(fallback, self.n).to(self.dtype)
        served = (1.0 - self.epsilon) * decided
        if self.epsilon > 0:
            qt = torch.where(safe_q > 0, safe_q, 0.0) ** (1.0 / self.temperature)
            served = served + self.epsilon * qt / qt.sum(dim=1, keepdim=True)
        certain = torch.nn.functional.one_hot(fallback, self.n).to(self.dtype)
        return torch.where(ok[:, None], served, certain)[:n]

    def served_of(self, logits: torch.Tensor, log_weights: torch.Tensor, allowed: torch.Tensor, fallback: torch.Tensor,
                  ok: torch.Tensor) -> torch.Tensor:
        return self.served(self.masked_q(logits, log_weights, allowed), fallback, ok)
