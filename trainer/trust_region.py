"""The trust-region step: conjugate gradient, step size to the KL target, backtracking line search.

The update solves the TRPO subproblem on the quadratic/linear models at ``θ_old``::

    maximise  gᵀ d    subject to   ½ dᵀ F d ≤ δ

with ``g = ∇L`` the surrogate's gradient and ``F`` the Fisher (``trainer.fisher``):

1. ``conjugate_gradient`` approximately solves ``(F + λI) s = g`` (``s ≈ F⁻¹ g``, the natural
   gradient direction) with a few Fisher-vector products. The damping ``λ`` lives here only:
   it conditions the solve and bends ``s`` towards ``g`` where ``F`` is nearly singular.
2. ``scale_step`` sizes it, ``d = β s`` with ``β = sqrt(2δ / sᵀ F s)``, from the *undamped*
   curvature: the constraint is on the KL, whose model is ``½ dᵀ F d`` with no ``λ`` in it.
   (With ``sᵀ (F + λI) s`` in its place, as Spinning Up and SB3-contrib do, the step falls
   short of the target by the factor ``sᵀ F s / sᵀ (F + λI) s``, which is tiny when ``F``'s
   eigenvalues are small next to ``λ``: KL ≈ 0.002 against a target of 0.05 in the issue.)
3. ``backtracking_line_search`` tries ``θ + b^k d`` and keeps the first that keeps the
   measured KL within ``δ (1 + tol)`` and improves the surrogate; else it restores ``θ``.
   Optionally it first refits the step to the measured KL (``kl_fitted_fraction``): at
   ``δ = 0.05`` the quadratic model of the KL can be off by half.

``ConstraintTracker`` follows the KL constraint's Lagrange multiplier ``η`` and how often the
constraint binds, across updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from trainer.fisher import flat_params, set_flat_params

LinearOperator = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class CGResult:
    """What ``conjugate_gradient`` found."""

    x: Tensor
    """The approximate solution of ``A x = b``."""
    iterations: int
    """Products with ``A`` used (one per iteration)."""
    residual_norm: float
    """``‖b − A x‖`` by the recurrence ``r ← r − α A p`` (exact in exact arithmetic)."""
    converged: bool
    """The residual stop was reached (``‖r‖ ≤ rtol ‖b‖``) before ``max_iterations``."""
    breakdown: bool
    """Stopped at a search direction with ``pᵀ A p ≤ 0`` or non-finite: ``A`` is not positive definite there."""


def conjugate_gradient(apply_a: LinearOperator, b: Tensor, *, max_iterations: int = 10, rtol: float = 1e-10) -> CGResult:
    """Solve ``A x = b`` for symmetric positive-definite ``A``, given only ``v ↦ A v``.

    From ``x_0 = 0``, ``r_0 = p_0 = b``, each iteration::

        α_k = r_kᵀ r_k / p_kᵀ A p_k
        x_{k+1} = x_k + α_k p_k,    r_{k+1} = r_k − α_k A p_k
        p_{k+1} = r_{k+1} + (r_{k+1}ᵀ r_{k+1} / r_kᵀ r_k) p_k

    ``x_k`` minimises ``½ xᵀ A x − bᵀ x`` over the Krylov space ``span{b, A b, …, A^{k−1} b}``,
    so it is exact after at most ``n`` iterations and ``bᵀ x_k`` grows monotonically. Stops
    when ``‖r‖ ≤ rtol ‖b‖`` or after ``max_iterations`` products; on ``pᵀ A p ≤ 0`` (not positive
    definite) or a non-finite value it stops and returns the last good ``x`` with ``breakdown``.
    """
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be ≥ 1, got {max_iterations}")
    x = torch.zeros_like(b)
    r = b.clone()
    p = b.clone()
    rr = float(r @ r)
    stop = rtol * math.sqrt(rr)
    if rr == 0.0:
        return CGResult(x, 0, 0.0, converged=True, breakdown=False)
    for k in range(1, max_iterations + 1):
        ap = apply_a(p)
        pap = float(p @ ap)
        if not (math.isfinite(pap) and pap > 0.0):
            return CGResult(x, k, math.sqrt(rr), converged=False, breakdown=True)
        alpha = rr / pap
        r_new = r - alpha * ap
        rr_new = float(r_new @ r_new)
        if not math.isfinite(rr_new):
            return CGResult(x, k, math.sqrt(rr), converged=False, breakdown=True)
        x, r = x + alpha * p, r_new
        if math.sqrt(rr_new) <= stop:
            return CGResult(x, k, math.sqrt(rr_new), converged=True, breakdown=False)
        p = r + (rr_new / rr) * p
        rr = rr_new
    return CGResult(x, max_iterations, math.sqrt(rr), converged=False, breakdown=False)


def kl_step_size(curvature: float, delta: float) -> float:
    """``β = sqrt(2δ / sᵀ F s)``: the scale at which the quadratic KL model ``½ β² sᵀ F s`` equals ``δ``.

    ``curvature`` is ``sᵀ F s`` (undamped); it must be finite and positive.
    """
    if not (math.isfinite(curvature) and curvature > 0.0):
        raise ValueError(f"sᵀFs must be finite and > 0, got {curvature}")
    return math.sqrt(2.0 * delta / curvature)


@dataclass(frozen=True)
class ScaledStep:
    """The full step of the trust-region subproblem, or why there is none."""

    step: Tensor | None
    """``d = β s``, or ``None`` when aborted."""
    beta: float
    """``β = sqrt(2δ / sᵀ F s)`` (nan when aborted)."""
    curvature: float
    """``sᵀ F s``, undamped: ``KL(θ + d) ≈ ½ β² sᵀ F s = δ``."""
    multiplier: float
    """``η = sqrt(sᵀ F s / 2δ) = 1/β``, the KL constraint's Lagrange multiplier (nan when aborted)."""
    expected_improvement: float
    """The linear model's gain ``gᵀ d = β gᵀ s`` (``= 2δη`` when ``s = F⁻¹ g`` exactly)."""
    aborted: str | None
    """``"aborted: <reason>"``, or ``None`` for a usable step."""

    @property
    def ok(self) -> bool:
        return self.aborted is None


def scale_step(direction: Tensor, curvature: float, gradient: Tensor, delta: float) -> ScaledStep:
    """Size the natural-gradient direction ``s`` to the KL target: ``d = β s``, ``β = sqrt(2δ / sᵀ F s)``.

    The Lagrangian of ``max gᵀ d s.t. ½ dᵀ F d ≤ δ`` is ``gᵀ d − η (½ dᵀ F d − δ)``;
    stationarity gives ``g = η F d``, so ``d = s / η`` with ``s = F⁻¹ g``, and the active
    constraint ``½ sᵀ F s / η² = δ`` gives::

        η = sqrt(sᵀ F s / 2δ) = 1/β,     d = β s,     gᵀ d = β sᵀ F s = 2δη

    ``η`` is the model's improvement per unit of KL budget at the margin
    (``d(gᵀ d)/dδ = d sqrt(2δ sᵀ F s)/dδ = η``). ``curvature`` must be the *undamped*
    ``sᵀ F s`` (see the module doc). Aborts, returning the reason rather than raising, when
    ``s`` or ``sᵀ F s`` is non-finite, ``sᵀ F s ≤ 0`` (nothing to scale, or ``F`` not positive
    there), or ``gᵀ s ≤ 0`` (not an ascent direction).
    """
    nan = float("nan")

    def abort(reason: str) -> ScaledStep:
        return ScaledStep(None, nan, curvature, nan, nan, f"aborted: {reason}")

    if not bool(torch.isfinite(direction).all()):
        return abort("the direction has non-finite entries")
    if not math.isfinite(curvature):
        return abort(f"sᵀFs is not finite ({curvature})")
    if curvature <= 0.0:
        return abort(f"sᵀFs = {curvature:.3g} ≤ 0")
    gs = float(gradient @ direction)
    if not (math.isfinite(gs) and gs > 0.0):
        return abort(f"gᵀs = {gs:.3g}: not an ascent direction")
    beta = kl_step_size(curvature, delta)
    return ScaledStep(beta * direction, beta, curvature, 1.0 / beta, beta * gs, None)


@dataclass(frozen=True)
class NaturalStep:
    cg: CGResult
    scaled: ScaledStep


def natural_gradient_step(
    fisher: LinearOperator,
    curvature: Callable[[Tensor], Tensor],
    gradient: Tensor,
    *,
    delta: float,
    cg_iterations: int = 10,
    cg_rtol: float = 1e-10,
) -> NaturalStep:
    """CG on ``fisher`` (damped, ``v ↦ (F + λI) v``), then ``scale_step`` with ``curvature`` (undamped ``sᵀ F s``).

    ``GaussNewtonFisher`` provides both: the operator itself and its ``curvature``; the
    curvature may come from a bigger sample of states than the CG's (e.g. CG on a 10 %
    subsample, ``sᵀ F s`` on the full batch: one ``J s``).
    """
    cg = conjugate_gradient(fisher, gradient, max_iterations=cg_iterations, rtol=cg_rtol)
    return NaturalStep(cg, scale_step(cg.x, float(curvature(cg.x)), gradient, delta))


class Evaluation(NamedTuple):
    """The line search's view of the policy at trial parameters (means over all states, reduced across ranks)."""

    kl: float
    """The divergence the trust region bounds: ``mean_i KL(q_i^old ‖ q_i^θ)`` (with the served trust region, of what
    is served, plus the logits' damping term: ``trainer.fisher``)."""
    surrogate: float
    """``L(θ)``, the objective being maximised."""


@dataclass(frozen=True)
class LineSearchResult:
    """The outcome of ``backtracking_line_search``."""

    accepted: bool
    fraction: float
    """The scale ``c`` of the accepted trial ``θ_0 + c d``: ``b^k`` without refits (``0.0`` when none was accepted)."""
    tries: int
    """Trials evaluated."""
    kl: float
    """Measured KL of the accepted step (nan when none)."""
    improvement: float
    """``L(θ_new) − L(θ_old)`` of the accepted step (nan when none)."""
    kl_rejections: int
    """Trials rejected because their KL exceeded ``δ (1 + kl_tolerance)``, or refitted down from a KL over ``δ``."""
    reason: str | None
    """Why no step was taken (``None`` when accepted)."""
    kl_fits: int = 0
    """Trials refitted to the measured KL (``kl_fits``), not judged."""


def kl_fitted_fraction(
    fraction: float, measured_kl: float, delta: float, *, previous: tuple[float, float] | None = None, max_factor: float = 2.0
) -> float:
    """The scale ``c`` of the step at which the measured KL would be ``δ``: ``c · (δ / KL)^{1/p}``.

    The quadratic model says ``KL(c d) ∝ c²`` (``p = 2``); refitted to one measurement ``KL``
    at ``c = fraction``, the KL is ``δ`` at ``c sqrt(δ / KL)``. If a cubic term makes the
    truth ``KL(c d) = δ (c² + e c³)``, the first measurement is off by ``e`` and the refitted
    one by ``−e (1 − 1/√(1+e)) / (1+e)`` (e = 0.45: −0.053). Given the ``previous``
    measurement ``(c', KL')`` too, ``p`` is the local exponent ``log(KL/KL') / log(c/c')``
    (a secant in log-log; kept to ``[1, 4]``, else 2), which converges much faster. The
    factor is clamped to ``[1/max_factor, max_factor]``, so a measurement near zero cannot
    send the step far past the model.
    """
    if not (math.isfinite(measured_kl) and measured_kl > 0.0):
        return fraction * max_factor
    power = 2.0
    if previous is not None and previous[0] > 0.0 and previous[0] != fraction and previous[1] > 0.0:
        slope = math.log(measured_kl / previous[1]) / math.log(fraction / previous[0])
        if math.isfinite(slope) and 1.0 <= slope <= 4.0:
            power = slope
    return fraction * min(max_factor, max(1.0 / max_factor, (delta / measured_kl) ** (1.0 / power)))


def backtracking_line_search(
    module: nn.Module,
    step: Tensor,
    evaluate: Callable[[], Evaluation],
    *,
    surrogate_before: float,
    delta: float,
    expected_improvement: float = 0.0,
    kl_tolerance: float = 0.5,
    backtrack: float = 0.5,
    max_tries: int = 10,
    accept_ratio: float = 0.0,
    kl_fits: int = 0,
    kl_fit_rtol: float = 0.1,
) -> LineSearchResult:
    """Set ``θ = θ_0 + c d`` for ``c = 1, b, b², …`` and keep the first ``c`` that passes::

        KL(θ) ≤ δ (1 + kl_tolerance)    and    L(θ) − L(θ_0) > max(0, accept_ratio · c · gᵀd)

    (``gᵀd`` = ``expected_improvement``, the linear model's gain at the full step; with
    ``accept_ratio = 0`` any improvement passes). ``evaluate`` reads the module as it stands.
    The default tolerance 0.5 is OpenAI baselines' (the step is sized so the *quadratic*
    model of the KL is ``δ``; the measured KL of a good step lands on either side of it).

    With ``kl_fits = m > 0``, up to ``m`` trials whose measured KL is off ``δ`` by more than
    ``kl_fit_rtol`` (relative) are not judged but refitted: ``c ← kl_fitted_fraction(c, KL, δ)``
    (which may exceed 1 when the model overestimated the KL; from the second refit on, with
    the measured exponent); backtracking goes on from the last ``c``. At ``δ = 0.05`` the
    quadratic model can be off by half (bench/fvp.py); one or two refits, a forward pass
    each, land within a few per cent.

    A KL of +inf (a trial that takes all of an action's probability away where the reference
    has some: with the served distribution, logits pushed so far apart that a masked
    probability underflows to exactly 0) is over the limit like any other: that trial is
    rejected for the constraint and the search backtracks, never refits (``kl_fitted_fraction``
    would grow the step). At most ``max_tries`` evaluations in all. On failure, and at once on
    a NaN KL or a non-finite surrogate, the module's parameters are restored to ``θ_0`` bit for bit. In
    data-parallel training ``evaluate`` must return reduced means, so that every rank takes
    the same decisions.
    """
    if not 0.0 < backtrack < 1.0 or max_tries < 1 or kl_fits < 0:
        raise ValueError("backtrack must be in (0, 1), max_tries ≥ 1 and kl_fits ≥ 0")
    theta0 = flat_params(module)
    if not bool(torch.isfinite(step).all()):
        return LineSearchResult(False, 0.0, 0, math.nan, math.nan, 0, "aborted: the step has non-finite entries")
    limit = delta * (1.0 + kl_tolerance)
    kl_rejections = fits = 0
    fraction = 1.0
    previous: tuple[float, float] | None = None  # the last refitted trial (c, KL)
    for k in range(1, max_tries + 1):
        set_flat_params(module, theta0 + fraction * step)
        kl, surrogate = evaluate()
        if kl == math.inf and math.isfinite(surrogate):  # the trial took all probability off an action: too far, not broken
            kl_rejections += 1
            fraction *= backtrack
            continue
        if not (math.isfinite(kl) and math.isfinite(surrogate)):
            set_flat_params(module, theta0)
            reason = f"aborted: non-finite KL {kl} or surrogate {surrogate}"
            return LineSearchResult(False, 0.0, k, math.nan, math.nan, kl_rejections, reason, fits)
        if fits < kl_fits and abs(kl / delta - 1.0) > kl_fit_rtol:
            fits += 1
            kl_rejections += int(kl > delta)  # shrunk because of the constraint
            fraction, previous = kl_fitted_fraction(fraction, kl, delta, previous=previous), (fraction, kl)
            continue
        improvement = surrogate - surrogate_before
        if kl > limit:
            kl_rejections += 1
        elif improvement > 0.0 and improvement >= accept_ratio * fraction * expected_improvement:
            return LineSearchResult(True, fraction, k, kl, improvement, kl_rejections, None, fits)
        fraction *= backtrack
    set_flat_params(module, theta0)
    reason = f"no step in {max_tries} tries ({kl_rejections} over the KL limit)"
    return LineSearchResult(False, 0.0, max_tries, math.nan, math.nan, kl_rejections, reason, fits)


def constraint_binds(search: LineSearchResult, delta: float, threshold: float = 0.9) -> bool:
    """The KL constraint binds on an update when it limited the step taken.

    That is: some trial was rejected for its KL (the line search shrank the step because of
    the constraint), or the accepted step's measured KL is ``≥ threshold · δ``. A step shrunk
    only because the surrogate did not improve does not count.
    """
    return search.kl_rejections > 0 or (search.accepted and search.kl >= threshold * delta)


@dataclass
class ConstraintTracker:
    """The KL constraint across updates: its multiplier, smoothed, and how often it binds.

    ``η_t = sqrt(sᵀ F s / 2δ)`` of each update that produced a step (``ScaledStep.multiplier``)
    feeds an exponential moving average started at the first value::

        η̄_1 = η_1,     η̄_t = α η̄_{t−1} + (1 − α) η_t

    A rising ``η̄`` says each unit of KL buys more surrogate, i.e. ``δ`` is tight.
    """

    alpha: float = 0.95
    bind_threshold: float = 0.9
    eta: float | None = None
    """The smoothed multiplier ``η̄`` (``None`` before the first step)."""
    steps: int = 0
    """Updates recorded with a step (not aborted)."""
    binds: int = 0
    """Of those, the ones where the constraint bound (``constraint_binds``)."""
    aborted: int = 0
    """Updates recorded with no step (``ScaledStep`` aborted)."""

    def record(self, scaled: ScaledStep, search: LineSearchResult | None, delta: float) -> bool:
        """Fold one update in; returns whether the constraint bound on it."""
        if not scaled.ok or not math.isfinite(scaled.multiplier):
            self.aborted += 1
            return False
        self.steps += 1
        eta = scaled.multiplier
        self.eta = eta if self.eta is None else self.alpha * self.eta + (1.0 - self.alpha) * eta
        bound = search is not None and constraint_binds(search, delta, self.bind_threshold)
        self.binds += int(bound)
        return bound

    @property
    def bind_rate(self) -> float:
        """Fraction of the recorded steps on which the constraint bound (nan before any)."""
        return self.binds / self.steps if self.steps else math.nan
