"""One off-policy natural-gradient step on the policy, KL-constrained.

Surrogate, over the step's logged rows i (those the decoder decides)::

    L(θ) = (1/N) Σ_i min(ρ_i(θ), c) Â_i,    ρ_i(θ) = P_θ(a_i | s_i) / μ_i

with P_θ the served distribution of the new bundle (``TorchDecoder``: guardrails, the new
guard's veto, sampled majority, fallback, exploration), μ_i the logged propensity and c
``max_ratio``. With ``surrogate = expected`` (and the critic's Â(s, a) = R_ψ(s, a) − V_φ(s) for every
action) it is instead

    L(θ) = (1/N) Σ_i Σ_a P_θ(a | s_i) Â(s_i, a)

over the allowed actions: TRPO's surrogate in its all-actions form (Schulman et al. 2015, the
"vine" estimator), with the critic in place of rollouts, on the logged states. R_ψ estimates
the logging behaviour's action values (the mixture of the versions in the window), not the
starting policy's as vine's rollouts do; the two agree when the window is the starting
bundle's own logs. No ratio: an action the behaviour rarely served at a state still has a
gradient where the critic, generalising from similar states, says it pays, where the logged
surrogate has only the rows that served it. Its bias is the critic's, and it leans towards
rarely served actions: R_ψ's outputs start at the mean return and an action's output learns
only from the rows that served it. Its gradient g is taken in chunks (the decoder's count-vector tensors are
large); the trust region is on the served distribution P_θ itself (``trust_region = "served"``,
the default: its Fisher through the decoder's Jacobian, ``fisher.served_metric``, and the
measured KL(P_old ‖ P_θ) in the line search, each with the logits' damping term of ``trainer.fisher``
added), or on the masked policy q = softmax(z + g_guard)
over the allowed actions (``"policy"``). Both Fishers have the Gauss-Newton form
(``fisher.GaussNewtonFisher``). A δ on q is not a δ on what is served: the sampled majority
sharpens q, so one step of 0.05 on q moved the served distribution by 0.3 to 1. CG solves
(F + λI) s = g on a subsample of the states, the step is scaled with the undamped sᵀFs of the
whole batch to the KL target δ, then line-searched on the measured KL and surrogate
(``trust_region``). Every mean goes through the ``Reducer``, so data-parallel ranks take the
same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainer.config import TrainConfig
from trainer.distributed import Reducer
from trainer.fisher import GaussNewtonFisher, centred_norm2, flat_params, masked_log_probs, mean_kl, set_flat_params
from trainer.networks import PolicyNet
from trainer.served import TorchDecoder
from trainer.trust_region import ConstraintTracker, Evaluation, backtracking_line_search, natural_gradient_step

CHUNK = 8192


@dataclass
class Stats:
    """What the updates of one run measured (into the manifest's training metrics)."""

    # Every TRPO step is sized so the quadratic KL model equals δ, so "the accepted KL is near δ"
    # holds on almost every step and says nothing. The constraint is counted as binding when the
    # measured KL broke the trust region and the line search had to shrink the step for it:
    # the quadratic model failed there (the monitor's > 5 % threshold is about that).
    tracker: ConstraintTracker = field(default_factory=lambda: ConstraintTracker(bind_threshold=math.inf))
    kls: list[float] = field(default_factory=list)
    improvements: list[float] = field(default_factory=list)
    ess: float = math.nan
    failed: int = 0
    support_limited: bool = False  # a step was shrunk to keep KL(new ‖ behaviour) within max_behavior_kl

    def summary(self) -> dict[str, float]:
        accepted = [k for k in self.kls if math.isfinite(k)]
        return {
            "kl_to_old": sum(accepted) / len(accepted) if accepted else 0.0,
            "constraint_activation_rate": self.tracker.bind_rate if self.tracker.steps else 0.0,
            "lagrange_multiplier": self.tracker.eta if self.tracker.eta is not None else math.nan,
            "updates_accepted": float(len(accepted)),
            "updates_failed": float(self.failed),
            "updates_aborted": float(self.tracker.aborted),
            "surrogate_improvement": sum(self.improvements),
            "effective_sample_size": self.ess,
            "support_limited": float(self.support_limited),
        }


@dataclass
class StepOutcome:
    accepted: bool
    kl: float
    improvement: float
    eta: float
    cg_iterations: int
    reason: str | None

    def to_dict(self) -> dict[str, object]:
        return {"accepted": self.accepted, "kl": self.kl, "improvement": self.improvement, "eta": self.eta,
                "cg_iterations": self.cg_iterations, "reason": self.reason}


@dataclass
class Batch:
    states: Tensor  # (N, S) float32
    actions: Tensor  # (N,) long
    propensity: Tensor  # (N,) float64
    advantages: Tensor  # (N,) float64, or (N, A): every action's (surrogate = expected)
    log_weights: Tensor  # (N, A) float64, -inf banned
    allowed: Tensor  # (N, A) bool
    fallback: Tensor  # (N,) long
    behavior: Tensor  # (N, A) float64 logged served probabilities

    def rows(self, sl: slice) -> Batch:
        return Batch(self.states[sl], self.actions[sl], self.propensity[sl], self.advantages[sl], self.log_weights[sl],
                     self.allowed[sl], self.fallback[sl], self.behavior[sl])


def served_prob(policy: PolicyNet, decoder: TorchDecoder, b: Batch) -> Tensor:
    """P_θ(a_i | s_i) for the logged actions (rows the decoder decides)."""
    served = decoder.served(decoder.masked_q(policy(b.states), b.log_weights, b.allowed), b.fallback, b.allowed.any(dim=1))
    return served.gather(1, b.actions[:, None])[:, 0]


def served_probs(policy: PolicyNet, decoder: TorchDecoder, b: Batch) -> Tensor:
    """P_θ(· | s_i) for every row of the batch, (N, A), without gradient, in chunks."""
    return served_and_logits(policy, decoder, b)[0]


def served_and_logits(policy: PolicyNet, decoder: TorchDecoder, b: Batch) -> tuple[Tensor, Tensor]:
    """P_θ(· | s_i) and the logits z_i for every row of the batch, (N, A) each, without gradient, in chunks."""
    served, logits = [], []
    with torch.no_grad():
        for r in (b.rows(slice(i, i + CHUNK)) for i in range(0, len(b.states), CHUNK)):
            z = policy(r.states)
            served.append(decoder.served(decoder.masked_q(z, r.log_weights, r.allowed), r.fallback, r.allowed.any(dim=1)))
            logits.append(z)
    return torch.cat(served), torch.cat(logits)


def served_kl(p_old: Tensor, p_new: Tensor) -> Tensor:
    """Per row KL(p_old ‖ p_new); 0 where p_old = 0, +inf where p_new = 0 < p_old. Differentiable in ``p_new``: the
    logs take 1 where p_old = 0 (a masked ``log(0)`` would still send NaN back through ``torch.where``)."""
    seen = p_old > 0
    terms = torch.where(seen, p_old * (torch.log(torch.where(seen, p_old, 1.0)) - torch.log(torch.where(seen, p_new, 1.0))), 0.0)
    return terms.sum(dim=1)


def surrogate_terms(policy: PolicyNet, decoder: TorchDecoder, b: Batch, max_ratio: float) -> Tensor:
    if b.advantages.ndim == 2:  # surrogate = expected: every action's estimated advantage, no ratio
        served = decoder.served(decoder.masked_q(policy(b.states), b.log_weights, b.allowed), b.fallback, b.allowed.any(dim=1))
        return (served * torch.where(b.allowed, b.advantages, 0.0)).sum(dim=1)
    ratio = served_prob(policy, decoder, b) / b.propensity
    return torch.clamp(ratio, max=max_ratio) * b.advantages


def surrogate_value(policy: PolicyNet, decoder: TorchDecoder, b: Batch, max_ratio: float, reducer: Reducer) -> float:
    n = len(b.states)
    with torch.no_grad():
        total = sum(float(surrogate_terms(policy, decoder, b.rows(slice(i, i + CHUNK)), max_ratio).sum()) for i in range(0, n, CHUNK))
    return float(reducer.weighted_mean(torch.tensor(total / max(n, 1), dtype=torch.float64), n))


def surrogate_gradient(policy: PolicyNet, decoder: TorchDecoder, b: Batch, max_ratio: float, reducer: Reducer) -> Tensor:
    """∇_θ L as one flat vector (chunked backward), averaged across ranks."""
    n = len(b.states)
    policy.zero_grad(set_to_none=True)
    for i in range(0, n, CHUNK):
        part = surrogate_terms(policy, decoder, b.rows(slice(i, i + CHUNK)), max_ratio).sum() / n
        part.backward()  # type: ignore[no-untyped-call]
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in policy.parameters()])
    policy.zero_grad(set_to_none=True)
    return reducer.weighted_mean(grad.double(), n).to(grad.dtype)


def effective_sample_size(policy: PolicyNet, decoder: TorchDecoder, b: Batch, max_ratio: float, reducer: Reducer | None = None) -> float:
    """(Σρ)² / (N Σρ²) of the truncated importance ratios (over every rank's part of the batch, with a ``reducer``):
    1 when the new policy is the behaviour."""
    with torch.no_grad():
        parts = [torch.clamp(served_prob(policy, decoder, b.rows(slice(i, i + CHUNK))) / b.propensity[i : i + CHUNK], max=max_ratio)
                 for i in range(0, len(b.states), CHUNK)]
    ratios = torch.cat(parts).double().cpu() if parts else torch.zeros(0, dtype=torch.float64)
    sums = torch.stack([ratios.sum(), (ratios**2).sum(), torch.tensor(float(len(ratios)), dtype=torch.float64)])
    s1, s2, n = (float(v) for v in (sums if reducer is None else reducer.total(sums)))
    return s1**2 / (n * s2) if n and s2 > 0 else math.nan


def served_kl_to_behavior(policy: PolicyNet, decoder: TorchDecoder, b: Batch, reducer: Reducer) -> float:
    """Mean KL(new ‖ behaviour) of the served distributions on the batch (behaviour floored at 1e-6)."""
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(b.states), CHUNK):
            r = b.rows(slice(i, i + CHUNK))
            p = decoder.served(decoder.masked_q(policy(r.states), r.log_weights, r.allowed), r.fallback, r.allowed.any(dim=1))
            terms = torch.where(p > 0, p * (torch.log(torch.where(p > 0, p, 1.0)) - torch.log(torch.clamp(r.behavior, min=1e-6))), 0.0)
            total += float(terms.sum())
    return float(reducer.weighted_mean(torch.tensor(total / max(len(b.states), 1), dtype=torch.float64), len(b.states)))


def shrink_until(policy: torch.nn.Module, theta0: Tensor, ok: Callable[[], bool], halvings: int = 10) -> bool:
    """Pull the step θ₁ − θ₀ just taken back by halves until ``ok()`` holds (at most ``halvings`` tries, else
    undo it); True when the step had to be shrunk (a limit binds: the caller stops updating)."""
    theta1 = flat_params(policy)
    fraction = 1.0
    for _ in range(halvings):
        if ok():
            return fraction < 1.0
        fraction *= 0.5
        set_flat_params(policy, theta0 + fraction * (theta1 - theta0))
    set_flat_params(policy, theta0)
    return True


def _within_support(policy: PolicyNet, decoder: TorchDecoder, b: Batch, theta0: Tensor, limit: float, reducer: Reducer) -> bool:
    """``shrink_until`` the served distribution's KL to the logged behaviour is within ``limit``."""
    return shrink_until(policy, theta0, lambda: served_kl_to_behavior(policy, decoder, b, reducer) <= limit)


def natural_step(policy: PolicyNet, decoder: TorchDecoder, b: Batch, config: TrainConfig, stats: Stats, reducer: Reducer,
                 generator: torch.Generator | None, shrink: Callable[[Tensor], bool] | None = None,
                 fisher_rows: Tensor | None = None) -> StepOutcome:
    """One step (module doc). ``shrink(θ_0)``, called on an accepted step after the support limit, may pull the
    parameters back towards ``θ_0`` (returning True when it did: the run then stops); what is reported is the
    step as finally applied. ``fisher_rows``: the batch rows of the subsampled Fisher (default: a ``fisher_fraction``
    drawn with ``generator``, or seeded 0 without one)."""
    if not bool(b.allowed.any(dim=1).all()):  # the caller draws batches from the rows the decoder decides
        raise ValueError("natural_step: every row needs an allowed action (rule-answered rows carry no gradient)")
    log_guard = torch.where(b.allowed, b.log_weights, -torch.inf).to(b.states.dtype)
    served = config.trust_region == "served"
    with torch.no_grad():  # the reference of the measured KL: what is served (and the logits), or the masked policy
        p_old, z_old = served_and_logits(policy, decoder, b) if served else (None, None)
        log_q_old = None if served else masked_log_probs(policy(b.states), log_guard)
    before = surrogate_value(policy, decoder, b, config.max_ratio, reducer)
    grad = surrogate_gradient(policy, decoder, b, config.max_ratio, reducer)

    def decode(z: Tensor, idx: Tensor) -> Tensor:  # the served distribution of rows ``idx`` of the batch, from their logits
        return decoder.served_of(z, b.log_weights[idx], b.allowed[idx], b.fallback[idx], b.allowed[idx].any(dim=1))

    kappa = config.logit_damping if served else 0.0  # (not config.damping: that is CG's λ)
    fisher = GaussNewtonFisher.from_module(policy, b.states, log_guard, damping=config.damping, subsample=config.fisher_fraction,
                                           generator=generator, reducer=reducer, served=decode if served else None,
                                           rows=fisher_rows, logit_damping=kappa)
    whole = GaussNewtonFisher.from_module(policy, b.states, log_guard, damping=0.0, reducer=reducer, served=decode if served else None,
                                          logit_damping=kappa)
    step = natural_gradient_step(fisher, whole.curvature, grad, delta=config.kl_delta, cg_iterations=config.cg_iters,
                                 cg_rtol=config.cg_residual_tol)
    if not step.scaled.ok or step.scaled.step is None:
        stats.tracker.record(step.scaled, None, config.kl_delta)
        return StepOutcome(False, math.nan, 0.0, math.nan, step.cg.iterations, step.scaled.aborted)

    applied: list[float] = [math.nan]  # the KL part of the last evaluation (what a step reports as its KL)

    def measured_kl() -> float:
        """The divergence the trust region bounds: KL(P_old ‖ P) + κ/2 ‖Δz − mean Δz‖² (``trainer.fisher``), or the
        masked policy's KL; its KL part is kept in ``applied``."""
        logit_term = torch.zeros((), dtype=torch.float64, device=b.states.device)
        with torch.no_grad():
            if p_old is not None and z_old is not None:
                p_new, z_new = served_and_logits(policy, decoder, b)
                local = served_kl(p_old, p_new).mean()
                if kappa > 0:
                    logit_term = 0.5 * kappa * centred_norm2((z_new - z_old).double(), b.allowed).mean()
            else:
                assert log_q_old is not None
                local = mean_kl(log_q_old, policy(b.states), log_guard)
        kl, logit_part = (float(v) for v in reducer.weighted_mean(torch.stack([local.double(), logit_term]), len(b.states)))
        applied[0] = kl
        return kl + logit_part

    def evaluate() -> Evaluation:
        return Evaluation(measured_kl(), surrogate_value(policy, decoder, b, config.max_ratio, reducer))

    theta0 = flat_params(policy)
    search = backtracking_line_search(policy, step.scaled.step.to(theta0.dtype), evaluate, surrogate_before=before,
                                      delta=config.kl_delta, expected_improvement=step.scaled.expected_improvement,
                                      max_tries=config.line_search_steps, kl_fits=2)  # resize to the measured KL: lands near δ
    kl, improvement = applied[0], search.improvement  # (the search's last evaluation is the step it kept)
    limited = False
    if search.accepted and config.max_behavior_kl is not None:
        limited = _within_support(policy, decoder, b, theta0, config.max_behavior_kl, reducer)
    if search.accepted and shrink is not None and bool(torch.any(flat_params(policy) != theta0)):
        limited |= shrink(theta0)
    stats.support_limited |= limited
    if limited and bool(torch.any(flat_params(policy) != theta0)):  # what was applied is the shrunk step: measure it again
        _, improvement = evaluate()
        kl, improvement = applied[0], improvement - before
    accepted = search.accepted and bool(torch.any(flat_params(policy) != theta0))
    if accepted:  # η and how often the region bound are of the steps the bundle took (a refused or undone one is not)
        stats.tracker.record(step.scaled, search, config.kl_delta)
        stats.kls.append(kl)
        stats.improvements.append(improvement)
    else:
        stats.failed += 1
    reason = search.reason if not search.accepted else None if accepted else "undone: past max_behavior_kl or the trajectory-ESS stop"
    if not accepted:
        kl, improvement = 0.0, 0.0
    return StepOutcome(accepted, kl, improvement, step.scaled.multiplier, step.cg.iterations, reason)
