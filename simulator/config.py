"""The simulator's knobs: one frozen ``SimConfig`` and one ``IntentProfile`` per hidden intent.

Every number the world uses lives here, with its meaning; ``effect_table`` renders the
intent × action effects and ``engagement_table`` the engagement signals' effects as the tables in
``simulator.world``'s docstring.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from core.domain import Action

# The actions a shopper can be shown, in ``Action.index`` order; every per-action tuple below
# follows it. EXIT is not among them: serving it makes the shopper leave.
SERVABLE: tuple[Action, ...] = (Action.ADD_TO_CART, Action.VIEW_DETAIL, Action.APPLY_COUPON, Action.SHARE_SOCIAL)

Quad = tuple[float, float, float, float]


class Intent(enum.IntEnum):
    """Why the shopper came. Hidden from the decider; ``SimConfig.intents`` is in this order."""

    BUYER = 0
    BROWSER = 1
    BARGAIN_HUNTER = 2
    SOCIAL_SHARER = 3

    @property
    def key(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class IntentProfile:
    """How one kind of shopper behaves. Probabilities are per page view unless said otherwise."""

    weight: float
    """Relative share of sessions with this intent (normalised over all intents)."""
    leave: float
    """Probability of leaving after a page, before the modifiers in ``SimConfig``."""
    take: Quad
    """P(the shopper takes up the served action), per ``SERVABLE`` action: adds the item to the
    cart, opens its detail page, claims the coupon, shares the item."""
    complain: Quad
    """P(a COMPLAINT), per ``SERVABLE`` action, whether or not the action was taken up."""
    order: float
    """P(order) when the session ends with a non-empty cart, before the lifts below."""
    coupon_lift: float
    """Added to the order probability once a coupon has been claimed."""
    share_lift: float
    """Added to the order probability once the shopper has shared something."""
    detail_take_lift: float
    """Added to the add-to-cart take-up, times min(detail pages opened on a prompt, 3) / 3."""
    detail_order_lift: float
    """Added to the order probability, times min(detail pages opened on a prompt, 3) / 3."""
    checkout: float
    """P(going to checkout after a page while the cart is not empty); the session then ends."""
    pages: tuple[float, float, float]
    """Weights of a search, recommend and detail page, for a page that is neither a detail page
    the agent opened nor a cart page."""
    behaviors: tuple[tuple[str, float], ...]
    """Background behaviour ids between two pages, with their weights."""
    peak_hour: float
    """Local (UTC) hour around which this intent's sessions start."""
    cheap_bias: float
    """Exponent on the price-rank draw within a category: > 1 favours cheap items, < 1 dear ones."""
    trendy: float
    """P(the favourite category is one of the ``SimConfig.n_trendy`` trendy ones)."""


DEFAULT_INTENTS: tuple[IntentProfile, ...] = (
    IntentProfile(  # BUYER: knows what they want; adds, checks out, buys.
        weight=0.25, leave=0.10, take=(0.50, 0.50, 0.40, 0.05), complain=(0.00, 0.00, 0.02, 0.10),
        order=0.70, coupon_lift=0.05, share_lift=0.00, detail_take_lift=0.05, detail_order_lift=0.05, checkout=0.20,
        pages=(0.5, 0.2, 0.3),
        behaviors=(("search_query", 3), ("view_item", 2), ("read_reviews", 2), ("view_cart", 2), ("compare_prices", 1)),
        peak_hour=20.0, cheap_bias=0.7, trendy=0.25,
    ),
    IntentProfile(  # BROWSER: window shopping; a push to the cart annoys, detail pages warm them up.
        weight=0.40, leave=0.20, take=(0.05, 0.60, 0.10, 0.05), complain=(0.10, 0.00, 0.05, 0.10),
        order=0.10, coupon_lift=0.05, share_lift=0.00, detail_take_lift=0.35, detail_order_lift=0.40, checkout=0.10,
        pages=(0.2, 0.5, 0.3),
        behaviors=(("browse_category", 4), ("view_item", 3), ("add_wishlist", 1), ("search_query", 1), ("read_reviews", 1)),
        peak_hour=22.0, cheap_bias=1.0, trendy=0.25,
    ),
    IntentProfile(  # BARGAIN_HUNTER: buys only with a discount.
        weight=0.20, leave=0.12, take=(0.30, 0.40, 0.85, 0.05), complain=(0.02, 0.00, 0.00, 0.10),
        order=0.10, coupon_lift=0.65, share_lift=0.00, detail_take_lift=0.05, detail_order_lift=0.05, checkout=0.15,
        pages=(0.6, 0.2, 0.2),
        behaviors=(("search_coupon", 3), ("sort_price_asc", 2), ("view_deals", 2), ("compare_prices", 2), ("search_query", 1)),
        peak_hour=12.0, cheap_bias=2.5, trendy=0.25,
    ),
    IntentProfile(  # SOCIAL_SHARER: shares what they like; having shared it, they buy it.
        weight=0.15, leave=0.12, take=(0.20, 0.50, 0.10, 0.70), complain=(0.05, 0.00, 0.08, 0.00),
        order=0.15, coupon_lift=0.00, share_lift=0.50, detail_take_lift=0.05, detail_order_lift=0.05, checkout=0.12,
        pages=(0.2, 0.4, 0.4),
        behaviors=(("follow_brand", 2), ("add_wishlist", 2), ("browse_category", 2), ("view_item", 2), ("read_reviews", 2)),
        peak_hour=18.0, cheap_bias=1.0, trendy=0.85,
    ),
)


@dataclass(frozen=True, slots=True)
class ProductSettings:
    """How shoppers react to a recommended product (``RecommendProduct``; ``simulator.products`` has the formulas).
    Per-intent numbers are in ``Intent`` order: buyer, browser, bargain hunter, social sharer."""

    categories: int = 6
    """Categories on a page's shelf."""
    skus: int = 6
    """Items of each category on the shelf."""
    favourite_offered: float = 0.7
    """P(the shopper's favourite category is among the shelf's)."""
    stockout: float = 0.15
    """P(an offered item is out of stock)."""
    competitor_known: float = 0.7
    """P(an item's competitor price is known)."""
    competitor_sigma: float = 0.1
    """Log-normal spread of a competitor's price around the list price."""
    bands: tuple[float, ...] = (0.85, 1.0, 1.15)
    """The price bands' multipliers of the list price."""
    first_visit: float = 0.3
    """P(a session is the shopper's first visit)."""
    base: Quad = (-1.0, -3.0, -2.0, -2.5)
    """Take-up logit of a median-priced item of a category that is neither favourite nor trendy, per intent."""
    favourite: float = 2.0
    """Added to the logit for the favourite category."""
    trendy: float = 1.0
    """Added to a social sharer's logit for a trendy category."""
    price: Quad = (0.5, 1.5, 4.0, 1.0)
    """Price sensitivity per intent: times log(paid / the category's median price), subtracted from the logit."""
    competitor: float = 2.0
    """Times log(paid / competitor price), subtracted where the shopper pays more than the competitor asks."""
    complaint: float = 0.01
    """P(a complaint about an offered product)."""
    first_visit_top_complaint: float = 0.15
    """P(a complaint when the top band is offered on a first visit)."""
    overpriced_ratio: float = 1.10
    """An offered item whose list price is more than this times its known competitor price is overpriced."""
    overpriced_complaint: float = 0.25
    """P(a complaint about price gouging when an overpriced item is offered, whatever the band): a cause independent of
    the others (P = 1 − (1 − the other rule's P) · (1 − this)); none where no competitor price is known."""
    sold_out_share: float = 0.5
    """A pushed category with at most this share of its offered items in stock looks like bait (``sold_out_complaint``)."""
    sold_out_complaint: float = 0.0
    """P(a complaint about bait when the offer's category is mostly sold out, whatever its item and band): a third
    independent cause, a fact of the category, for a category-layer guard to learn. 0, off, in the default world, so
    every world of the results before it is unchanged; ``bench.product_guard --sold-out-complaint`` turns it on."""

    def __post_init__(self) -> None:
        problems = [f"products.{k}: must be a probability" for k in ("favourite_offered", "stockout", "competitor_known",
                                                                       "first_visit", "complaint", "first_visit_top_complaint",
                                                                       "overpriced_complaint", "sold_out_share",
                                                                       "sold_out_complaint")
                    if not 0 <= getattr(self, k) <= 1]
        if not (math.isfinite(self.overpriced_ratio) and self.overpriced_ratio > 0):
            problems.append("products.overpriced_ratio: must be finite and > 0")
        if self.categories < 1 or self.skus < 1:
            problems.append("products.categories and products.skus: must be >= 1")
        if not self.bands or not all(math.isfinite(b) and b > 0 for b in self.bands):
            problems.append("products.bands: need at least one finite multiplier > 0")
        numbers = (self.competitor_sigma, self.favourite, self.trendy, self.competitor, *self.base, *self.price)
        if not all(math.isfinite(x) for x in numbers) or self.competitor_sigma < 0:
            problems.append("products: every number must be finite (competitor_sigma >= 0)")
        if problems:
            raise ValueError("invalid ProductSettings: " + "; ".join(problems))


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes the simulated world. With a seed, it fixes every number the world produces."""

    # The catalogue.
    n_items: int = 5000
    """Items in the catalogue."""
    item_dim: int = 768
    """Length of an item embedding (the bundle's ``item_dim``)."""
    n_categories: int = 16
    """Hidden item categories; each has its own embedding direction and price level."""
    n_trendy: int = 4
    """Categories 0..n_trendy-1 are the trendy ones social sharers favour."""
    price_median_range: tuple[float, float] = (8.0, 200.0)
    """A category's median price is log-uniform in this range."""
    price_sigma: float = 0.5
    """Log-normal spread of prices within a category."""
    embed_category: float = 0.8
    """Weight of the category direction in an item embedding (before normalising to unit norm)."""
    embed_price: float = 0.35
    """Weight of the price direction, times the item's standardised log price."""
    embed_noise: float = 0.5
    """Weight of the per-item Gaussian noise (norm about this much)."""

    # The shoppers.
    intents: tuple[IntentProfile, ...] = DEFAULT_INTENTS
    """One profile per ``Intent``, in its order: the mix and the effect of every action."""
    n_users: int = 50_000
    """Distinct user ids sessions are drawn from (a user's sessions need not share an intent)."""
    fav_stick: float = 0.6
    """P(a fresh page shows an item of the shopper's favourite category); otherwise any category."""
    cart_page_p: float = 0.25
    """P(the next page is the cart page, showing the last item added), while the cart is not empty."""
    extra_behavior_p: float = 0.5
    """P(a second background behaviour between two pages)."""
    max_behaviors: int = 8
    """Recent behaviour ids sent with a page (most recent first); the proto allows 32."""
    max_pages: int = 20
    """Page views per session at most; the shopper leaves after the last one."""

    # Effects shared by all intents.
    engaged_leave_mult: float = 0.7
    """The leave probability is multiplied by this after a page whose action was taken up."""
    complaint_leave_add: float = 0.3
    """Added to the leave probability after a complaint."""
    cart_page_checkout_mult: float = 2.0
    """The checkout probability is multiplied by this on a cart page."""
    order_p_max: float = 0.95
    """Cap on the order probability after all lifts."""
    late_order_factor: float = 0.6
    """A shopper who leaves (rather than checks out) with a non-empty cart orders later with
    this times the order probability."""
    coupon_rate: float = 0.15
    """A claimed coupon takes this fraction off the order (the order's ``coupon_discount``) ..."""
    coupon_cap: float = 40.0
    """... but at most this much."""

    # Time.
    epoch_s: float = 1_793_491_200.0
    """Start of the first simulated day (2026-11-01T00:00Z), seconds since the Unix epoch."""
    n_days: int = 28
    """Sessions start on a day drawn uniformly from this many days after ``epoch_s``."""
    hour_spread_h: float = 3.0
    """Standard deviation (hours) of a session's start around its intent's ``peak_hour``."""
    dwell_median_s: float = 40.0
    """Median seconds between two page views (log-normal)."""
    dwell_sigma: float = 0.8
    """Log-normal spread of the dwell time."""
    checkout_delay_median_s: float = 240.0
    """Median seconds from the last page to the order, at checkout (log-normal)."""
    checkout_delay_sigma: float = 0.6
    """Log-normal spread of the checkout delay."""
    late_order_mean_s: float = 12 * 3600.0
    """Mean seconds from leaving to a later order (exponential: about 8 % within 1 h, 14 % after 24 h)."""

    # Engagement signals (``ShopperSession.engagement``), from a page's hidden reaction. Each
    # effect is (base, + if the prompt was taken up, + if it was dismissed, + if the shopper
    # complained), summed over the reactions that hold (a complaint can come with either).
    engagement_active: Quad = (0.5, 1.0, -0.8, -1.5)
    """Logit of the fraction of the page's time the shopper was active on it (``dwell_s`` = page
    time × that fraction), before the noise."""
    engagement_active_sigma: float = 1.0
    """Standard deviation of the Gaussian noise on that logit."""
    engagement_scroll: Quad = (0.45, 0.20, -0.15, -0.15)
    """Scroll depth before the noise (then clipped to [0, 1])."""
    engagement_scroll_sigma: float = 0.25
    """Standard deviation of the Gaussian noise on the scroll depth."""
    engagement_bounce: Quad = (0.06, -0.03, 0.06, 0.40)
    """P(the page view is a bounce), before clipping to ``engagement_bounce_range``."""
    engagement_bounce_range: tuple[float, float] = (0.005, 0.95)
    """The bounce probability is clipped to this range: never impossible, never certain."""

    products: ProductSettings = ProductSettings()
    """Shoppers' reactions to a recommended product (``RecommendProduct``)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("n_items", "item_dim", "n_categories", "n_users", "max_behaviors", "max_pages", "n_days"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: must be >= 1")
        if not 0 <= self.n_trendy <= self.n_categories:
            problems.append("n_trendy: must be in [0, n_categories]")
        lo, hi = self.price_median_range
        if not 0 < lo <= hi:
            problems.append("price_median_range: need 0 < low <= high")
        if len(self.intents) != len(Intent):
            problems.append(f"intents: need one profile per intent ({len(Intent)}), got {len(self.intents)}")
        if sum(p.weight for p in self.intents) <= 0:
            problems.append("intents: the weights must not all be 0")
        probs = {
            "fav_stick": self.fav_stick, "cart_page_p": self.cart_page_p, "extra_behavior_p": self.extra_behavior_p,
            "order_p_max": self.order_p_max, "late_order_factor": self.late_order_factor, "coupon_rate": self.coupon_rate,
        }
        for intent, p in zip(Intent, self.intents, strict=False):
            probs |= {f"intents[{intent.key}].{k}": getattr(p, k) for k in ("leave", "order", "checkout", "trendy")}
            probs |= {f"intents[{intent.key}].take[{a.key}]": v for a, v in zip(SERVABLE, p.take, strict=True)}
            probs |= {f"intents[{intent.key}].complain[{a.key}]": v for a, v in zip(SERVABLE, p.complain, strict=True)}
            if p.weight < 0 or not p.behaviors or min(w for _, w in p.behaviors) <= 0 or min(p.pages) < 0 or sum(p.pages) <= 0:
                problems.append(f"intents[{intent.key}]: weights must be >= 0 (behaviours > 0), with some page weight")
            if p.cheap_bias <= 0:
                problems.append(f"intents[{intent.key}].cheap_bias: must be > 0")
        problems += [f"{k}: must be a probability, got {v!r}" for k, v in probs.items() if not 0 <= v <= 1]
        positive = ("price_sigma", "dwell_median_s", "checkout_delay_median_s", "late_order_mean_s", "coupon_cap")
        problems += [f"{k}: must be > 0" for k in positive if not getattr(self, k) > 0]
        problems += [f"{k}: must be >= 0" for k in ("engagement_active_sigma", "engagement_scroll_sigma") if not getattr(self, k) >= 0]
        lo, hi = self.engagement_bounce_range
        if not 0 <= lo <= hi <= 1:
            problems.append("engagement_bounce_range: need 0 <= low <= high <= 1")
        for k, v in vars(self).items():
            if isinstance(v, float) and not math.isfinite(v):
                problems.append(f"{k}: must be finite")
            if k.startswith("engagement_") and isinstance(v, tuple) and not all(math.isfinite(x) for x in v):
                problems.append(f"{k}: must be finite")
        if problems:
            raise ValueError("invalid SimConfig: " + "; ".join(problems))


def effect_table(config: SimConfig) -> str:
    """The intent × action effects of ``config`` as a Markdown table (the one in ``world``'s docstring)."""
    total = sum(p.weight for p in config.intents)
    head = ("intent", "mix", "leave", "take atc/vd/cpn/shr", "complain atc/vd/cpn/shr", "order", "+coupon", "+share",
            "+detail take/order", "checkout")
    rows = [head, tuple("---" for _ in head)]
    for intent, p in zip(Intent, config.intents, strict=True):
        rows.append((
            intent.key, f"{p.weight / total:.2f}", f"{p.leave:.2f}",
            "/".join(f"{v:.2f}" for v in p.take), "/".join(f"{v:.2f}" for v in p.complain),
            f"{p.order:.2f}", f"{p.coupon_lift:.2f}", f"{p.share_lift:.2f}",
            f"{p.detail_take_lift:.2f}/{p.detail_order_lift:.2f}", f"{p.checkout:.2f}",
        ))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def engagement_table(config: SimConfig) -> str:
    """The engagement effects of ``config`` per hidden reaction, before the noise, as a Markdown table
    (the one in ``world``'s docstring): the active logit, the scroll depth and P(bounce) (clipped)."""
    lo, hi = config.engagement_bounce_range
    head = ("reaction", "active logit", "scroll", "bounce")
    rows = [head, tuple("---" for _ in head)]
    for name, taken, dismissed in (("taken up", 1, 0), ("dismissed", 0, 1), ("idle", 0, 0)):
        for complained in (0, 1):
            x = (1, taken, dismissed, complained)
            active, scroll, bounce = (
                sum(c * v for c, v in zip(coefs, x, strict=True))
                for coefs in (config.engagement_active, config.engagement_scroll, config.engagement_bounce)
            )
            rows.append((name + " + complaint" * complained, f"{active:.2f}", f"{scroll:.2f}", f"{min(hi, max(lo, bounce)):.3f}"))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)
