"""The layered product decision without a model: each layer's guardrails, then its rule (``policy.product_rules``).

A bundle without product heads (every bundle of format 1 to today's) answers ``RecommendProduct`` this way, each layer
with ``source`` FALLBACK_NO_MODEL and its rule's name, with certainty (propensity 1): the rules are deterministic.
"""

from __future__ import annotations

from core.domain import Source
from core.product import LayerChoice, ProductDecision, ProductRequest
from policy import product_rules as rules


def by_rules(request: ProductRequest, model_version: str, source: Source = Source.FALLBACK_NO_MODEL) -> ProductDecision:
    """Every layer answered by its rule within its guardrails, in order (the SKU within the chosen category)."""
    category = rules.rule_category(request, rules.category_permitted(request))
    chosen = request.categories[category]
    sku = rules.rule_sku(chosen, rules.sku_permitted(chosen))
    band = rules.rule_band(request.price_bands, rules.band_permitted(request))
    def certain(index: int, count: int, rule: str) -> LayerChoice:
        return LayerChoice(index, 1.0, source, rule=rule, served=tuple(float(i == index) for i in range(count)))

    return ProductDecision(certain(category, len(request.categories), rules.RULE_CATEGORY),
                           certain(sku, len(chosen.skus), rules.RULE_SKU),
                           certain(band, len(request.price_bands), rules.RULE_PRICE_BAND), model_version)
