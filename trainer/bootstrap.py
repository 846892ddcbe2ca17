"""Point estimates with percentile bootstrap intervals over episodes, paired across reports by the seed.

**Confidence intervals**: percentile bootstrap over episodes (``n_boot`` resamples of ``E``
episodes with replacement). Resample ``b`` is drawn from its own generator, child ``b`` of
``SeedSequence(seed)``, so it depends only on ``(seed, E)``: two reports of the same logs and
seed (the new bundle and the active one) use the very same resamples, and ``difference`` gives
the paired CI of their gap. IPS, DR and the behaviour value are means of per-episode terms
(one matrix product per chunk of resamples); SNIPS's normaliser is recomputed per resample.
The intervals ignore the variance of fitting Q̂.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from core.domain import FloatArray
from trainer.ope_arrays import WORK

MIN_BOOTSTRAP = 20
"""The fewest resamples a run takes (``evaluate --bootstrap``, ``TrainConfig.bootstrap``). A 95 % percentile interval of
a handful of resamples is their extremes, and of one resample that one value: ``evaluate --bootstrap 1`` printed
``dr 21.11 95% CI [19.53, 19.53]``, an interval that did not hold its own estimate (2026-12-06)."""
MAX_BOOTSTRAP = 100_000
"""The most: each resample is a seed object and a row of figures held until the interval is taken, so the count bounds
the memory (``--bootstrap 50000000`` reached 2.3 GB before its ``MemoryError``; a 20-digit count failed converting to a
C size: a review, 2026-12-07); 100,000 resamples put a 95 % interval's ends within about 0.1 % of their quantiles."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """A point estimate (on the full sample) with its percentile bootstrap interval."""

    value: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def bootstrap_counts(n_episodes: int, n_boot: int, seed: int) -> Iterator[FloatArray]:
    """Episode multiplicities of ``n_boot`` resamples, in chunks of rows ``(b, E)`` (each row sums to ``E``).

    Resample ``i`` draws ``E`` episode indices uniformly with replacement from the generator of
    child ``i`` of ``SeedSequence(seed)``: it depends on ``(seed, E, i)`` only, not on the chunking.
    """
    children = np.random.SeedSequence(seed).spawn(n_boot)
    rows = max(1, WORK // max(n_episodes, 1))
    for lo in range(0, n_boot, rows):
        chunk = children[lo : lo + rows]
        counts = np.empty((len(chunk), n_episodes), dtype=np.float64)
        for i, child in enumerate(chunk):
            counts[i] = np.bincount(np.random.default_rng(child).integers(0, n_episodes, size=n_episodes), minlength=n_episodes)
        yield counts


def interval(samples: FloatArray, value: float, level: float) -> Estimate:
    low, high = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return Estimate(value=value, ci_low=float(low), ci_high=float(high))


