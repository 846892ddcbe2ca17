"""The peer of the layered product decision: one flat policy over every (category, SKU, band) the request offers.

What the reference design had before its split, built to compare fairly with ``RecommendProduct``'s layers:

- **the same inputs**: the start bundle's shared encoding h of the shopper (held fixed, as the layers hold it) and the
  same candidate features (``policy.product_features``: the category's, the SKU's, the band's for that SKU);
- **one head** scores each joint candidate: an MLP (HIDDEN + F_category + F_sku + F_band) → 32 → 32 → 1, as wide as one
  layer's head. Its first layer is linear in the concatenated features, so it is computed as the sum of per-part
  projections (the item embeddings projected once per catalogue row): the (candidates × features) matrix is never
  built, and a cycle's 30,000 decisions × 108 joint candidates fit in a few GB;
- **the same guardrails and decoding**: the joint candidates permitted are those every layer's guardrails permit; it is
  served by the same plurality vote (``policy.plurality``: K = 10 draws, 4 votes, ε-exploration), the rule engine's
  joint choice on low consensus;
- **the same learning**: ``trainer.product_update.trust_region_steps`` on the joint served propensity, the same
  reward (``trainer.product_data.rewards``), a cross-fitted baseline on h, and a trust region of δ = 0.10: the sum of
  the layers' (0.03 + 0.05 + 0.02), since a joint KL is the sum of the layers' conditional KLs.

Bench-only (``bench.product_learning``); it reads the simulator's catalogue to map a SKU id to its embedding row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from core.domain import Source
from core.product import LayerChoice, ProductDecision, ProductRequest
from experience.objective import BusinessObjective
from policy import product_rules as rules
from policy.plurality import PluralityDecoder
from policy.product_features import band_features
from policy.product_policy import masked_softmax
from simulator.items import Catalogue
from simulator.world import ShopperSession
from weights import mlp
from weights.product_heads import BAND_FEATURES, CATEGORY_EXTRA, HEAD_WIDTH, HIDDEN, SKU_EXTRA

DELTA = 0.10
KEYS = ("wh", "wce", "wcx", "wse", "wsx", "wb", "b1", "w2", "b2", "w3", "b3")


def init_flat(rng: np.random.Generator, item_dim: int) -> dict[str, npt.NDArray[np.float32]]:
    """He-uniform over the concatenated input width (as ``weights.mlp.init_params``), the output layer scaled by 0.1."""
    fan_in = HIDDEN + (item_dim + CATEGORY_EXTRA) + (item_dim + SKU_EXTRA) + BAND_FEATURES
    bound = np.sqrt(6.0 / fan_in)
    p = mlp.init_params(rng, [fan_in, HEAD_WIDTH, HEAD_WIDTH, 1])
    w1 = rng.uniform(-bound, bound, size=(fan_in, HEAD_WIDTH)).astype(np.float32)
    cuts = np.cumsum([HIDDEN, item_dim, CATEGORY_EXTRA, item_dim, SKU_EXTRA])
    wh, wce, wcx, wse, wsx, wb = np.split(w1, cuts)
    return {"wh": wh, "wce": wce, "wcx": wcx, "wse": wse, "wsx": wsx, "wb": wb, "b1": p["b1"], "w2": p["w2"], "b2": p["b2"],
            "w3": p["w3"] * np.float32(0.1), "b3": p["b3"]}


@dataclass
class JointInputs:
    """One request's joint candidates, padded to (C, S, B)."""

    items: npt.NDArray[np.int64]
    """(C, S) catalogue rows of the SKUs (0 where padded)."""
    sku_valid: npt.NDArray[np.bool_]
    category_extra: npt.NDArray[np.float32]
    sku_extra: npt.NDArray[np.float32]
    band: npt.NDArray[np.float32]
    permitted: npt.NDArray[np.bool_]
    rule: int


def joint_inputs(request: ProductRequest, catalogue: Catalogue, shape: tuple[int, int, int]) -> JointInputs:
    c_max, s_max, b_max = shape
    items = np.zeros((c_max, s_max), dtype=np.int64)
    valid = np.zeros((c_max, s_max), dtype=np.bool_)
    cat_x = np.zeros((c_max, CATEGORY_EXTRA), dtype=np.float32)
    sku_x = np.zeros((c_max, s_max, SKU_EXTRA), dtype=np.float32)
    band = np.zeros((c_max, s_max, b_max, BAND_FEATURES), dtype=np.float32)
    permitted = np.zeros((c_max, s_max, b_max), dtype=np.bool_)
    cat_ok = rules.category_permitted(request)
    band_ok = rules.band_permitted(request)
    nb = len(request.price_bands)
    for c, category in enumerate(request.categories):
        skus = category.skus
        prices = [s.price for s in skus]
        cat_x[c] = [np.log(np.mean(prices)), category.in_stock / len(skus), np.log(len(skus)), np.log1p(sum(s.stock for s in skus))]
        sku_ok = rules.sku_permitted(category)
        for s, sku in enumerate(skus):
            items[c, s] = catalogue.index[sku.sku_id]
            valid[c, s] = True
            sku_x[c, s] = [np.log(sku.price), float(sku.competitor_price is not None),
                           np.log(sku.price / sku.competitor_price) if sku.competitor_price else 0.0, np.log1p(sku.stock)]
            band[c, s, :nb] = band_features(request.price_bands, sku, request.visit_count == 1)
            permitted[c, s, :nb] = cat_ok[c] & sku_ok[s] & band_ok
    rc = rules.rule_category(request, cat_ok)
    rs = rules.rule_sku(request.categories[rc], rules.sku_permitted(request.categories[rc]))
    rb = rules.rule_band(request.price_bands, band_ok)
    return JointInputs(items, valid, cat_x, sku_x, band, permitted, int(np.ravel_multi_index((rc, rs, rb), (c_max, s_max, b_max))))


def logits_np(p: dict[str, npt.NDArray[np.float32]], h: npt.NDArray[np.float32], x: JointInputs,
              embeddings: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """(C·S·B) joint logits for one request (``h``: (HIDDEN,))."""
    emb = embeddings[x.items]  # (C, S, D)
    counts = np.maximum(x.sku_valid.sum(axis=1, keepdims=True), 1)
    cat_emb = (emb * x.sku_valid[..., None]).sum(axis=1) / counts
    pre = (h @ p["wh"] + p["b1"] + (cat_emb @ p["wce"] + x.category_extra @ p["wcx"])[:, None, None, :]
           + (emb @ p["wse"] + x.sku_extra @ p["wsx"])[:, :, None, :] + x.band @ p["wb"])
    z = np.maximum(np.maximum(pre, 0.0) @ p["w2"] + p["b2"], 0.0)
    out: npt.NDArray[np.float32] = (z @ p["w3"] + p["b3"])[..., 0].reshape(-1)
    return out


def served_joint(params: dict[str, npt.NDArray[np.float32]], h: npt.NDArray[np.float32], x: JointInputs,
                 embeddings: npt.NDArray[np.float32], decoder: PluralityDecoder) -> npt.NDArray[np.float64]:
    """The flat policy's served distribution over the joint candidates, shape (C, S, B)."""
    q = masked_softmax(logits_np(params, h, x, embeddings), x.permitted.reshape(-1))
    return decoder.served(q, x.rule).reshape(x.permitted.shape)


def layer_views(served: npt.NDArray[np.float64], c: int, s: int) -> dict[str, npt.NDArray[np.float64]]:
    """A joint served distribution as the layers see it: the category marginal, the SKU given category ``c``, the band
    given (``c``, ``s``)."""
    category = served.sum(axis=(1, 2))
    sku = served[c].sum(axis=1) / max(category[c], 1e-300)
    band = served[c, s] / max(served[c, s].sum(), 1e-300)
    return {"category": category, "sku": sku, "price_band": band}


@dataclass
class FlatChooser:
    """Serves the flat policy in ``simulator.drive`` (a ``OneProductChooser``) and keeps what a trainer needs of each decision."""

    params: dict[str, npt.NDArray[np.float32]]
    encode: Any
    """request, hour → h (HIDDEN,): the start bundle's product encoder."""
    catalogue: Catalogue
    decoder: PluralityDecoder
    shape: tuple[int, int, int]
    record: bool = True
    rows: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, session: ShopperSession, request: ProductRequest, hour: int, did: str) -> ProductDecision:
        h = self.encode(request, hour)
        x = joint_inputs(request, self.catalogue, self.shape)
        allowed = x.permitted.reshape(-1)
        q = masked_softmax(logits_np(self.params, h, x, self.catalogue.embeddings), allowed)
        served = self.decoder.served(q, x.rule)
        draw = self.decoder.draw(q, did)
        if draw.index is None:
            index, source = x.rule, Source.FALLBACK_LOW_CONSENSUS
        else:
            index, source = int(draw.index), Source.EXPLORATION if draw.explored else Source.POLICY
        c, s, b = (int(i) for i in np.unravel_index(index, self.shape))
        if self.record:
            paid = request.categories[c].skus[s].price * request.price_bands[b].price_multiplier
            self.rows.append({"decision_id": did, "session_id": request.shopper.session_id, "event_time_s": request.shopper.event_time_s,
                              "h": h, "x": x, "index": index, "propensity": float(served[index]), "paid": paid})
        choice = LayerChoice(c, float(served[index]), source)
        return ProductDecision(choice, LayerChoice(s, 1.0, source), LayerChoice(b, 1.0, source), "flat")


def train_flat(params: dict[str, npt.NDArray[np.float32]], rows: Sequence[dict[str, Any]], outcomes: pa.Table,
               embeddings: npt.NDArray[np.float32], delta: float = DELTA) -> tuple[dict[str, npt.NDArray[np.float32]], dict[str, Any]]:
    """Trust-region steps of the flat head on its recorded decisions, rewarded from ``outcomes`` (as the layers are)."""
    import torch

    from trainer.product_data import rewards
    from trainer.product_update import cross_fitted_advantage, trust_region_steps

    table = pa.table({k: [r[k] for r in rows] for k in ("decision_id", "session_id", "event_time_s")})
    reward, taken, _ = rewards(table, outcomes, np.array([r["paid"] for r in rows]), BusinessObjective().complaint_cost)
    h = np.stack([r["h"] for r in rows]).astype(np.float32)
    advantage = cross_fitted_advantage(np.concatenate([h, np.ones((len(h), 1), np.float32)], axis=1).astype(np.float64), reward,
                                       np.array([r["session_id"] for r in rows]))

    def stack(name: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([getattr(r["x"], name) for r in rows]))

    items, valid, cat_x, sku_x, band = stack("items"), stack("sku_valid"), stack("category_extra"), stack("sku_extra"), stack("band")
    permitted = stack("permitted").reshape(len(rows), -1)
    emb = torch.from_numpy(np.array(embeddings, dtype=np.float32))
    ht = torch.from_numpy(h)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    counts = valid.sum(dim=2, keepdim=True).clamp(min=1)

    def log_q() -> torch.Tensor:
        t = tensors
        sku_emb = (emb @ t["wse"])[items]  # (N, C, S, W): embeddings projected once per catalogue row
        cat_emb = ((emb @ t["wce"])[items] * valid[..., None]).sum(dim=2) / counts
        pre = ((ht @ t["wh"] + t["b1"])[:, None, None, None, :] + (cat_emb + cat_x @ t["wcx"])[:, :, None, None, :]
               + (sku_emb + sku_x @ t["wsx"])[:, :, :, None, :] + band @ t["wb"])
        z = torch.relu(torch.relu(pre) @ t["w2"] + t["b2"])
        logits = (z @ t["w3"] + t["b3"])[..., 0].reshape(len(rows), -1)
        return torch.log_softmax(logits.masked_fill(~permitted, -np.inf), dim=1)

    result = trust_region_steps([tensors[k] for k in KEYS], log_q, permitted, torch.tensor([r["index"] for r in rows]),
                                torch.from_numpy(advantage.astype(np.float32)),
                                torch.tensor([max(r["propensity"], 1e-6) for r in rows], dtype=torch.float32), delta)
    new = {k: v.detach().numpy().copy() for k, v in tensors.items()}
    return new, {"rows": len(rows), "kl": result.kl, "improvement": result.improvement, "steps": result.steps,
                 "mean_reward": float(reward.mean()), "taken": float(taken.mean()), "delta": delta}
