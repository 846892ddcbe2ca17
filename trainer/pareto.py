"""How heavy the upper tail of importance weights is: the Pareto shape k̂ of Pareto-smoothed importance sampling.

An importance-sampling mean Σ wᵢ gᵢ / n is unbiased, but when the weights' tail is heavy the sessions that carry its
expectation are so rare that a finite sample usually misses them: the estimate then falls short of the truth, and a
bootstrap of the same sample cannot see it (it resamples what is there). Vehtari, Simpson, Gelman, Yao and Gabry
("Pareto Smoothed Importance Sampling", JMLR 25, 2024) read the tail off the sample itself: fit a generalized Pareto
distribution to the largest M = min(n / 5, 3 √n) weights' excesses over the next one; its shape k̂ says

- k̂ < 0.5: the weights have a finite variance, the central limit theorem holds, a bootstrap interval means what it says;
- 0.5 ≤ k̂ < 0.7: the variance is infinite; the mean converges, slowly, and an interval from the sample undercovers;
- k̂ ≥ 0.7 (for n above a few thousand): the estimate is not to be trusted at any sample size one can afford.

The fit is Zhang and Stephens' empirical-Bayes estimate ("A New and Efficient Estimation Method for the Generalized
Pareto Distribution", Technometrics 51, 2009), with the weakly informative prior PSIS adds (k̂ pulled towards 0.5 as if
by 10 more observations), written here from the papers in numpy: a few dozen lines do not justify scipy or arviz as
trainer dependencies. ``pareto_k`` of weights that are all equal (a policy judged on its own logs) is −∞: no tail.
Weights that tie at the tail's threshold (a discrete policy's) set the fit's scale by the smallest positive excess
instead of the lower quartile, so ties do not hide a heavy tail.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

MIN_TAIL = 5
"""Fewer tail weights than this and there is nothing to fit: ``pareto_k`` gives NaN."""
PRIOR_WEIGHT = 10.0
PRIOR_K = 0.5


def tail_size(n: int) -> int:
    """M, the number of largest weights the fit reads: min(n / 5, 3 √n)."""
    return int(min(n / 5.0, 3.0 * math.sqrt(n)))


def gpd_shape(excesses: npt.ArrayLike) -> float:
    """The generalized Pareto shape k of positive ``excesses`` (Zhang & Stephens; k > 0 a heavy tail), before the prior."""
    x = np.sort(np.asarray(excesses, dtype=np.float64))
    n = len(x)
    if n < MIN_TAIL or not np.isfinite(x).all() or x[0] < 0:
        raise ValueError(f"excesses: expected at least {MIN_TAIL} finite values >= 0, got {n}")
    if x[-1] <= 0:
        return -math.inf
    quartile = x[max(int(n / 4 + 0.5) - 1, 0)]
    if quartile <= 0:  # ties at the threshold (discrete weights): the grid's scale from the smallest positive excess
        quartile = float(x[x > 0][0])
    m = 30 + int(math.sqrt(n))
    j = np.arange(1, m + 1, dtype=np.float64)
    # Candidate θ = −k/σ on the grid of the paper, each with its profile log-likelihood; θ̂ is their posterior mean.
    theta = 1.0 / x[-1] + (1.0 - np.sqrt(m / (j - 0.5))) / (3.0 * quartile)
    k_of = -np.log1p(-theta[:, None] * x[None, :]).mean(axis=1)
    loglik = n * (np.log(theta / k_of) + k_of - 1.0)
    posterior = np.exp(loglik - loglik.max())  # 1 / Σ_j exp(ℓ_j − ℓ_i), without overflowing where ℓ_i is far below
    posterior /= posterior.sum()
    theta_hat = float((posterior * theta).sum())
    return float(np.log1p(-theta_hat * x).mean())


def pareto_k(weights: npt.ArrayLike) -> float:
    """PSIS's k̂ of ``weights``' upper tail (see the module doc); NaN when there are too few to fit, −∞ when no tail."""
    w = np.asarray(weights, dtype=np.float64).ravel()
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights: expected finite values >= 0")
    return upper_tail_k(w)


def upper_tail_k(values: npt.ArrayLike) -> float:
    """The same k̂ of the upper tail of any finite ``values`` (negative ones too): PSIS's function-specific diagnostic when
    given an estimate's per-session terms wᵢ gᵢ instead of the weights (Vehtari et al., section 3), the tail of what is
    averaged. NaN when there are too few to fit, −∞ when no tail."""
    w = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if not np.isfinite(w).all():
        raise ValueError("values: expected finite values")
    m = tail_size(len(w))
    if m < MIN_TAIL:
        return math.nan
    excesses = w[-m:] - w[-m - 1]
    k = gpd_shape(excesses)
    if k == -math.inf:
        return k
    return (m * k + PRIOR_WEIGHT * PRIOR_K) / (m + PRIOR_WEIGHT)


def shown_against(k: float, limit: float) -> str:
    """``k`` to as few decimals (at least 2) as tell it from ``limit``: a refusal at 0.7004 printed "0.70 > 0.7"."""
    if not math.isfinite(k):
        return str(k)
    for digits in range(2, 17):
        text = f"{k:.{digits}f}"
        if float(text) != limit or k == limit:
            return text
    return repr(k)
