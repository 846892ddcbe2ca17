"""Each product layer's candidate features (``policy.product_features``), against plain per-candidate arithmetic."""

from __future__ import annotations

import math

import numpy as np

from core.product import CategoryCandidate, SkuCandidate
from policy.product_features import category_features


def _categories(sizes: list[int], seed: int = 3) -> tuple[CategoryCandidate, ...]:
    rng = np.random.default_rng(seed)
    return tuple(CategoryCandidate(f"c{c}", tuple(
        SkuCandidate(f"s{c}-{k}", rng.standard_normal(768).astype(np.float32), float(rng.uniform(5.0, 500.0)),
                     int(rng.integers(0, 4))) for k in range(n))) for c, n in enumerate(sizes))


def test_a_categorys_row_is_its_own_skus_mean_embedding_and_statistics_bit_for_bit() -> None:
    categories = _categories([6, 1, 13, 2, 40])  # uneven: every category reduced over its own rows only
    features = category_features(categories)
    assert features.shape == (5, 768 + 4) and features.dtype == np.float32
    for row, category in zip(features, categories, strict=True):
        embeddings = np.stack([s.embedding for s in category.skus]).astype(np.float64)
        prices = [s.price for s in category.skus]
        stock = [s.stock for s in category.skus]
        expected = np.concatenate([embeddings.mean(axis=0),
                                   [math.log(sum(prices) / len(prices)), sum(q > 0 for q in stock) / len(stock),
                                    math.log(len(stock)), math.log1p(sum(stock))]]).astype(np.float32)
        assert np.array_equal(row[:768], expected[:768])  # the same float64 sums, row by row, then the same rounding
        np.testing.assert_allclose(row[768:], expected[768:], rtol=1e-6)
