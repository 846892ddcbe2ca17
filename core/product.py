"""The layered product decision's types: candidates a request offers, and what each layer chose.

``RecommendProduct`` decides in three layers, each conditioned on the ones before: a category
among those offered, a SKU within it, a price band. A request carries the candidates (the shop's
catalogue and pricing services know them; the model does not) and the shopper's state, validated
as a ``RecommendAction`` request (``server.product_validation``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from core.domain import DecisionRequest, Source

MAX_CATEGORIES = 32
MAX_SKUS_PER_CATEGORY = 64
MAX_SKUS = 256
MAX_PRICE_BANDS = 8
"""A request's candidate limits (``server.product_validation``); a bundle's product heads are run at these sizes when it
is loaded (``weights.product_heads``), so what a head allocates for the largest request is known before it serves."""
MIN_PRICE, MAX_PRICE = 0.01, 1_000_000.0  # a cent to a million: the features take logs of prices and their ratios
MIN_MULTIPLIER, MAX_MULTIPLIER = 0.01, 10.0
"""A request's price and price-band multiplier limits (``server.product_validation``); the price a band asks is their
product, so its logged log (``policy.product_features.band_features``) lies within their logs' sum
(``trainer.product_checks``)."""


class Layer(enum.Enum):
    """The layers, in the order they decide."""

    CATEGORY = "category"
    SKU = "sku"
    PRICE_BAND = "price_band"


LAYERS = tuple(Layer)


@dataclass(frozen=True, slots=True)
class SkuCandidate:
    sku_id: str
    embedding: npt.NDArray[np.float32]
    price: float
    stock: int
    competitor_price: float | None = None


@dataclass(frozen=True, slots=True)
class CategoryCandidate:
    category_id: str
    skus: tuple[SkuCandidate, ...]

    @property
    def in_stock(self) -> int:
        return sum(1 for s in self.skus if s.stock > 0)


@dataclass(frozen=True, slots=True)
class PriceBand:
    band_id: str
    price_multiplier: float


@dataclass(frozen=True, slots=True)
class ProductRequest:
    """A validated ``RecommendProductRequest``: every candidate list non-empty, ids unique, at least one SKU in stock."""

    shopper: DecisionRequest
    categories: tuple[CategoryCandidate, ...]
    price_bands: tuple[PriceBand, ...]
    visit_count: int = 0
    """Visits including this one; 0: unknown."""


@dataclass(frozen=True, slots=True)
class LayerChoice:
    """What one layer served: the candidate's position, its probability given the layers before, and why."""

    index: int
    propensity: float
    source: Source
    votes: int = 0
    rule: str = ""
    served: tuple[float, ...] = ()
    """The probability of serving each of the layer's candidates (the behaviour policy the logs keep)."""
    permitted: tuple[bool, ...] = ()
    """Which candidates the layer could serve: what its guardrails let through less what the bundle's guard vetoed (when
    the guard vetoed all of them, the rule's candidate alone)."""
    fallback: int = -1
    """The layer's rule's choice (served on low consensus): with ``permitted``, what a replay needs besides the scores."""
    vetoed: int = 0
    """How many candidates the guardrails permit that the bundle's learned guard vetoed (``permitted`` excludes them)."""
    guardrail: tuple[bool, ...] = ()
    """Which candidates the guardrails alone let through (before any guard): with ``rule_rank``, what a replay under
    another bundle's guard needs."""
    rule_rank: tuple[int, ...] = ()
    """Each candidate's place in the layer's rule's order (``policy.product_rules``): the rule chooses the first one
    permitted, whatever the vetoes."""


@dataclass(frozen=True, slots=True)
class ProductDecision:
    category: LayerChoice
    sku: LayerChoice
    price_band: LayerChoice
    model_version: str

    @property
    def joint_propensity(self) -> float:
        """The probability of the whole (category, SKU, band): each layer's is conditional on those before."""
        return self.category.propensity * self.sku.propensity * self.price_band.propensity

    def choices(self) -> tuple[tuple[Layer, LayerChoice], ...]:
        return (Layer.CATEGORY, self.category), (Layer.SKU, self.sku), (Layer.PRICE_BAND, self.price_band)
