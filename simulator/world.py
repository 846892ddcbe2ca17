"""The shopper simulator's world: seeded shoppers with hidden intents, reacting to served actions.

``World(config, seed)`` builds the item catalogue once; ``world.session(i)`` is shopper
session ``i``. A session alternates ``page()`` (the request fields of the next page view, or
None once the shopper has left) and ``respond(action)`` (the outcome events the action
caused); after ``respond``, ``engagement()`` is what the frontend measured on that page. Pure: no
I/O, no clock, no global random state.

Determinism. Session ``i`` draws all of its randomness up front from
``default_rng([seed, 1, i])``: a few numbers for the shopper and a fixed row of uniforms and
normals per page, each slot with one meaning (take-up, complaint, leave, …). So a session's
course depends only on the seed, ``i`` and the actions served to it, never on which other
sessions ran, in which order or in which thread; and two deciders facing session ``i`` see
the same shopper and the same dice (common random numbers: policy comparisons have low variance).

The shopper. Each session has a hidden ``Intent`` drawn from the mix, a favourite category
(social sharers favour the trendy ones), a start time (a day in ``n_days`` after 2026-11-01
UTC, an hour around the intent's peak) and a user id. A page shows an item of the favourite
category or any other; bargain hunters see cheap items, buyers dearer ones. Between pages the
shopper leaves background behaviour ids typical of the intent (bargain hunters
``search_coupon``, ``sort_price_asc`` …), and the reaction to the last prompt (``cart_add``,
``view_detail``, ``coupon_claim``, ``share``, ``dismiss_prompt``). So the item embedding, the
behaviour ids, the page type and the hour each partly reveal the intent.

Effects (the defaults; ``effect_table(SimConfig())``). Per page, with the served action:
*take* = P(the shopper takes it up: the item goes into the cart (ADD_TO_CART), the detail page
opens (the next page is DETAIL), the coupon is claimed (COUPON_USED), the item is shared
(SHARE)); *complain* = P(COMPLAINT). *leave* = P(leaving after the page), × 0.7 after an action
taken up, + 0.3 after a complaint. With a non-empty cart the shopper goes to *checkout* (× 2 on
a cart page) and ends the session. The session ends with a non-empty cart ⇒ ORDER with
P = *order* + *+coupon* (coupon claimed) + *+share* (shared) + *+detail* × min(details, 3)/3
(at most 0.95): minutes after the last page at checkout; after leaving, with 0.6 × that
probability, hours later (exponential, mean 12 h: about 14 % after 24 h, 8 % within 1 h).
Detail pages opened on a VIEW_DETAIL prompt also raise the add-to-cart take-up by
*+detail take* × min(details, 3)/3.

| intent | mix | leave | take atc/vd/cpn/shr | complain atc/vd/cpn/shr | order | +coupon | +share | +detail take/order | checkout |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| buyer | 0.25 | 0.10 | 0.50/0.50/0.40/0.05 | 0.00/0.00/0.02/0.10 | 0.70 | 0.05 | 0.00 | 0.05/0.05 | 0.20 |
| browser | 0.40 | 0.20 | 0.05/0.60/0.10/0.05 | 0.10/0.00/0.05/0.10 | 0.10 | 0.05 | 0.00 | 0.35/0.40 | 0.10 |
| bargain_hunter | 0.20 | 0.12 | 0.30/0.40/0.85/0.05 | 0.02/0.00/0.00/0.10 | 0.10 | 0.65 | 0.00 | 0.05/0.05 | 0.15 |
| social_sharer | 0.15 | 0.12 | 0.20/0.50/0.10/0.70 | 0.05/0.00/0.08/0.00 | 0.15 | 0.00 | 0.50 | 0.05/0.05 | 0.12 |

So the best action depends on the intent: buyers ⇒ add_to_cart; bargain hunters ⇒ a coupon
first, then add_to_cart; social sharers ⇒ share first, then add_to_cart; browsers ⇒ detail
pages first (they warm up), then add_to_cart. Pushing a prompt at the wrong shopper gets
complaints, and complaints drive shoppers away.

Orders. ``value`` is the cart's GMV (the sum of the prices of the items added, at list
price); ``coupon_discount`` is ``min(0.15 × value, 40)`` when a coupon was claimed, else 0.
Serving EXIT makes the shopper leave. Every session ends with exactly one EXIT event, at the
latest after ``max_pages`` pages. Event times never decrease within a session: reactions fall
within the page's dwell time (tens of seconds to minutes), EXIT at its end, and an order
minutes (checkout) or hours (after leaving, so after the EXIT) later.

Engagement signals. ``engagement()`` (after a ``respond``) is that page view's ``PageEngagement``:
the active seconds on the page, the scroll depth and whether the shopper bounced, reported at the
page's end. They follow only the page's hidden reaction: the prompt *taken up*, *dismissed* (a
prompt other than VIEW_DETAIL not taken up) or *idle* (VIEW_DETAIL not taken up, or EXIT served:
the shopper just leaves, with no prompt to take up or dismiss and no complaint drawn), and a
*complaint* (with any of them). With T the page's time (the next page's event time − this one's;
on the last page the dwell drawn for it) and fresh noise z1, z2 ~ N(0, 1), u ~ U(0, 1):
``dwell_s`` = T × logistic(*active logit* + 1.0 z1), ``scroll_depth`` = clip(*scroll* + 0.25 z2, 0, 1),
``bounced`` = u < *bounce* (clipped to [0.005, 0.95]), with (``engagement_table(SimConfig())``):

| reaction | active logit | scroll | bounce |
| --- | --- | --- | --- |
| taken up | 1.50 | 0.65 | 0.030 |
| taken up + complaint | 0.00 | 0.50 | 0.430 |
| dismissed | -0.30 | 0.30 | 0.120 |
| dismissed + complaint | -1.80 | 0.15 | 0.520 |
| idle | 0.50 | 0.45 | 0.060 |
| idle + complaint | -1.00 | 0.30 | 0.460 |

So the mean active fraction is about 0.78 taken up, 0.44 dismissed, 0.61 idle and 0.2 after a
complaint; informative, but noisy page by page (and T itself varies, log-normal). The noise
comes from the session's own stream ``default_rng([seed, 2, i])``, drawn on the first call, one
row per page: calling ``engagement()`` or not changes nothing else in the session (its draws and
course are those of a session without it), and the signals never change what happens next.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from core.domain import Action, DecisionRequest, Outcome, PageType
from simulator.config import Intent, IntentProfile, SimConfig
from simulator.items import Catalogue
from simulator.products import PRODUCT_STREAM, Shelf, complaint_probability, in_stock_share, shelf, take_probability

_CATALOGUE_STREAM = 0
_SESSION_STREAM = 1
_ENGAGEMENT_STREAM = 2

# Per-page uniform slots.
_U_CART_PAGE, _U_STICK, _U_CATEGORY, _U_ITEM, _U_PAGE_TYPE, _U_BEHAVIOR, _U_EXTRA_P, _U_EXTRA = range(8)
_U_TAKE, _U_COMPLAIN, _U_CHECKOUT, _U_LEAVE, _U_ORDER, _U_REACT, _U_LATE = range(8, 15)
_N_U = 15
# Per-page normal slots.
_Z_DWELL, _Z_CHECKOUT = range(2)
_N_Z = 2
# The logit of the active fraction is clamped to this, so that 0 < fraction (and dwell_s) holds in floats.
_ACTIVE_LOGIT_MAX = 30.0

_PAGE_TYPES = (PageType.SEARCH, PageType.RECOMMEND, PageType.DETAIL)
_REACTION = {Action.ADD_TO_CART: "cart_add", Action.VIEW_DETAIL: "view_detail", Action.APPLY_COUPON: "coupon_claim",
             Action.SHARE_SOCIAL: "share"}
_TAKEN_OUTCOME = {Action.ADD_TO_CART: Outcome.ADD_TO_CART, Action.APPLY_COUPON: Outcome.COUPON_USED,
                  Action.SHARE_SOCIAL: Outcome.SHARE}


@dataclass(slots=True)
class PageView:
    """The request fields of one page view. Treat as immutable; ``item_embedding`` is read-only."""

    step: int  # 0-based page number within the session
    item_id: str
    item_embedding: npt.NDArray[np.float32]
    recent_behavior_ids: tuple[str, ...]  # most recent first
    page_type: PageType
    cart_item_count: int
    event_time_s: float


@dataclass(slots=True)
class OutcomeEvent:
    """What the frontend would report after a served action (``core.domain.Outcome``)."""

    outcome: Outcome
    value: float  # order GMV; 0 for other outcomes
    coupon_discount: float  # the order's coupon discount; 0 for other outcomes
    event_time_s: float


@dataclass(frozen=True, slots=True)
class PageEngagement:
    """What the frontend measured on one page view, reported after it (ReportEngagement)."""

    dwell_s: float  # active seconds on the page, 0 < dwell_s <= the page's time (next page's event time − this page's)
    scroll_depth: float  # in [0, 1]
    bounced: bool
    event_time_s: float  # when it is reported: the end of the page view (the time respond() moved the session clock to)


def _cdf(weights: tuple[float, ...]) -> tuple[float, ...]:
    total = sum(weights)
    return tuple(c / total for c in accumulate(weights))


def _pick(cdf: tuple[float, ...], u: float) -> int:
    return min(bisect_right(cdf, u), len(cdf) - 1)


@dataclass(frozen=True, slots=True)
class _IntentTables:
    """An intent profile's categorical distributions, as cumulative tables for ``_pick``."""

    profile: IntentProfile
    page_cdf: tuple[float, ...]
    behavior_ids: tuple[str, ...]
    behavior_cdf: tuple[float, ...]


class World:
    """The catalogue and the shopper population for one (config, seed)."""

    def __init__(self, config: SimConfig, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.config = config
        self.seed = seed
        self.catalogue = Catalogue.build(config, np.random.default_rng([seed, _CATALOGUE_STREAM]))
        self._intent_cdf = _cdf(tuple(p.weight for p in config.intents))
        self._tables = tuple(
            _IntentTables(p, _cdf(p.pages), tuple(b for b, _ in p.behaviors), _cdf(tuple(w for _, w in p.behaviors)))
            for p in config.intents
        )
        self._categories = tuple(c for c, items in enumerate(self.catalogue.by_category) if items)
        trendy = tuple(c for c in self._categories if c < config.n_trendy)
        self._trendy = trendy or self._categories

    def session(self, index: int) -> ShopperSession:
        """Shopper session ``index`` (>= 0); the same index always gives the same shopper."""
        if index < 0:
            raise ValueError(f"session index must be >= 0, got {index}")
        return ShopperSession(self, index)


class ShopperSession:
    """One shopper's visit. Call ``page()``, serve an action with ``respond()``, repeat until ``page()`` is None.

    ``intent``, ``cart_value``, ``coupon_claimed``, ``shared`` and ``details_opened`` are the
    hidden state, for drivers and tests; never show them to the decider.
    """

    __slots__ = (
        "_behaviors", "_cart", "_ended", "_engagement_noise", "_follow_item", "_index", "_item", "_multipliers", "_offer_complaint",
        "_offered", "_pending", "_reaction", "_shelf", "_step", "_t", "_tables", "_u", "_visit_count", "_world", "_z", "coupon_claimed",
        "details_opened", "favourite", "intent", "session_id", "shared", "user_id",
    )

    def __init__(self, world: World, index: int) -> None:
        config = world.config
        rng = np.random.default_rng([world.seed, _SESSION_STREAM, index])
        head = rng.random(5).tolist()
        hour_z = float(rng.standard_normal())
        self._u: list[list[float]] = rng.random((config.max_pages, _N_U)).tolist()
        self._z: list[list[float]] = rng.standard_normal((config.max_pages, _N_Z)).tolist()

        self._world = world
        self._index = index
        self.intent = Intent(_pick(world._intent_cdf, head[0]))
        self._tables = world._tables[self.intent]
        profile = self._tables.profile
        pool = world._trendy if head[1] < profile.trendy else world._categories
        self.favourite: int = pool[min(int(head[2] * len(pool)), len(pool) - 1)]
        self.session_id = f"sim{world.seed}-s{index}"
        self.user_id = f"sim{world.seed}-u{int(head[3] * config.n_users)}"
        hour = (profile.peak_hour + config.hour_spread_h * hour_z) % 24.0
        day = min(int(head[4] * config.n_days), config.n_days - 1)
        self._t = config.epoch_s + day * 86_400.0 + hour * 3600.0

        self._behaviors: deque[str] = deque(maxlen=config.max_behaviors)
        self._cart: list[int] = []
        self._step = 0
        self._pending: PageView | None = None
        self._follow_item: int | None = None  # the item whose detail page the shopper opened
        self._item = -1  # the current page's item
        self._ended = False
        # The last page responded to: (its start, its end, taken up, dismissed, complained).
        self._reaction: tuple[float, float, bool, bool, bool] | None = None
        # Per page [z active, z scroll] and u bounce, drawn on the first ``engagement()``.
        self._engagement_noise: tuple[list[list[float]], list[float]] | None = None
        self.coupon_claimed = False
        self.shared = False
        self.details_opened = 0
        self._multipliers: list[float] = []  # per cart item, its price band's multiplier (1: added on a prompt)
        self._offered = -1  # the step whose page was offered a product (one offer a page)
        self._shelf: tuple[int, Shelf] | None = None  # (step, its shelf): a driver asks for the candidates, then offers
        self._offer_complaint = False  # this page's offer drew a complaint: the shopper may leave after it
        self._visit_count: int | None = None  # drawn from the product stream when first asked

    @property
    def cart_value(self) -> float:
        prices = self._world.catalogue.prices  # × 1.0 for an item added on a prompt: the same float as its price
        return sum(prices[i] * m for i, m in zip(self._cart, self._multipliers, strict=True))

    @property
    def visit_count(self) -> int:
        """The shopper's visits including this one (hidden: the frontend knows it; 1 is a first visit)."""
        if self._visit_count is None:
            rng = np.random.default_rng([self._world.seed, PRODUCT_STREAM, self._index])
            first, extra = rng.random(), rng.geometric(0.3)
            self._visit_count = 1 if first < self._world.config.products.first_visit else 1 + int(extra)
        return self._visit_count

    def shelf(self) -> Shelf:
        """The current page's product candidates (``simulator.products``); the same on every call for this page."""
        if self.page() is None:
            raise RuntimeError(f"session {self.session_id} has ended")
        if self._shelf is None or self._shelf[0] != self._step:  # kept for the page: built from its own stream, it cannot change
            world = self._world
            self._shelf = (self._step, shelf(world.catalogue, world.config.products, world.seed, self._index, self._step,
                                             self.favourite, world._categories, self.visit_count))
        return self._shelf[1]

    def offer(self, category: int, sku: int, band: int) -> list[OutcomeEvent]:
        """Show the current page's shelf product ``categories[category]``, item ``sku`` of it, at band ``band``: the
        shopper takes it (ADD_TO_CART: into the cart at its list price × the band) or not, and may complain. At most one
        offer a page, before ``respond``; an item out of stock cannot be offered (the server never serves one)."""
        page = self.page()
        if page is None:
            raise RuntimeError(f"session {self.session_id} has ended")
        if self._offered == self._step:
            raise RuntimeError("this page was already offered a product")
        here = self.shelf()
        if not (0 <= category < len(here.categories) and 0 <= sku < len(here.items[category]) and 0 <= band < len(here.multipliers)):
            raise ValueError(f"offer: no candidate ({category}, {sku}, {band}) on this shelf")
        if here.stock[category][sku] == 0:
            raise ValueError(f"offer: item {sku} of category {category} is out of stock")
        self._offered = self._step
        world, settings = self._world, self._world.config.products
        item, multiplier = here.items[category][sku], here.multipliers[band]
        take = take_probability(world.catalogue, settings, self.intent, self.favourite, here.categories[category] in world._trendy,
                                here.categories[category], item, multiplier, here.competitor[category][sku])
        t = page.event_time_s + 1.0
        events: list[OutcomeEvent] = []
        if here.u_take < take:
            self._cart.append(item)
            self._multipliers.append(multiplier)
            self._behaviors.appendleft(_REACTION[Action.ADD_TO_CART])
            events.append(OutcomeEvent(Outcome.ADD_TO_CART, 0.0, 0.0, t))
        self._offer_complaint = here.u_complain < complaint_probability(settings, multiplier, here.multipliers, here.visit_count,
                                                                        float(world.catalogue.price[item]),
                                                                        here.competitor[category][sku],
                                                                        in_stock_share(here, category))
        if self._offer_complaint:
            events.append(OutcomeEvent(Outcome.COMPLAINT, 0.0, 0.0, t))
        return events

    @property
    def ended(self) -> bool:
        return self._ended

    def page(self) -> PageView | None:
        """The next page view (the same one until ``respond``), or None once the shopper has left."""
        if self._ended:
            return None
        if self._pending is None:
            self._pending = self._next_page()
        return self._pending

    def request(self, page: PageView, request_id: str = "") -> DecisionRequest:
        """``page`` as the decision code's request type."""
        return DecisionRequest(
            user_id=self.user_id, session_id=self.session_id, item_id=page.item_id, item_embedding=page.item_embedding,
            recent_behavior_ids=page.recent_behavior_ids, page_type=page.page_type, event_time_s=page.event_time_s,
            cart_item_count=page.cart_item_count, request_id=request_id,
        )

    def _next_page(self) -> PageView:
        world, config, tables = self._world, self._world.config, self._tables
        catalogue = world.catalogue
        u = self._u[self._step]
        if self._follow_item is not None:
            item, page_type = self._follow_item, PageType.DETAIL
        elif self._cart and u[_U_CART_PAGE] < config.cart_page_p:
            item, page_type = self._cart[-1], PageType.CART
        else:
            page_type = _PAGE_TYPES[_pick(tables.page_cdf, u[_U_PAGE_TYPE])]
            cats = world._categories
            category = self.favourite if u[_U_STICK] < config.fav_stick else cats[min(int(u[_U_CATEGORY] * len(cats)), len(cats) - 1)]
            items = catalogue.by_category[category]
            item = items[min(int(u[_U_ITEM] ** tables.profile.cheap_bias * len(items)), len(items) - 1)]
        self._follow_item = None
        self._item = item
        self._behaviors.appendleft(tables.behavior_ids[_pick(tables.behavior_cdf, u[_U_BEHAVIOR])])
        if u[_U_EXTRA_P] < config.extra_behavior_p:
            self._behaviors.appendleft(tables.behavior_ids[_pick(tables.behavior_cdf, u[_U_EXTRA])])
        return PageView(
            step=self._step, item_id=catalogue.item_ids[item], item_embedding=catalogue.embeddings[item],
            recent_behavior_ids=tuple(self._behaviors), page_type=page_type, cart_item_count=len(self._cart),
            event_time_s=self._t,
        )

    def respond(self, action: Action) -> list[OutcomeEvent]:
        """The shopper's reaction to ``action`` served on the current page, in time order.

        Ends the session (the events then include exactly one EXIT) when the shopper leaves,
        checks out, was served EXIT, or this was page ``max_pages``.
        """
        page = self.page()
        if page is None:
            raise RuntimeError(f"session {self.session_id} has ended")
        config, profile = self._world.config, self._tables.profile
        u, z = self._u[self._step], self._z[self._step]
        t_next = page.event_time_s + config.dwell_median_s * math.exp(config.dwell_sigma * z[_Z_DWELL])
        t_react = page.event_time_s + (0.1 + 0.4 * u[_U_REACT]) * (t_next - page.event_time_s)
        events: list[OutcomeEvent] = []
        self._pending = None
        self._step += 1
        self._t = t_next

        if action is Action.EXIT:
            self._reaction = (page.event_time_s, t_next, False, False, False)
            return self._end(events, checkout=False, u=u, z=z)

        a = action.index
        take = profile.take[a]
        if action is Action.ADD_TO_CART:
            take = min(1.0, take + profile.detail_take_lift * min(self.details_opened, 3) / 3)
        taken = u[_U_TAKE] < take
        if taken:
            if action is Action.ADD_TO_CART:
                self._cart.append(self._item)
                self._multipliers.append(1.0)
            elif action is Action.VIEW_DETAIL:
                self.details_opened += 1
                self._follow_item = self._item
            elif action is Action.APPLY_COUPON:
                self.coupon_claimed = True
            else:
                self.shared = True
            outcome = _TAKEN_OUTCOME.get(action)
            if outcome is not None:
                events.append(OutcomeEvent(outcome, 0.0, 0.0, t_react))
            self._behaviors.appendleft(_REACTION[action])
        elif action is not Action.VIEW_DETAIL:
            self._behaviors.appendleft("dismiss_prompt")
        complained = u[_U_COMPLAIN] < profile.complain[a]
        if complained:
            events.append(OutcomeEvent(Outcome.COMPLAINT, 0.0, 0.0, t_react))
        self._reaction = (page.event_time_s, t_next, taken, not taken and action is not Action.VIEW_DETAIL, complained)

        if self._cart:
            checkout = profile.checkout * (config.cart_page_checkout_mult if page.page_type is PageType.CART else 1.0)
            if u[_U_CHECKOUT] < checkout:
                return self._end(events, checkout=True, u=u, z=z)
        complained_here = complained or (self._offer_complaint and self._offered == self._step - 1)
        leave = profile.leave * (config.engaged_leave_mult if taken else 1.0) + (config.complaint_leave_add if complained_here else 0.0)
        if u[_U_LEAVE] < leave or self._step >= config.max_pages:
            return self._end(events, checkout=False, u=u, z=z)
        return events

    def engagement(self) -> PageEngagement | None:
        """The engagement of the page most recently responded to (None before the first respond()).

        A function of that page's hidden reaction, its time and its own noise (the session's
        engagement stream, row ``step``): calling it or not never changes the session.
        """
        if self._reaction is None:
            return None
        if self._engagement_noise is None:
            n = self._world.config.max_pages
            rng = np.random.default_rng([self._world.seed, _ENGAGEMENT_STREAM, self._index])
            self._engagement_noise = rng.standard_normal((n, 2)).tolist(), rng.random(n).tolist()
        zs, us = self._engagement_noise
        z_active, z_scroll = zs[self._step - 1]
        u_bounce = us[self._step - 1]
        t0, t1, taken, dismissed, complained = self._reaction
        config = self._world.config
        a, s, b = config.engagement_active, config.engagement_scroll, config.engagement_bounce
        logit = a[0] + a[1] * taken + a[2] * dismissed + a[3] * complained + config.engagement_active_sigma * z_active
        fraction = 1.0 / (1.0 + math.exp(-min(max(logit, -_ACTIVE_LOGIT_MAX), _ACTIVE_LOGIT_MAX)))
        scroll = s[0] + s[1] * taken + s[2] * dismissed + s[3] * complained + config.engagement_scroll_sigma * z_scroll
        lo, hi = config.engagement_bounce_range
        bounce = min(hi, max(lo, b[0] + b[1] * taken + b[2] * dismissed + b[3] * complained))
        return PageEngagement(
            dwell_s=(t1 - t0) * fraction, scroll_depth=min(1.0, max(0.0, scroll)), bounced=u_bounce < bounce, event_time_s=t1,
        )

    def _end(self, events: list[OutcomeEvent], *, checkout: bool, u: list[float], z: list[float]) -> list[OutcomeEvent]:
        """Close the session at ``self._t``: EXIT, and the order if the shopper places one."""
        config, profile = self._world.config, self._tables.profile
        self._ended = True
        self._follow_item = None
        p_order = 0.0
        if self._cart:
            p_order = min(
                config.order_p_max,
                profile.order + profile.coupon_lift * self.coupon_claimed + profile.share_lift * self.shared
                + profile.detail_order_lift * min(self.details_opened, 3) / 3,
            )
            if not checkout:
                p_order *= config.late_order_factor
        if not u[_U_ORDER] < p_order:
            events.append(OutcomeEvent(Outcome.EXIT, 0.0, 0.0, self._t))
            return events
        value = round(self.cart_value, 2)
        discount = round(min(config.coupon_rate * value, config.coupon_cap), 2) if self.coupon_claimed else 0.0
        if checkout:
            t_order = self._t + config.checkout_delay_median_s * math.exp(config.checkout_delay_sigma * z[_Z_CHECKOUT])
            events.append(OutcomeEvent(Outcome.ORDER, value, discount, t_order))
            events.append(OutcomeEvent(Outcome.EXIT, 0.0, 0.0, t_order))
        else:
            t_order = self._t - config.late_order_mean_s * math.log1p(-u[_U_LATE])
            events.append(OutcomeEvent(Outcome.EXIT, 0.0, 0.0, self._t))
            events.append(OutcomeEvent(Outcome.ORDER, value, discount, t_order))
        return events
