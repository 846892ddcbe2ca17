"""Offline evaluation of a bundle on logs, and the gate: numpy and onnxruntime only (no torch).

**What is judged: the business objective** (``experience.objective``), per session, undiscounted.
``evaluate_bundle`` builds the episodes with the objective's rules (each order's net value and
each complaint's cost at the latest decision at or before it) and γ = 1, whatever the trainer
was configured to optimise: so IPS, SNIPS, DR and TIS (``trainer.offline``) estimate the bundle's
objective per session, ``behavior_value`` is the logs' own, and no training aid (attribution,
discount, reward normalisation or clipping) can make a bundle look better here than the orders
it brings in. Placing each reward where it is observed is also what makes the per-decision
weights valid: no reward depends on a later action.

**The target policy** is what the bundle would serve on each logged state, computed by the
server's own decision code (``replay``); the behaviour policy is the logged propensity. Rows the
logs say were served with certainty (``LoggedSteps.certain``, propensity 1) enter with their
exact target probability, which depends on why the rule engine answered:

- ``FALLBACK_GUARD`` (every permitted action vetoed): the bundle's own decision on that state
  (its guard may veto otherwise) — the replay, as for every other row.
- ``FALLBACK_DEGRADED`` (overload, deadline, inference error): a condition of the server, not of
  the policy; under it the bundle answers with its rule engine too (``ModelSet.fallback``), so its
  probability is 1 on that answer.
- ``FALLBACK_NO_MODEL``: no bundle was loaded, so none plays a part: the target is the logged answer.

The ratio of such a row is then ``π(a_t|s_t) / 1``, the exact likelihood ratio (1 where the target
answers the same). Q̂ for DR is a cross-fitted ridge regression on compact features of the state
(a fixed random projection of it, plus the page type and the step's position in its session).

**The gate** compares a new bundle with the current one on the same held-out logs with the same
bootstrap resamples (a paired difference): publish when the lower bound of DR(new) − DR(current)
is at least −tolerance, and the new bundle's estimate can be trusted at all:

- *Effective sample size.* The ESS of the new bundle's final trajectory weights (``OfflineReport.ess``)
  must be at least ``min_ess_fraction`` (default ``MIN_ESS_FRACTION`` = 0.05) of the held-out
  sessions, and at least ``min_ess`` (default ``MIN_ESS`` = 100) sessions. An order is observed at
  the end of its session, so the weight on most of the reward is the session's final one. The
  estimate's variance grows about as E / ESS: at 0.05 of E, √20 ≈ 4.5× the on-policy interval
  width, the widest at which an interval still says something a gate can act on; the trainer's
  own limit (``max_behavior_kl`` 0.3) lands its bundles at 0.06–0.15 of E, where the
  calibration bench (``bench/gate_calibration.py``) finds the DR intervals hold the truth in 18
  of 20 worlds, and a floor of 0.1 would refuse two thirds of them without refusing the two
  that missed. Below 100 effective sessions a handful of sessions decide both the estimate and
  its percentile bootstrap, whatever E is, and the interval means less than it claims.
- *Support.* The new bundle's mean probability per logged decision on actions the behaviour gave
  less than ``SUPPORT_FLOOR`` = 1e-6 (``LoggedSteps.behavior_probs``: the logs never serve them
  there) must be at most ``max_unsupported`` (default ``MAX_UNSUPPORTED`` = 0.01). No weighting can
  estimate what happens after such an action: the estimators count it as nothing (a ratio of 0 on
  the paths that did not take it), so a bundle that moves mass there is judged on the rest of its
  decisions only. A limit of 1 % of the probability per decision keeps that blind part to about
  1 % of a session's decisions; a bundle that moves more (a new guard letting through what the old
  one vetoed, a changed guardrail) needs logs that served it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from core.domain import N_ACTIONS, Source
from core.progress import progress
from experience.objective import GAMMA as OBJECTIVE_GAMMA
from experience.objective import BusinessObjective
from experience.sessions import EpisodeConfig, build_episodes
from trainer import offline, q_model
from trainer.bootstrap import Estimate
from trainer.pareto import shown_against
from trainer.replay import LoggedSteps, logged_steps, replay
from weights.model_set import ModelSet

PROJECTION_DIM = 48
MIN_ESS_FRACTION = 0.05
"""Gate: the new bundle's ESS (final trajectory weights) must be at least this fraction of the held-out sessions…"""
MIN_ESS = 100.0
"""… and at least this many sessions."""
SUPPORT_FLOOR = 1e-6
"""A logged behaviour probability below this is an action the logs never serve at that state."""
MAX_UNSUPPORTED = 0.01
"""Gate: the new bundle's mean probability per decision on such actions must be at most this."""
MAX_PARETO_K = 0.7
"""Gate: the new bundle's weights' tail k̂ (``trainer.pareto``) must be at most this: beyond it an importance-weighted
estimate is not to be trusted at any affordable sample size (PSIS's threshold, for a few thousand sessions and more).
Between 0.5 and 0.7 the estimate is kept but falls short of the truth: a bundle that far from the logs is judged
pessimistically (docs/performance.md)."""


def q_projection(state_dim: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """The seeded Gaussian projection of the state that ``q_features`` applies (the same for every chunk of a run)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((state_dim, PROJECTION_DIM)) / np.sqrt(PROJECTION_DIM)).astype(np.float32)


def q_features(steps: LoggedSteps, positions: npt.NDArray[np.int64], projection: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Compact per-step features for Q̂: the projected state, page type one-hot, and the step's position in its session
    (``positions``, capped at 20)."""
    page = np.eye(5, dtype=np.float32)[np.array([int(c.page_type) for c in steps.contexts], dtype=np.int64)]
    position = np.minimum(np.asarray(positions, dtype=np.float32), 20.0)[:, None] / 20.0
    return np.concatenate([steps.states @ projection, page, position], axis=1)


@dataclass(slots=True)
class Evaluation:
    report: offline.OfflineReport
    behavior_kl: float  # mean KL(target ‖ behaviour) of the served distributions on the logged states
    n_steps: int
    unsupported_mass: float = 0.0
    """Mean over the logged steps of the target's probability on actions the behaviour gave < ``SUPPORT_FLOOR``."""
    n_certain: int = 0
    """Logged rows served with certainty (propensity 1): rule-engine answers."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.report.to_dict(), "kl_to_behavior": self.behavior_kl, "steps": self.n_steps,
                "unsupported_mass": self.unsupported_mass, "rows_served_with_certainty": self.n_certain}


def mean_kl(p: npt.NDArray[np.float64], q: npt.NDArray[np.float64]) -> float:
    """Mean over rows of KL(p ‖ q); terms with p = 0 are 0, q = 0 where p > 0 gives +inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(q)), 0.0)
    return float(terms.sum(axis=1).mean()) if len(p) else 0.0


def unsupported_mass(target: npt.NDArray[np.float64], behavior: npt.NDArray[np.float64], floor: float = SUPPORT_FLOOR) -> float:
    """Mean over rows of ``Σ_a target[a] · [behavior[a] < floor]``: the target's mass where the logs have no support."""
    return float(np.where(behavior < floor, target, 0.0).sum(axis=1).mean()) if len(target) else 0.0


def target_probs(model: ModelSet, steps: LoggedSteps, served: npt.NDArray[np.float64],
                 sources: npt.NDArray[np.int64] | None) -> npt.NDArray[np.float64]:
    """What ``model`` would serve on each logged row, given why the logged row was served (see the module doc).

    ``served`` is the replay's distribution; ``sources`` the logged ``source`` per row (None: no
    such column, every row taken as a policy row). Degraded rows get the model's rule-engine
    answer with certainty, no-model rows the logged answer; every other row keeps the replay.
    """
    if sources is None:
        return served
    target = served.copy()
    no_model = np.flatnonzero(sources == int(Source.FALLBACK_NO_MODEL))
    target[no_model] = steps.behavior_probs[no_model]
    for i in np.flatnonzero(sources == int(Source.FALLBACK_DEGRADED)).tolist():
        target[i] = 0.0
        target[i, model.fallback(steps.contexts[i], Source.FALLBACK_DEGRADED).action.index] = 1.0
    return target


EVAL_CHUNK = 32_768
"""Logged rows whose states ``evaluate_bundle`` builds at once (≈ 120 MB at 920 features): its memory is bounded by
this and by per-row scalars, not by the held-out logs' size."""


@dataclass(slots=True)
class _Scored:
    """Per logged row, what the estimators need of a bundle (the states are gone)."""

    propensity: npt.NDArray[np.float64]
    actions: npt.NDArray[np.int64]
    target: npt.NDArray[np.float64]
    behavior: npt.NDArray[np.float64]
    features: npt.NDArray[np.float32]
    certain: int


def _scored(model: ModelSet, decisions: pa.Table, rows: npt.NDArray[np.int64], positions: npt.NDArray[np.int64],
            sources: npt.NDArray[np.int64] | None, seed: int, chunk: int) -> _Scored:
    """Replay ``model`` on the logged ``rows`` (episode order), ``chunk`` rows of states at a time."""
    projection = q_projection(model.encoder.spec.state_dim, seed)
    parts: list[tuple[LoggedSteps, npt.NDArray[np.float64], npt.NDArray[np.float32]]] = []
    for lo in range(0, len(rows), chunk):
        steps = logged_steps(decisions, model, rows[lo : lo + chunk])
        target = target_probs(model, steps, replay(model, steps).served, None if sources is None else sources[lo : lo + chunk])
        parts.append((steps, target, q_features(steps, positions[lo : lo + chunk], projection)))
        steps.states = steps.states[:0]  # only the scalars are kept
    if not parts:
        empty = np.zeros((0, N_ACTIONS))
        return _Scored(np.zeros(0), np.zeros(0, np.int64), empty, empty, np.zeros((0, PROJECTION_DIM + 6), np.float32), 0)
    return _Scored(np.concatenate([p.propensity for p, _, _ in parts]), np.concatenate([p.actions for p, _, _ in parts]),
                   np.concatenate([t for _, t, _ in parts]), np.concatenate([p.behavior_probs for p, _, _ in parts]),
                   np.concatenate([f for _, _, f in parts]), int(sum(p.certain.sum() for p, _, _ in parts)))


def evaluate_bundle(model: ModelSet, decisions: pa.Table, outcomes: pa.Table, episode_config: EpisodeConfig | None = None,
                    *, gamma: float = OBJECTIVE_GAMMA, n_boot: int = 200, seed: int = 0,
                    max_ratio: float = offline.MAX_RATIO, max_weight: float = offline.MAX_WEIGHT,
                    level: float = offline.LEVEL, chunk: int = EVAL_CHUNK) -> Evaluation:
    """The offline estimates of ``model``'s objective per session on the logs (the defaults: the gate's view).

    ``episode_config`` and ``gamma`` default to the business objective's episodes and γ = 1; others
    estimate something else (a training reward, say) and are for experiments, never for the gate.
    The states are built ``chunk`` rows at a time and dropped once replayed: what is kept is a few
    numbers per row (``_Scored``), so a large held-out set costs its Arrow rows and little more.
    """
    with progress(f"evaluate.{model.version}", total=3, unit="stage") as bar:
        episodes = build_episodes(decisions, outcomes, episode_config or BusinessObjective().episode_config())
        sources = (np.asarray(decisions.column("source").take(pa.array(episodes.rows)).to_numpy(), dtype=np.int64)
                   if "source" in decisions.column_names else None)
        positions = np.arange(len(episodes.rows)) - np.repeat(episodes.starts, episodes.lengths)
        scored = _scored(model, decisions, np.asarray(episodes.rows, dtype=np.int64), positions, sources, seed, chunk)
        bar.update(1, rows=len(scored.actions))  # replayed: the bundle's served distribution at every logged state
        q_hat = q_model.cross_fit_q(episodes, scored.features, scored.actions, gamma=gamma, seed=seed)
        bar.update(1)  # the DR's Q̂, cross-fitted
        report = offline.evaluate(episodes, scored.propensity, scored.target, scored.actions, q_hat, gamma=gamma, n_boot=n_boot,
                                  seed=seed, max_ratio=max_ratio, max_weight=max_weight, level=level)
        bar.update(1, resamples=n_boot)
    return Evaluation(report, mean_kl(scored.target, np.maximum(scored.behavior, 1e-6)),  # finite where the logs were certain
                      len(scored.actions), unsupported_mass(scored.target, scored.behavior), scored.certain)


@dataclass(slots=True)
class GateResult:
    publish: bool
    reason: str
    difference: Estimate
    new: Evaluation
    current: Evaluation
    checks: dict[str, float]
    """What the gate compared: ESS and its floor, unsupported mass and its limit, the difference's bound and −tolerance."""

    def to_dict(self) -> dict[str, Any]:
        checks = {k: v if math.isfinite(v) else None for k, v in self.checks.items()}  # k̂ is −∞ with no tail, NaN unfitted
        return {"publish": self.publish, "reason": self.reason, "dr_difference": self.difference.to_dict(), "checks": checks,
                "new": self.new.to_dict(), "current": self.current.to_dict()}


def gate(new: Evaluation, current: Evaluation, tolerance: float, estimator: str = "dr", *,
         min_ess_fraction: float = MIN_ESS_FRACTION, min_ess: float = MIN_ESS, max_unsupported: float = MAX_UNSUPPORTED,
         max_pareto_k: float = MAX_PARETO_K) -> GateResult:
    """Publish iff the new bundle's estimate can be trusted (ESS, support, the weights' tail) and the paired lower bound
    of new − current ≥ −tolerance."""
    if not 0.0 <= min_ess_fraction <= 1.0:
        raise ValueError(f"min_ess_fraction: expected a number in [0, 1], got {min_ess_fraction!r}")
    if not min_ess >= 0.0:
        raise ValueError(f"min_ess: expected a number >= 0, got {min_ess!r}")
    if not 0.0 <= max_unsupported <= 1.0:
        raise ValueError(f"max_unsupported: expected a number in [0, 1], got {max_unsupported!r}")
    if not max_pareto_k > 0.0:
        raise ValueError(f"max_pareto_k: expected a number > 0 (math.inf: no limit), got {max_pareto_k!r}")
    if not (tolerance >= 0.0 and math.isfinite(tolerance)):  # a NaN tolerance published whatever the estimate (a review)
        raise ValueError(f"tolerance: expected a finite number >= 0, got {tolerance!r}")
    diff = offline.difference(new.report, current.report, estimator)
    n_episodes = new.report.n_episodes
    ess_floor = max(min_ess_fraction * n_episodes, min_ess)
    checks = {"ess": new.report.ess, "ess_floor": ess_floor, "unsupported_mass": new.unsupported_mass,
              "max_unsupported": max_unsupported, "pareto_k": new.report.pareto_k, "max_pareto_k": max_pareto_k,
              "difference_low": diff.ci_low, "tolerance": tolerance}
    refusals = []
    if new.report.ess < ess_floor:
        refusals.append(f"too few effective sessions: the new bundle's ESS is {new.report.ess:.1f} of {n_episodes} held-out "
                        f"sessions, below the floor {ess_floor:.1f} (max({min_ess_fraction:g} of them, {min_ess:g})); it is too "
                        f"far from the logs, or they are too few, for its estimate to be trusted")
    if new.unsupported_mass > max_unsupported:
        refusals.append(f"the new bundle puts {new.unsupported_mass:.3g} of its probability per decision on actions the logs "
                        f"never served at those states (limit {max_unsupported:g}); the logs cannot judge them")
    if new.report.pareto_k > max_pareto_k:  # NaN (too few sessions to fit) is left to the ESS floor
        refusals.append(f"the new bundle's importance weights are too heavy-tailed to judge: Pareto k̂ "
                        f"{shown_against(new.report.pareto_k, max_pareto_k)} > {max_pareto_k:g}; the sessions that carry its "
                        f"estimate are too rare in {n_episodes} held-out sessions (a canary can judge it)")
    if diff.ci_low < -tolerance:  # (the estimates are finite: trainer.ope_arrays refuses non-finite inputs)
        refusals.append(f"the new bundle may be worse: {estimator} new − current = {diff.value:.4g}, "
                        f"lower bound {diff.ci_low:.4g} < −{tolerance:g}")
    if refusals:
        return GateResult(False, "; ".join(refusals), diff, new, current, checks)
    return GateResult(True, f"{estimator} new − current = {diff.value:.4g}, lower bound {diff.ci_low:.4g} ≥ −{tolerance:g}; "
                            f"ESS {new.report.ess:.1f} ≥ {ess_floor:.1f}, "
                            f"Pareto k̂ {shown_against(new.report.pareto_k, max_pareto_k)} ≤ {max_pareto_k:g}, "
                            f"unsupported mass {new.unsupported_mass:.3g} ≤ "
                            f"{max_unsupported:g}", diff, new, current, checks)
