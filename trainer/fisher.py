"""Fisher-vector products for the guardrail-masked categorical policy.

Per logged state ``s_i`` the policy has logits ``z_i = f_θ(s_i)`` (``PolicyNet``) and fixed log
guardrail weights ``g_i ∈ [−inf, 0]^A`` (``−inf``: the action is blocked). The policy the
trust region is about is the masked categorical ``q_i = softmax(z_i + g_i)``, zero on blocked
actions, and the constraint is on the mean KL over the logged states::

    KL(θ) = (1/N) Σ_i KL(q_i^old ‖ q_i^θ)

At ``θ = θ_old`` its Hessian is the Fisher matrix, which has the Gauss-Newton form::

    F = (1/N) Σ_i J_iᵀ H_i J_i,    J_i = ∂z_i/∂θ  (A × P),    H_i = diag(q_i) − q_i q_iᵀ

``H_i`` is the Hessian of the KL in logit space (the Fisher of a categorical in its logits);
the other term of the chain rule, ``Σ_a ∂KL/∂z_ia · ∂²z_ia/∂θ²``, vanishes because
``∂KL/∂z_i = q_i^θ − q_i^old = 0`` at ``θ_old``. ``g_i`` is a constant shift of ``z_i``, so
``J_i`` does not see it; blocked actions have ``q = 0`` and drop out of ``H_i``.

``GaussNewtonFisher`` is the operator the conjugate gradient uses: it runs the forward pass
once per update (``Linearization``) and then costs one ``J v`` and one ``Jᵀ u`` per product,
optionally on a fixed random subset of the states (the TRPO paper's subsampled Fisher), with
damping, and averaged across data-parallel ranks through a ``Reducer``.
**The served distribution.** What the bundle serves is not ``q`` but ``P_i = D_i(z_i)``: the
sampled-majority decoder with its fallback and exploration (``trainer.served``), a smooth
function of the logits wherever their order is fixed (the vote's tie rule follows the order of q,
so P jumps where two logits cross: a step that crosses one lands off the quadratic model, and the
line search sees it). Its Fisher in logit space is ``M_i = D_iᵀ diag(1/P_i) D_i`` with
``D_i = ∂P_i/∂z_i`` (A × A; terms with ``P_ia = 0`` dropped), the Hessian of
``KL(P_i^old ‖ P_i^θ)`` at ``θ_old`` for the same reason as above (``Σ_a ∂P_ia/∂z = 0``).
``served_metric`` computes ``M_i`` with one backward pass per action through the decoder, and
``GaussNewtonFisher(..., metric=M)`` uses ``M_i u`` in place of ``H_i u``: the trust region is
then on the distribution the shoppers see (``TrainConfig.trust_region = "served"``).

``M_i`` is nearly singular in the logits of the actions the decoder seldom serves: once one
action wins the vote, pushing the others' logits further down changes what is served only
through the exploration floor ε·q_T, and with a flat q_T (a large temperature) hardly at all.
A step sized to δ by ``M`` alone then runs those logits away (gaps of 3 to 575 in three steps of
δ = 0.5 in ``tests/trainer/test_update.py``, 2.2 to 386 in one cycle on the simulator), until a
probability underflows: every trial is then over the limit (a KL of +inf), or ``sᵀ F s`` is NaN,
and no later run can step. So the served metric carries ``κ C_i`` as well (``centring``; ``TrainConfig.logit_damping``): the divergence the
trust region bounds is ``KL(P_old ‖ P) + κ/2 ‖Δz_i − mean Δz_i‖²`` over the allowed actions,
whose Hessian is ``M_i + κ C_i``. Damping in the output space, as Martens and Sutskever's
structural damping is in a network's hidden states: where the served distribution does not see
the logits, a step moves them by about ``sqrt(2δ/κ)`` at most (root mean square over the states;
a single state's may move further), and where it does, by what ``M`` allows (``κ`` is small next to
``M`` along the directions that change what is served). It bounds each step, not the sum of many:
steps that gain nothing served can still drift those logits a few units at a time (about 5 a step
at δ = 0.5 in the test; in the default loop's five cycles the largest gap on the logged states
went from 2.2 to 6.4).

``fvp_double_backward`` is the textbook reference (Spinning Up, SB3-contrib): the gradient of
``∇KL · v``; ``fvp_gauss_newton`` is the same product as ``GaussNewtonFisher`` without reuse.
Both are for tests and the bench.

Parameters travel as one flat vector ``θ ∈ R^P`` (``flat_params`` / ``set_flat_params``), and
``logits_fn`` turns a module and a batch of states into the pure function ``θ ↦ z``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp

from trainer.distributed import LocalReducer, Reducer

METRIC_CHUNK = 8192
"""Rows per ``served_metric`` call when an operator is built (the decoder's graph is per row)."""

LogitsFn = Callable[[Tensor], Tensor]
"""A pure function ``θ (P,) ↦ z (N, A)``: the policy's logits on a fixed batch of states."""


def flat_params(module: nn.Module) -> Tensor:
    """The module's parameters as one detached flat vector (a copy), in ``parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def set_flat_params(module: nn.Module, theta: Tensor) -> None:
    """Copy the flat vector ``theta`` into the module's parameters, in place and bit for bit.

    (``torch.nn.utils.vector_to_parameters`` would instead make the parameters views of
    ``theta``, so a later change to ``theta`` would change the module.)
    """
    params = list(module.parameters())
    if theta.numel() != sum(p.numel() for p in params):
        raise ValueError(f"theta has {theta.numel()} entries, the module {sum(p.numel() for p in params)} parameters")
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(theta[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def logits_fn(module: nn.Module, states: Tensor) -> LogitsFn:
    """``θ ↦ f_θ(states)``: the module's forward pass as a pure function of the flat parameters."""
    named = list(module.named_parameters())
    names = [name for name, _ in named]
    shapes = [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]

    def logits(theta: Tensor) -> Tensor:
        chunks = torch.split(theta, sizes)
        return functional_call(module, {n: c.view(s) for n, c, s in zip(names, chunks, shapes, strict=True)}, (states,))

    return logits


def masked_log_probs(logits: Tensor, log_guard: Tensor) -> Tensor:
    """``log q = log_softmax(z + g)`` over the last axis; ``−inf`` on blocked actions.

    Every state must allow at least one action (a row of ``g`` all ``−inf`` has no distribution).
    """
    return torch.log_softmax(logits + log_guard, dim=-1)


def check_guard(log_guard: Tensor) -> None:
    """Raise ``ValueError`` unless every ``g ≤ 0`` (or ``−inf``) and every state allows an action."""
    if bool(torch.isnan(log_guard).any()) or bool((log_guard > 0).any()):
        raise ValueError("log guardrail weights must be in [-inf, 0]")
    if bool(torch.isneginf(log_guard).all(dim=-1).any()):
        raise ValueError("a state has every action blocked")


def mean_kl(log_q_old: Tensor, logits: Tensor, log_guard: Tensor) -> Tensor:
    """``(1/N) Σ_i Σ_a q_ia^old (log q_ia^old − log q_ia^θ)``, with ``q^θ = softmax(z + g)``.

    Terms with ``q^old = 0`` (blocked actions) are zero (``0 log 0 = 0``), and masked with
    ``where`` so that their ``−inf − (−inf)`` never reaches a gradient.
    """
    log_q = masked_log_probs(logits, log_guard)
    allowed = log_q_old > float("-inf")
    diff = torch.where(allowed, log_q_old - log_q, torch.zeros_like(log_q))
    return (log_q_old.exp() * diff).sum(dim=-1).mean()


def categorical_fisher_product(q: Tensor, u: Tensor) -> Tensor:
    """``H u`` per row, ``H = diag(q) − q qᵀ``: ``(H u)_a = q_a (u_a − Σ_b q_b u_b)``.

    ``H`` is the Fisher of a categorical in its logits (the Hessian of ``KL(q ‖ softmax(z))``
    in ``z`` at ``softmax(z) = q``). Symmetric, positive semi-definite, ``H 1 = 0`` (a constant
    shift of the logits changes nothing) and zero on the rows and columns where ``q_a = 0``.
    """
    return q * (u - (q * u).sum(dim=-1, keepdim=True))


def fvp_double_backward(kl: Callable[[Tensor], Tensor], theta: Tensor, v: Tensor) -> Tensor:
    """``F v = ∇_θ (∇_θ KL(θ) · v)``: the Hessian-vector product of the KL by double backward.

    The reference form (Spinning Up's ``hessian_vector_product``, SB3-contrib's TRPO): a
    forward pass, a backward pass with ``create_graph``, and a backward pass through that,
    all recomputed on every call. Undamped. ``kl`` maps flat parameters to the mean KL from
    the fixed old policy, e.g. ``lambda t: mean_kl(log_q_old, f(t), log_guard)``.
    """
    with torch.enable_grad():
        theta = theta.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(kl(theta), theta, create_graph=True)
        (hv,) = torch.autograd.grad(grad @ v, theta)
    return hv.detach()


def fvp_gauss_newton(f: LogitsFn, theta: Tensor, log_guard: Tensor, v: Tensor) -> Tensor:
    """``F v = (1/N) Σ_i J_iᵀ H_i J_i v`` in one shot: a fresh ``Linearization``, one ``J v``, one ``Jᵀ u``.

    The plain Gauss-Newton product with nothing reused across calls (a forward pass and the
    ``J v`` set-up on every call), for the bench and the tests; ``GaussNewtonFisher`` is the
    form to use. Undamped. (``torch.func.jvp``'s forward mode would do for ``J v`` too, but on
    CPU it is slower than the double-vjp, and its first use warns from inside torch.)
    """
    lin = Linearization(f, theta)
    q = masked_log_probs(lin.logits, log_guard).exp()
    return lin.vjp(categorical_fisher_product(q, lin.jvp(v))) / q.shape[0]


class Linearization:
    """``f`` at a fixed ``θ``: the logits, ``J v`` and ``Jᵀ u``, from one forward pass.

    ``Jᵀ u`` is ``torch.func.vjp``'s pullback, which keeps the forward's activations. ``J v`` is
    the double-vjp trick: the pullback ``u ↦ Jᵀ u`` is linear, so its own vjp at any ``u`` is
    ``v ↦ J v``, whatever that ``u``. It is built once, as a by-product of the first ``vjp``
    call (which then returns ``Jᵀ u`` from it: the surrogate's gradient, say, for free), or
    at the first ``jvp`` call from ``u = 0`` (one backward pass); each ``J v`` then costs
    about one backward pass and no forward pass.
    """

    def __init__(self, f: LogitsFn, theta: Tensor) -> None:
        logits, self._pullback = vjp(f, theta.detach())[:2]
        self.logits: Tensor = logits.detach()
        self._pushforward: Callable[[tuple[Tensor]], tuple[Tensor, ...]] | None = None

    def _build(self, u: Tensor) -> Tensor:
        out, self._pushforward = vjp(self._pullback, u)[:2]
        return out[0].detach()  # type: ignore[no-any-return]

    def vjp(self, u: Tensor) -> Tensor:
        """``Jᵀ u = Σ_i J_iᵀ u_i`` for ``u`` shaped like the logits ``(N, A)``: shape ``(P,)``."""
        if self._pushforward is None:
            return self._build(u)
        (out,) = self._pullback(u)
        return out.detach()

    def jvp(self, v: Tensor) -> Tensor:
        """``J v`` for ``v`` of shape ``(P,)``: the logits' directional derivative ``(N, A)``."""
        if self._pushforward is None:
            self._build(torch.zeros_like(self.logits))
        assert self._pushforward is not None
        (out,) = self._pushforward((v,))
        return out.detach()


def subsample_indices(n: int, fraction: float, generator: torch.Generator) -> Tensor:
    """A fixed random subset of ``max(1, round(fraction · n))`` of ``range(n)``, sorted."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    k = max(1, round(fraction * n))
    return torch.randperm(n, generator=generator)[:k].sort().values


def served_metric(served: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """``M_i = D_iᵀ diag(1/P_i) D_i`` per row (N, A, A), ``P = served(logits)``, ``D_i = ∂P_i/∂z_i``.

    ``served`` maps logits (N, A) to the served probabilities (N, A) row by row (no coupling
    between rows, so the gradient of ``P[:, a].sum()`` is row ``a`` of every ``D_i``): one
    backward pass per action. Actions with ``P_ia = 0`` (blocked, or certain rows) carry no
    information and are dropped. Symmetric positive semi-definite; ``M_i 1 = 0`` whenever the
    decoder ignores a constant shift of the logits, as softmax does.
    """
    z = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        p = served(z)
        rows = [torch.autograd.grad(p[:, a].sum(), z, retain_graph=a + 1 < p.shape[1])[0] for a in range(p.shape[1])]
    d = torch.stack(rows, dim=1).detach().double()  # (N, A_out, A_in): d[i, a, k] = ∂P_ia / ∂z_ik
    pd = p.detach().double()
    inv = torch.where(pd > 0, 1.0 / torch.where(pd > 0, pd, 1.0), 0.0)
    return torch.einsum("iak,ia,ial->ikl", d, inv, d)


def centring(allowed: Tensor) -> Tensor:
    """Per row ``C_i = diag(a_i) − a_i a_iᵀ / |a_i|`` (N, A, A) for the allowed actions ``a_i`` (a bool (N, A)): the
    Euclidean metric of the logits on the allowed actions, less their mean (a shift of every logit changes nothing).
    ``uᵀ C_i u`` is ``centred_norm2``."""
    a = allowed.double()
    return torch.diag_embed(a) - a[:, :, None] * a[:, None, :] / a.sum(dim=1).clamp(min=1.0)[:, None, None]


def centred_norm2(u: Tensor, allowed: Tensor) -> Tensor:
    """Per row ``‖u_i − mean(u_i)‖²`` over the allowed actions (N,): ``uᵀ C_i u`` without the matrices."""
    a = allowed.double()
    mean = torch.where(allowed, u, 0.0).sum(dim=1) / a.sum(dim=1).clamp(min=1.0)
    return (torch.where(allowed, u - mean[:, None], 0.0) ** 2).sum(dim=1)


def _rows_of(served: Callable[[Tensor, Tensor], Tensor], rows: Tensor, logits: Tensor) -> Tensor:
    return served(logits, rows)


class GaussNewtonFisher:
    """The damped Fisher operator of one update: ``v ↦ F v + λ v``, forward pass done once.

    ``F v = (1/N) Σ_i J_iᵀ H_i J_i v`` with ``H_i u = q_i ⊙ u − q_i (q_iᵀ u)`` (see the module
    doc), ``q_i = softmax(z_i + g_i)`` at the ``θ`` the operator is built at (``θ_old``). Per
    call: one ``J v``, the per-state ``H_i``, one ``Jᵀ u``; no forward pass.

    Built on the states of its ``Linearization`` (which may also serve the surrogate's
    gradient, ``linearization.vjp(∂L/∂z)``, from the same forward pass); on a subset of them
    for the subsampled Fisher (``from_module(subsample=…)``). With a ``reducer`` the local
    mean ``F v`` (and ``sᵀ F s``) is averaged across ranks weighted by each rank's number of
    states, so every rank applies the Fisher of the union of the shards; damping is added
    after the reduction.
    """

    def __init__(self, linearization: Linearization, log_guard: Tensor, *, damping: float = 0.0, reducer: Reducer | None = None,
                 metric: Tensor | None = None) -> None:
        if damping < 0:
            raise ValueError(f"damping must be ≥ 0, got {damping}")
        check_guard(log_guard)
        self.linearization = linearization
        self.q: Tensor = masked_log_probs(linearization.logits, log_guard).exp()
        self.n_states: int = self.q.shape[0]
        if metric is not None and metric.shape != (self.n_states, self.q.shape[1], self.q.shape[1]):
            raise ValueError(f"metric: expected ({self.n_states}, {self.q.shape[1]}, {self.q.shape[1]}), got {tuple(metric.shape)}")
        self.metric = None if metric is None else metric.double()  # float64: the served Fisher is ill-conditioned
        """Per state ``M_i`` (logit space) in place of the categorical ``H_i``: the served distribution's Fisher."""
        self.damping = damping
        self.reducer: Reducer = reducer if reducer is not None else LocalReducer()

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        states: Tensor,
        log_guard: Tensor,
        *,
        damping: float = 0.0,
        subsample: float | None = None,
        generator: torch.Generator | None = None,
        reducer: Reducer | None = None,
        served: Callable[[Tensor, Tensor], Tensor] | None = None,
        rows: Tensor | None = None,
        logit_damping: float = 0.0,
    ) -> GaussNewtonFisher:
        """The operator at the module's current parameters, on all states or a random ``subsample`` fraction of them.

        ``generator`` draws the subset (default: seeded 0, so every call draws the same one); ``rows`` gives it
        instead (indices into ``states``: a keyed sample, the same rows on any sharding, ``trainer.minibatches``).
        ``served`` maps (logits, row indices into ``states``) to the served probabilities of
        those rows: given, the operator is the served distribution's Fisher (``served_metric``), plus
        ``logit_damping · C_i`` (``centring``): the metric of KL(P_old ‖ P) + κ/2 ‖Δz − mean Δz‖² (module doc;
        without ``served`` the categorical Fisher is never singular that way, and ``logit_damping`` is not used).
        """
        if not (logit_damping >= 0 and math.isfinite(logit_damping)):
            raise ValueError(f"logit_damping must be finite and ≥ 0, got {logit_damping}")
        idx = torch.arange(states.shape[0], device=states.device)
        if rows is not None:
            idx = rows.to(states.device)
            states, log_guard = states[idx], log_guard[idx]
        elif subsample is not None and subsample < 1.0:
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            idx = subsample_indices(states.shape[0], subsample, gen).to(states.device)
            states, log_guard = states[idx], log_guard[idx]
        lin = Linearization(logits_fn(module, states), flat_params(module))
        metric = None
        if served is not None:  # rows are independent: in chunks, so the decoder's graph stays small
            decode = served
            parts = [served_metric(functools.partial(_rows_of, decode, idx[i : i + METRIC_CHUNK]), lin.logits[i : i + METRIC_CHUNK])
                     for i in range(0, len(idx), METRIC_CHUNK)]
            metric = torch.cat(parts) if parts else None
            if metric is not None and logit_damping > 0:
                metric = metric + logit_damping * centring(torch.isfinite(log_guard))
        return cls(lin, log_guard, damping=damping, reducer=reducer, metric=metric)

    def _apply_metric(self, u: Tensor) -> Tensor:
        if self.metric is None:
            return categorical_fisher_product(self.q, u)
        return torch.einsum("ikl,il->ik", self.metric, u.to(self.metric.dtype)).to(u.dtype)

    def __call__(self, v: Tensor) -> Tensor:
        """``F v + λ v``, ``F`` averaged over the states (and the ranks)."""
        jv = self.linearization.jvp(v)
        fv = self.linearization.vjp(self._apply_metric(jv)) / max(self.n_states, 1)
        return self.reducer.weighted_mean(fv, self.n_states) + self.damping * v

    def curvature(self, s: Tensor) -> Tensor:
        """``sᵀ F s = (1/N) Σ_i (J_i s)ᵀ H_i (J_i s)``, undamped; one ``J s``, no ``Jᵀ u``.

        Twice the quadratic model of the KL of the step ``s``: ``KL(θ + s) ≈ ½ sᵀ F s``.
        """
        js = self.linearization.jvp(s)
        local = (js * self._apply_metric(js)).sum() / max(self.n_states, 1)
        return self.reducer.weighted_mean(local, self.n_states)
