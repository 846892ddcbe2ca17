"""Train ``RecommendProduct``'s per-layer guards on the complaints the logged offers drew (``weights.product_guard``).

For each layer, every logged offer is one example: ``[h, the chosen candidate's features]`` (h from the new encoder,
the one the exported heads read) and whether a complaint was reported against the offer's decision. Each guard is the
guard-shaped MLP (``weights.product_guard``) fitted from a fresh start each run by logistic loss with an L2 penalty
(Adam, seeded minibatches, the best weights on a held fifth of the rows, ``_fit``): its output is a calibrated
complaint probability, which the server compares with ``product.guard.max_complaint``. The label is the offer's,
whatever layer caused it: a layer's guard learns the complaint rate of its candidates under the logged choices of the
layers after it. A vetoed candidate is never served and so never labelled: the previous guard's vetoes are carried as
soft labels (``carried``).

Judged on the product gate's held-out sessions, per layer: the complaint rate, the share of offers the guard would veto,
the complaint rate among those and among the rest, and the ranking quality (AUC). A guard is data like the heads: its
effect on what shoppers see is measured on the simulator (``bench.product_guard``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from trainer.guard_threshold import rank_auc
from trainer.product_data import HEAD_OF, LAYERS, ProductRows
from weights import mlp
from weights.product_guard import MAX_COMPLAINT, init_params
from weights.product_heads import HIDDEN, SKU_EXTRA

F32 = npt.NDArray[np.float32]
VALIDATION = 0.2
"""The share of a guard's training rows (seeded) whose loss picks the weights kept."""
CHECK_EVERY = 50
PATIENCE = 6
"""Checks without a better held loss after which training stops."""
EMBEDDED = ("category", "sku")
"""The heads whose candidate features start with an item embedding (``policy.product_features``)."""


@dataclass(frozen=True)
class GuardConfig:
    max_complaint: float = MAX_COMPLAINT
    steps: int = 2000
    batch: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-3
    embeddings: bool = False
    """Whether a guard reads the candidates' embeddings (category, SKU): off, it reads h and the candidates' few price,
    stock and band features, where complaints have their causes, and ~800 inputs learnt from rare complaints would
    mostly fit the training rows' embeddings."""

    def to_dict(self) -> dict[str, Any]:
        return {"max_complaint": self.max_complaint, "steps": self.steps, "batch": self.batch, "lr": self.lr,
                "weight_decay": self.weight_decay, "embeddings": self.embeddings}


def examples(rows: ProductRows, h: F32, layer: str) -> tuple[F32, npt.NDArray[np.float32]]:
    """Per logged offer, ``[h, the layer's chosen candidate's features]`` and 1.0 where it drew a complaint."""
    data = rows.layers[layer]
    chosen = data.features[np.arange(len(rows)), data.index]
    return np.concatenate([h, chosen], axis=1).astype(np.float32), (rows.complaints > 0).astype(np.float32)


SCALE_FLOOR = 0.01
"""The least scale a guard's input is standardised by, as a share of its mean's size (at least 1): ``input_scale``."""


def input_scale(x: F32) -> tuple[F32, F32]:
    """Each column's mean and the scale it is standardised by: its standard deviation, but at least ``SCALE_FLOOR`` ×
    max(|mean|, 1), and 1 for a column that does not vary. Folded into the exported weights (``folded``), a column that
    barely varies around a large mean would otherwise make the first layer add two float32 terms each thousands of times
    its result, and rounding then moves the logit (measured: a column 6,670 of its standard deviations from 0 failed a
    bundle's golden self-test by 1.8e-4; the floor keeps that ratio at most 1 / ``SCALE_FLOOR``)."""
    mean = x.mean(axis=0)
    spread = x.std(axis=0)
    scale = np.where(spread > 1e-6, np.maximum(spread, SCALE_FLOOR * np.maximum(np.abs(mean), 1.0)), 1.0)
    return mean.astype(np.float32), scale.astype(np.float32)


def _fit(params: mlp.Params, x: F32, y: npt.NDArray[np.float32], config: GuardConfig, seed: int,
         ignored: slice = slice(0, 0)) -> mlp.Params:
    """Logistic loss plus an L2 penalty on standardised inputs (a one-column signal such as log(price / competitor) is
    then as easy to find as a 768-d embedding's), minibatches of a seeded permutation, for at most ``config.steps``,
    keeping the weights of the best loss on a seeded ``VALIDATION`` share of the rows (checked every ``CHECK_EVERY``
    steps, stopping after ``PATIENCE`` checks without a better one): complaints are rare, so a guard of ~800 inputs
    would otherwise learn the training rows' embeddings by heart.
    The scaling is then folded into the first layer, so the exported graph reads the raw ``[h, features]``. Columns
    ``ignored`` (the candidates' embeddings, unless ``config.embeddings``) are left out of training and get 0 weights."""
    rng = np.random.default_rng([seed, 11])
    check = rng.random(len(x)) < VALIDATION
    if check.all() or not check.any():
        check[:] = False
    mean, scale = input_scale(x[~check])
    used = np.ones(x.shape[1], dtype=np.bool_)
    used[ignored] = False  # an input held at 0 moves nothing but its own weights' penalty: leave it out of the products
    names = ("w1", "b1", "w2", "b2", "w3", "b3")
    tensors = {k: torch.tensor(params[k][used] if k == "w1" else params[k], requires_grad=True) for k in names}
    optimiser = torch.optim.Adam(list(tensors.values()), lr=config.lr)
    z = torch.from_numpy(((x - mean) / scale)[:, used])
    xs, ys, xv, yv = z[torch.from_numpy(~check)], torch.from_numpy(y[~check]), z[torch.from_numpy(check)], torch.from_numpy(y[check])

    def loss_of(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        a = torch.relu(inputs @ tensors["w1"] + tensors["b1"])
        a = torch.relu(a @ tensors["w2"] + tensors["b2"])
        return torch.nn.functional.binary_cross_entropy_with_logits((a @ tensors["w3"] + tensors["b3"])[:, 0], labels)

    generator = torch.Generator().manual_seed(seed)
    order, at = torch.randperm(len(xs), generator=generator), 0
    best, kept, since = math.inf, {k: t.detach().clone() for k, t in tensors.items()}, 0
    for step in range(config.steps):
        if at >= len(order):
            order, at = torch.randperm(len(xs), generator=generator), 0
        batch, at = order[at:at + config.batch], at + config.batch
        penalty = sum((tensors[k] ** 2).sum() for k in ("w1", "w2", "w3"))
        loss = loss_of(xs[batch], ys[batch]) + config.weight_decay * penalty
        optimiser.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        if len(xv) and (step + 1) % CHECK_EVERY == 0:
            with torch.no_grad():
                held = float(loss_of(xv, yv))
            if held < best:
                best, kept, since = held, {k: t.detach().clone() for k, t in tensors.items()}, 0
            else:
                since += 1
                if since >= PATIENCE:  # no better for PATIENCE checks: the held rows say it has started to fit noise
                    break
    final = {k: t.detach() for k, t in tensors.items()}
    out = {k: t.numpy().astype(np.float32) for k, t in (kept if math.isfinite(best) else final).items()}
    w1 = np.zeros_like(params["w1"])
    w1[used] = out["w1"]
    return folded({**out, "w1": w1}, mean, scale, ignored)


def folded(params: mlp.Params, mean: F32, scale: F32, ignored: slice = slice(0, 0)) -> mlp.Params:
    """``params`` trained on ``(x − mean) / scale`` with the ``ignored`` columns held at 0, as weights that read the raw
    x: ``((x − mean) / scale) @ w1 + b1 = x @ (w1 / scale) + (b1 − (mean / scale) @ w1)``, the ignored rows 0 first
    (those inputs added nothing in training, so they may add nothing to the bias either)."""
    out = {k: v.copy() for k, v in params.items()}
    out["w1"][ignored] = 0.0
    out["b1"] = (out["b1"] - (mean / scale) @ out["w1"]).astype(np.float32)
    out["w1"] = (out["w1"] / scale[:, None]).astype(np.float32)
    return out


def judged(params: mlp.Params, x: F32, y: npt.NDArray[np.float32], max_complaint: float) -> dict[str, Any]:
    """A guard's figures on held-out offers."""
    p = 1.0 / (1.0 + np.exp(-mlp.policy_forward(params, x)[:, 0].astype(np.float64)))
    veto, complained = p > max_complaint, y > 0

    def rate(m: npt.NDArray[np.bool_]) -> float | None:
        return float(complained[m].mean()) if m.any() else None

    return {"offers": len(y), "complaint_rate": rate(np.ones(len(y), dtype=bool)), "vetoed_share": float(veto.mean()) if len(y) else None,
            "complaint_rate_vetoed": rate(veto), "complaint_rate_kept": rate(~veto), "mean_predicted": float(p.mean()) if len(y) else None,
            "auc": rank_auc(p, complained) if complained.any() and not complained.all() else None}  # null: JSON has no NaN


@dataclass(frozen=True)
class PreviousGuard:
    """The guards of the bundle being trained from, and the h they read (its encoder's, on the training rows)."""

    params: Mapping[str, mlp.Params]
    h: F32
    max_complaint: Mapping[str, float]


def carried(rows: ProductRows, h: F32, layer: str, previous: PreviousGuard) -> tuple[F32, npt.NDArray[np.float32]]:
    """The previous guard's vetoes as examples: every logged candidate the record did not permit (``valid`` and not
    ``permitted``: the guardrails' bans and the old guard's vetoes) that the old guard scores above its threshold, with
    its probability as a soft label. A vetoed candidate is never served, so no outcome ever labels it; without these a
    guard trained on a guarded bundle's traffic forgets what its predecessor vetoed (``bench.product_guard``)."""
    head, data = HEAD_OF[layer], rows.layers[layer]
    row, candidate = np.nonzero(data.valid & ~data.permitted)
    if not len(row):
        return np.zeros((0, h.shape[1] + data.features.shape[2]), np.float32), np.zeros(0, np.float32)
    features = data.features[row, candidate]
    old = mlp.policy_forward(previous.params[head], np.concatenate([previous.h[row], features], axis=1))[:, 0]
    p = 1.0 / (1.0 + np.exp(-old.astype(np.float64)))
    keep = p > previous.max_complaint[head]
    return np.concatenate([h[row[keep]], features[keep]], axis=1).astype(np.float32), p[keep].astype(np.float32)


def train_guards(rows: ProductRows, h: F32, held: ProductRows, h_held: F32, widths: Mapping[str, int],
                 config: GuardConfig | None = None, seed: int = 0,
                 previous: PreviousGuard | None = None) -> tuple[dict[str, mlp.Params], dict[str, Any]]:
    """One guard per layer (by head name) fitted on ``rows`` (and ``previous``'s vetoes, ``carried``) and judged on
    ``held``'s offers; their params and figures."""
    config = config or GuardConfig()
    start = init_params(np.random.default_rng([seed, 7]), dict(widths))
    params, report = {}, {"config": config.to_dict(), "layers": {}}
    item_dim = widths["sku"] - SKU_EXTRA
    for layer in LAYERS:
        head = HEAD_OF[layer]
        x, y = examples(rows, h, layer)
        extra = carried(rows, h, layer, previous) if previous is not None else (x[:0], y[:0])
        ignored = slice(HIDDEN, HIDDEN + item_dim) if head in EMBEDDED and not config.embeddings else slice(0, 0)
        fit_x, fit_y = np.concatenate([x, extra[0]]), np.concatenate([y, extra[1]])
        params[head] = _fit(start[head], fit_x, fit_y, config, seed, ignored) if len(fit_y) else start[head]
        report["layers"][layer] = {"train": judged(params[head], x, y, config.max_complaint), "carried": len(extra[1]),
                                   "held_out": judged(params[head], *examples(held, h_held, layer), config.max_complaint)}
    return params, report
