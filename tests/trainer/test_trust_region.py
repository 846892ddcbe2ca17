"""Conjugate gradient, step size, line search and the multiplier tracker against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from trainer.fisher import GaussNewtonFisher, Linearization, flat_params, logits_fn, masked_log_probs, mean_kl, set_flat_params
from trainer.networks import PolicyNet
from trainer.trust_region import (
    ConstraintTracker,
    Evaluation,
    LineSearchResult,
    ScaledStep,
    backtracking_line_search,
    conjugate_gradient,
    constraint_binds,
    kl_fitted_fraction,
    kl_step_size,
    natural_gradient_step,
    scale_step,
)

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/trainer/conftest.py


def spd(n: int, seed: int, eigenvalues: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = eigenvalues if eigenvalues is not None else rng.uniform(0.1, 10.0, n)
    return (q * lam) @ q.T


def as_operator(a: np.ndarray):  # type: ignore[no-untyped-def]
    at = torch.from_numpy(a)
    return lambda v: at @ v


# --- conjugate gradient -----------------------------------------------------------------


def test_cg_solves_a_small_spd_system() -> None:
    a = spd(8, seed=0)
    b = np.random.default_rng(1).standard_normal(8)
    result = conjugate_gradient(as_operator(a), torch.from_numpy(b), max_iterations=50, rtol=1e-12)
    np.testing.assert_allclose(result.x.numpy(), np.linalg.solve(a, b), rtol=1e-9, atol=1e-12)
    assert result.converged and not result.breakdown and result.iterations <= 12
    assert result.residual_norm <= 1e-12 * np.linalg.norm(b)


def test_cg_is_exact_after_as_many_iterations_as_distinct_eigenvalues() -> None:
    a = spd(10, seed=2, eigenvalues=np.array([1.0] * 4 + [3.0] * 3 + [7.0] * 3))
    b = np.random.default_rng(3).standard_normal(10)
    result = conjugate_gradient(as_operator(a), torch.from_numpy(b), max_iterations=10, rtol=1e-10)
    assert result.iterations == 3 and result.converged
    np.testing.assert_allclose(result.x.numpy(), np.linalg.solve(a, b), rtol=1e-10)


def test_cg_residual_stop_and_iteration_cap() -> None:
    a = spd(30, seed=4)
    b = torch.from_numpy(np.random.default_rng(5).standard_normal(30))
    loose = conjugate_gradient(as_operator(a), b, max_iterations=100, rtol=1e-2)
    true_residual = float(torch.linalg.norm(b - torch.from_numpy(a) @ loose.x))
    assert loose.converged and loose.residual_norm <= 1e-2 * float(torch.linalg.norm(b))
    assert true_residual == pytest.approx(loose.residual_norm, rel=1e-6)
    capped = conjugate_gradient(as_operator(a), b, max_iterations=3, rtol=1e-12)
    assert capped.iterations == 3 and not capped.converged
    assert loose.iterations > 3
    assert float(b @ capped.x) < float(b @ loose.x)  # bᵀx_k grows with k


def test_cg_stops_on_a_non_positive_direction_and_on_a_zero_rhs() -> None:
    b = torch.ones(4, dtype=F64)
    broken = conjugate_gradient(lambda v: -v, b, max_iterations=5)
    assert broken.breakdown and broken.iterations == 1 and torch.equal(broken.x, torch.zeros_like(b))
    nan = conjugate_gradient(lambda v: v * float("nan"), b, max_iterations=5)
    assert nan.breakdown and torch.equal(nan.x, torch.zeros_like(b))
    zero = conjugate_gradient(lambda v: v, torch.zeros(4, dtype=F64))
    assert zero.converged and zero.iterations == 0


# --- step size -----------------------------------------------------------------------------


def test_scaled_step_meets_the_quadratic_kl_target_exactly() -> None:
    f = torch.from_numpy(spd(6, seed=6))
    g = torch.from_numpy(np.random.default_rng(7).standard_normal(6))
    s = torch.linalg.solve(f, g)
    delta = 0.05
    scaled = scale_step(s, float(s @ f @ s), g, delta)
    assert scaled.ok and scaled.step is not None
    assert 0.5 * float(scaled.step @ f @ scaled.step) == pytest.approx(delta, rel=1e-12)
    eta = math.sqrt(float(s @ f @ s) / (2 * delta))
    assert scaled.multiplier == pytest.approx(eta, rel=1e-12) and scaled.beta == pytest.approx(1 / eta, rel=1e-12)
    assert scaled.expected_improvement == pytest.approx(2 * delta * eta, rel=1e-10)  # gᵀd = 2δη
    # KKT: g = η F d
    torch.testing.assert_close(g, scaled.multiplier * (f @ scaled.step), rtol=1e-10, atol=1e-12)
    assert kl_step_size(8.0, 0.04) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("curvature", "direction", "reason"),
    [
        (0.0, [1.0, 0.0], "≤ 0"),
        (-2.0, [1.0, 0.0], "≤ 0"),
        (float("nan"), [1.0, 0.0], "not finite"),
        (float("inf"), [1.0, 0.0], "not finite"),
        (1.0, [float("nan"), 0.0], "non-finite entries"),
        (1.0, [-1.0, 0.0], "not an ascent direction"),
    ],
)
def test_scale_step_aborts_with_a_reason(curvature: float, direction: list[float], reason: str) -> None:
    scaled = scale_step(torch.tensor(direction, dtype=F64), curvature, torch.tensor([1.0, 0.0], dtype=F64), 0.05)
    assert not scaled.ok and scaled.step is None
    assert scaled.aborted is not None and scaled.aborted.startswith("aborted: ") and reason in scaled.aborted
    with pytest.raises(ValueError):
        kl_step_size(0.0, 0.05)


def test_measured_kl_of_the_scaled_step_lands_on_delta_on_a_network() -> None:
    """CG on the damped Fisher, β from the undamped sᵀFs: the step's real KL is δ to O(δ^{3/2})."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    net = PolicyNet(12, 16, 5).double()
    states = torch.randn(64, 12, generator=gen, dtype=F64)
    log_guard = torch.zeros(64, 5, dtype=F64)
    log_guard[torch.rand(64, 5, generator=gen) < 0.3] = float("-inf")
    log_guard[:, 1] = 0.0
    actions = torch.full((64,), 1, dtype=torch.long)  # allowed everywhere
    advantages = torch.randn(64, generator=gen, dtype=F64)
    f = logits_fn(net, states)
    theta = flat_params(net)
    log_q_old = masked_log_probs(f(theta), log_guard).detach()

    def surrogate(t: torch.Tensor) -> torch.Tensor:
        return (advantages * masked_log_probs(f(t), log_guard)[torch.arange(64), actions]).mean()

    t = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(surrogate(t), t)
    damping = 1e-2
    fisher = GaussNewtonFisher(Linearization(f, theta), log_guard, damping=damping)
    errors = []
    for delta, rel in ((1e-4, 0.15), (1e-6, 0.02)):  # the model's error is O(|d|³) = O(δ^{3/2}): relative O(√δ)
        step = natural_gradient_step(fisher, fisher.curvature, g, delta=delta, cg_iterations=30)
        assert step.scaled.ok and step.scaled.step is not None
        kl = float(mean_kl(log_q_old, f(theta + step.scaled.step), log_guard))
        assert kl == pytest.approx(delta, rel=rel)
        errors.append(abs(kl / delta - 1))
        # scaled with the damped curvature instead, the KL falls short by sᵀFs / sᵀ(F+λI)s
        s = step.cg.x
        damped = float(s @ fisher(s))
        short = scale_step(s, damped, g, delta)
        assert short.step is not None
        kl_short = float(mean_kl(log_q_old, f(theta + short.step), log_guard))
        assert kl_short / delta == pytest.approx(step.scaled.curvature / damped, rel=rel)
    assert errors[1] < 0.2 * errors[0]


# --- line search ----------------------------------------------------------------------------


class QuadraticWorld:
    """KL = q (1 + e sqrt(q/δ)) with q = ½ dᵀ F d, and L = gᵀ d − c ‖d‖³, d = θ − θ0 read from a module.

    Along the scaled step ``d*`` (q(d*) = δ): ``KL(c d*) = δ (c² + e c³)``.
    """

    def __init__(self, module: nn.Module, f: torch.Tensor, g: torch.Tensor, delta: float) -> None:
        self.module, self.f, self.g, self.delta = module, f, g, delta
        self.cubic = self.kl_cubic = 0.0
        self.theta0 = flat_params(module)
        self.calls = 0

    def __call__(self) -> Evaluation:
        self.calls += 1
        d = flat_params(self.module) - self.theta0
        q = 0.5 * float(d @ self.f @ d)
        return Evaluation(q * (1 + self.kl_cubic * math.sqrt(q / self.delta)), float(self.g @ d) - self.cubic * float(d.norm()) ** 3)


def world(seed: int = 8) -> tuple[nn.Module, QuadraticWorld, torch.Tensor, float]:
    torch.manual_seed(seed)
    module = nn.Linear(3, 2).double()
    f = torch.from_numpy(spd(8, seed))
    g = torch.from_numpy(np.random.default_rng(seed).standard_normal(8))
    s = torch.linalg.solve(f, g)
    delta = 0.01
    step = scale_step(s, float(s @ f @ s), g, delta).step
    assert step is not None
    return module, QuadraticWorld(module, f, g, delta), step, delta


def test_line_search_accepts_the_full_step_when_it_is_fine() -> None:
    module, evaluate, step, delta = world()
    theta0 = flat_params(module)
    result = backtracking_line_search(module, step, evaluate, surrogate_before=0.0, delta=delta)
    assert result.accepted and result.fraction == 1.0 and result.tries == 1 and result.kl_rejections == 0
    assert result.kl == pytest.approx(delta, rel=1e-9) and result.reason is None
    torch.testing.assert_close(flat_params(module), theta0 + step, rtol=0, atol=1e-15)


def test_line_search_backtracks_when_the_kl_is_too_big() -> None:
    module, evaluate, step, delta = world()
    theta0 = flat_params(module)
    # 4x the step: KL(b^k · 4d) = 16 b^{2k} δ ≤ 1.5 δ first at b^k = 1/4 (k = 2)
    result = backtracking_line_search(module, 4 * step, evaluate, surrogate_before=0.0, delta=delta, kl_tolerance=0.5)
    assert result.accepted and result.fraction == 0.25 and result.tries == 3 and result.kl_rejections == 2
    assert result.kl == pytest.approx(delta, rel=1e-9)
    torch.testing.assert_close(flat_params(module), theta0 + step, rtol=0, atol=1e-15)
    assert constraint_binds(result, delta)


def test_line_search_demands_a_fraction_of_the_expected_improvement() -> None:
    module, evaluate, step, delta = world()
    expected = float(evaluate.g @ step)
    # L(b d) = b gᵀd − c b³ ‖d‖³ with c ‖d‖³ = 0.8 gᵀd: the full step gains 0.2 gᵀd (< half of it), the half step 0.4 (≥ 0.25)
    evaluate.cubic = 0.8 * expected / float(step.norm()) ** 3
    lenient = backtracking_line_search(module, step, evaluate, surrogate_before=0.0, delta=delta)
    assert lenient.accepted and lenient.fraction == 1.0 and lenient.improvement == pytest.approx(0.2 * expected)
    set_flat_params(module, evaluate.theta0)
    strict = backtracking_line_search(
        module, step, evaluate, surrogate_before=0.0, delta=delta, expected_improvement=expected, accept_ratio=0.5
    )
    assert strict.accepted and strict.fraction == 0.5 and strict.improvement == pytest.approx(0.4 * expected)
    assert strict.kl_rejections == 0 and not constraint_binds(strict, delta)  # shrunk for the surrogate, not the KL


def test_kl_fitted_fraction() -> None:
    assert kl_fitted_fraction(1.0, 0.04, 0.01) == 0.5
    assert kl_fitted_fraction(0.5, 0.0025, 0.01) == 1.0
    assert kl_fitted_fraction(1.0, 1.0, 0.01) == 0.5  # the factor is clamped to [1/2, 2]
    assert kl_fitted_fraction(1.0, 0.0, 0.01) == 2.0
    assert kl_fitted_fraction(1.0, float("nan"), 0.01) == 2.0
    # KL ∝ c³ measured at c = 1 and 2: the exponent 3 is used
    assert kl_fitted_fraction(1.0, 0.008, 0.001, previous=(2.0, 0.064)) == pytest.approx(0.5)
    assert kl_fitted_fraction(1.0, 0.004, 0.001, previous=(2.0, 0.004)) == 0.5  # slope 0: back to the square root


@pytest.mark.parametrize(("scale", "fraction"), [(1.6, 0.625), (0.5, 2.0)])
def test_line_search_refits_the_step_to_the_measured_kl(scale: float, fraction: float) -> None:
    module, evaluate, step, delta = world()
    theta0 = flat_params(module)
    result = backtracking_line_search(module, scale * step, evaluate, surrogate_before=0.0, delta=delta, kl_fits=1)
    assert result.accepted and result.kl_fits == 1 and result.tries == 2
    assert result.fraction == pytest.approx(fraction) and result.kl == pytest.approx(delta, rel=1e-9)
    assert result.kl_rejections == int(scale > 1)
    torch.testing.assert_close(flat_params(module), theta0 + step, rtol=1e-12, atol=1e-14)


def test_one_refit_leaves_the_closed_form_error_of_a_cubic_kl() -> None:
    module, evaluate, step, delta = world()
    e = 0.45
    evaluate.kl_cubic = e
    plain = backtracking_line_search(module, step, evaluate, surrogate_before=0.0, delta=delta)
    assert plain.kl == pytest.approx(delta * (1 + e), rel=1e-9)
    set_flat_params(module, evaluate.theta0)
    fitted = backtracking_line_search(module, step, evaluate, surrogate_before=0.0, delta=delta, kl_fits=1)
    assert fitted.fraction == pytest.approx(1 / math.sqrt(1 + e))
    assert fitted.kl / delta - 1 == pytest.approx(-e * (1 - 1 / math.sqrt(1 + e)) / (1 + e), rel=1e-9)  # -0.053
    set_flat_params(module, evaluate.theta0)
    secant = backtracking_line_search(module, step, evaluate, surrogate_before=0.0, delta=delta, kl_fits=2, kl_fit_rtol=0.01)
    assert secant.kl_fits == 2 and secant.tries == 3
    c1 = 1 / math.sqrt(1 + e)
    slope = math.log((c1**2 + e * c1**3) / (1 + e)) / math.log(c1)  # the measured exponent
    assert secant.fraction == pytest.approx(c1 * (c1**2 + e * c1**3) ** (-1 / slope), rel=1e-9)
    assert abs(secant.kl / delta - 1) < 1e-3


def test_line_search_failure_restores_the_parameters_exactly() -> None:
    module, evaluate, step, delta = world()
    theta0 = flat_params(module).clone()
    result = backtracking_line_search(module, -step, evaluate, surrogate_before=0.0, delta=delta, max_tries=6)
    assert not result.accepted and result.tries == 6 and evaluate.calls == 6
    assert result.reason is not None and "no step in 6 tries" in result.reason
    assert torch.equal(flat_params(module), theta0)
    assert not constraint_binds(result, delta)


@pytest.mark.parametrize("kl_fits", [0, 2])
def test_an_infinite_kl_is_over_the_limit_and_backtracks(kl_fits: int) -> None:
    """A trial whose KL is +inf (an action's probability pushed to exactly 0) is shrunk like any trial past δ, with or
    without refits, where it used to abort the whole update (the lifted-limits loop lost every update of a cycle so)."""
    module, evaluate, step, delta = world()
    theta0 = flat_params(module).clone()

    def cliff() -> Evaluation:  # past a quarter of the step the support breaks; below it, the quadratic world
        got = evaluate()
        d = flat_params(module) - theta0
        return Evaluation(math.inf, got.surrogate) if float(d.norm()) > 0.3 * float(step.norm()) else got

    result = backtracking_line_search(module, step, cliff, surrogate_before=0.0, delta=delta, kl_fits=kl_fits)
    assert result.accepted and result.fraction == 0.25 and result.kl_rejections >= 2, result
    assert math.isfinite(result.kl) and result.kl <= delta * 1.5
    assert torch.allclose(flat_params(module), theta0 + 0.25 * step)
    assert constraint_binds(result, delta)  # the constraint limited the step: the tracker says so


def test_a_kl_infinite_at_every_trial_fails_cleanly_and_restores() -> None:
    module, _, step, delta = world()
    theta0 = flat_params(module).clone()
    result = backtracking_line_search(module, step, lambda: Evaluation(math.inf, 1.0), surrogate_before=0.0, delta=delta,
                                      max_tries=4)
    assert not result.accepted and result.tries == 4 and result.kl_rejections == 4
    assert result.reason is not None and "4 over the KL limit" in result.reason
    assert torch.equal(flat_params(module), theta0)


def test_line_search_aborts_on_nan_and_restores() -> None:
    module, _, step, delta = world()
    theta0 = flat_params(module).clone()
    calls: list[int] = []

    def nan_world() -> Evaluation:
        calls.append(1)
        return Evaluation(float("nan"), 1.0)

    result = backtracking_line_search(module, step, nan_world, surrogate_before=0.0, delta=delta)
    assert not result.accepted and result.tries == 1 and len(calls) == 1
    assert result.reason is not None and result.reason.startswith("aborted: non-finite")
    assert torch.equal(flat_params(module), theta0)
    bad = step.clone()
    bad[0] = float("inf")
    result = backtracking_line_search(module, bad, nan_world, surrogate_before=0.0, delta=delta)
    assert not result.accepted and result.tries == 0 and len(calls) == 1
    assert torch.equal(flat_params(module), theta0)


# --- the multiplier and how often the constraint binds ------------------------------------------


def _scaled(eta: float) -> ScaledStep:
    return ScaledStep(torch.zeros(1), 1 / eta, 1.0, eta, 1.0, None)


def _search(accepted: bool, kl: float, kl_rejections: int) -> LineSearchResult:
    return LineSearchResult(accepted, 1.0 if accepted else 0.0, 1, kl, 0.1, kl_rejections, None if accepted else "no step")


def test_constraint_tracker_ema_and_bind_rate_on_a_hand_sequence() -> None:
    delta = 0.05
    tracker = ConstraintTracker(alpha=0.95)
    assert tracker.eta is None and math.isnan(tracker.bind_rate)
    assert tracker.record(_scaled(2.0), _search(True, 0.046, 0), delta)  # 0.046 ≥ 0.9 δ = 0.045
    assert tracker.eta == 2.0
    assert not tracker.record(_scaled(4.0), _search(True, 0.030, 0), delta)
    assert tracker.eta == pytest.approx(0.95 * 2.0 + 0.05 * 4.0)  # 2.1
    assert tracker.record(_scaled(1.0), _search(True, 0.010, 2), delta)  # shrunk for its KL
    assert tracker.eta == pytest.approx(0.95 * 2.1 + 0.05 * 1.0)  # 2.045
    aborted = ScaledStep(None, math.nan, -1.0, math.nan, math.nan, "aborted: sᵀFs = -1 ≤ 0")
    assert not tracker.record(aborted, None, delta)
    assert tracker.record(_scaled(1.0), _search(False, math.nan, 10), delta)  # failed, every try over the limit
    assert tracker.eta == pytest.approx(0.95 * 2.045 + 0.05 * 1.0)
    assert (tracker.steps, tracker.binds, tracker.aborted) == (4, 3, 1)
    assert tracker.bind_rate == 0.75
