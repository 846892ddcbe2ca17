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
    category_ok = rules.category_permitted(request)
    category = rules.rule_category(request, category_ok)
    chosen = request.categories[category]
    sku_ok = rules.sku_permitted(chosen)
    sku = rules.rule_sku(chosen, sku_ok)
    band_ok = rules.band_permitted(request)
    band = rules.rule_band(request.price_bands, band_ok)

    def certain(index: int, permitted: npt.NDArray[np.bool_], rule: str) -> LayerChoice:
        return LayerChoice(index, 1.0, source, rule=rule, served=tuple(float(i == index) for i in range(len(permitted))),
                           permitted=tuple(permitted.tolist()), fallback=index)

    return ProductDecision(certain(category, category_ok, rules.RULE_CATEGORY), certain(sku, sku_ok, rules.RULE_SKU),
                           certain(band, band_ok, rules.RULE_PRICE_BAND), model_version)
