"""The gate of the product decision: is the new bundle's offer worth more than the current one's, on held-out logs?

An offer is a one-step decision, so importance weighting needs no product of ratios over a session: the weight of a
logged offer is the new bundle's probability of serving the logged (category, SKU, band), given the same candidates,
over the probability it was logged with, w = π(c) π(s | c) π(b | c, s) / μ(c, s, b). Each factor is the layer's
*served* probability (the plurality vote, exploration and rule fallback of ``policy.plurality``, computed from the
logged features, what the guardrails permitted and the rule's order: what the server would serve, up to the logged
features' float16 rounding, which can flip a guard's veto of a candidate that close to its threshold). Each
bundle's own learned guard (``weights.product_guard``) vetoes among what the guardrails permitted, as it does when
serving, so a new guard is judged with the heads it ships with, and the rule's choice among what it leaves is read
from the logged order. Rows logged before the guardrail mask and the rule's order were (``experience.schema``) are
replayed under the serving bundle's mask and rule choice instead, exact only for a bundle with the serving one's
vetoes; the verdict counts them (``offers_on_logged_mask``). The estimate is the
per-session sum of w · r (``trainer.product_data``'s reward), averaged over held-out sessions; the current bundle is
estimated the same way on the same offers, and the difference is paired per session, with a percentile bootstrap over
sessions (``trainer.bootstrap``: the same resamples for both). Weights are cut at ``MAX_WEIGHT``; the tail of the
uncut weights is read by PSIS's k̂ (``trainer.pareto``), as the flat decision's gate reads it.

Verdict: publish iff the held-out sessions are at least ``MIN_SESSIONS``, k̂ ≤ ``MAX_PARETO_K`` (NaN refuses), and
the lower bound of new − current is ≥ −tolerance. Before judging, the current bundle's replay of the offers it
served (its heads and its guard) must give back the logged propensities (``REPLAY_TOLERANCE``); a mismatch is an error, not a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from policy.product_policy import masked_softmax_padded
from policy.product_rules import first_permitted_rows
from trainer.bootstrap import Estimate, bootstrap_counts, interval
from trainer.pareto import pareto_k, shown_against
from trainer.product_data import HEAD_OF, LAYERS, ProductRows
from weights.model_set import ProductLayers

MAX_WEIGHT = 100.0
MAX_PARETO_K = 0.7
N_BOOT = 400
REPLAY_CHUNK = 512  # rows replayed at once: the served-probability arrays stay about 10 MB each at 64 candidates
MIN_SESSIONS = 100
"""Held-out sessions below which the gate does not judge (k̂ cannot be fitted on fewer than ~25 offers either)."""
REPLAY_TOLERANCE = 0.02
"""How far the current bundle's replayed joint probability may be from the logged one, on average over the rows it
served: further, and the logs were served with other decoder settings (a server's --samples, --min-votes,
--exploration-epsilon) or other heads or guard, and neither side's estimate would be of what was served."""


def served_probability(product: ProductLayers, rows: ProductRows) -> npt.NDArray[np.float64]:
    """Per logged offer, the probability that ``product`` (its heads, its guard, its decoder) would serve the logged
    (category, SKU, band) on its candidates (module doc)."""
    return np.prod(list(layer_probabilities(product, rows).values()), axis=0)  # type: ignore[no-any-return]


def layer_probabilities(product: ProductLayers, rows: ProductRows) -> dict[str, npt.NDArray[np.float64]]:
    """Per layer and logged offer, the probability that ``product`` would serve the layer's logged choice given the
    logged choices before it."""
    heads, guard = product.heads, product.guard
    n = len(rows)
    h = heads.encode(rows.states) if n else np.zeros((0, 1), np.float32)
    out = {}
    for layer in LAYERS:
        data, head = rows.layers[layer], HEAD_OF[layer]
        row_of, cand = np.nonzero(data.valid)
        logits = np.zeros(data.valid.shape, dtype=np.float32)
        allowed = data.guardrail.copy()
        if len(row_of):  # every row's candidates in one call
            x = data.features[row_of, cand]
            logits[row_of, cand] = heads.score(head, h[row_of], x)
            if guard is not None:
                allowed[row_of, cand] &= ~guard.vetoed(head, h[row_of], x)
        logged = data.guardrails_logged
        allowed = np.where(logged[:, None], allowed, data.permitted)
        all_vetoed = logged & ~allowed.any(axis=1)  # the rule answers among what the guardrails permit, with certainty
        allowed[all_vetoed] = data.guardrail[all_vetoed]
        fallback = np.where(logged, first_permitted_rows(data.rule_rank, allowed), data.fallback)
        sizes, out[layer] = data.valid.sum(axis=1), np.ones(n)
        for start in range(0, n, REPLAY_CHUNK):  # the server's batched procedure, a chunk of rows at a time
            at = slice(start, start + REPLAY_CHUNK)
            width = int(sizes[at].max())  # valid candidates are a prefix of each row
            q = masked_softmax_padded(logits[at, :width], allowed[at, :width])
            chosen = product.decoder.served_batch(q, fallback[at])[np.arange(len(q)), data.index[at]]
            out[layer][at] = np.where(all_vetoed[at], data.index[at] == fallback[at], chosen)
    return out


def session_terms(rows: ProductRows, target: npt.NDArray[np.float64], max_weight: float = MAX_WEIGHT
                  ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.object_], npt.NDArray[np.float64]]:
    """Per held-out session, Σ min(w, max_weight) · r over its offers; the sessions; the uncut weights."""
    behaviour = np.prod([rows.layers[layer].propensity for layer in LAYERS], axis=0)
    weights = target / np.maximum(behaviour, 1e-12)
    sessions, which = np.unique(rows.sessions.astype(str), return_inverse=True)
    terms = np.bincount(which, weights=np.minimum(weights, max_weight) * rows.rewards, minlength=len(sessions)).astype(np.float64)
    return terms, sessions, weights


@dataclass(frozen=True)
class ProductGate:
    publish: bool
    reason: str
    new: Estimate
    current: Estimate
    difference: Estimate
    pareto_k: float
    sessions: int
    offers: int
    offers_on_logged_mask: int = 0
    """Offers logged without the guardrail mask and the rule's order, replayed under the serving bundle's (module doc)."""

    def to_dict(self) -> dict[str, Any]:
        return {"publish": self.publish, "reason": self.reason, "new": self.new.to_dict(), "current": self.current.to_dict(),
                "difference": self.difference.to_dict(), "pareto_k": self.pareto_k if math.isfinite(self.pareto_k) else None,
                "sessions": self.sessions, "offers": self.offers, "offers_on_logged_mask": self.offers_on_logged_mask,
                "value": "product reward per session (IPS)"}


def judge(new: ProductLayers, current: ProductLayers, rows: ProductRows, tolerance: float = 0.0, seed: int = 0,
          n_boot: int = N_BOOT, level: float = 0.95, current_version: str | None = None) -> ProductGate:
    """The verdict on ``rows`` (held-out offers; module doc). ``current_version``: the current bundle's model version,
    whose logged rows its replay must reproduce."""
    if len(rows) == 0:
        raise ValueError("the gate has no held-out product decisions to judge on")
    current_p = served_probability(current, rows)
    mine = rows.versions == current_version
    if mine.any():
        logged = np.prod([rows.layers[layer].propensity[mine] for layer in LAYERS], axis=0)
        gap = float(np.abs(current_p[mine] - logged).mean())
        if gap > REPLAY_TOLERANCE:
            raise ValueError(f"the current bundle ({current_version}) does not replay its own logged propensities (mean gap "
                             f"{gap:.3g} > {REPLAY_TOLERANCE}): the logs were served with other decoder settings, heads or guard")
    new_terms, sessions, new_w = session_terms(rows, served_probability(new, rows))
    cur_terms, _, _ = session_terms(rows, current_p)
    with np.errstate(invalid="ignore", over="ignore"):  # a reward that is not finite: NaN figures, refused below
        stacked = np.stack([new_terms, cur_terms, new_terms - cur_terms], axis=1)
        samples = np.concatenate([counts @ stacked / len(sessions) for counts in bootstrap_counts(len(sessions), n_boot, seed)])
        point = stacked.mean(axis=0)
        est = [interval(samples[:, j], float(point[j]), level) for j in range(3)]
    k = pareto_k(new_w)
    refusals = []
    if len(sessions) < MIN_SESSIONS:
        refusals.append(f"too few held-out sessions to judge: {len(sessions)} < {MIN_SESSIONS}")
    if not k <= MAX_PARETO_K and len(sessions) >= MIN_SESSIONS:  # NaN refuses too
        refusals.append(f"the new heads' weights are too heavy-tailed to judge: Pareto k̂ {shown_against(k, MAX_PARETO_K)} > "
                        f"{MAX_PARETO_K}")
    if not (math.isfinite(est[2].value) and math.isfinite(est[2].ci_low)):  # NaN < −tolerance is false: refused here
        refusals.append(f"the difference could not be estimated: new − current = {est[2].value:.4g} per session, lower bound "
                        f"{est[2].ci_low:.4g} (a reward or weight that is not a finite number)")
    elif est[2].ci_low < -tolerance:
        refusals.append(f"the new heads may be worse: new − current = {est[2].value:.4g} per session, lower bound "
                        f"{est[2].ci_low:.4g} < −{tolerance:g}")
    reason = "; ".join(refusals) or (f"new − current = {est[2].value:.4g} per session, lower bound {est[2].ci_low:.4g} ≥ "
                                     f"−{tolerance:g}; Pareto k̂ {shown_against(k, MAX_PARETO_K)}")
    on_mask = int((~np.all([rows.layers[layer].guardrails_logged for layer in LAYERS], axis=0)).sum())
    return ProductGate(not refusals, reason, est[0], est[1], est[2], k, len(sessions), len(rows), on_mask)
