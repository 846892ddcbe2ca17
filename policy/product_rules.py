"""The layered product decision's guardrails and rule engine, one per layer (no model needed).

Guardrails (what a layer may never serve, model or rule alike):

- a category with no SKU in stock, and a SKU with none in stock: nothing to sell;
- the top price band (the largest multiplier, when more than one band is offered) to a shopper on
  the first visit (``visit_count`` 1), or whose visits are unknown (0: it fails closed, since an
  omitted field must not switch a guardrail off): the reference design's own example of a guard, a
  first impression at the highest price costs more trust than it earns.

The rules (what a layer serves when its model cannot decide):

- category: the one with the most SKUs in stock (ties: the first offered) — the widest choice;
- SKU: the best deal in stock, the lowest price relative to the competitor's (1 where unknown),
  then the lower price, then the first offered;
- price band: the permitted band whose multiplier is closest to 1 (the list price), then the lower
  multiplier, then the first offered.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from core.product import CategoryCandidate, PriceBand, ProductRequest

Mask = npt.NDArray[np.bool_]

RULE_CATEGORY = "category_most_in_stock"
RULE_SKU = "sku_best_deal"
RULE_PRICE_BAND = "price_band_nearest_list"


def category_permitted(request: ProductRequest) -> Mask:
    return np.array([c.in_stock > 0 for c in request.categories], dtype=np.bool_)


def sku_permitted(category: CategoryCandidate) -> Mask:
    return np.array([s.stock > 0 for s in category.skus], dtype=np.bool_)


def band_permitted(request: ProductRequest) -> Mask:
    bands = request.price_bands
    allowed = np.ones(len(bands), dtype=np.bool_)
    if request.visit_count <= 1 and len(bands) > 1:  # a first visit, or unknown
        multipliers = np.array([b.price_multiplier for b in bands])
        allowed &= multipliers < multipliers.max()  # every band at the top multiplier
        if not allowed.any():  # all bands at one multiplier: none is above another
            allowed[:] = True
    return allowed


def rule_category(request: ProductRequest, permitted: Mask) -> int:
    stock = np.array([c.in_stock for c in request.categories])
    return int(np.argmax(np.where(permitted, stock, -1)))


def rule_sku(category: CategoryCandidate, permitted: Mask) -> int:
    keys = [(s.price / s.competitor_price if s.competitor_price else 1.0, s.price, i)
            for i, s in enumerate(category.skus) if permitted[i]]
    return min(keys)[2]


def rule_band(bands: tuple[PriceBand, ...], permitted: Mask) -> int:
    keys = [(abs(b.price_multiplier - 1.0), b.price_multiplier, i) for i, b in enumerate(bands) if permitted[i]]
    return min(keys)[2]
