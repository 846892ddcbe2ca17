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
