"""Recommended products in the simulator: shelves are data of the page and its own stream, offers follow the hidden
state (favourite category, price sensitivity, competitor prices, the first visit's top band), and which product is
shown changes the shop's objective."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from core.domain import Action, DecisionRequest, Outcome
from core.product import ProductRequest
from policy import product_rules as rules
from simulator.config import Intent, ProductSettings, SimConfig
from simulator.products import (
    candidates,
    complaint_probability,
    complaint_table,
    in_stock_share,
    overpriced,
    product_effect_table,
    take_probability,
)
from simulator.reference import COMPLAINT_COST, product_oracle
from simulator.world import ShopperSession, World

SMALL = SimConfig(n_items=600, item_dim=16)


def test_a_shelf_is_the_same_for_its_page_and_differs_between_pages() -> None:
    world = World(SMALL, seed=3)
    a, b = world.session(5), world.session(5)
    assert a.shelf() == b.shelf() == a.shelf()
    first = a.shelf()
    a.respond(Action.VIEW_DETAIL)
    if a.page() is not None:
        assert a.shelf() != first
    here = first
    assert len(here.categories) == SMALL.products.categories == len(set(here.categories))
    assert all(len(items) == SMALL.products.skus for items in here.items)
    assert here.multipliers == SMALL.products.bands and here.visit_count >= 1


def test_a_kept_shelf_is_the_pages_own_on_every_page_of_a_session() -> None:
    """The session keeps the page's shelf between the driver's two asks (the candidates, then the offer); on each page
    it is the one a session that never asked before draws there."""
    world = World(SMALL, seed=3)
    index = next(i for i in range(50) if _pages(world, i) >= 3)  # a session of a few pages
    asked = world.session(index)
    for step in range(_pages(world, index)):
        fresh = world.session(index)
        for _ in range(step):
            fresh.respond(Action.VIEW_DETAIL)
        assert asked.shelf() is asked.shelf() and asked.shelf() == fresh.shelf(), step
        asked.respond(Action.VIEW_DETAIL)


def _pages(world: World, index: int) -> int:
    """How many pages session ``index`` shows when every page is answered VIEW_DETAIL."""
    session, pages = world.session(index), 0
    while session.page() is not None:
        session.respond(Action.VIEW_DETAIL)
        pages += 1
    return pages


def test_reading_shelves_changes_nothing_of_a_session() -> None:
    world = World(SMALL, seed=4)
    for i in range(50):
        plain, looked = world.session(i), world.session(i)
        plain_events, looked_events = [], []
        while plain.page() is not None:
            looked.shelf()
            plain_events += plain.respond(Action.ADD_TO_CART)
            looked_events += looked.respond(Action.ADD_TO_CART)
        assert looked.page() is None and plain_events == looked_events and plain.cart_value == looked.cart_value


def test_offers_are_refused_when_out_of_stock_repeated_or_off_the_shelf() -> None:
    world = World(SMALL, seed=5)
    session = next(s for s in map(world.session, range(200)) if any(0 in stock for stock in s.shelf().stock))
    here = session.shelf()
    c, s = next((c, s) for c, stock in enumerate(here.stock) for s, n in enumerate(stock) if n == 0)
    with pytest.raises(ValueError, match="out of stock"):
        session.offer(c, s, 0)
    with pytest.raises(ValueError, match="no candidate"):
        session.offer(len(here.categories), 0, 0)
    c, s = next((c, s) for c, stock in enumerate(here.stock) for s, n in enumerate(stock) if n > 0)
    session.offer(c, s, 0)
    with pytest.raises(RuntimeError, match="already offered"):
        session.offer(c, s, 0)


def test_take_up_follows_the_favourite_the_price_and_the_competitor() -> None:
    world = World(SMALL, seed=6)
    settings, catalogue = SMALL.products, world.catalogue
    fav = 2
    item = catalogue.by_category[fav][len(catalogue.by_category[fav]) // 2]

    def p(intent: Intent, category: int = fav, m: float = 1.0, competitor: float | None = None, favourite: int = fav) -> float:
        return take_probability(catalogue, settings, intent, favourite, False, category, item, m, competitor)

    for intent in Intent:
        assert p(intent) > p(intent, favourite=fav + 1)  # the favourite category is taken more
        assert p(intent, m=0.85) > p(intent, m=1.0) > p(intent, m=1.15)  # a lower band is taken more
    spread = {i: p(i, m=0.85) - p(i, m=1.15) for i in Intent}
    assert spread[Intent.BARGAIN_HUNTER] > 2 * spread[Intent.BUYER]  # bargain hunters mind the price most
    price = float(catalogue.price[item])
    assert p(Intent.BUYER, competitor=price * 0.8) < p(Intent.BUYER) == p(Intent.BUYER, competitor=price * 1.2)
    bands = settings.bands
    assert complaint_probability(settings, max(bands), bands, 1, price, None) == settings.first_visit_top_complaint
    assert complaint_probability(settings, max(bands), bands, 2, price, None) == settings.complaint
    assert complaint_probability(settings, min(bands), bands, 1, price, None) == settings.complaint
    for alone in ((1.0,), (1.2, 1.2)):  # a single price (or the same one twice) is no top band to be stung by
        assert complaint_probability(settings, alone[0], alone, 1, price, None) == settings.complaint
    assert "bargain_hunter" in product_effect_table(SMALL)


def test_an_overpriced_sku_adds_its_own_complaint_cause_to_the_bands() -> None:
    """P = 1 − (1 − the band's P) · (1 − overpriced_complaint) when the list price is more than overpriced_ratio × a known
    competitor price; no effect without a competitor price or at or below the ratio."""
    settings = SMALL.products
    assert (settings.overpriced_ratio, settings.overpriced_complaint) == (1.10, 0.25)
    bands, top, low = settings.bands, max(settings.bands), min(settings.bands)

    def p(price: float, competitor: float | None, multiplier: float = low, visit_count: int = 2) -> float:
        return complaint_probability(settings, multiplier, bands, visit_count, price, competitor)

    assert p(100.0, None) == settings.complaint == 0.01
    assert p(1000.0, None) == 0.01  # however dear: no competitor price, no such complaint
    assert p(100.0, 95.0) == p(100.0, 100.0 / 1.10) == p(100.0, 100.0) == 0.01  # below or at the threshold
    assert p(100.0, 200.0) == 0.01  # cheaper than the competitor
    assert p(100.0, 90.0) == pytest.approx(1 - (1 - 0.01) * (1 - 0.25), abs=1e-15)  # 100 > 1.10 × 90 = 99
    assert p(100.0, 90.0, top, visit_count=2) == pytest.approx(0.2575, abs=1e-15)  # a returning shopper: the base rate
    assert p(100.0, 90.0, top, visit_count=1) == pytest.approx(1 - (1 - 0.15) * (1 - 0.25), abs=1e-15)  # 0.3625
    assert p(100.0, 90.0, low, visit_count=1) == pytest.approx(0.2575, abs=1e-15)
    assert p(100.0, 95.0, top, visit_count=1) == settings.first_visit_top_complaint
    table = complaint_table(SimConfig())
    assert all(x in table for x in ("| 0.01 | 0.2575 |", "| 0.15 | 0.3625 |", "1.1 × competitor"))
    assert table in (Path(__file__).parents[2] / "docs" / "simulator.md").read_text(encoding="utf-8")  # the docs' copy


def _first_offers(settings: ProductSettings, sessions: range, want_overpriced: bool,
                  seed: int = 11) -> list[tuple[bool, float, list[Outcome]]]:
    """On the first page of each session, offer the first in-stock SKU that is (or is not) overpriced, at the lowest band
    (never the top one): (whether it complained, the page's u_complain, the offer's outcomes)."""
    config = SimConfig(n_items=600, item_dim=16, products=settings)
    world = World(config, seed)
    out = []
    for i in sessions:
        session = world.session(i)
        here = session.shelf()
        pick = next(((c, s) for c, items in enumerate(here.items) for s, item in enumerate(items) if here.stock[c][s] > 0
                     and overpriced(settings, float(world.catalogue.price[item]), here.competitor[c][s]) == want_overpriced), None)
        if pick is None:
            continue
        events = session.offer(*pick, here.multipliers.index(min(here.multipliers)))
        outcomes = [e.outcome for e in events]
        out.append((Outcome.COMPLAINT in outcomes, here.u_complain, outcomes))
    return out


def test_offered_overpriced_skus_draw_complaints_at_their_rate_and_fair_ones_at_the_base_rate() -> None:
    """Through the real world: 2,000 first-page offers of each kind, at the lowest band. The rates are within 6 standard
    deviations of 1 − 0.99 · 0.75 = 0.2575 and of 0.01 (a false alarm about 1e-9), and each outcome is the page's own die
    against that probability (no new draw)."""
    settings = SMALL.products
    for want, p in ((True, 1 - (1 - settings.complaint) * (1 - settings.overpriced_complaint)), (False, settings.complaint)):
        offers = _first_offers(settings, range(2400), want)[:2000]
        assert len(offers) == 2000
        assert all(complained == (u < p) for complained, u, _ in offers)
        rate = sum(complained for complained, _, _ in offers) / len(offers)
        assert abs(rate - p) < 6 * math.sqrt(p * (1 - p) / len(offers)), (want, rate, p)


def test_the_overpriced_rule_changes_only_complaints_of_overpriced_offers() -> None:
    """With overpriced_complaint 0 the world is the one before the rule: the same shelves and dice, the same take-up; the
    complaints differ only on overpriced offers."""
    settings = SMALL.products
    before = replace(settings, overpriced_complaint=0.0)
    for want in (True, False):
        now, then = _first_offers(settings, range(300), want), _first_offers(before, range(300), want)
        assert [u for _, u, _ in now] == [u for _, u, _ in then] and len(now) > 100
        assert [Outcome.ADD_TO_CART in o for _, _, o in now] == [Outcome.ADD_TO_CART in o for _, _, o in then]
        changed = sum(a != b for (a, _, _), (b, _, _) in zip(now, then, strict=True))
        assert (changed > 0) if want else (changed == 0)


def test_a_mostly_sold_out_category_is_a_third_cause_off_in_the_default_world() -> None:
    """P = 1 − (1 − p_band) · (1 − p_overpriced) · (1 − sold_out_complaint) when at most sold_out_share of the category's
    offered items are in stock; the default world has it off, exactly."""
    settings = SMALL.products
    assert (settings.sold_out_share, settings.sold_out_complaint) == (0.5, 0.0)
    bands, low, top = settings.bands, min(settings.bands), max(settings.bands)
    for multiplier, visit_count, competitor in itertools.product(bands, (1, 2), (None, 100.0, 80.0)):  # off: as before
        band = settings.first_visit_top_complaint if multiplier == top and visit_count == 1 else settings.complaint
        before = 1 - (1 - band) * (1 - settings.overpriced_complaint) if competitor == 80.0 else band  # the two causes
        assert {complaint_probability(settings, multiplier, bands, visit_count, 100.0, competitor, share)
                for share in (0.0, 0.5, 1.0)} == {before}
    on = replace(settings, sold_out_complaint=0.3)

    def p(share: float, competitor: float | None = None, multiplier: float = low, visit_count: int = 2) -> float:
        return complaint_probability(on, multiplier, bands, visit_count, 100.0, competitor, share)

    assert p(1.0) == p(0.51) == 0.01 and p(0.5) == p(1 / 6) == pytest.approx(1 - 0.99 * 0.7, abs=1e-15)
    assert p(0.5, 90.0) == pytest.approx(1 - 0.99 * 0.75 * 0.7, abs=1e-15)  # overpriced too: independent causes
    assert p(0.5, multiplier=top, visit_count=1) == pytest.approx(1 - 0.85 * 0.7, abs=1e-15)
    # Through the real world, with the cause certain: a mostly sold-out category's offer always draws a complaint.
    world = World(SimConfig(n_items=600, item_dim=16, products=replace(on, sold_out_complaint=1.0)), 11)
    seen = {True: 0, False: 0}
    for i in range(600):
        session = world.session(i)
        here = session.shelf()
        for c in range(len(here.categories)):
            share = in_stock_share(here, c)
            s = next((k for k, stock in enumerate(here.stock[c]) if stock > 0), None)
            if s is None or seen[share <= 0.5] >= 30:
                continue
            outcomes = [e.outcome for e in session.offer(c, s, bands.index(low))]
            if share <= 0.5:
                assert Outcome.COMPLAINT in outcomes
            seen[share <= 0.5] += 1
            break
    assert seen[True] == seen[False] == 30


@pytest.mark.parametrize(("field", "value"), [("overpriced_complaint", 1.5), ("overpriced_complaint", -0.1),
                                              ("sold_out_complaint", 1.1), ("sold_out_share", -0.5),
                                              ("overpriced_complaint", math.nan), ("overpriced_ratio", 0.0),
                                              ("overpriced_ratio", -1.0), ("overpriced_ratio", math.inf),
                                              ("overpriced_ratio", math.nan)])
def test_bad_overpriced_settings_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"products\.{field}"):
        ProductSettings(**{field: value})


def _rules(session: ShopperSession, world: World) -> tuple[int, int, int]:
    """The server's per-layer rules (``policy.product_rules``) on the shelf as a frontend would send it."""
    categories, bands = candidates(world.catalogue, session.shelf())
    page = session.page()
    assert page is not None
    shopper = DecisionRequest("u", session.session_id, page.item_id, page.item_embedding, page.recent_behavior_ids, page.page_type,
                              page.event_time_s, page.cart_item_count)
    request = ProductRequest(shopper, categories, bands, session.visit_count)
    c = rules.rule_category(request, rules.category_permitted(request))
    s = rules.rule_sku(categories[c], rules.sku_permitted(categories[c]))
    return c, s, rules.rule_band(bands, rules.band_permitted(request))


def _objective(world: World, sessions: range, choose: object) -> np.ndarray:
    values = []
    for i in sessions:
        session, total = world.session(i), 0.0
        while session.page() is not None:
            events = [] if choose is None else session.offer(*choose(session, world))  # type: ignore[operator]
            events += session.respond(Action.VIEW_DETAIL)
            total += sum(e.value - e.coupon_discount if e.outcome is Outcome.ORDER else 0.0 for e in events)
            total -= COMPLAINT_COST * sum(e.outcome is Outcome.COMPLAINT for e in events)
        values.append(total)
    return np.array(values)


def test_which_product_is_shown_changes_the_objective() -> None:
    """Same sessions, same dice: offering the hidden-state reference's product beats the server's rules, which beat
    offering nothing (a detail prompt on every page, so orders come only from the offers)."""
    world = World(SimConfig(), seed=7)
    sessions = range(1000)
    oracle = _objective(world, sessions, lambda s, w: product_oracle(s, s.shelf()))
    by_rules = _objective(world, sessions, _rules)
    nothing = _objective(world, sessions, None)

    def z(a: np.ndarray, b: np.ndarray) -> float:
        d = a - b
        return float(d.mean() / (d.std(ddof=1) / math.sqrt(len(d))))

    assert z(oracle, by_rules) > 3 and z(by_rules, nothing) > 3, (oracle.mean(), by_rules.mean(), nothing.mean())
