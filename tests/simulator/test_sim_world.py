"""The simulator's world: seeded and order-independent, well-formed events, and intent-dependent effects."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

import simulator.world as world_module
from core.domain import Action, Outcome, PageType
from simulator import SERVABLE, Intent, PageView, ShopperSession, SimConfig, World, effect_table
from simulator.reference import intent_policy

Decider = Callable[[ShopperSession, PageView], Action]
Trace = list[tuple[object, ...]]

GAMMA = 0.85
DAY_S, HOUR_S = 86_400.0, 3600.0
SMALL = SimConfig(n_items=400, item_dim=32, n_categories=6, n_trendy=2)


@pytest.fixture(scope="module")
def world() -> World:
    return World(SimConfig(), seed=11)


def random_decider(session: ShopperSession, page: PageView) -> Action:
    """Uniform over the servable actions, seeded by session and step (so reruns serve the same)."""
    rng = np.random.default_rng([zlib.crc32(session.session_id.encode()), page.step])
    return SERVABLE[int(rng.integers(len(SERVABLE)))]


def constant(action: Action) -> Decider:
    return lambda session, page: action


def feature_decider(session: ShopperSession, page: PageView) -> Action:
    """Reads only the page (what the real decider sees): the last three behaviour ids and the page type."""
    recent, seen = set(page.recent_behavior_ids[:3]), page.recent_behavior_ids
    if recent & {"search_coupon", "sort_price_asc", "view_deals"} and "coupon_claim" not in seen:
        return Action.APPLY_COUPON
    if "follow_brand" in recent and "share" not in seen:
        return Action.SHARE_SOCIAL
    if "browse_category" in recent and page.page_type is not PageType.DETAIL:
        return Action.VIEW_DETAIL
    return Action.ADD_TO_CART


def log_price(world: World, page: PageView) -> float:
    return math.log(world.catalogue.prices[world.catalogue.index[page.item_id]])


def play(session: ShopperSession, decide: Decider) -> tuple[list[PageView], list[Action], list[list[world_module.OutcomeEvent]]]:
    pages, actions, events = [], [], []
    while (page := session.page()) is not None:
        action = decide(session, page)
        pages.append(page)
        actions.append(action)
        events.append(session.respond(action))
    return pages, actions, events


def trace(session: ShopperSession, decide: Decider) -> Trace:
    """Everything a session produced, embeddings as bytes, for exact comparison."""
    out: Trace = [(session.session_id, session.user_id, session.intent)]
    for page, action, events in zip(*play(session, decide), strict=True):
        out.append((page.step, page.item_id, page.item_embedding.tobytes(), page.recent_behavior_ids, page.page_type,
                    page.cart_item_count, page.event_time_s, action))
        out.extend((e.outcome, e.value, e.coupon_discount, e.event_time_s) for e in events)
    return out


def discounted_return(pages: list[PageView], actions: list[Action], events: list[list[world_module.OutcomeEvent]]) -> float:
    """The attribution rules, last touch: an order credits 0.3 × GMV to the latest add_to_cart within 24 h
    before it, and 0.7 × its coupon discount to the latest apply_coupon within 1 h before it."""
    rules = ((Action.ADD_TO_CART, DAY_S, 0.3, "value"), (Action.APPLY_COUPON, HOUR_S, 0.7, "coupon_discount"))
    total = 0.0
    for order in (e for step in events for e in step if e.outcome is Outcome.ORDER):
        for action, window, weight, field in rules:
            steps = [k for k, (p, a) in enumerate(zip(pages, actions, strict=True))
                     if a is action and p.event_time_s <= order.event_time_s <= p.event_time_s + window]
            if steps:
                total += GAMMA ** steps[-1] * weight * getattr(order, field)
    return total


def value(world: World, decide: Decider, n: int) -> tuple[float, dict[Intent, float]]:
    """Mean discounted return per session, overall and per intent."""
    by_intent: dict[Intent, list[float]] = {i: [] for i in Intent}
    for index in range(n):
        session = world.session(index)
        by_intent[session.intent].append(discounted_return(*play(session, decide)))
    returns = [r for rs in by_intent.values() for r in rs]
    return sum(returns) / n, {i: sum(rs) / len(rs) for i, rs in by_intent.items()}


def test_same_seed_same_numbers_different_seed_different_numbers() -> None:
    a, b, c = World(SMALL, seed=3), World(SMALL, seed=3), World(SMALL, seed=4)
    assert a.catalogue.embeddings.tobytes() == b.catalogue.embeddings.tobytes()
    assert a.catalogue.prices == b.catalogue.prices
    assert a.catalogue.embeddings.tobytes() != c.catalogue.embeddings.tobytes()
    traces = [[trace(w.session(i), random_decider) for i in range(30)] for w in (a, b, c)]
    assert traces[0] == traces[1]
    assert traces[0] != traces[2]
    assert sum(len(t) for t in traces[0]) > 30 * 3  # not a run of empty sessions


def test_a_session_depends_only_on_seed_index_and_actions() -> None:
    alone = trace(World(SMALL, seed=5).session(5), random_decider)
    w = World(SMALL, seed=5)
    for index in range(5):
        trace(w.session(index), random_decider)
    assert trace(w.session(5), random_decider) == alone
    # Interleaved with another session, step by step, as concurrent drivers would.
    other, fifth = w.session(2), w.session(5)
    interleaved: Trace = [(fifth.session_id, fifth.user_id, fifth.intent)]
    while (page := fifth.page()) is not None:
        if (o := other.page()) is not None:
            other.respond(random_decider(other, o))
        action = random_decider(fifth, page)
        interleaved.append((page.step, page.item_id, page.item_embedding.tobytes(), page.recent_behavior_ids, page.page_type,
                            page.cart_item_count, page.event_time_s, action))
        interleaved.extend((e.outcome, e.value, e.coupon_discount, e.event_time_s) for e in fifth.respond(action))
    assert interleaved == alone
    # Other actions give another course.
    assert trace(w.session(5), constant(Action.ADD_TO_CART)) != alone


def test_embeddings_are_finite_unit_norm_and_carry_category_and_price(world: World) -> None:
    cat = world.catalogue
    emb = cat.embeddings
    assert emb.dtype == np.float32 and emb.shape == (5000, 768)
    assert np.isfinite(emb).all()
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert not emb.flags.writeable
    page = world.session(0).page()
    assert page is not None and page.item_embedding.shape == (768,) and page.item_embedding.dtype == np.float32
    # Nearest category mean recovers the hidden category; a linear fit recovers the log price.
    means = np.stack([emb[cat.category == c].mean(axis=0) for c in range(world.config.n_categories)])
    assert ((emb @ means.T).argmax(axis=1) == cat.category).mean() > 0.95
    log_price = np.log(cat.price)
    x = np.hstack([emb, np.ones((len(emb), 1), dtype=np.float32)]).astype(np.float64)
    fit = x @ np.linalg.lstsq(x[:2500], log_price[:2500], rcond=None)[0]
    assert np.corrcoef(fit[2500:], log_price[2500:])[0, 1] > 0.8  # held-out half
    assert World(SMALL, seed=1).catalogue.embeddings.shape == (400, 32)


def test_every_session_ends_with_one_exit_within_max_pages() -> None:
    config = replace(SMALL, max_pages=6)
    w = World(config, seed=8)
    lengths = []
    for index in range(400):
        session = w.session(index)
        decide: Decider = random_decider if index % 10 else constant(Action.ADD_TO_CART)
        pages, _, events = play(session, decide)
        flat = [e.outcome for step in events for e in step]
        assert flat.count(Outcome.EXIT) == 1, index
        assert Outcome.EXIT in [e.outcome for e in events[-1]]  # on the last page
        assert 1 <= len(pages) <= config.max_pages
        assert session.page() is None and session.ended
        with pytest.raises(RuntimeError, match="has ended"):
            session.respond(Action.VIEW_DETAIL)
        lengths.append(len(pages))
    assert config.max_pages in lengths and 1 in lengths


def test_serving_exit_ends_the_session(world: World) -> None:
    session = world.session(3)
    assert session.page() is not None
    events = session.respond(Action.EXIT)
    assert [e.outcome for e in events] == [Outcome.EXIT]  # the cart is empty: nothing to order later
    assert session.page() is None


def test_events_are_in_time_order_and_well_formed(world: World) -> None:
    orders = discounted = late = soon = 0
    starts = set()
    for index in range(1500):
        session = world.session(index)
        decide = intent_policy if index % 2 else random_decider
        pages, _, events = play(session, decide)
        starts.add(int(pages[0].event_time_s // HOUR_S) % 24)
        claimed = False
        last = pages[0].event_time_s
        for k, (page, step) in enumerate(zip(pages, events, strict=True)):
            assert page.event_time_s >= last
            assert page.cart_item_count == (pages[k - 1].cart_item_count if k else 0) + (
                k > 0 and Outcome.ADD_TO_CART in [e.outcome for e in events[k - 1]])
            assert page.recent_behavior_ids and len(page.recent_behavior_ids) <= world.config.max_behaviors
            if k:
                assert 1.0 < page.event_time_s - pages[k - 1].event_time_s < 3 * HOUR_S
            last = page.event_time_s
            for e in step:
                assert e.event_time_s >= last, (index, k, e)
                last = e.event_time_s
                assert e.value >= 0 and e.coupon_discount >= 0 and math.isfinite(e.value)
                claimed |= e.outcome is Outcome.COUPON_USED
                if e.outcome is not Outcome.ORDER:
                    assert e.value == 0 and e.coupon_discount == 0
                    continue
                orders += 1
                assert e is step[-1] or step[-1].outcome is Outcome.EXIT  # an order ends the session
                assert e.value > 0 and e.value == pytest.approx(session.cart_value, abs=0.011)
                added = [p for p, s in zip(pages, events, strict=True) if Outcome.ADD_TO_CART in [x.outcome for x in s]]
                assert e.value == pytest.approx(sum(math.exp(log_price(world, p)) for p in added), abs=0.011)
                assert (e.coupon_discount > 0) == claimed
                discounted += e.coupon_discount > 0
                delay = e.event_time_s - page.event_time_s
                soon += delay < HOUR_S
                late += delay > DAY_S
    assert orders > 200 and discounted > 20
    assert soon > orders / 2 and late > 0  # the 1 h and 24 h windows both cut
    assert len(starts) >= 20  # sessions start at most hours of the day


def test_observed_features_partly_reveal_the_intent(world: World) -> None:
    coupon_ids = {"search_coupon", "sort_price_asc", "view_deals"}
    hits: dict[Intent, list[bool]] = {i: [] for i in Intent}
    prices: dict[Intent, list[float]] = {i: [] for i in Intent}
    for index in range(1500):
        session = world.session(index)
        page = session.page()
        assert page is not None
        hits[session.intent].append(bool(coupon_ids & set(page.recent_behavior_ids)))
        prices[session.intent].append(log_price(world, page))
    rate = {i: sum(h) / len(h) for i, h in hits.items()}
    assert rate[Intent.BARGAIN_HUNTER] > 0.6 and max(rate[i] for i in Intent if i is not Intent.BARGAIN_HUNTER) < 0.1
    mean_price = {i: sum(p) / len(p) for i, p in prices.items()}
    assert mean_price[Intent.BARGAIN_HUNTER] < mean_price[Intent.BROWSER] - 0.3 < mean_price[Intent.BUYER] - 0.3


def test_the_best_action_depends_on_the_intent(world: World) -> None:
    n = 2000
    oracle, oracle_by = value(world, intent_policy, n)
    always_cart, cart_by = value(world, constant(Action.ADD_TO_CART), n)
    baselines = [always_cart, value(world, random_decider, n)[0]]
    baselines += [value(world, constant(a), 300)[0] for a in SERVABLE if a is not Action.ADD_TO_CART]
    assert oracle > 1.2 * max(baselines)
    assert oracle_by[Intent.BUYER] == cart_by[Intent.BUYER]  # the oracle is always-add-to-cart for buyers
    for intent in (Intent.BROWSER, Intent.BARGAIN_HUNTER, Intent.SOCIAL_SHARER):
        assert oracle_by[intent] > 2 * cart_by[intent], intent
    # A decider that reads only the page beats every constant one.
    assert value(world, feature_decider, n)[0] > 1.1 * max(baselines)


def test_the_docstring_table_is_the_default_config() -> None:
    assert world_module.__doc__ is not None and effect_table(SimConfig()) in world_module.__doc__


@pytest.mark.parametrize(("change", "message"), [
    ({"intents": SimConfig().intents[:3]}, "one profile per intent"),
    ({"max_pages": 0}, "max_pages"),
    ({"coupon_rate": 1.5}, "coupon_rate"),
    ({"n_trendy": 40}, "n_trendy"),
])
def test_bad_config_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(SimConfig(), **change)  # type: ignore[arg-type]


def test_bad_seed_and_index_are_refused(world: World) -> None:
    with pytest.raises(ValueError, match="seed"):
        World(SMALL, seed=-1)
    with pytest.raises(ValueError, match="index"):
        world.session(-1)
