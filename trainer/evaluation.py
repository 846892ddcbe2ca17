"""Offline evaluation of a bundle on logs, and the gate: numpy and onnxruntime only (no torch).

The target policy is what the bundle would serve on each logged state, computed by the
server's own decision code (``replay``); the behaviour policy is the logged propensity.
``trainer.offline`` turns them into IPS, SNIPS and DR estimates of the bundle's
mean_return, with bootstrap intervals; Q̂ for DR is a cross-fitted ridge regression on
compact features of the state (a fixed random projection of it, plus the page type and the
step's position in its session).

The gate compares a new bundle with the current one on the same held-out logs with the same
bootstrap resamples (a paired difference): publish when the lower bound of
DR(new) − DR(current) is at least −tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from experience.returns import GAMMA
from experience.sessions import EpisodeConfig, build_episodes
from trainer import offline, q_model
from trainer.bootstrap import Estimate
from trainer.replay import LoggedSteps, logged_steps, replay
from weights.model_set import ModelSet

PROJECTION_DIM = 48


def q_features(steps: LoggedSteps, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], seed: int = 0) -> npt.NDArray[np.float32]:
    """Compact per-step features for Q̂: a seeded Gaussian projection of the state, page type one-hot, step index."""
    rng = np.random.default_rng(seed)
    proj = (rng.standard_normal((steps.states.shape[1], PROJECTION_DIM)) / np.sqrt(PROJECTION_DIM)).astype(np.float32)
    page = np.eye(5, dtype=np.float32)[np.array([int(c.page_type) for c in steps.contexts], dtype=np.int64)]
    position = (np.arange(len(steps)) - np.repeat(starts, lengths)).astype(np.float32)[:, None]
    return np.concatenate([steps.states @ proj, page, np.minimum(position, 20.0) / 20.0], axis=1)


@dataclass(slots=True)
class Evaluation:
    report: offline.OfflineReport
    behavior_kl: float  # mean KL(target ‖ behaviour) of the served distributions on the logged states
    n_steps: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.report.to_dict(), "kl_to_behavior": self.behavior_kl, "steps": self.n_steps}


def mean_kl(p: npt.NDArray[np.float64], q: npt.NDArray[np.float64]) -> float:
    """Mean over rows of KL(p ‖ q); terms with p = 0 are 0, q = 0 where p > 0 gives +inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(q)), 0.0)
    return float(terms.sum(axis=1).mean()) if len(p) else 0.0


def evaluate_bundle(model: ModelSet, decisions: pa.Table, outcomes: pa.Table, episode_config: EpisodeConfig | None = None,
                    *, gamma: float = GAMMA, n_boot: int = 200, seed: int = 0, max_ratio: float = offline.MAX_RATIO) -> Evaluation:
    episodes = build_episodes(decisions, outcomes, episode_config)
    ordered = decisions.take(pa.array(episodes.rows))
    steps = logged_steps(ordered, model)
    served = replay(model, steps).served
    q_hat = q_model.cross_fit_q(episodes, q_features(steps, episodes.starts, episodes.lengths, seed), steps.actions, gamma=gamma,
                                seed=seed)
    report = offline.evaluate(episodes, steps.propensity, served, steps.actions, q_hat, gamma=gamma, n_boot=n_boot, seed=seed,
                              max_ratio=max_ratio)
    return Evaluation(report, mean_kl(served, np.maximum(steps.behavior_probs, 1e-6)), len(steps))  # finite where the logs were certain


@dataclass(slots=True)
class GateResult:
    publish: bool
    reason: str
    difference: Estimate
    new: Evaluation
    current: Evaluation

    def to_dict(self) -> dict[str, Any]:
        return {"publish": self.publish, "reason": self.reason, "dr_difference": self.difference.to_dict(),
                "new": self.new.to_dict(), "current": self.current.to_dict()}


def gate(new: Evaluation, current: Evaluation, tolerance: float, estimator: str = "dr") -> GateResult:
    diff = offline.difference(new.report, current.report, estimator)
    if diff.ci_low >= -tolerance:
        return GateResult(True, f"{estimator} new − current = {diff.value:.4g}, lower bound {diff.ci_low:.4g} ≥ −{tolerance:g}",
                          diff, new, current)
    return GateResult(False, f"the new bundle may be worse: {estimator} new − current = {diff.value:.4g}, "
                             f"lower bound {diff.ci_low:.4g} < −{tolerance:g}", diff, new, current)
