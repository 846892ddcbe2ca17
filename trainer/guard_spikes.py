"""Auto-labels for the Action Guard from the policy updates whose multiplier η spikes (numpy, no torch).

**What η says.** Each natural-gradient update solves ``max gᵀd s.t. ½ dᵀFd ≤ δ``; its KL
multiplier is ``η = sqrt(sᵀFs / 2δ)`` with ``s ≈ F⁻¹g`` (``trust_region.scale_step``), i.e.
``η ≈ ‖g‖_{F⁻¹} / sqrt(2δ)``: the surrogate one more unit of KL would buy. The batches of one run
are draws from the same logs under a policy that moves by ``δ`` a step, so from one update to the
next η drifts slowly (it falls as the policy fits the batch's advantages) and jitters by batch
noise. An η far above its earlier level says that this batch carries a much stronger signal than
the others: rows whose served action the policy still favours although it did far worse than the
state's baseline (or the mirror image, good actions it neglects). The gradient's coefficient of
row ``i`` is ``ρ_i Â_i`` (``update.surrogate_terms``): the step pushes hardest away from the
rows with the most negative advantages, and in a spiking batch those are the (state, action)
pairs the policy is most wrong to serve. (With ``surrogate = expected`` the row's advantage is
that of its logged action, ``Â(s_i, a_i)``, which is what the trainer passes here.) The seed
design labels exactly these harmful for the guard: a veto can stop them before the next update
catches up.

**Rule** (``spike_labels``, ``SpikeRule``). With the updates' multipliers ``η_1 … η_T`` in order
(non-finite ones, aborted steps, are skipped: never a spike, not in any mean), update ``t``
*spikes* iff at least ``min_history`` finite multipliers came before it and::

    η_t > factor · mean(η_u : u < t, η_u finite)

(the plain mean of the earlier ones, not ``ConstraintTracker``'s EMA, which already contains
``η_t``). In a spiking batch with advantages ``Â`` (over its rows), row ``i`` is labelled
harmful iff::

    Â_i ≤ Q_q(Â)   and   Â_i < 0

with ``Q_q`` the empirical ``quantile`` (inverted CDF: the smallest advantage with at least a
share ``q`` of the batch at or below it; so ``⌈q m⌉`` rows, more on ties). The sign condition
keeps a batch whose advantages are all positive from labelling its "worst" rows harmful: the
step pushes towards them. A row in several spiking batches is labelled once. Rows are indices
into the trainer's step arrays (``Experience.steps``), the same indices as the batches.

These labels are a heuristic, which is why ``train_guard`` uses them for training only: its
threshold, held-out figures and veto decision keep to the outcome labels, so a guard that
learns the wrong thing from them loses its veto rather than shipping it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SpikeRule:
    """When an update's η spikes, and which of its rows are then labelled harmful (module doc)."""

    factor: float = 2.0
    """``k``: an update spikes when its η exceeds ``k`` times the mean of the earlier ones; > 1."""
    quantile: float = 0.1
    """``q``: the share of a spiking batch, lowest advantages first, labelled harmful (negative ones only); in (0, 1]."""
    min_history: int = 2
    """Finite multipliers needed before an update can spike (the first updates of a run have no level to spike from); ≥ 1."""

    def __post_init__(self) -> None:
        if not (self.factor > 1.0 and math.isfinite(self.factor)):
            raise ValueError(f"factor: expected > 1, got {self.factor!r}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile: expected in (0, 1], got {self.quantile!r}")
        if self.min_history < 1:
            raise ValueError(f"min_history: expected >= 1, got {self.min_history!r}")


def eta_spikes(etas: Sequence[float] | FloatArray, rule: SpikeRule | None = None) -> BoolArray:
    """Per update: ``η_t > factor · mean`` of the earlier finite multipliers, with at least ``min_history`` of them."""
    rule = rule or SpikeRule()
    eta = np.asarray(etas, dtype=np.float64).reshape(-1)
    finite = np.isfinite(eta)
    value = np.where(finite, eta, 0.0)
    before_sum = np.concatenate([[0.0], np.cumsum(value)[:-1]])
    before_n = np.concatenate([[0], np.cumsum(finite)[:-1]])
    enough = before_n >= rule.min_history
    mean = np.divide(before_sum, before_n, out=np.zeros_like(before_sum), where=before_n > 0)
    return np.asarray(finite & enough & (eta > rule.factor * mean), dtype=np.bool_)


@dataclass(frozen=True, slots=True)
class SpikeLabels:
    """What ``spike_labels`` found."""

    harmful: BoolArray
    """Per row of the step arrays: labelled harmful (pass to ``train_guard(extra_harmful=harmful[rows])``)."""
    spiked: BoolArray
    """Per update: its η spiked."""
    rule: SpikeRule

    def metrics(self) -> dict[str, float]:
        """Counts for the manifest's training metrics (floats)."""
        return {
            "guard_eta_spike_updates": float(self.spiked.sum()),
            "guard_eta_spike_rows": float(self.harmful.sum()),
            "guard_eta_spike_factor": self.rule.factor,
            "guard_eta_spike_quantile": self.rule.quantile,
        }


def spike_labels(
    etas: Sequence[float] | FloatArray, batches: Sequence[npt.ArrayLike], advantages: FloatArray, rule: SpikeRule | None = None,
    gather: Callable[[FloatArray], FloatArray] | None = None,
) -> SpikeLabels:
    """Harmful rows from the updates whose η spikes (module doc).

    ``etas[t]`` is update ``t``'s multiplier (``StepOutcome.eta``, nan when aborted), ``batches[t]``
    the row indices of its whole batch (before any data-parallel sharding), ``advantages`` (N,) the
    advantages of all N rows, fixed within a run; a batch's advantages are ``advantages[batches[t]]``.
    On ranks that each hold a shard of the rows, ``batches[t]`` is this rank's part of the batch and
    ``gather`` (``Reducer.gather``) collects every part's advantages for the batch's quantile.
    """
    rule = rule or SpikeRule()
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.ndim != 1:
        raise ValueError(f"advantages: expected (N,), got {adv.shape}")
    if not bool(np.isfinite(adv).all()):
        raise ValueError("advantages: contains NaN or Inf")
    if len(etas) != len(batches):
        raise ValueError(f"etas and batches: expected one per update, got {len(etas)} and {len(batches)}")
    spiked = eta_spikes(etas, rule)
    harmful = np.zeros(len(adv), dtype=np.bool_)
    for t in np.flatnonzero(spiked).tolist():
        rows = np.asarray(batches[t])
        if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
            raise ValueError(f"batches[{t}]: expected a 1-D array of row indices, got {rows.dtype} {rows.shape}")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= len(adv)):
            raise ValueError(f"batches[{t}]: row indices outside [0, {len(adv)})")
        a = adv[rows]
        whole = a if gather is None else gather(a)  # every rank's part of the batch (all ranks take part)
        if whole.size == 0:
            continue
        cut = float(np.quantile(whole, rule.quantile, method="inverted_cdf"))
        harmful[rows[(a <= cut) & (a < 0.0)]] = True
    return SpikeLabels(harmful, spiked, rule)


@dataclass
class SpikeLog:
    """The updates of one run as the loop takes them, for ``spike_labels`` afterwards."""

    etas: list[float] = field(default_factory=list)
    batches: list[IntArray] = field(default_factory=list)

    def record(self, eta: float, rows: npt.ArrayLike) -> None:
        """One update: its multiplier (nan when aborted) and its whole batch's row indices."""
        self.etas.append(float(eta))
        self.batches.append(np.asarray(rows, dtype=np.int64).reshape(-1).copy())

    def labels(self, advantages: FloatArray, rule: SpikeRule | None = None,
               gather: Callable[[FloatArray], FloatArray] | None = None) -> SpikeLabels:
        return spike_labels(self.etas, self.batches, advantages, rule, gather)
