"""Each layer's rule is an order of its candidates (``policy.product_rules``): its choice among any permitted set is the
first permitted in that order, the same as the rule's definition applied to that set (checked against the definitions
written out, on random shelves with ties), so a replay under another guard's vetoes knows what the rule would choose."""

from __future__ import annotations

import numpy as np
import pytest

from core.domain import DecisionRequest, PageType
from core.product import CategoryCandidate, PriceBand, ProductRequest, SkuCandidate
from policy import product_rules as rules

EMBEDDING = np.zeros(4, dtype=np.float32)
SHOPPER = DecisionRequest("user", "session", "item", EMBEDDING, (), PageType.SEARCH, 0.0, 0)


def _shelf(rng: np.random.Generator) -> ProductRequest:
    categories = []
    for c in range(int(rng.integers(1, 6))):
        skus = tuple(SkuCandidate(f"s{c}-{k}", EMBEDDING, float(rng.choice([50.0, 80.0, 100.0])), int(rng.integers(0, 3)),
                                  None if rng.random() < 0.3 else float(rng.choice([50.0, 80.0, 100.0])))
                     for k in range(int(rng.integers(1, 7))))
        categories.append(CategoryCandidate(f"c{c}", skus))
    bands = tuple(PriceBand(f"b{k}", float(rng.choice([0.8, 0.9, 1.0, 1.1, 1.2]))) for k in range(int(rng.integers(1, 6))))
    return ProductRequest(SHOPPER, tuple(categories), bands, int(rng.integers(0, 4)))


def test_the_first_permitted_in_each_rules_order_is_the_rules_choice() -> None:
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(300):
        shelf = _shelf(rng)
        for rank, keys in (
            (rules.category_rank(shelf), [(-c.in_stock, i) for i, c in enumerate(shelf.categories)]),
            *((rules.sku_rank(c), [(s.price / s.competitor_price if s.competitor_price else 1.0, s.price, i)
                                   for i, s in enumerate(c.skus)]) for c in shelf.categories),
            (rules.band_rank(shelf.price_bands), [(abs(b.price_multiplier - 1.0), b.price_multiplier, i)
                                                  for i, b in enumerate(shelf.price_bands)]),
        ):
            assert sorted(rank.tolist()) == list(range(len(keys)))  # a permutation: every candidate has one place
            for _ in range(4):
                permitted = rng.random(len(keys)) < 0.6
                if not permitted.any():
                    continue
                assert rules.first_permitted(rank, permitted) == min(k for k, ok in zip(keys, permitted, strict=True) if ok)[-1]
                checked += 1
    assert checked > 1000
    with pytest.raises(ValueError, match="no permitted candidate"):  # never a banned candidate, whatever the order
        rules.first_permitted(np.array([0, 1]), np.array([False, False]))
    rows = np.array([[2, 0, 1], [0, 1, 2]])
    assert rules.first_permitted_rows(rows, np.array([[True, False, True], [False, True, True]])).tolist() == [2, 1]
