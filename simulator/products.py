"""Product recommendations in the simulated world: the shelf a frontend would offer, and how a shopper takes a product.

``RecommendProduct`` chooses a category, a SKU in it and a price band from candidates the request carries. Here a
page's candidates are its ``Shelf``: ``ProductSettings.categories`` categories (the shopper's favourite among them with
P ``favourite_offered``), ``skus`` items of each (any in stock with P 1 − ``stockout``, a competitor price known with P
``competitor_known``), and the price bands ``bands`` (multipliers of the list price). The shopper's hidden state decides
whether an offered product is taken (into the cart, at the list price × the band's multiplier):

    P(take) = logistic( base[intent] + favourite · [category = the favourite]
                        + trendy · [social sharer and the category is trendy]
                        − price[intent] · log(paid / the category's median price)
                        − competitor · max(0, log(paid / competitor price)) )     (where a competitor price is known)

and whether it draws a complaint, from independent causes:

    P(complaint) = 1 − (1 − p_band) · (1 − p_overpriced) · (1 − p_sold_out)

where p_band is ``first_visit_top_complaint`` for the top band (the largest multiplier) on a first visit (a session's
``visit_count`` 1, with P ``first_visit``), else ``complaint``; p_overpriced is ``overpriced_complaint`` when the
item is overpriced (a competitor price is known and the list price is more than ``overpriced_ratio`` × it), else 0;
and p_sold_out is ``sold_out_complaint`` (0, off, in the default world) when at most ``sold_out_share`` of the
category's offered items are in stock (the category features' in-stock share), else 0. A
shopper who sees a product priced well above what a competitor asks complains about price gouging whatever band is
shown: a fact of the SKU, not of the band. The request carries the competitor price and the SKU features include
log(price / competitor price) (``policy.product_features``), so a guard at the SKU layer can learn to refuse such an
item, while the policy's own reward (a complaint's cost) only discourages it on average and exploration can still
serve one. ``complaint_table(SimConfig())`` tabulates the complaint probabilities.

A taken product's GMV counts when the session orders (``simulator.world``: its order probability, unchanged); a
complaint costs what every complaint costs and raises the chance the shopper leaves after the page, as a complaint on
the page's prompt does. So which category (the favourite: +``favourite`` logits), which SKU (bargain hunters take cheap
ones, buyers dear ones, which earn more; an overpriced one draws complaints) and which band (a higher price earns more
per order but is taken less, and the top band risks a first visitor's complaint) all change orders, GMV and
complaints: ``product_effect_table(SimConfig())`` tabulates the take-up.

Determinism: a page's shelf and the offer's dice come from ``default_rng([seed, 3, session, step])``, apart from the
session's own stream, so a session that is never offered a product runs exactly as before (tested against a digest),
and a shelf is the same whoever asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.product import CategoryCandidate, PriceBand, SkuCandidate
from simulator.config import Intent, ProductSettings, SimConfig
from simulator.items import Catalogue

PRODUCT_STREAM = 3


@dataclass(frozen=True, slots=True)
class Shelf:
    """A page's product candidates, in the order a frontend sends them."""

    categories: tuple[int, ...]
    items: tuple[tuple[int, ...], ...]
    """Per category, its offered items (catalogue rows)."""
    stock: tuple[tuple[int, ...], ...]
    competitor: tuple[tuple[float | None, ...], ...]
    multipliers: tuple[float, ...]
    visit_count: int
    u_take: float
    u_complain: float


def shelf(catalogue: Catalogue, settings: ProductSettings, seed: int, session: int, step: int, favourite: int,
          categories: tuple[int, ...], visit_count: int) -> Shelf:
    """Page ``step``'s shelf for session ``session`` (its own random stream)."""
    rng = np.random.default_rng([seed, PRODUCT_STREAM, session, step])
    others = [c for c in categories if c != favourite]
    n = min(settings.categories, len(categories))
    picked = [int(c) for c in rng.permutation(others)[: n]]
    if rng.random() < settings.favourite_offered and favourite in categories:
        picked = [favourite, *picked[: n - 1]]
        picked = [int(c) for c in rng.permutation(picked)]
    items, stock, competitor = [], [], []
    for c in picked:
        pool = catalogue.by_category[c]
        chosen = rng.choice(len(pool), size=min(settings.skus, len(pool)), replace=False)
        rows = tuple(int(pool[i]) for i in chosen)
        items.append(rows)
        stock.append(tuple(0 if rng.random() < settings.stockout else int(rng.integers(1, 50)) for _ in rows))
        competitor.append(tuple(round(float(catalogue.price[r] * math.exp(settings.competitor_sigma * rng.standard_normal())), 2)
                                if rng.random() < settings.competitor_known else None for r in rows))
    u_take, u_complain = rng.random(2).tolist()
    return Shelf(tuple(picked), tuple(items), tuple(stock), tuple(competitor), settings.bands, visit_count, u_take, u_complain)


def take_probability(catalogue: Catalogue, settings: ProductSettings, intent: Intent, favourite: int, trendy: bool,
                     category: int, item: int, multiplier: float, competitor: float | None) -> float:
    """P(the shopper takes this product at this band): the module doc's formula."""
    paid = float(catalogue.price[item]) * multiplier
    logit = settings.base[intent] + settings.favourite * (category == favourite)
    logit += settings.trendy * (trendy and intent is Intent.SOCIAL_SHARER)
    logit -= settings.price[intent] * math.log(paid / catalogue.category_median[category])
    if competitor is not None:
        logit -= settings.competitor * max(0.0, math.log(paid / competitor))
    return 1.0 / (1.0 + math.exp(-logit))


def overpriced(settings: ProductSettings, price: float, competitor: float | None) -> bool:
    """Whether an item at list price ``price`` is overpriced: more than ``overpriced_ratio`` × its known competitor price."""
    return competitor is not None and price > settings.overpriced_ratio * competitor


def complaint_probability(settings: ProductSettings, multiplier: float, multipliers: tuple[float, ...], visit_count: int,
                          price: float, competitor: float | None, in_stock_share: float = 1.0) -> float:
    """P(offering an item at list price ``price`` (competitor price ``competitor``, None where unknown) at band
    ``multiplier`` of ``multipliers``, from a category with ``in_stock_share`` of its offered items in stock, draws a
    complaint): the module doc's independent causes."""
    top = len(set(multipliers)) > 1 and multiplier >= max(multipliers)
    band = settings.first_visit_top_complaint if top and visit_count == 1 else settings.complaint
    spared = 1.0  # P(no complaint from the other causes)
    if overpriced(settings, price, competitor):
        spared *= 1.0 - settings.overpriced_complaint
    if in_stock_share <= settings.sold_out_share:
        spared *= 1.0 - settings.sold_out_complaint
    return band if spared == 1.0 else 1.0 - (1.0 - band) * spared


def in_stock_share(here: Shelf, category: int) -> float:
    """The share of the shelf's ``category``-th category's offered items in stock."""
    stock = here.stock[category]
    return sum(1 for s in stock if s > 0) / len(stock)


def complaint_table(config: SimConfig) -> str:
    """P(complaint) for a fairly priced item and an overpriced one, on a first visit's top band and otherwise (markdown)."""
    s = config.products

    def p(top: bool, over: bool) -> str:  # a first visit either way; the lowest band is never the top one (unless alone)
        x = complaint_probability(s, max(s.bands) if top else min(s.bands), s.bands, 1, 2.0 * s.overpriced_ratio if over else 1.0, 1.0)
        return f"{round(x, 4):g}"

    return "\n".join([
        f"| offer | fairly priced (or no competitor price) | overpriced (list price > {s.overpriced_ratio:g} × competitor) |",
        "| --- | --- | --- |",
        f"| any other offer | {p(False, False)} | {p(False, True)} |",
        f"| the top band on a first visit | {p(True, False)} | {p(True, True)} |",
    ])


def product_effect_table(config: SimConfig) -> str:
    """P(take) per intent for a median-priced item of the favourite category and of another, at each band (markdown)."""
    s = config.products
    rows = ["| intent | favourite at " + " / ".join(f"×{m:g}" for m in s.bands) + " | other category at the same |", "| --- | --- | --- |"]
    for intent in Intent:
        def p(fav: bool, m: float, intent: Intent = intent) -> float:
            logit = s.base[intent] + s.favourite * fav - s.price[intent] * math.log(m)
            return 1.0 / (1.0 + math.exp(-logit))
        rows.append(f"| {intent.key} | " + " / ".join(f"{p(True, m):.2f}" for m in s.bands) + " | "
                    + " / ".join(f"{p(False, m):.2f}" for m in s.bands) + " |")
    return "\n".join(rows)


def candidates(catalogue: Catalogue, here: Shelf) -> tuple[tuple[CategoryCandidate, ...], tuple[PriceBand, ...]]:
    """The shelf as a ``RecommendProduct`` request's candidates (what a frontend sends): ids, embeddings, prices, stock,
    competitor prices, bands."""
    categories = tuple(
        CategoryCandidate(f"category-{c}", tuple(
            SkuCandidate(catalogue.item_ids[item], catalogue.embeddings[item], float(catalogue.price[item]), stock, competitor)
            for item, stock, competitor in zip(here.items[k], here.stock[k], here.competitor[k], strict=True)))
        for k, c in enumerate(here.categories))
    bands = tuple(PriceBand(f"band-{m:g}", m) for m in here.multipliers)
    return categories, bands
