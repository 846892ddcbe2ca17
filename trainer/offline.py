"""Off-policy evaluation on logged sessions: per-decision IPS, its self-normalised form, doubly robust, trajectory IS.

numpy only (no torch): the ``evaluate`` command runs it next to onnxruntime. Every estimate is in
the units of ``mean_return`` (``experience.returns``): the expected discounted return per
session from its first step, of the episodes' raw rewards, with the ``gamma`` given. The gate
gives it the business objective's rewards and γ = 1 (``trainer.evaluation``), so there every
estimate is of the objective per session. The logs were served by the
behaviour policy μ (its propensity of the served action is logged); the target policy π is the
one being evaluated. Per step ``t`` of episode ``e`` (flat arrays in ``Episodes`` step order)::

    ρ_t      = min(π(a_t|s_t) / μ(a_t|s_t), max_ratio)                   per-decision ratio
    w_{0:t}  = min(Π_{k ≤ t} ρ_k, max_weight),   w_{0:-1} = 1             cumulative weight

    IPS   (PDIS)  V = (1/E) Σ_e Σ_t γ^t w_{0:t} r_t
    SNIPS (WPDIS) V = Σ_t γ^t (Σ_e w_{e,0:t} r_{e,t}) / (Σ_e w̄_{e,t})
    DR            V = (1/E) Σ_e Σ_t γ^t [w_{0:t} (r_t − Q̂(s_t, a_t)) + w_{0:t−1} V̂(s_t)],  V̂(s) = Σ_a π(a|s) Q̂(s, a)
    TIS           V = (1/E) Σ_e w_{e,0:L_e−1} Σ_t γ^t r_{e,t}                trajectory-wise, for comparison

**Which weights are valid.** The per-decision estimators weight ``r_t`` by ``w_{0:t}`` only, which
is right when ``r_t`` depends on the actions up to ``t`` and not on later ones: rewards placed at
the step where they are observed, as the default rules place them (``experience.attribution``).
A credit rule that makes ``r_t`` depend on later actions (last touch: an add_to_cart earns the
order only if no later step served add_to_cart) biases them, and only TIS, whose one weight is
the whole session's, stays unbiased; it pays for that with a larger variance. TIS next to DR
is the check that the credit assignment in use is one the per-decision weights can carry.

**Rows served with certainty** (a rule-engine answer, logged with μ(a_t|s_t) = 1) need no special
case: their ratio π(a_t|s_t) / 1 is the exact likelihood ratio of what was served, and with π = μ
there (the target answers the same with certainty) it is exactly 1, so every estimator is then
exactly the behaviour's value. What such a row cannot show is any other action: π's mass on
actions μ gave no probability is outside the logs' support, and no weighting can estimate it;
the gate measures that mass and refuses a bundle that puts too much there.

**Truncation** applies twice: to each ratio (``max_ratio``) and to each cumulative weight
(``max_weight``), the cap taken on the running product, ``min(W, Π ρ)``, not recursively. So no
weight that multiplies a reward exceeds ``max_weight``, and one extreme decision cannot carry a
whole session. Both trade bias (weights shrunk) for variance; ``math.inf`` turns either off, and
then IPS and DR are unbiased provided μ(a|s) > 0 wherever π(a|s) > 0 (which the logs cannot
show: only the served action's propensity is logged). Defaults: ``max_ratio = 10`` (a target ten
times as likely as the logger to take an action is already far off-policy), ``max_weight = 100``.
``mean_final_weight`` (1 in expectation without truncation) and the ESS say when they bind.

**SNIPS** normalises the weight at each step index ``t`` by the weights of *all* episodes: an
episode shorter than ``t`` sits in an absorbing state with reward 0 and its final weight carried
(``w̄_{e,t} = w_{e,0:min(t, L_e−1)}``; in the absorbing state π = μ, so the ratio is 1). With π = μ
every weight is 1, the normaliser is ``E`` at every ``t`` and SNIPS is exactly mean_return;
normalising by the episodes alive at ``t`` only would not be (it over-weights long sessions).

**DR** is the per-decision doubly robust estimator (Jiang & Li 2016; Thomas & Brunskill 2016).
It is unbiased for any Q̂ fixed independently of the evaluation data (cross-fitting, below); a
better Q̂ only lowers its variance. With a perfect Q̂ on a deterministic problem every episode
contributes exactly ``V^π(s_0)``, whatever the weights (the sum telescopes). With π = μ it equals
mean_return plus ``Σ_t γ^t (V̂(s_t) − Q̂(s_t, a_t))``, zero in expectation but not per sample unless
Q̂ ignores the action or the policy is deterministic.

**ESS** ``(Σ w)² / Σ w²`` of the final trajectory weights ``w_{e,0:L_e−1}`` (``ess``, at most
``E``), and of all per-step weights ``w_{0:t}`` (``ess_steps``, at most ``N``).

**Confidence intervals**: the percentile bootstrap over episodes of ``trainer.bootstrap``, the
same resamples for the same logs and seed, so ``difference`` gives the paired CI of two
reports' gap.

Cost, 10⁶ steps on one core: ``evaluate`` with 400 resamples ≈ 3 s, ``cross_fit_q`` with 50
features ≈ 3 s. (On an oversubscribed machine, multi-threaded BLAS can be ten times slower:
set ``OPENBLAS_NUM_THREADS`` at the entry point.)


The inputs are checked in ``trainer.ope_arrays``; the bootstrap is ``trainer.bootstrap``; Q̂ is
``trainer.q_model``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.domain import FloatArray
from experience.returns import GAMMA, mean_return, session_returns
from experience.sessions import Episodes
from trainer.bootstrap import Estimate, bootstrap_counts, interval
from trainer.ope_arrays import (
    BoolArray,
    IntArray,
    Layout,
    check_actions,
    check_behavior_prob,
    check_matrix,
    check_target_probs,
    layout,
)
from trainer.pareto import pareto_k

MAX_RATIO = 10.0
MAX_WEIGHT = 100.0
N_BOOT = 400
LEVEL = 0.95
ESTIMATORS = ("ips", "snips", "dr", "tis", "behavior_value")


# --- importance weights ------------------------------------------------------------------------


def segment_cumsum(x: npt.NDArray[Any], starts: IntArray, lengths: IntArray) -> npt.NDArray[Any]:
    """Running sums restarted at every episode: one global ``cumsum`` minus the sum before each episode."""
    total = np.cumsum(x)
    before = np.concatenate([np.zeros(1, dtype=total.dtype), total])[starts]
    out: npt.NDArray[Any] = total - np.repeat(before, lengths)
    return out


def importance_ratios(target_probs: FloatArray, actions: IntArray, behavior_prob: FloatArray, max_ratio: float = MAX_RATIO) -> FloatArray:
    """``ρ_t = min(π(a_t|s_t) / μ(a_t|s_t), max_ratio)`` with ``π(a_t|s_t) = target_probs[t, actions[t]]``."""
    pi = target_probs[np.arange(len(actions)), actions]
    return np.minimum(pi / behavior_prob, max_ratio)


def cumulative_weights(ratios: FloatArray, starts: IntArray, lengths: IntArray, max_weight: float = MAX_WEIGHT) -> FloatArray:
    """``w_{0:t} = min(Π_{k ≤ t} ρ_k, max_weight)`` within each episode, no padding.

    The product is a running sum of ``log ρ`` restarted per episode (``segment_cumsum``); a zero
    ratio (π gives the served action no mass) is counted separately and zeroes the weight from
    that step on. The cap is applied in log space, so nothing overflows, and capped weights are
    exactly ``max_weight``. Rounding: the restart subtracts two running sums over all steps, an
    absolute error of about ``1e-16 · |Σ log ρ|`` in ``log w`` (≈ 1e-10 relative for 10⁶ steps);
    ratios of exactly 1 give weights of exactly 1.
    """
    return _cumulative_weights(ratios, starts, lengths, max_weight)[0]


def _cumulative_weights(ratios: FloatArray, starts: IntArray, lengths: IntArray, max_weight: float) -> tuple[FloatArray, BoolArray]:
    """``cumulative_weights`` and, per step, whether the cap cut its weight."""
    zero = ratios <= 0
    log_product = segment_cumsum(np.log(np.where(zero, 1.0, ratios)), starts, lengths)
    dead = segment_cumsum(zero.astype(np.int64), starts, lengths) > 0
    log_cap = math.log(max_weight)
    capped = ~dead & (log_product > log_cap)
    weights = np.exp(np.minimum(log_product, log_cap))
    weights[capped] = max_weight
    weights[dead] = 0.0
    return weights, capped


def previous_weights(weights: FloatArray, starts: IntArray) -> FloatArray:
    """``w_{0:t−1}`` per step: the weight one step earlier in the episode, 1 at each episode's first step."""
    prev = np.empty_like(weights)
    prev[1:] = weights[:-1]
    prev[starts] = 1.0
    return prev


def effective_sample_size(weights: FloatArray) -> float:
    """``(Σ w)² / Σ w²``: ``len(w)`` for equal weights, 1 when one weight carries everything, 0 when all are 0."""
    sq = float(np.dot(weights, weights))
    return float(weights.sum()) ** 2 / sq if sq > 0 else 0.0


# --- estimators --------------------------------------------------------------------------------


def pdis_terms(rewards: FloatArray, weights: FloatArray, discount: FloatArray, starts: IntArray) -> FloatArray:
    """Per episode ``Σ_t γ^t w_{0:t} r_t``; IPS (PDIS, Precup et al. 2000) is their mean."""
    return np.add.reduceat(discount * weights * rewards, starts)


def tis_terms(rewards: FloatArray, weights: FloatArray, discount: FloatArray, starts: IntArray, lengths: IntArray) -> FloatArray:
    """Per episode ``w_{0:L−1} Σ_t γ^t r_t``: the session's return times its final (truncated) weight; TIS is their mean."""
    return weights[starts + lengths - 1] * np.add.reduceat(discount * rewards, starts)


def dr_terms(
    rewards: FloatArray,
    weights: FloatArray,
    discount: FloatArray,
    starts: IntArray,
    target_probs: FloatArray,
    actions: IntArray,
    q_hat: FloatArray,
) -> FloatArray:
    """Per episode ``Σ_t γ^t [w_{0:t} (r_t − Q̂(s_t, a_t)) + w_{0:t−1} V̂(s_t)]``, ``V̂(s) = Σ_a π(a|s) Q̂(s, a)``; DR is their mean."""
    q_served = q_hat[np.arange(len(actions)), actions]
    v_hat = np.einsum("ij,ij->i", target_probs, q_hat)
    step = weights * (rewards - q_served) + previous_weights(weights, starts) * v_hat
    return np.add.reduceat(discount * step, starts)


@dataclass(frozen=True, slots=True, eq=False)
class _WpdisPlan:
    """SNIPS under episode multiplicities ``c_e`` (1 for the sample, bootstrap counts for a resample)::

        V(c) = Σ_t γ^t  Σ_e c_e w_{e,0:t} r_{e,t}  /  Σ_e c_e w̄_{e,t}
        Σ_e c_e w̄_{e,t} = Σ_{e alive at t} c_e w_{e,0:t}  +  Σ_{e: L_e ≤ t} c_e w_{e,0:L_e−1}

    With the episodes ordered longest first, those alive at ``t`` are the first ``k_t`` and the
    ended ones the rest. So for a chunk of resamples ``C`` (b, E) in that order, step index ``t``
    costs one matrix product of the contiguous view ``C[:, :k_t]`` with the (k_t, 2) block of
    ``[w r, w]`` at ``t``, and the ended part is a suffix sum of ``C · w_final`` read at ``k_t``:
    O(b · N) work in ``max L`` BLAS calls, no (b, N) array.
    """

    order: IntArray
    """The episodes, longest first (stable)."""
    alive: IntArray
    """``k_t``: how many episodes are longer than ``t``, for t = 0 … max L − 1."""
    offsets: IntArray
    """Block ``t`` of ``step_terms`` is rows ``offsets[t] : offsets[t] + k_t``."""
    step_terms: FloatArray
    """(N, 2): ``[w_{0:t} r_t, w_{0:t}]`` of the first ``k_t`` episodes in ``order``, block by block."""
    final_w: FloatArray
    """Final weights in ``order``."""
    discount: FloatArray
    """γ^t for t = 0 … max L − 1."""

    @classmethod
    def build(cls, lay: Layout, weights: FloatArray, gamma: float) -> _WpdisPlan:
        order = np.argsort(-lay.lengths, kind="stable")
        sorted_len = lay.lengths[order]
        n_t = int(sorted_len[0])
        alive = np.searchsorted(-sorted_len, -np.arange(n_t), side="left").astype(np.int64)
        first = lay.starts[order]
        steps = np.concatenate([first[:k] + t for t, k in enumerate(alive.tolist())])
        return cls(
            order=order,
            alive=alive,
            offsets=np.concatenate([[0], np.cumsum(alive)[:-1]]).astype(np.int64),
            step_terms=np.stack([weights * lay.rewards, weights], axis=1)[steps],
            final_w=weights[first + sorted_len - 1],
            discount=gamma ** np.arange(n_t, dtype=np.float64),
        )

    def values(self, counts: FloatArray) -> FloatArray:
        """SNIPS for each row of episode multiplicities ``counts`` (b, E)."""
        c = np.ascontiguousarray(counts[:, self.order])
        n_e = c.shape[1]
        ended = np.zeros((len(c), n_e + 1))
        ended[:, :n_e] = np.cumsum((c * self.final_w)[:, ::-1], axis=1)[:, ::-1]  # ended[:, k] = Σ_{j ≥ k}
        numerator = np.empty((len(c), len(self.alive)))
        normaliser = np.empty_like(numerator)
        for t, (k, lo) in enumerate(zip(self.alive.tolist(), self.offsets.tolist(), strict=True)):
            sums = c[:, :k] @ self.step_terms[lo : lo + k]
            numerator[:, t] = sums[:, 0]
            normaliser[:, t] = sums[:, 1] + ended[:, k]
        ratio = np.divide(numerator, normaliser, out=np.zeros_like(numerator), where=normaliser > 0)
        return ratio @ self.discount


# --- the report --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class OfflineReport:
    """The estimates of one target policy on one set of logs, and how much to trust them."""

    ips: Estimate
    snips: Estimate
    dr: Estimate | None
    """None when no Q̂ was given."""
    tis: Estimate
    """Trajectory-wise IS: valid whatever the credit assignment, noisier."""
    behavior_value: Estimate
    """The on-policy mean_return of the logs (the behaviour policy's value), same resamples."""
    ess: float
    """ESS of the final trajectory weights (≤ n_episodes)."""
    ess_steps: float
    """ESS of all per-step cumulative weights (≤ n_steps)."""
    n_episodes: int
    n_steps: int
    n_clipped_ratios: int
    """Steps whose ratio was cut to ``max_ratio``."""
    n_clipped_weights: int
    """Steps whose cumulative weight was cut to ``max_weight``."""
    mean_final_weight: float
    """Mean of the final trajectory weights: near 1 when the estimates are sound (E_μ[w] = 1 untruncated)."""
    pareto_k: float
    """PSIS's k̂ of the untruncated final trajectory weights (``trainer.pareto``): below 0.5 the intervals mean what
    they say; from 0.5 the weights' variance is infinite and the sessions that carry the mean are too rare to be in
    the sample, so the estimates fall short and the intervals undercover; −∞ when every weight is equal, NaN with too
    few episodes to fit."""
    final_weight: Estimate
    """``mean_final_weight`` with its interval (same resamples). The weights' estimate of a number known to be 1: an
    interval far from 1 says they missed the sessions that carry the mean (a heavy tail not yet sampled) or that a
    few carry it all, and then the estimates are no better."""
    gamma: float
    max_ratio: float
    max_weight: float
    n_boot: int
    level: float
    seed: int
    fingerprint: str
    """Hash of the episodes' lengths and rewards; ``difference`` pairs only reports with equal ones."""
    samples: Mapping[str, FloatArray]
    """Per estimator: its ``n_boot`` bootstrap values (resample ``i`` is the same across reports)."""
    episode_terms: Mapping[str, FloatArray]
    """Per estimator that is a mean over episodes (``ips``, ``tis``, ``dr`` with Q̂, ``behavior_value``): each episode's
    term, in the episodes' order; the estimate is their mean. SNIPS, a ratio, has none."""

    def to_dict(self) -> dict[str, Any]:
        def cap(x: float) -> float | None:
            return x if math.isfinite(x) else None  # json.dumps would write Infinity

        return {
            "ips": self.ips.to_dict(),
            "snips": self.snips.to_dict(),
            "dr": self.dr.to_dict() if self.dr is not None else None,
            "tis": self.tis.to_dict(),
            "behavior_value": self.behavior_value.to_dict(),
            "diagnostics": {
                "ess": self.ess,
                "ess_steps": self.ess_steps,
                "n_episodes": self.n_episodes,
                "n_steps": self.n_steps,
                "n_clipped_ratios": self.n_clipped_ratios,
                "n_clipped_weights": self.n_clipped_weights,
                "mean_final_weight": self.mean_final_weight,
                "pareto_k": cap(self.pareto_k),
                "final_weight": self.final_weight.to_dict(),
                "gamma": self.gamma,
                "max_ratio": cap(self.max_ratio),
                "max_weight": cap(self.max_weight),
                "n_boot": self.n_boot,
                "level": self.level,
                "seed": self.seed,
            },
        }


def final_weights_tail(raw_ratios: FloatArray, starts: IntArray) -> float:
    """k̂ of the untruncated final weights Π_t ρ_t per episode, from their logs (scaled by the largest: k̂ does not see
    the scale, and a product of many ratios would overflow)."""
    if len(starts) == 0:
        return math.nan
    with np.errstate(divide="ignore"):
        log_w = np.add.reduceat(np.log(raw_ratios), starts)
    finite = log_w[np.isfinite(log_w)]
    top = finite.max() if len(finite) else 0.0
    return pareto_k(np.exp(np.where(np.isfinite(log_w), log_w - top, -np.inf)))


def _check_settings(gamma: float, max_ratio: float, max_weight: float, n_boot: int, level: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: expected a number in [0, 1], got {gamma!r}")
    for name, cap in (("max_ratio", max_ratio), ("max_weight", max_weight)):
        if math.isnan(cap) or cap <= 0:
            raise ValueError(f"{name}: expected a number > 0 (math.inf for no cap), got {cap!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot: expected an integer >= 1, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected a number in (0, 1), got {level!r}")


def evaluate(
    episodes: Episodes,
    behavior_prob: FloatArray,
    target_probs: FloatArray,
    actions: npt.NDArray[np.integer[Any]],
    q_hat: FloatArray | None = None,
    *,
    gamma: float = GAMMA,
    max_ratio: float = MAX_RATIO,
    max_weight: float = MAX_WEIGHT,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = 0,
) -> OfflineReport:
    """Estimate the target policy's mean_return from the logs: IPS, SNIPS, DR (with ``q_hat``), TIS, behaviour value.

    All per-step inputs are in the episodes' step order (length ``N = len(episodes.rewards)``):
    ``behavior_prob`` the logged propensity μ(a_t|s_t) ∈ (0, 1] of the served action,
    ``target_probs`` (N, 5) the target policy's action probabilities at s_t (rows sum to 1),
    ``actions`` (N,) the served action index 0..4, ``q_hat`` (N, 5) Q̂(s_t, a) for DR, fitted on
    other episodes (``cross_fit_q``). Bad inputs raise ``ValueError`` naming the argument.
    """
    _check_settings(gamma, max_ratio, max_weight, n_boot, level)
    lay = layout(episodes)
    n = lay.n_steps
    mu = check_behavior_prob(behavior_prob, n)
    pi = check_target_probs(target_probs, n)
    a = check_actions(actions, n)
    q = None if q_hat is None else check_matrix(q_hat, n, "q_hat")

    raw = importance_ratios(pi, a, mu, max_ratio=math.inf)
    ratios = np.minimum(raw, max_ratio)
    weights, capped = _cumulative_weights(ratios, lay.starts, lay.lengths, max_weight)
    final = weights[lay.starts + lay.lengths - 1]
    discount = gamma ** lay.t.astype(np.float64)

    # Per-episode terms: the estimate under multiplicities c is Σ_e c_e term_e / E.
    names = ["ips", "behavior_value", "tis", "final_weight"] + (["dr"] if q is not None else [])
    columns = [pdis_terms(lay.rewards, weights, discount, lay.starts), session_returns(episodes, gamma=gamma),
               tis_terms(lay.rewards, weights, discount, lay.starts, lay.lengths), final]
    if q is not None:
        columns.append(dr_terms(lay.rewards, weights, discount, lay.starts, pi, a, q))
    terms = np.stack(columns, axis=1)
    plan = _WpdisPlan.build(lay, weights, gamma)

    values = dict(zip(names, terms.mean(axis=0).tolist(), strict=True))
    values["behavior_value"] = mean_return(terms[:, 1]).mean
    values["snips"] = float(plan.values(np.ones((1, lay.n_episodes)))[0])

    chunks: dict[str, list[FloatArray]] = {name: [] for name in [*names, "snips"]}
    for counts in bootstrap_counts(lay.n_episodes, n_boot, seed):
        for name, column in zip(names, (counts @ terms / lay.n_episodes).T, strict=True):
            chunks[name].append(column)
        chunks["snips"].append(plan.values(counts))
    samples = {name: np.concatenate(parts) for name, parts in chunks.items()}
    est = {name: interval(samples[name], values[name], level) for name in samples}

    return OfflineReport(
        ips=est["ips"],
        snips=est["snips"],
        dr=est.get("dr"),
        tis=est["tis"],
        behavior_value=est["behavior_value"],
        ess=effective_sample_size(final),
        ess_steps=effective_sample_size(weights),
        n_episodes=lay.n_episodes,
        n_steps=n,
        n_clipped_ratios=int((raw > max_ratio).sum()),
        n_clipped_weights=int(capped.sum()),
        mean_final_weight=float(final.mean()),
        pareto_k=final_weights_tail(raw, lay.starts),
        final_weight=est["final_weight"],
        gamma=gamma,
        max_ratio=max_ratio,
        max_weight=max_weight,
        n_boot=n_boot,
        level=level,
        seed=seed,
        fingerprint=lay.fingerprint(),
        samples=samples,
        episode_terms={name: terms[:, i].copy() for i, name in enumerate(names) if name != "final_weight"},
    )


def difference(new: OfflineReport, old: OfflineReport, estimator: str = "snips") -> Estimate:
    """``new − old`` for one estimator, with the percentile interval of the *paired* bootstrap differences.

    Both reports must come from the same logs, seed and ``n_boot`` (so resample ``i`` is the same
    episodes in both); the pairing cancels the episodes' common noise, so the interval is much
    narrower than comparing two separate intervals.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {list(ESTIMATORS)}, got {estimator!r}")
    if (new.fingerprint, new.seed, new.n_boot, new.level) != (old.fingerprint, old.seed, old.n_boot, old.level):
        raise ValueError("new, old: reports of different logs, seeds, n_boot or levels cannot be paired")
    a, b = getattr(new, estimator), getattr(old, estimator)
    if a is None or b is None:
        raise ValueError(f"estimator: {estimator!r} is missing from a report (no q_hat)")
    return interval(new.samples[estimator] - old.samples[estimator], a.value - b.value, new.level)
