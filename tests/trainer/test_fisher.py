"""Fisher-vector products against the explicit Fisher matrix of a tiny network (float64)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.functional import hessian, jacobian

from trainer.fisher import (
    GaussNewtonFisher,
    Linearization,
    categorical_fisher_product,
    centred_norm2,
    centring,
    check_guard,
    flat_params,
    fvp_double_backward,
    fvp_gauss_newton,
    logits_fn,
    masked_log_probs,
    mean_kl,
    set_flat_params,
    subsample_indices,
)
from trainer.networks import PolicyNet

N_STATES, STATE_DIM, HIDDEN, N_ACTIONS = 16, 7, 6, 5
NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/trainer/conftest.py


def tiny_problem(seed: int = 0) -> tuple[PolicyNet, torch.Tensor, torch.Tensor]:
    """A float64 PolicyNet, states, and log guard weights with some blocked actions (never all)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = PolicyNet(STATE_DIM, HIDDEN, N_ACTIONS).double()
    states = torch.randn(N_STATES, STATE_DIM, generator=gen, dtype=torch.float64)
    log_guard = -torch.rand(N_STATES, N_ACTIONS, generator=gen, dtype=torch.float64)  # soft weights in (-1, 0]
    blocked = torch.rand(N_STATES, N_ACTIONS, generator=gen) < 0.3
    blocked[:, 0] = False  # every state allows action 0
    blocked[3] = torch.tensor([False, True, True, True, True])  # one state with a single allowed action
    log_guard[blocked] = NEG_INF
    return net, states, log_guard


def explicit_fisher(net: PolicyNet, states: torch.Tensor, log_guard: torch.Tensor) -> torch.Tensor:
    """``F = (1/N) Σ_i J_iᵀ (diag(q_i) − q_i q_iᵀ) J_i`` with ``J`` from ``jacobian``: ``(P, P)``."""
    f = logits_fn(net, states)
    theta = flat_params(net)
    jac = jacobian(f, theta)  # type: ignore[no-untyped-call]  # (N, A, P)
    q = masked_log_probs(f(theta), log_guard).exp()
    h = torch.diag_embed(q) - q[:, :, None] * q[:, None, :]  # (N, A, A)
    return torch.einsum("nap,nab,nbq->pq", jac, h, jac) / states.shape[0]


def kl_of(net: PolicyNet, states: torch.Tensor, log_guard: torch.Tensor):  # type: ignore[no-untyped-def]
    f = logits_fn(net, states)
    log_q_old = masked_log_probs(f(flat_params(net)), log_guard).detach()
    return lambda theta: mean_kl(log_q_old, f(theta), log_guard)


@pytest.fixture(scope="module")
def problem() -> tuple[PolicyNet, torch.Tensor, torch.Tensor, torch.Tensor]:
    net, states, log_guard = tiny_problem()
    return net, states, log_guard, explicit_fisher(net, states, log_guard)


def test_the_explicit_fisher_is_the_hessian_of_the_kl_at_the_old_policy(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, log_guard, fisher = problem
    kl = kl_of(net, states, log_guard)
    theta = flat_params(net)
    assert float(kl(theta)) == 0.0
    torch.testing.assert_close(hessian(kl, theta), fisher, rtol=1e-9, atol=1e-12)  # type: ignore[no-untyped-call]
    eigenvalues = torch.linalg.eigvalsh(fisher)
    assert float(eigenvalues.min()) > -1e-12  # positive semi-definite


def test_gauss_newton_and_double_backward_fvps_equal_the_explicit_fisher(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, log_guard, fisher = problem
    theta = flat_params(net)
    f = logits_fn(net, states)
    op = GaussNewtonFisher(Linearization(f, theta), log_guard)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # the operator is reused across products, as in CG
        v = torch.randn(theta.numel(), generator=gen, dtype=torch.float64)
        expected = fisher @ v
        torch.testing.assert_close(op(v), expected, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(fvp_gauss_newton(f, theta, log_guard, v), expected, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(fvp_double_backward(kl_of(net, states, log_guard), theta, v), expected, rtol=1e-9, atol=1e-12)
        assert float(op.curvature(v)) == pytest.approx(float(v @ fisher @ v), rel=1e-10)


def test_damping_adds_lambda_v_and_not_to_the_curvature(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, log_guard, fisher = problem
    op = GaussNewtonFisher.from_module(net, states, log_guard, damping=0.25)
    v = torch.randn(fisher.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(op(v), fisher @ v + 0.25 * v, rtol=1e-10, atol=1e-13)
    assert float(op.curvature(v)) == pytest.approx(float(v @ fisher @ v), rel=1e-10)
    with pytest.raises(ValueError, match="damping"):
        GaussNewtonFisher.from_module(net, states, log_guard, damping=-1.0)


def test_logit_damping_adds_kappa_jt_c_j_to_the_served_fisher(problem) -> None:  # type: ignore[no-untyped-def]
    """With the masked softmax as the "served" distribution, M_i is the categorical H_i, so the operator with
    ``logit_damping`` κ is the explicit (1/N) Σ Jᵀ (H_i + κ C_i) J; κ reaches the curvature too (it is part of the
    divergence the step is sized to), unlike the CG damping λ."""
    net, states, log_guard, fisher = problem
    allowed = torch.isfinite(log_guard)

    def softmax(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return masked_log_probs(z, log_guard[rows]).exp()

    jac = jacobian(logits_fn(net, states), flat_params(net))  # type: ignore[no-untyped-call]
    damped = fisher + 0.3 * torch.einsum("nap,nab,nbq->pq", jac, centring(allowed), jac) / N_STATES
    v = torch.randn(fisher.shape[0], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    plain = GaussNewtonFisher.from_module(net, states, log_guard, served=softmax)
    op = GaussNewtonFisher.from_module(net, states, log_guard, served=softmax, logit_damping=0.3)
    torch.testing.assert_close(plain(v), fisher @ v, rtol=1e-8, atol=1e-11)
    torch.testing.assert_close(op(v), damped @ v, rtol=1e-8, atol=1e-11)
    assert float(op.curvature(v)) == pytest.approx(float(v @ damped @ v), rel=1e-8)
    with pytest.raises(ValueError, match="logit_damping"):
        GaussNewtonFisher.from_module(net, states, log_guard, served=softmax, logit_damping=-0.1)


def test_centring_is_the_euclidean_metric_of_the_allowed_logits_less_their_mean() -> None:
    gen = torch.Generator().manual_seed(7)
    allowed = torch.rand(9, 5, generator=gen) < 0.7
    allowed[:, 0] = True
    allowed[4] = torch.tensor([True, False, False, False, False])  # one allowed action: nothing to move
    c = centring(allowed)
    u = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(c, c.transpose(1, 2))
    torch.testing.assert_close(c @ c, c, rtol=1e-12, atol=1e-14)  # a projection
    assert float((c @ allowed.double()[:, :, None]).abs().max()) < 1e-14  # a shift of the allowed logits costs nothing
    assert torch.equal(c[~allowed], torch.zeros_like(c[~allowed]))  # nor does a banned action's logit
    torch.testing.assert_close(centred_norm2(u, allowed), torch.einsum("na,nab,nb->n", u, c, u), rtol=1e-12, atol=1e-14)
    assert float(centred_norm2(u, allowed)[4]) == 0.0


def test_subsampled_fvp_is_the_explicit_fisher_of_that_subset(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, log_guard, _ = problem
    op = GaussNewtonFisher.from_module(net, states, log_guard, subsample=0.25, generator=torch.Generator().manual_seed(5))
    idx = subsample_indices(N_STATES, 0.25, torch.Generator().manual_seed(5))
    assert idx.tolist() == sorted(set(idx.tolist())) and len(idx) == 4 and op.n_states == 4
    fisher_subset = explicit_fisher(net, states[idx], log_guard[idx])
    v = torch.randn(fisher_subset.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(op(v), fisher_subset @ v, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="fraction"):
        subsample_indices(10, 0.0, torch.Generator())


def test_categorical_fisher_product_is_diag_q_minus_qqt() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(6, 5, generator=gen, dtype=torch.float64), dim=-1)
    q[:, 2] = 0.0  # a blocked action
    q = q / q.sum(-1, keepdim=True)
    u = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    h = torch.diag_embed(q) - q[:, :, None] * q[:, None, :]
    torch.testing.assert_close(categorical_fisher_product(q, u), (h @ u[:, :, None])[..., 0], rtol=1e-12, atol=1e-15)
    assert float(categorical_fisher_product(q, torch.ones_like(u)).abs().max()) < 1e-15  # H 1 = 0
    assert torch.equal(categorical_fisher_product(q, u)[:, 2], torch.zeros(6, dtype=torch.float64))


def test_mean_kl_closed_form_and_finite_gradients_with_blocked_actions(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, log_guard, _ = problem
    kl = kl_of(net, states, log_guard)
    theta = flat_params(net)
    moved = theta + 0.3 * torch.randn(theta.numel(), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    f = logits_fn(net, states)
    q_old = masked_log_probs(f(theta), log_guard).exp()
    q_new = masked_log_probs(f(moved), log_guard).exp()
    allowed = q_old > 0
    expected = sum(
        float((q_old[i][allowed[i]] * (q_old[i][allowed[i]] / q_new[i][allowed[i]]).log()).sum()) for i in range(N_STATES)
    ) / N_STATES
    assert float(kl(moved)) == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(kl(moved.requires_grad_(True)), moved)
    assert bool(torch.isfinite(grad).all())
    assert bool(torch.equal(q_new[~allowed], torch.zeros_like(q_new[~allowed])))


def test_linearization_reuses_one_forward_for_jvp_and_vjp(problem) -> None:  # type: ignore[no-untyped-def]
    net, states, _, _ = problem
    f = logits_fn(net, states)
    theta = flat_params(net)
    lin = Linearization(f, theta)
    jac = jacobian(f, theta)  # type: ignore[no-untyped-call]  # (N, A, P)
    gen = torch.Generator().manual_seed(7)
    v = torch.randn(theta.numel(), generator=gen, dtype=torch.float64)
    u = torch.randn(N_STATES, N_ACTIONS, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(lin.logits, f(theta))
    vjp_first = Linearization(f, theta)  # J v's closure then comes from the vjp at u ≠ 0: the same linear map
    torch.testing.assert_close(vjp_first.vjp(u), torch.einsum("nap,na->p", jac, u), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(vjp_first.jvp(v), jac @ v, rtol=1e-10, atol=1e-13)
    for _ in range(2):
        torch.testing.assert_close(lin.jvp(v), jac @ v, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(lin.vjp(u), torch.einsum("nap,na->p", jac, u), rtol=1e-10, atol=1e-13)


def test_flat_params_round_trip_without_aliasing() -> None:
    net, _, _ = tiny_problem()
    theta = flat_params(net)
    other = PolicyNet(STATE_DIM, HIDDEN, N_ACTIONS).double()
    set_flat_params(other, theta)
    assert torch.equal(flat_params(other), theta)
    theta += 1.0  # the module holds a copy, not a view
    assert torch.equal(flat_params(other), flat_params(net))
    with pytest.raises(ValueError, match="entries"):
        set_flat_params(other, theta[:-1])


def test_guard_validation() -> None:
    check_guard(torch.tensor([[0.0, NEG_INF, -2.0]]))
    with pytest.raises(ValueError, match="every action blocked"):
        check_guard(torch.tensor([[NEG_INF, NEG_INF, NEG_INF]]))
    for above in (0.5, 1e-9):  # any weight above 1 (a log above 0), however slightly
        with pytest.raises(ValueError, match=r"\[-inf, 0\]"):
            check_guard(torch.tensor([[above, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[-inf, 0\]"):
        check_guard(torch.tensor([[float("nan"), 0.0, 0.0]]))
