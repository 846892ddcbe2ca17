"""The layered product decision's guardrails and rule engine, one per layer (no model needed).

Guardrails (what a layer may never serve, model or rule alike):

- a category with no SKU in stock, and a SKU with none in stock: nothing to sell;
- the top price band (the largest multiplier, when more than one band is offered) to a shopper on
  the first visit (``visit_count`` 1), or whose visits are unknown (0: it fails closed, since an
  omitted field must not switch a guardrail off): the reference design's own example of a guard, a
  first impression at the highest price costs more trust than it earns.

The rules (what a layer serves when its model cannot decide), each an order of the layer's candidates
(``*_rank``: every candidate's place in it, 0 first) whose choice is the first permitted candidate in that order
(``first_permitted``), so a replay under another bundle's vetoes knows what the rule would have chosen:

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
Rank = npt.NDArray[np.int64]

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


def _places(*keys: npt.ArrayLike) -> Rank:
    """Each candidate's place (0 first) in the order of ``keys``, the first key the most significant, then position."""
    order = np.lexsort((np.arange(len(np.asarray(keys[0]))), *reversed([np.asarray(k) for k in keys])))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank


def category_rank(request: ProductRequest) -> Rank:
    return _places([-c.in_stock for c in request.categories])


def sku_rank(category: CategoryCandidate) -> Rank:
    skus = category.skus
    return _places([s.price / s.competitor_price if s.competitor_price else 1.0 for s in skus], [s.price for s in skus])


def band_rank(bands: tuple[PriceBand, ...]) -> Rank:
    return _places([abs(b.price_multiplier - 1.0) for b in bands], [b.price_multiplier for b in bands])


def first_permitted(rank: Rank, permitted: Mask) -> int:
    """The rule's choice: the permitted candidate first in its order; ``ValueError`` when none is permitted (a rule
    must never answer with a banned candidate)."""
    if not permitted.any():
        raise ValueError("the rule has no permitted candidate to choose")
    return int(first_permitted_rows(rank, permitted))


def first_permitted_rows(rank: Rank, permitted: Mask) -> Rank:
    """``first_permitted`` along the last axis: of one row (n,), or of each row of (B, n); a row that permits none
    gets 0."""
    return np.argmin(np.where(permitted, rank, np.iinfo(np.int64).max), axis=-1)


def rule_category(request: ProductRequest, permitted: Mask) -> int:
    return first_permitted(category_rank(request), permitted)


def rule_sku(category: CategoryCandidate, permitted: Mask) -> int:
    return first_permitted(sku_rank(category), permitted)


def rule_band(bands: tuple[PriceBand, ...], permitted: Mask) -> int:
    return first_permitted(band_rank(bands), permitted)
