"""``RecommendProductRequest`` validation: the wire message becomes a ``ProductRequest`` or an ``InvalidRequest``.

The shopper is checked as a ``RecommendActionRequest`` (its errors are named ``shopper.<field>``); every candidate's
field by its path (``categories[2].skus[0].price``). Counts are bounded so that one request's size and the work of its
layers stay small (``ProductLimits``: a request at the limits with 768-d embeddings is about 0.8 MB on the wire, past
the server's default ``--max-message-bytes`` of 64 KiB, which takes about 19 SKUs: raise it to serve larger shelves).
A request whose candidates leave nothing to sell (no SKU in stock) is refused too: no layer could answer it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.product import (
    MAX_CATEGORIES,
    MAX_MULTIPLIER,
    MAX_PRICE,
    MAX_PRICE_BANDS,
    MAX_SKUS,
    MAX_SKUS_PER_CATEGORY,
    MIN_MULTIPLIER,
    MIN_PRICE,
    CategoryCandidate,
    PriceBand,
    ProductRequest,
    SkuCandidate,
)
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.validation import InvalidRequest, Limits, count_of, embedding_of, parse_request, required_id


@dataclass(frozen=True, slots=True)
class ProductLimits:
    max_categories: int = MAX_CATEGORIES
    max_skus_per_category: int = MAX_SKUS_PER_CATEGORY
    max_skus: int = MAX_SKUS
    max_price_bands: int = MAX_PRICE_BANDS


def _price(value: float, name: str) -> float:
    if not (math.isfinite(value) and MIN_PRICE <= value <= MAX_PRICE):
        raise InvalidRequest(name, f"must be a finite price in [{MIN_PRICE:g}, {MAX_PRICE:g}], got {value}")
    return value


def _unique(value: str, name: str, seen: set[str], limits: Limits) -> str:
    value = required_id(value, name, limits)
    if value in seen:
        raise InvalidRequest(name, f"duplicate id {value!r}")
    seen.add(value)
    return value


def _sku(msg: pb.ProductSku, raw: bytes, at: str, seen: set[str], limits: Limits) -> SkuCandidate:
    competitor = _price(msg.competitor_price, f"{at}.competitor_price") if msg.HasField("competitor_price") else None
    return SkuCandidate(_unique(msg.sku_id, f"{at}.sku_id", seen, limits),
                        embedding_of(msg.embedding, f"{at}.embedding", limits.item_dim, raw),
                        _price(msg.price, f"{at}.price"), msg.stock, competitor)


def _categories(msg: pb.RecommendProductRequest, view: Any, limits: Limits, product: ProductLimits) -> tuple[CategoryCandidate, ...]:
    n = len(msg.categories)
    if not 1 <= n <= product.max_categories:
        raise InvalidRequest("categories", f"expected 1 to {product.max_categories} categories, got {n}")
    total = sum(len(c.skus) for c in msg.categories)
    if total > product.max_skus:
        raise InvalidRequest("categories", f"at most {product.max_skus} SKUs in all, got {total}")
    category_ids: set[str] = set()
    sku_ids: set[str] = set()
    out = []
    # the view parses what the message does into the same elements; without one, every embedding is read from its container
    viewed = view.categories if view is not None else [None] * n
    for i, (category, seen) in enumerate(zip(msg.categories, viewed, strict=True)):
        at = f"categories[{i}]"
        category_id = _unique(category.category_id, f"{at}.category_id", category_ids, limits)
        if not 1 <= len(category.skus) <= product.max_skus_per_category:
            raise InvalidRequest(f"{at}.skus", f"expected 1 to {product.max_skus_per_category} SKUs, got {len(category.skus)}")
        raws = [s.embedding for s in seen.skus] if seen is not None else [b""] * len(category.skus)
        out.append(CategoryCandidate(category_id, tuple(_sku(s, raw, f"{at}.skus[{j}]", sku_ids, limits)
                                                         for j, (s, raw) in enumerate(zip(category.skus, raws, strict=True)))))
    if not any(c.in_stock for c in out):
        raise InvalidRequest("categories", "no SKU is in stock: nothing can be recommended")
    return tuple(out)


def _bands(msg: pb.RecommendProductRequest, limits: Limits, product: ProductLimits) -> tuple[PriceBand, ...]:
    n = len(msg.price_bands)
    if not 1 <= n <= product.max_price_bands:
        raise InvalidRequest("price_bands", f"expected 1 to {product.max_price_bands} price bands, got {n}")
    seen: set[str] = set()
    out = []
    for i, band in enumerate(msg.price_bands):
        at = f"price_bands[{i}]"
        band_id = _unique(band.band_id, f"{at}.band_id", seen, limits)
        m = band.price_multiplier
        if not (math.isfinite(m) and MIN_MULTIPLIER <= m <= MAX_MULTIPLIER):
            raise InvalidRequest(f"{at}.price_multiplier", f"must be finite, in [{MIN_MULTIPLIER:g}, {MAX_MULTIPLIER:g}], got {m}")
        out.append(PriceBand(band_id, m))
    return tuple(out)


def parse_product(msg: pb.RecommendProductRequest, limits: Limits, now_s: float,
                  product: ProductLimits | None = None, view: Any = None) -> ProductRequest:
    """Check every field of a RecommendProductRequest; ``now_s`` stands in for the shopper's missing event_time.
    ``view``: the same bytes parsed as its wire view (``server.wire_view``), for the embeddings."""
    product = product or ProductLimits()
    if not msg.HasField("shopper"):
        raise InvalidRequest("shopper", "required")
    try:
        shopper = parse_request(msg.shopper, limits, now_s, view.shopper if view is not None else None)
    except InvalidRequest as exc:
        raise InvalidRequest(f"shopper.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return ProductRequest(shopper, _categories(msg, view, limits, product), _bands(msg, limits, product),
                          count_of(msg.visit_count, "visit_count"))
