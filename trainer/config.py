"""The trainer's configuration: one frozen dataclass, a docstring per field, recorded in the manifest."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from trainer.guard_train import GuardConfig


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    """Seed of every random choice (splits, subsamples, initialisation, golden data): same logs + seed ⇒ same bundle bytes on CPU."""
    heldout_fraction: float = 0.2
    """Share of sessions (by hash) kept out of training for the gate's offline estimates."""
    gamma: float = 0.85
    """Discount of the Monte Carlo returns (the same γ as mean_return)."""
    horizon_hours: float = 72.0
    """Sessions are cut this long after their first decision."""
    open_terminal_reward: float = 0.0
    """Added to the last step of sessions cut open (no EXIT seen)."""
    normalize_rewards: bool = True
    """Quantile-normalise the rewards (5 % / 95 % of the non-zero ones) before the returns; the step is
    KL-scaled so this changes the baseline's numerics, not the step size."""
    advantage: str = "baseline"
    """``baseline`` (G − V̂(s), a learned value net) or ``group`` (z-score of G within the page type)."""
    group_std_floor: float = 1e-3
    """Floor of the group standard deviation (``advantage = group``)."""
    value_hidden: int = 64
    """Hidden width of the value baseline."""
    value_epochs: int = 4
    """Passes of the value fit over its rows."""
    max_fit_rows: int = 262_144
    """At most this many training rows (sampled) fit the value baseline and the guard."""
    max_ratio: float = 10.0
    """Importance ratios (new served probability / logged propensity) are truncated at this value."""
    kl_delta: float = 0.05
    """Trust region: mean KL(old ‖ new) of the masked policy over the update's states."""
    updates: int = 4
    """Natural-gradient steps per run. The sampled-majority decoder sharpens whatever the policy does, so
    a few steps of δ on the policy already move the served distribution far (see ``kl_to_behavior``)."""
    batch: int = 65_536
    """States per step (sampled from the training rows without replacement)."""
    cg_iters: int = 10
    """Conjugate-gradient iterations per step."""
    cg_residual_tol: float = 1e-10
    """Stop CG once the residual's squared norm falls below this."""
    damping: float = 0.1
    """λ in (F + λI) for CG only; the step is scaled with the undamped curvature."""
    fisher_fraction: float = 0.1
    """Share of the step's states the Fisher-vector products use (subsampled Fisher)."""
    line_search_steps: int = 10
    """Backtracking tries (halving the step) before a step is given up."""
    max_behavior_kl: float | None = 0.3
    """Keep the served distribution within this mean KL(new ‖ behaviour) of the logged one: a step that would
    go further is shrunk and the run stops there (off-policy estimates, the gate's included, are only reliable
    where the logs have support). None: no limit (the run still warns above ``behavior_kl_warn``)."""
    behavior_kl_warn: float = 0.3
    """Above this mean KL(new ‖ behaviour) on the logged states the run warns and marks the manifest."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """How the Action Guard is labelled, trained and thresholded."""
    tolerance: float = 0.0
    """Gate: publish when the paired lower bound of (new − current) DR value is ≥ −tolerance (mean_return units)."""
    bootstrap: int = 200
    """Bootstrap resamples of the offline confidence intervals."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.heldout_fraction < 1:
            problems.append(f"heldout_fraction: expected in (0, 1), got {self.heldout_fraction}")
        if not 0 <= self.gamma <= 1:
            problems.append(f"gamma: expected in [0, 1], got {self.gamma}")
        if self.advantage not in ("baseline", "group"):
            problems.append(f"advantage: expected baseline or group, got {self.advantage!r}")
        for name in ("value_hidden", "value_epochs", "max_fit_rows", "updates", "batch", "cg_iters", "line_search_steps", "bootstrap"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("max_ratio", "kl_delta", "horizon_hours"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                problems.append(f"{name}: expected > 0, got {getattr(self, name)}")
        if not 0 < self.fisher_fraction <= 1:
            problems.append(f"fisher_fraction: expected in (0, 1], got {self.fisher_fraction}")
        if self.damping < 0 or self.tolerance < 0:
            problems.append("damping and tolerance must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "guard"}
        out["guard"] = self.guard.to_dict()
        return out

    @classmethod
    def with_overrides(cls, **values: Any) -> TrainConfig:
        return dataclasses.replace(cls(), **values)
