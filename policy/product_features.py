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
    """One row per category, from the stacked SKUs: each category's embeddings summed row by row in float64 (one
    ``sum(axis=0)`` a category: the bits of ``np.add.reduceat`` over the rows, at a third of its time, which reduces
    along the first axis slowly: 17 against 45 µs for 6 categories of 6 SKUs, 124 against 340 for 32 of 8), the
    other columns by ``np.add.reduceat`` over 1-D arrays."""
    counts = np.array([len(c.skus) for c in categories], dtype=np.float64)
    skus = [s for c in categories for s in c.skus]
    starts = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.intp)
    stacked = np.stack([s.embedding for s in skus]).astype(np.float64)
    embedding = np.empty((len(categories), stacked.shape[1]))
    for row, (start, category) in enumerate(zip(starts.tolist(), categories, strict=True)):
        stacked[start : start + len(category.skus)].sum(axis=0, out=embedding[row])
    embedding /= counts[:, None]
    price = np.array([s.price for s in skus])
    stock = np.array([s.stock for s in skus], dtype=np.float64)
    extra = np.stack([np.log(np.add.reduceat(price, starts) / counts), np.add.reduceat((stock > 0) * 1.0, starts) / counts,
                      np.log(counts), np.log1p(np.add.reduceat(stock, starts))], axis=1)
    return np.concatenate([embedding, extra], axis=1).astype(np.float32)


def band_features(bands: tuple[PriceBand, ...], sku: SkuCandidate, first_visit: bool) -> F32:
    multipliers = np.array([b.price_multiplier for b in bands])
    order = np.argsort(np.argsort(multipliers, kind="stable"), kind="stable")
    rank = order / (len(bands) - 1) if len(bands) > 1 else np.full(len(bands), 0.5)
    return np.stack([np.log(multipliers), rank, np.full(len(bands), float(first_visit)), np.log(sku.price * multipliers)],
                    axis=1).astype(np.float32)
