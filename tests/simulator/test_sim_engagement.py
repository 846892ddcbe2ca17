"""The simulator's per-page engagement signals: deterministic, bounded, informative, and no change to the dynamics."""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import replace

import numpy as np
import pytest

import simulator.world as world_module
from core.domain import Action, Outcome
from simulator.config import SimConfig, engagement_table
from simulator.world import OutcomeEvent, PageEngagement, PageView, ShopperSession, World

SMALL = SimConfig(n_items=400, item_dim=32, n_categories=6, n_trendy=2)
ACTIONS = (Action.ADD_TO_CART, Action.VIEW_DETAIL, Action.APPLY_COUPON, Action.SHARE_SOCIAL, Action.EXIT)
ACTION_CDF = tuple(np.cumsum((0.3, 0.3, 0.15, 0.2, 0.05)).tolist())
TAKEN_OUTCOME = {Action.ADD_TO_CART: Outcome.ADD_TO_CART, Action.APPLY_COUPON: Outcome.COUPON_USED,
                 Action.SHARE_SOCIAL: Outcome.SHARE}
# The courses of sessions 0..199 of World(SMALL, seed=17) under ``decide``, as ``course`` writes them,
# computed before the engagement signals existed. Change it only with a deliberate change to the dynamics.
COURSES_SHA256 = "7be3c085de0fbafcca34fef7cedcaf0f692755238f4e987ec3bd3625149625be"


def decide(session: ShopperSession, page: PageView) -> Action:
    """Mostly prompts, sometimes EXIT; seeded by session and step, so reruns serve the same."""
    u = float(np.random.default_rng([zlib.crc32(session.session_id.encode()), page.step]).random())
    return ACTIONS[min(sum(c <= u for c in ACTION_CDF), len(ACTIONS) - 1)]


def course(session: ShopperSession, read: bool) -> tuple[list[object], list[PageEngagement]]:
    """A session's course (times to the millisecond, money to the cent) and, if ``read``, its engagement per page."""
    out: list[object] = [session.session_id, session.user_id, session.intent.name]
    signals: list[PageEngagement] = []
    while (page := session.page()) is not None:
        action = decide(session, page)
        out.append((page.step, page.item_id, page.recent_behavior_ids, page.page_type.name, page.cart_item_count,
                    f"{page.event_time_s:.3f}", action.name))
        out.extend((e.outcome.name, f"{e.value:.2f}", f"{e.coupon_discount:.2f}", f"{e.event_time_s:.3f}")
                   for e in session.respond(action))
        if read:
            engagement = session.engagement()
            assert engagement is not None
            signals.append(engagement)
    return out, signals


def reaction(session: ShopperSession, action: Action, details_before: int, events: list[OutcomeEvent]) -> str:
    """The page's hidden reaction, from what the session reported: taken / dismissed / idle, or complained."""
    outcomes = [e.outcome for e in events]
    if Outcome.COMPLAINT in outcomes:
        return "complained"
    if action is Action.EXIT:
        return "idle"
    if action is Action.VIEW_DETAIL:
        return "taken" if session.details_opened > details_before else "idle"
    return "taken" if TAKEN_OUTCOME[action] in outcomes else "dismissed"


def test_none_before_the_first_respond() -> None:
    session = World(SMALL, seed=1).session(0)
    assert session.engagement() is None
    assert session.page() is not None
    assert session.engagement() is None
    session.respond(Action.VIEW_DETAIL)
    assert isinstance(session.engagement(), PageEngagement)


def test_the_dynamics_are_unchanged_whether_or_not_engagement_is_read() -> None:
    world = World(SMALL, seed=17)
    unread = [course(world.session(i), read=False)[0] for i in range(200)]
    read = [course(world.session(i), read=True)[0] for i in range(200)]
    assert read == unread
    assert hashlib.sha256(repr(unread).encode()).hexdigest() == COURSES_SHA256
    assert sum(len(c) for c in unread) > 200 * 5  # not a run of empty sessions


def test_engagement_is_deterministic_for_seed_index_and_actions() -> None:
    a, b = World(SMALL, seed=9), World(SMALL, seed=9)
    first = [course(a.session(i), read=True)[1] for i in range(30)]
    assert first == [course(b.session(i), read=True)[1] for i in range(30)]
    # Read on some pages only, twice, in another order of sessions: the same values on those pages.
    for index in reversed(range(30)):
        session, k = b.session(index), 0
        while (page := session.page()) is not None:
            session.respond(decide(session, page))
            if k % 2:
                assert session.engagement() == session.engagement() == first[index][k]
            k += 1
    other = [course(World(SMALL, seed=10).session(i), read=True)[1] for i in range(30)]
    assert [e.dwell_s for s in other for e in s] != [e.dwell_s for s in first for e in s]


def test_engagement_is_bounded_and_reported_at_the_end_of_the_page() -> None:
    world = World(SMALL, seed=4)
    n = 0
    for index in range(300):
        session = world.session(index)
        page = session.page()
        while page is not None:
            events = session.respond(decide(session, page))
            engagement = session.engagement()
            assert engagement is not None
            page_time = engagement.event_time_s - page.event_time_s
            assert 0 < engagement.dwell_s <= page_time < 3 * 3600.0
            assert 0.0 <= engagement.scroll_depth <= 1.0
            assert all(e.event_time_s >= page.event_time_s for e in events)
            reactions = [e for e in events if e.outcome not in (Outcome.EXIT, Outcome.ORDER)]
            assert all(e.event_time_s <= engagement.event_time_s for e in reactions)
            page = session.page()
            if page is not None:  # the clock moved to the next page's time
                assert engagement.event_time_s == page.event_time_s
            else:  # left: EXIT at the clock; at checkout, the order and EXIT minutes later
                (exit_time,) = [e.event_time_s for e in events if e.outcome is Outcome.EXIT]
                checkout = [e.outcome for e in events][-2:] == [Outcome.ORDER, Outcome.EXIT]
                assert exit_time > engagement.event_time_s if checkout else exit_time == engagement.event_time_s
            n += 1
    assert n > 1000


def test_the_signals_follow_the_hidden_reaction() -> None:
    world = World(SMALL, seed=23)
    by: dict[str, list[tuple[float, float, float, bool]]] = {k: [] for k in ("taken", "dismissed", "idle", "complained")}
    index = 0
    while sum(map(len, by.values())) < 4000:
        session = world.session(index)
        index += 1
        while (page := session.page()) is not None:
            action, details = decide(session, page), session.details_opened
            events = session.respond(action)
            e = session.engagement()
            assert e is not None
            by[reaction(session, action, details, events)].append(
                (e.dwell_s, e.dwell_s / (e.event_time_s - page.event_time_s), e.scroll_depth, e.bounced))
    n = {k: len(v) for k, v in by.items()}
    assert n["taken"] > 800 and n["dismissed"] > 800 and n["idle"] > 200 and n["complained"] > 80, n
    mean = {k: np.array(v, dtype=np.float64).mean(axis=0) for k, v in by.items()}
    dwell, active, scroll, bounce = ({k: float(m[j]) for k, m in mean.items()} for j in range(4))
    # Expected (defaults): active 0.78 / 0.44 / 0.61 / ~0.2, scroll 0.64 / 0.32 / 0.45 / ~0.2, bounce 0.03 / 0.12 / 0.06 / ~0.5.
    assert dwell["taken"] > 1.4 * dwell["dismissed"] and dwell["dismissed"] > 1.4 * dwell["complained"], dwell
    assert active["taken"] > active["idle"] + 0.08 > active["dismissed"] + 0.16 > active["complained"] + 0.26, active
    assert scroll["taken"] > scroll["idle"] + 0.08 > scroll["dismissed"] + 0.16, scroll
    assert scroll["taken"] > scroll["dismissed"] + 0.25 and scroll["dismissed"] > scroll["complained"] + 0.03, scroll
    assert bounce["taken"] < 0.06 and 0.07 < bounce["dismissed"] < 0.18 and bounce["complained"] > 0.35, bounce
    assert bounce["complained"] > 3 * bounce["dismissed"] > 6 * bounce["taken"], bounce
    # Noisy page by page: every reaction spans a wide range of scroll depths.
    for k in ("taken", "dismissed"):
        depths = np.array([v[2] for v in by[k]])
        assert depths.std() > 0.15 and depths.min() < 0.2 and depths.max() > 0.8, k


def test_without_noise_the_signals_are_the_documented_formulas() -> None:
    config = replace(SMALL, engagement_active_sigma=0.0, engagement_scroll_sigma=0.0, engagement_bounce_range=(0.0, 1.0),
                     engagement_bounce=(0.5, 0.5, -0.5, 0.0))  # taken up: always a bounce, dismissed: never
    a, s = config.engagement_active, config.engagement_scroll
    world, seen = World(config, seed=2), set()
    for index in range(200):
        session = world.session(index)
        while (page := session.page()) is not None:
            action, details = decide(session, page), session.details_opened
            kind = reaction(session, action, details, session.respond(action))
            if kind == "complained":
                continue
            e = session.engagement()
            assert e is not None
            x = (1.0, kind == "taken", kind == "dismissed", 0.0)
            logit = sum(c * v for c, v in zip(a, x, strict=True))
            assert e.dwell_s == pytest.approx((e.event_time_s - page.event_time_s) / (1 + math.exp(-logit)), rel=1e-12)
            assert e.scroll_depth == pytest.approx(sum(c * v for c, v in zip(s, x, strict=True)), abs=1e-12)
            if kind != "idle":  # idle: P(bounce) = 0.5
                assert e.bounced is (kind == "taken")
            seen.add(kind)
    assert seen == {"taken", "dismissed", "idle"}


def test_the_docstring_table_is_the_default_config() -> None:
    config, doc = SimConfig(), world_module.__doc__
    assert doc is not None and engagement_table(config) in doc
    assert f"+ {config.engagement_active_sigma} z1" in doc and f"+ {config.engagement_scroll_sigma} z2" in doc
    lo, hi = config.engagement_bounce_range
    assert f"[{lo}, {hi}]" in doc


@pytest.mark.parametrize(("change", "message"), [
    ({"engagement_active_sigma": -1.0}, "engagement_active_sigma"),
    ({"engagement_scroll_sigma": -0.1}, "engagement_scroll_sigma"),
    ({"engagement_bounce_range": (0.5, 0.2)}, "engagement_bounce_range"),
    ({"engagement_bounce_range": (0.0, 1.5)}, "engagement_bounce_range"),
    ({"engagement_scroll": (0.4, math.nan, 0.0, 0.0)}, "engagement_scroll"),
    ({"engagement_active": (0.0, 0.0, math.inf, 0.0)}, "engagement_active"),
])
def test_bad_engagement_config_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(SimConfig(), **change)  # type: ignore[arg-type]
