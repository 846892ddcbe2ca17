"""The layered product decision without a model: each layer's guardrails, then its rule (``policy.product_rules``).

A bundle without product heads (every bundle of format 1 to today's) answers ``RecommendProduct`` this way, each layer
with ``source`` FALLBACK_NO_MODEL and its rule's name, with certainty (propensity 1): the rules are deterministic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from core.domain import Source
from core.product import LayerChoice, ProductDecision, ProductRequest
from policy import product_rules as rules


def by_rules(request: ProductRequest, model_version: str, source: Source = Source.FALLBACK_NO_MODEL) -> ProductDecision:
    """Every layer answered by its rule within its guardrails, in order (the SKU within the chosen category)."""
    category = certain(rules.category_rank(request), rules.category_permitted(request), rules.RULE_CATEGORY, source)
    chosen = request.categories[category.index]
    sku = certain(rules.sku_rank(chosen), rules.sku_permitted(chosen), rules.RULE_SKU, source)
    band = certain(rules.band_rank(request.price_bands), rules.band_permitted(request), rules.RULE_PRICE_BAND, source)
    return ProductDecision(category, sku, band, model_version)


def certain(rank: rules.Rank, permitted: npt.NDArray[np.bool_], rule: str, source: Source) -> LayerChoice:
    """The layer's rule's choice among ``permitted``, with certainty, as it is logged."""
    index = rules.first_permitted(rank, permitted)
    mask = tuple(permitted.tolist())
    return LayerChoice(index, 1.0, source, rule=rule, served=tuple(float(i == index) for i in range(len(permitted))),
                       permitted=mask, fallback=index, guardrail=mask, rule_rank=tuple(rank.tolist()))
