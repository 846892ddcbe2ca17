"""Each product layer's candidate features, from a validated ``ProductRequest`` (``weights.product_heads`` reads them).

- **SKU** (one row per SKU of a category): its embedding, log price, whether a competitor price is known, log(price /
  competitor price) (0 when unknown), log(1 + stock).
- **Category**: the mean of its SKUs' embeddings, log of their mean price, the share in stock, log(SKU count),
  log(1 + total stock).
- **Price band** (for the SKU chosen): log multiplier, its rank among the bands offered (0 the lowest, 1 the highest;
  ½ for a single band), whether this is the shopper's first visit, log(the price paid: the SKU's × the multiplier).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from core.product import CategoryCandidate, PriceBand, SkuCandidate

F32 = npt.NDArray[np.float32]


def sku_features(skus: tuple[SkuCandidate, ...]) -> F32:
    extra = np.array([[math.log(s.price), float(s.competitor_price is not None),
                       math.log(s.price / s.competitor_price) if s.competitor_price else 0.0, math.log1p(s.stock)] for s in skus])
    return np.concatenate([np.stack([s.embedding for s in skus]), extra], axis=1).astype(np.float32)


def category_features(categories: tuple[CategoryCandidate, ...]) -> F32:
    rows = []
    for c in categories:
        embedding = np.mean(np.stack([s.embedding for s in c.skus]), axis=0)
        extra = [math.log(float(np.mean([s.price for s in c.skus]))), c.in_stock / len(c.skus), math.log(len(c.skus)),
                 math.log1p(sum(s.stock for s in c.skus))]
        rows.append(np.concatenate([embedding, extra]))
    return np.asarray(rows, dtype=np.float32)


def band_features(bands: tuple[PriceBand, ...], sku: SkuCandidate, first_visit: bool) -> F32:
    multipliers = np.array([b.price_multiplier for b in bands])
    order = np.argsort(np.argsort(multipliers, kind="stable"), kind="stable")
    rank = order / (len(bands) - 1) if len(bands) > 1 else np.full(len(bands), 0.5)
    return np.stack([np.log(multipliers), rank, np.full(len(bands), float(first_visit)), np.log(sku.price * multipliers)],
                    axis=1).astype(np.float32)
