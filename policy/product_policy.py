"""The layered product decision with a model: category, then SKU within it, then price band, each sampled.

Each layer scores its candidates (``weights.product_heads``: the shared encoder's h beside each candidate's features,
``policy.product_features``), removes what its guardrails ban (``policy.product_rules``), and serves by the same
seeded, replayable majority vote as ``RecommendAction`` over any number of candidates (``policy.plurality``): with
probability ε an exploration draw from q^(1/T), else the most-voted of K draws, or the layer's rule when fewer than
``min_votes`` agree (``FALLBACK_LOW_CONSENSUS``). Each layer's uniforms come from the decision id and the layer's name,
so a logged decision replays exactly; each layer's propensity is the exact probability of its choice given the layers
before it, and the joint propensity is their product.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from core.domain import Source
from core.product import Layer, LayerChoice, ProductDecision, ProductRequest
from policy import product_rules as rules
from policy.plurality import PluralityDecoder
from policy.product_features import band_features, category_features, sku_features

F32 = npt.NDArray[np.float32]


class Heads(Protocol):
    def encode(self, states: F32) -> F32: ...

    def score(self, head: str, h: F32, features: F32) -> F32: ...


def masked_softmax(logits: F32, permitted: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """The softmax of ``logits`` over the permitted candidates (0 elsewhere); ``FloatingPointError`` on a non-finite logit."""
    z = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(z).all():
        raise FloatingPointError("a product head produced NaN or Inf for this input")
    z = np.where(permitted, z - z[permitted].max(), -np.inf)
    q = np.exp(z)
    return q / q.sum()


def layer_choice(decoder: PluralityDecoder, logits: F32, permitted: npt.NDArray[np.bool_], rule_index: int, rule: str,
                 stream: str) -> LayerChoice:
    """One layer's draw with its exact propensity; ``stream`` seeds its uniforms (the decision id and the layer)."""
    q = masked_softmax(logits, permitted)
    served = decoder.served(q, rule_index)
    draw = decoder.draw(q, stream)
    distribution, allowed = tuple(served.tolist()), tuple(permitted.tolist())
    if draw.index is None:
        return LayerChoice(rule_index, float(served[rule_index]), Source.FALLBACK_LOW_CONSENSUS, rule=rule, served=distribution,
                           permitted=allowed, fallback=rule_index)
    source = Source.EXPLORATION if draw.explored else Source.POLICY
    return LayerChoice(draw.index, float(served[draw.index]), source, votes=int(draw.counts[draw.index]), served=distribution,
                       permitted=allowed, fallback=rule_index)


def decide(heads: Heads, decoder: PluralityDecoder, state: F32, request: ProductRequest, decision_id: str,
           model_version: str) -> ProductDecision:
    """The three layers in order for one request (``state``: the shopper's encoded state, shape (1, S))."""
    h = heads.encode(state)
    permitted = rules.category_permitted(request)
    category = layer_choice(decoder, heads.score("category", h, category_features(request.categories)), permitted,
                            rules.rule_category(request, permitted), rules.RULE_CATEGORY, f"{decision_id}/{Layer.CATEGORY.value}")
    chosen = request.categories[category.index]
    permitted = rules.sku_permitted(chosen)
    sku = layer_choice(decoder, heads.score("sku", h, sku_features(chosen.skus)), permitted, rules.rule_sku(chosen, permitted),
                       rules.RULE_SKU, f"{decision_id}/{Layer.SKU.value}")
    permitted = rules.band_permitted(request)
    features = band_features(request.price_bands, chosen.skus[sku.index], request.visit_count == 1)
    band = layer_choice(decoder, heads.score("band", h, features), permitted, rules.rule_band(request.price_bands, permitted),
                        rules.RULE_PRICE_BAND, f"{decision_id}/{Layer.PRICE_BAND.value}")
    return ProductDecision(category, sku, band, model_version)
