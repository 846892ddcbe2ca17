"""The item catalogue: hidden category and price per item, and an embedding built from them.

An item's embedding is ``embed_category · c[category] + embed_price · z(log price) · p + embed_noise · n``,
normalised to unit length, where ``c`` are random unit category directions, ``p`` a random
unit price direction, ``z`` the standardised log price and ``n`` Gaussian noise of norm about 1.
So a linear probe reads the category and the price level back, as from a real embedding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from simulator.config import SimConfig


@dataclass(frozen=True)
class Catalogue:
    """Built once per world; read by every session. The arrays are read-only."""

    item_ids: tuple[str, ...]
    embeddings: npt.NDArray[np.float32]  # (n_items, item_dim), unit-norm rows
    category: npt.NDArray[np.int64]  # (n_items,)
    price: npt.NDArray[np.float64]  # (n_items,)
    prices: tuple[float, ...]  # the same prices as Python floats, for the per-step code
    by_category: tuple[tuple[int, ...], ...]  # per category, its item indices by ascending price
    category_median: tuple[float, ...]  # per category, the median price of its items (nan for an empty one)
    index: Mapping[str, int]  # item id -> row

    @classmethod
    def build(cls, config: SimConfig, rng: np.random.Generator) -> Catalogue:
        n, d, k = config.n_items, config.item_dim, config.n_categories
        lo, hi = config.price_median_range
        category = rng.integers(0, k, size=n)
        log_median = rng.uniform(math.log(lo), math.log(hi), size=k)
        log_price = log_median[category] + config.price_sigma * rng.standard_normal(n)
        price = np.round(np.exp(log_price), 2).clip(1.0)
        directions = rng.standard_normal((k + 1, d))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        z_price = (log_price - log_price.mean()) / max(float(log_price.std()), 1e-9)
        emb = (
            config.embed_category * directions[category]
            + config.embed_price * z_price[:, None] * directions[k]
            + config.embed_noise * rng.standard_normal((n, d)) / math.sqrt(d)
        )
        emb /= np.linalg.norm(emb, axis=1, keepdims=True).clip(1e-12)
        embeddings = emb.astype(np.float32)
        order = np.argsort(price, kind="stable")
        by_category = tuple(tuple(int(i) for i in order[category[order] == c]) for c in range(k))
        for a in (embeddings, category, price):
            a.setflags(write=False)
        width = len(str(n - 1))
        item_ids = tuple(f"item-{i:0{width}d}" for i in range(n))
        return cls(
            item_ids=item_ids, index=MappingProxyType({item: i for i, item in enumerate(item_ids)}),
            embeddings=embeddings, category=category, price=price,
            prices=tuple(float(p) for p in price), by_category=by_category,
            category_median=tuple(float(np.median(price[list(rows)])) if rows else math.nan for rows in by_category),
        )
