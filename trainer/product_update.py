"""One natural-gradient step per product layer, each in its own trust region, the layers isolated from one another.

For layer ℓ (category, SKU, price band) with head parameters θ_ℓ, on logged rows (state s, the layer's candidates,
the logged choice a_ℓ, its behaviour probability μ_ℓ(a_ℓ), the reward r):

- **Its policy** q_ℓ is the head's softmax over the candidates its guardrails permitted (what the decoder samples from).
- **Its own advantage** A_ℓ = r − b_ℓ, where b_ℓ is a ridge regression of r on what the layer knows before it
  chooses: the shared encoding h(s) for the category; h and the chosen category's summary features for the SKU; h and
  the chosen SKU's price, stock and competitor features for the band. Each layer's baseline removes what the layers
  before it already decided, so a category's value does not drown the SKU's signal (the reference design's reason).
- **Its own off-policy ratio** ρ_ℓ = q_ℓ(a_ℓ | s; θ_ℓ) / μ_ℓ(a_ℓ) from the logged layer propensity, cut at
  ``max_ratio``; the surrogate L_ℓ(θ_ℓ) = mean(min(ρ_ℓ, max_ratio) · A_ℓ), the gradient of the sampling policy's value.
- **Its own trust region**: the step s = F_ℓ⁻¹ ∇L_ℓ (conjugate gradient on Fisher-vector products of the layer's mean
  KL(q_old ‖ q_θ), double back-propagation), scaled to KL = δ_ℓ and halved until the KL from the layer's starting
  policy is ≤ δ_ℓ and L_ℓ improves; up to ``ITERATIONS`` such steps, re-linearised, all within the same region: δ 0.03
  for the category, 0.05 for the SKU, 0.02 for the band by default (the reference design's).

**Gradients are stopped between layers**: each layer's loss is a function of its own head's parameters only (h is an
input, the other heads' outputs are never read), so a category step cannot move the SKU head (tested).

**The shared encoder is held fixed** (its trust region has radius 0): every layer reads the same h, and a change to h
would move all three layers at once, outside their own trust regions. Training it needs a region that bounds the sum
of the three layers' KL; that is not built (docs/training.md says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from trainer.product_data import HEAD_OF, LAYERS, ProductRows
from weights import mlp
from weights.product_heads import CATEGORY_EXTRA, SKU_EXTRA

DELTAS = {"category": 0.03, "sku": 0.05, "price_band": 0.02}
MAX_RATIO = 10.0
CG_ITERATIONS = 10
DAMPING = 1e-2
BACKTRACKS = 10
ITERATIONS = 5
RIDGE = 1.0
KEYS = ("w1", "b1", "w2", "b2", "w3", "b3")


@dataclass(frozen=True)
class LayerStep:
    layer: str
    kl: float
    improvement: float
    rows: int
    delta: float
    advantage_sd: float
    steps: int = 0
    """Natural-gradient steps taken (each within the region from the layer's starting policy)."""

    @property
    def accepted(self) -> bool:
        return self.steps > 0

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "kl": self.kl, "improvement": self.improvement, "rows": self.rows,
                "delta": self.delta, "advantage_sd": self.advantage_sd, "steps": self.steps}


def baseline_features(rows: ProductRows, h: npt.NDArray[np.float32], layer: str) -> npt.NDArray[np.float64]:
    """What layer ``layer`` knows before it chooses (module doc), with a constant."""
    n = len(rows)
    parts: list[npt.NDArray[Any]] = [h, np.ones((n, 1), dtype=np.float32)]
    if layer == "sku":
        cat = rows.layers["category"]
        parts.append(cat.features[np.arange(n), cat.index, -CATEGORY_EXTRA:])
    elif layer == "price_band":
        sku = rows.layers["sku"]
        parts.append(sku.features[np.arange(n), sku.index, -SKU_EXTRA:])
    return np.concatenate(parts, axis=1).astype(np.float64)


def cross_fitted_advantage(x: npt.NDArray[np.float64], r: npt.NDArray[np.float64], ridge: float = RIDGE) -> npt.NDArray[np.float64]:
    """r − a ridge regression of r on ``x``, cross-fitted on two halves (a row's baseline never saw its own reward)."""
    fold = np.arange(len(r)) % 2
    out = np.empty_like(r)
    for k in (0, 1):
        fit, apply = fold != k, fold == k
        xf = x[fit]
        coef = np.linalg.solve(xf.T @ xf + ridge * np.eye(x.shape[1]), xf.T @ r[fit])
        out[apply] = r[apply] - x[apply] @ coef
    return out


def advantages(rows: ProductRows, h: npt.NDArray[np.float32], layer: str) -> npt.NDArray[np.float64]:
    """Layer ``layer``'s own advantage: r − b_ℓ on what it knows before it chooses (``baseline_features``)."""
    return cross_fitted_advantage(baseline_features(rows, h, layer), rows.rewards)


class Head:
    """A product head's parameters as torch tensors: (HIDDEN + F) → 32 → 32 → 1 per candidate (``weights.product_heads``)."""

    def __init__(self, params: mlp.Params) -> None:
        self.params = [torch.tensor(np.asarray(params[k], dtype=np.float32), requires_grad=True) for k in KEYS]

    def logits(self, x: Tensor) -> Tensor:
        w1, b1, w2, b2, w3, b3 = self.params
        z = torch.relu(x @ w1 + b1)
        z = torch.relu(z @ w2 + b2)
        return (z @ w3 + b3)[..., 0]

    def to_params(self) -> mlp.Params:
        return {k: p.detach().numpy().copy() for k, p in zip(KEYS, self.params, strict=True)}


def _log_q(head: Head, x: Tensor, permitted: Tensor) -> Tensor:
    return torch.log_softmax(head.logits(x).masked_fill(~permitted, -math.inf), dim=1)


def _kl(old_log_q: Tensor, log_q: Tensor, permitted: Tensor) -> Tensor:
    p = old_log_q.exp()
    return torch.where(permitted, p * (old_log_q - log_q), torch.zeros_like(p)).sum(dim=1).mean()


def _conjugate_gradient(fvp: Any, b: Tensor, iterations: int) -> Tensor:
    x, r = torch.zeros_like(b), b.clone()
    p, rr = r.clone(), r @ r
    for _ in range(iterations):
        fp = fvp(p)
        alpha = rr / (p @ fp)
        x, r = x + alpha * p, r - alpha * fp
        new = r @ r
        if new < 1e-12:
            break
        p, rr = r + (new / rr) * p, new
    return x


@dataclass(frozen=True)
class RegionResult:
    kl: float
    improvement: float
    steps: int


def trust_region_steps(params: list[Tensor], log_q: Callable[[], Tensor], permitted: Tensor, chosen: Tensor, advantage: Tensor,
                       behaviour: Tensor, delta: float, max_ratio: float = MAX_RATIO, iterations: int = ITERATIONS) -> RegionResult:
    """Natural-gradient steps of ``params`` for a categorical policy over candidates, in one trust region.

    ``log_q()``: (N, K) log-probabilities under the current ``params`` (−∞ where not ``permitted``); the surrogate is
    mean(min(q(chosen)/behaviour, max_ratio) · advantage). Up to ``iterations`` steps, each re-linearised where the last
    one ended (a ReLU head's KL is far from quadratic: one step scaled to δ by the Fisher overshoots and is halved a long
    way), each accepted only while the KL from the *starting* policy stays within δ and the surrogate improves: the
    region bounds the whole run's move. A step that cannot be accepted is undone and ends the run."""
    def vector() -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    def assign(flat: Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].reshape(p.shape))
                offset += p.numel()

    def surrogate() -> Tensor:
        chosen_log_q = log_q().gather(1, chosen[:, None])[:, 0]
        return (torch.clamp(chosen_log_q.exp() / behaviour, max=max_ratio) * advantage).mean()

    with torch.no_grad():
        start_log_q = log_q()
        first = float(surrogate())
    kl_total, steps = 0.0, 0
    for _ in range(iterations):
        before = float(surrogate().detach())
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(surrogate(), params)])
        with torch.no_grad():
            here_log_q = log_q()
        kl_grad = torch.autograd.grad(_kl(here_log_q, log_q(), permitted), params, create_graph=True)
        flat_kl_grad = torch.cat([g.reshape(-1) for g in kl_grad])

        def fvp(v: Tensor, flat_kl_grad: Tensor = flat_kl_grad) -> Tensor:
            hv = torch.autograd.grad(flat_kl_grad @ v, params, retain_graph=True)
            return torch.cat([g.reshape(-1) for g in hv]) + DAMPING * v

        direction = _conjugate_gradient(fvp, grad, CG_ITERATIONS)
        curvature = float(direction @ fvp(direction))
        if not curvature > 0 or not math.isfinite(curvature):
            break
        here = vector()
        step = direction * math.sqrt(2.0 * delta / curvature)
        accepted = False
        for k in range(BACKTRACKS):
            assign(here + step * 0.5**k)
            with torch.no_grad():
                kl = float(_kl(start_log_q, log_q(), permitted))
                gain = float(surrogate()) - before
            if kl <= delta and gain > 0:
                accepted, kl_total = True, kl
                break
        if not accepted:
            assign(here)
            break
        steps += 1
    with torch.no_grad():
        improvement = float(surrogate()) - first
    return RegionResult(kl_total, improvement, steps)


def layer_step(head: Head, h: npt.NDArray[np.float32], rows: ProductRows, layer: str, delta: float,
               max_ratio: float = MAX_RATIO, iterations: int = ITERATIONS) -> LayerStep:
    """``trust_region_steps`` of ``head`` (layer ``layer``) on ``rows``, with the layer's own advantage and ratio; the
    other heads are not touched."""
    data = rows.layers[layer]
    n, c = data.features.shape[:2]
    x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
    permitted = torch.from_numpy(data.permitted)
    advantage = advantages(rows, h, layer)
    result = trust_region_steps(head.params, lambda: _log_q(head, x, permitted), permitted, torch.from_numpy(data.index),
                                torch.from_numpy(advantage.astype(np.float32)),
                                torch.from_numpy(np.maximum(data.propensity, 1e-6).astype(np.float32)), delta, max_ratio, iterations)
    return LayerStep(layer, result.kl, result.improvement, n, delta, float(advantage.std()), result.steps)


def update_heads(params: Mapping[str, mlp.Params], rows: ProductRows, deltas: Mapping[str, float] = DELTAS,
                 layers: tuple[str, ...] = LAYERS) -> tuple[dict[str, mlp.Params], list[LayerStep]]:
    """One step per layer in ``layers`` (each in its own region), the encoder held fixed; the other heads come back as
    they went in."""
    for layer in layers:
        if layer not in LAYERS:
            raise ValueError(f"layers: unknown layer {layer!r} (expected among {LAYERS})")
        if not deltas[layer] > 0:
            raise ValueError(f"deltas[{layer!r}]: expected > 0, got {deltas[layer]!r}")
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    out = {name: {k: np.array(v, copy=True) for k, v in p.items()} for name, p in params.items()}
    steps = []
    for layer in layers:
        head = Head(params[HEAD_OF[layer]])
        steps.append(layer_step(head, h, rows, layer, deltas[layer]))
        out[HEAD_OF[layer]] = head.to_params()
    return out, steps
