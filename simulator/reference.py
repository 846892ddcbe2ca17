"""A reference decider that reads what no real decider can: each shopper's hidden intent.

``intent_policy`` plays the effect table's best sequence per intent (``simulator.world``):
bargain hunters get a coupon first, social sharers a share prompt, browsers detail pages until
they have opened three, and then everyone is asked to add to cart. It is a reference for
learning benches (how much of the hidden structure a learner recovers), not an upper bound:
it ignores prices, timing and the dice.
"""

from __future__ import annotations

from core.domain import Action
from simulator.config import Intent
from simulator.products import Shelf, complaint_probability, in_stock_share, take_probability
from simulator.world import PageView, ShopperSession


def intent_policy(session: ShopperSession, page: PageView) -> Action:
    """The intent-optimal play of the effect table: prepare the shopper, then add to cart."""
    if session.intent is Intent.BARGAIN_HUNTER and not session.coupon_claimed:
        return Action.APPLY_COUPON
    if session.intent is Intent.SOCIAL_SHARER and not session.shared:
        return Action.SHARE_SOCIAL
    if session.intent is Intent.BROWSER and session.details_opened < 3:
        return Action.VIEW_DETAIL
    return Action.ADD_TO_CART


COMPLAINT_COST = 10.0  # the business objective's cost of a complaint (experience.objective)


def product_oracle(session: ShopperSession, here: Shelf) -> tuple[int, int, int]:
    """The offer of ``here`` (category, item, band positions) with the best expected value to the shop, read from the
    shopper's hidden state: P(take) × the price paid × the intent's order probability − the complaint cost × P(complaint),
    over the items in stock. A reference for the layered decision, not a bound: it ignores the lifts a session earns later."""
    world = session._world  # a reference may read what a decider cannot
    settings, catalogue = world.config.products, world.catalogue
    order = world.config.intents[session.intent].order
    best, choice = -float("inf"), (0, 0, 0)
    for c, category in enumerate(here.categories):
        trendy = category in world._trendy
        for s, item in enumerate(here.items[c]):
            if here.stock[c][s] == 0:
                continue
            for b, multiplier in enumerate(here.multipliers):
                take = take_probability(catalogue, settings, session.intent, session.favourite, trendy, category, item, multiplier,
                                        here.competitor[c][s])
                value = take * float(catalogue.price[item]) * multiplier * order
                value -= COMPLAINT_COST * complaint_probability(settings, multiplier, here.multipliers, here.visit_count,
                                                                float(catalogue.price[item]), here.competitor[c][s],
                                                                in_stock_share(here, c))
                if value > best:
                    best, choice = value, (c, s, b)
    return choice
