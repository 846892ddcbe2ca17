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

**The shared encoder** (``encoder_delta`` > 0) moves after the heads, in a region of its own on the *sum* of the
layers' KL: every layer reads the same h, so a change to h moves them all at once. With the new heads held fixed, its
surrogate is the sum of the surrogates of the layers that teach it (by default every stepped layer; ``encoder_layers``
below), each with its own advantage and ratio, and its steps are the same natural-gradient steps, with the Fisher of
the summed KL: Σ_ℓ KL(q_ℓ ‖ q_ℓ') ≤ δ_encoder, measured from the policies after the heads' steps. KL has no triangle
inequality, so the two regions do not add up to a bound on a layer's whole move; each layer's KL from its starting
policy after both is measured and reported (``kl_from_start``). The heads' parameters are never moved by another
layer's loss; the encoder's are moved by those of every layer that teaches it. With ``encoder_delta`` 0
(``update_heads``' default; the trainer's is ``ENCODER_DELTA``, 0.02) the encoder is held fixed and a layer's whole
move is its head's, within δ_ℓ. ``encoder_layers`` names the layers whose data teach the encoder: a layer left out
enters its step with a zero advantage and its head as it *started* (so its KL in the region is measured under that
head), and its data cannot reach the other layers through the encoder. Leaving the category out costs some learning
(``bench.product_stability``, ``docs/performance.md``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from trainer.advantages import baseline_folds
from trainer.product_data import HEAD_OF, LAYERS, ProductRows
from weights import mlp
from weights.product_heads import CATEGORY_EXTRA, SKU_EXTRA

DELTAS = {"category": 0.03, "sku": 0.05, "price_band": 0.02}
ENCODER_DELTA = 0.02
"""The trainer's default region for the shared encoder on the sum of the layers' mean KL (module doc; ``update_heads``
itself holds it fixed unless asked). On the simulator it gained +6.6 per session over four cycles against a fixed
encoder (``docs/performance.md``, *Product learning*)."""
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
    kl_from_start: float | None = None
    """With the encoder moved too: the layer's mean KL from its starting policy after both steps (None: as ``kl``)."""
    taught: tuple[str, ...] | None = None
    """The encoder's step only: the layers whose data taught it (``advantage_sd`` is over theirs)."""

    @property
    def accepted(self) -> bool:
        return self.steps > 0

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "kl": self.kl, "improvement": self.improvement, "rows": self.rows,
                "delta": self.delta, "advantage_sd": self.advantage_sd, "steps": self.steps,
                **({} if self.kl_from_start is None else {"kl_from_start": self.kl_from_start}),
                **({} if self.taught is None else {"taught": list(self.taught)})}


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


def cross_fitted_advantage(x: npt.NDArray[np.float64], r: npt.NDArray[np.float64], sessions: npt.NDArray[Any],
                           ridge: float = RIDGE, seed: int = 0) -> npt.NDArray[np.float64]:
    """r − a ridge regression of r on ``x``, cross-fitted on two halves of the sessions (``sessions``: each row's, split
    by ``baseline_folds`` keyed by ``seed``, the run's): a row's baseline never saw its own reward, nor its session's
    other offers', which share the session's orders."""
    fold = baseline_folds(np.asarray(sessions), seed)
    out = np.empty_like(r)
    for k in (False, True):
        fit, apply = fold != k, fold == k
        xf = x[fit]
        coef = np.linalg.solve(xf.T @ xf + ridge * np.eye(x.shape[1]), xf.T @ r[fit])
        out[apply] = r[apply] - x[apply] @ coef
    return out


def advantages(rows: ProductRows, h: npt.NDArray[np.float32], layer: str, seed: int = 0) -> npt.NDArray[np.float64]:
    """Layer ``layer``'s own advantage: r − b_ℓ on what it knows before it chooses (``baseline_features``), its folds
    keyed by ``seed``."""
    return cross_fitted_advantage(baseline_features(rows, h, layer), rows.rewards, rows.sessions, seed=seed)


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
    mean(min(q(chosen)/behaviour, max_ratio) · advantage). For several policies at once (the encoder's step), ``log_q``
    holds their blocks side by side, each normalised on its own, and ``chosen``, ``behaviour``, ``advantage`` are
    (N, L), one column per policy: the surrogate is the sum of theirs and the KL (summed over the columns) the sum of
    theirs. Up to ``iterations`` steps, each re-linearised where the last
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

    columns = chosen.reshape(len(chosen), -1)  # one chosen column per row, or one per layer of a joint policy

    def surrogate() -> Tensor:
        chosen_log_q = log_q().gather(1, columns).reshape(behaviour.shape)
        return (torch.clamp(chosen_log_q.exp() / behaviour, max=max_ratio) * advantage).mean(dim=0).sum()

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
               advantage: npt.NDArray[np.float64], max_ratio: float = MAX_RATIO, iterations: int = ITERATIONS) -> LayerStep:
    """``trust_region_steps`` of ``head`` (layer ``layer``) on ``rows``, with the layer's ``advantage`` per row (its own:
    ``advantages``, as ``update_heads`` computes them) and its ratio; the other heads are not touched."""
    data = rows.layers[layer]
    n, c = data.features.shape[:2]
    x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
    permitted = torch.from_numpy(data.permitted)
    result = trust_region_steps(head.params, lambda: _log_q(head, x, permitted), permitted, torch.from_numpy(data.index),
                                torch.from_numpy(advantage.astype(np.float32)),
                                torch.from_numpy(np.maximum(data.propensity, 1e-6).astype(np.float32)), delta, max_ratio, iterations)
    return LayerStep(layer, result.kl, result.improvement, n, delta, float(advantage.std()), result.steps)


def encoder_step(params: Mapping[str, mlp.Params], rows: ProductRows, advantage: Mapping[str, npt.NDArray[np.float64]],
                 delta: float, layers: tuple[str, ...] = LAYERS, max_ratio: float = MAX_RATIO,
                 iterations: int = ITERATIONS) -> tuple[mlp.Params, LayerStep]:
    """``trust_region_steps`` of the shared encoder with every head held fixed: the surrogates of ``layers`` summed, their
    KLs summed within ``delta`` (module doc). The heads' first layer is split into its h part and its candidate part;
    the candidate part is fixed, so it is computed once, and h is the only input that carries a gradient. (A layer not in
    ``layers`` reads h too and moves with it, unreported: the trainer steps all three.)"""
    n = len(rows)
    encoder = [torch.tensor(np.asarray(params["encoder"][k], dtype=np.float32), requires_grad=True) for k in KEYS]
    states = torch.from_numpy(np.ascontiguousarray(rows.states, dtype=np.float32))
    fixed, offsets, offset = [], [], 0
    with torch.no_grad():
        for layer in layers:
            head = [torch.tensor(np.asarray(params[HEAD_OF[layer]][k], dtype=np.float32)) for k in KEYS]  # a copy: may be read-only
            data = rows.layers[layer]
            width = encoder[4].shape[1]  # HIDDEN: the rows of the head's w1 that read h
            candidates = torch.from_numpy(data.features) @ head[0][width:] + head[1]  # (N, C, 32): fixed
            fixed.append((head, candidates, torch.from_numpy(data.permitted)))
            offsets.append(offset)
            offset += data.permitted.shape[1]

    def log_q() -> Tensor:
        w1, b1, w2, b2, w3, b3 = encoder
        h = torch.relu(states @ w1 + b1)
        h = torch.relu(h @ w2 + b2) @ w3 + b3
        blocks = []
        for head, candidates, permitted in fixed:
            z = torch.relu((h @ head[0][: h.shape[1]])[:, None, :] + candidates)
            z = torch.relu(z @ head[2] + head[3])
            logits = (z @ head[4] + head[5])[..., 0]
            blocks.append(torch.log_softmax(logits.masked_fill(~permitted, -math.inf), dim=1))
        return torch.cat(blocks, dim=1)

    permitted = torch.cat([p for _, _, p in fixed], dim=1)
    chosen = torch.stack([torch.from_numpy(rows.layers[layer].index.astype(np.int64)) + o for layer, o in zip(layers, offsets,
                                                                                                          strict=True)], dim=1)
    behaviour = torch.from_numpy(np.stack([np.maximum(rows.layers[layer].propensity, 1e-6) for layer in layers], axis=1)
                                 .astype(np.float32))
    gains = torch.from_numpy(np.stack([advantage[layer] for layer in layers], axis=1).astype(np.float32))
    result = trust_region_steps(encoder, log_q, permitted, chosen, gains, behaviour, delta, max_ratio, iterations)
    moved = {k: p.detach().numpy().copy() for k, p in zip(KEYS, encoder, strict=True)}
    return moved, LayerStep("encoder", result.kl, result.improvement, n, delta, float(gains.std()), result.steps)


def update_heads(params: Mapping[str, mlp.Params], rows: ProductRows, deltas: Mapping[str, float] = DELTAS,
                 layers: tuple[str, ...] = LAYERS, encoder_delta: float = 0.0,
                 advantage: Mapping[str, npt.NDArray[np.float64]] | None = None,
                 encoder_layers: tuple[str, ...] | None = None, seed: int = 0) -> tuple[dict[str, mlp.Params], list[LayerStep]]:
    """One step per layer in ``layers`` (each in its own region), then, with ``encoder_delta`` > 0, one of the shared
    encoder under the new heads (module doc); the other heads come back as they went in. ``advantage``: each layer's
    advantage per row instead of its own (``advantages``), for a counterfactual in which only one layer's data changes
    (``bench.product_stability``). ``encoder_layers`` (default: ``layers``): the layers whose data the encoder learns
    from. For the others, its step sees a zero advantage and their heads as they *started* (their new heads are what
    their data made), so nothing of their data reaches the encoder, nor through it the other layers; their KL still
    counts in its region, measured under those starting heads, and their whole move after both steps is measured
    (``kl_from_start``). ``seed`` (the run's) keys the advantages' cross-fitting folds."""
    encoder_layers = layers if encoder_layers is None else encoder_layers
    for layer in layers:
        if layer not in LAYERS:
            raise ValueError(f"layers: unknown layer {layer!r} (expected among {LAYERS})")
        if not deltas[layer] > 0:
            raise ValueError(f"deltas[{layer!r}]: expected > 0, got {deltas[layer]!r}")
    if not encoder_layers or not set(encoder_layers) <= set(layers):
        raise ValueError(f"encoder_layers: expected some of the layers stepped {layers}, got {encoder_layers}")
    if not (encoder_delta >= 0 and math.isfinite(encoder_delta)):
        raise ValueError(f"encoder_delta: expected >= 0, got {encoder_delta!r}")
    h = mlp.policy_forward(params["encoder"], rows.states).astype(np.float32)
    out = {name: {k: np.array(v, copy=True) for k, v in p.items()} for name, p in params.items()}
    if advantage is not None and not set(layers) <= set(advantage):
        raise ValueError(f"advantage: expected one per layer stepped {layers}, got {sorted(advantage)}")
    gains = {layer: advantages(rows, h, layer, seed) if advantage is None else np.asarray(advantage[layer], dtype=np.float64)
             for layer in layers}
    for layer, a in gains.items():
        if a.shape != (len(rows),):
            raise ValueError(f"advantage[{layer!r}]: expected {len(rows)} rows, got shape {a.shape}")
    steps = []
    for layer in layers:
        head = Head(params[HEAD_OF[layer]])
        steps.append(layer_step(head, h, rows, layer, deltas[layer], gains[layer]))
        out[HEAD_OF[layer]] = head.to_params()
    if encoder_delta > 0:
        taught = {layer: gains[layer] if layer in encoder_layers else np.zeros(len(rows)) for layer in layers}
        under = {**out, **{HEAD_OF[layer]: params[HEAD_OF[layer]] for layer in layers if layer not in encoder_layers}}
        out["encoder"], step = encoder_step(under, rows, taught, encoder_delta, layers)
        step = dataclasses.replace(step, taught=tuple(encoder_layers),
                                   advantage_sd=float(np.concatenate([gains[layer] for layer in encoder_layers]).std()))
        moved = mlp.policy_forward(out["encoder"], rows.states).astype(np.float32)
        steps = [dataclasses.replace(s, kl_from_start=layer_kl(params, h, out, moved, rows, s.layer)) for s in steps]
        steps.append(step)
    return out, steps


def layer_kl(before: Mapping[str, mlp.Params], h_before: npt.NDArray[np.float32], after: Mapping[str, mlp.Params],
             h_after: npt.NDArray[np.float32], rows: ProductRows, layer: str) -> float:
    """Layer ``layer``'s mean KL(q_before ‖ q_after) over ``rows`` (each side with its own encoding h and head)."""
    data = rows.layers[layer]
    n, c = data.features.shape[:2]
    permitted = torch.from_numpy(data.permitted)

    def log_q(params: Mapping[str, mlp.Params], h: npt.NDArray[np.float32]) -> Tensor:
        x = torch.from_numpy(np.concatenate([np.broadcast_to(h[:, None, :], (n, c, h.shape[1])), data.features], axis=2))
        return _log_q(Head(params[HEAD_OF[layer]]), x, permitted)

    with torch.no_grad():
        return float(_kl(log_q(before, h_before), log_q(after, h_after), permitted))
