"""Engagement confidence weights: the function at its edges (closed forms), the join to the logged steps, the returns."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Outcome
from experience.attribution import ConfigError
from experience.engagement import EngagementWeights, step_weights
from experience.returns import discounted_returns
from experience.schema import ENGAGEMENTS
from experience.sessions import HORIZON_S, Episodes, build_episodes

NAN = math.nan
W = EngagementWeights()


@pytest.mark.parametrize(("dwell", "scroll", "bounced", "expected"), [
    pytest.param(NAN, NAN, NAN, 1.0, id="nothing-measured"),
    pytest.param(15.0, 0.5, 0.0, 1.0, id="average-page"),
    pytest.param(30.0, 1.0, 0.0, 1.5, id="full-engagement-upper-bound"),
    pytest.param(600.0, 1.0, 0.0, 1.5, id="dwell-past-the-reference-says-nothing-more"),
    pytest.param(0.0, 0.0, 1.0, 0.25, id="nothing-and-bounced-clipped-to-the-floor"),
    pytest.param(NAN, NAN, 1.0, 0.5, id="bounce-alone"),
    pytest.param(NAN, NAN, 0.0, 1.0, id="no-bounce-alone"),
    pytest.param(0.0, NAN, NAN, 0.75, id="zero-dwell-alone"),
    pytest.param(NAN, 0.9, NAN, 1.2, id="scroll-alone"),
    pytest.param(7.5, 0.25, 1.0, 1 - 0.125 - 0.125 - 0.5, id="interior"),
])
def test_weight_closed_forms(dwell: float, scroll: float, bounced: float, expected: float) -> None:
    got = W.of(np.array([dwell]), np.array([scroll]), np.array([bounced]))
    assert got[0] == pytest.approx(expected, abs=1e-12)


def test_weights_are_bounded_and_monotone_in_each_signal() -> None:
    rng = np.random.default_rng(0)
    d, s, b = rng.uniform(0, 100, 2000), rng.uniform(0, 1, 2000), (rng.random(2000) < 0.3).astype(float)
    w = W.of(d, s, b)
    assert (w >= W.low).all() and (w <= W.high).all()
    assert (W.of(d + 5.0, s, b) >= w).all() and (W.of(d, np.minimum(s + 0.1, 1.0), b) >= w).all()
    assert (W.of(d, s, np.ones_like(b)) <= w).all()


def test_settings_round_trip_and_bad_ones_are_refused_naming_the_field() -> None:
    custom = EngagementWeights(dwell=1.0, dwell_ref_s=10.0, scroll=0.0, bounce=0.9, low=0.1, high=2.0)
    assert EngagementWeights.from_dict(custom.to_dict()) == custom
    assert EngagementWeights.from_dict({}) == W
    for spec, message in [({"dwell": -0.1}, "engagement_weights.dwell: expected >= 0"),
                          ({"dwell_ref_s": 0}, "engagement_weights.dwell_ref_s: expected > 0"),
                          ({"low": 0.0}, "engagement_weights.low, high: expected 0 < low <= 1 <= high"),
                          ({"high": 0.9}, "engagement_weights.low, high"),
                          ({"bounce": float("nan")}, "engagement_weights.bounce: expected a finite number"),
                          ({"scroll": True}, "engagement_weights.scroll: expected a finite number"),
                          ({"shape": 1}, "engagement_weights")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            EngagementWeights.from_dict(spec)


def _decisions(rows: list[tuple[str, str, float]]) -> pa.Table:
    return pa.table({"decision_id": [r[0] for r in rows], "session_id": [r[1] for r in rows],
                     "event_time_s": [r[2] for r in rows], "action": pa.array([1] * len(rows), pa.int8())})


def _outcomes(rows: list[tuple[str, str, int, float, float]]) -> pa.Table:
    return pa.table({"outcome_id": [f"o{i}" for i in range(len(rows))], "decision_id": [r[0] for r in rows],
                     "session_id": [r[1] for r in rows], "outcome": pa.array([r[2] for r in rows], pa.int8()),
                     "value": [r[3] for r in rows], "coupon_discount": [0.0] * len(rows), "event_time_s": [r[4] for r in rows],
                     "received_s": [r[4] for r in rows]})


def _reports(rows: list[tuple[str, str, str, float | None, float | None, bool | None, float, float]]) -> pa.Table:
    names = ["engagement_id", "decision_id", "session_id", "dwell_s", "scroll_depth", "bounced", "event_time_s", "received_s"]
    columns = {n: [r[i] for r in rows] for i, n in enumerate(names)}
    return pa.Table.from_pydict({"schema_version": [2] * len(rows), **columns, "sample_rate": [1.0] * len(rows)}, schema=ENGAGEMENTS)


def _episodes(decisions: pa.Table, outcomes: pa.Table) -> tuple[pa.Table, Episodes]:
    episodes = build_episodes(decisions, outcomes)
    return decisions.take(pa.array(episodes.rows)), episodes


def test_the_join_weighs_the_named_step_and_leaves_out_what_it_cannot_place() -> None:
    decisions = _decisions([("a1", "A", 100.0), ("a2", "A", 160.0), ("b1", "B", 50.0), ("a0", "A", 40.0)])
    outcomes = _outcomes([("a2", "A", int(Outcome.ORDER), 80.0, 200.0), ("b1", "B", int(Outcome.ORDER), 10.0, 60.0)])
    steps, episodes = _episodes(decisions, outcomes)
    assert steps.column("decision_id").to_pylist() == ["a0", "a1", "a2", "b1"]  # episode order
    reports = _reports([
        ("e1", "a2", "A", 30.0, 1.0, False, 190.0, 190.0),        # full engagement on a2: 1.5
        ("e1", "a2", "A", 0.0, 0.0, True, 190.0, 195.0),          # a resend of e1, received later: the first copy counts
        ("e2", "a1", "A", None, None, True, 130.0, 130.0),        # a1 bounced: 0.5 ...
        ("e3", "a1", "A", None, None, False, 150.0, 150.0),       # ... superseded by a later report for a1: 1.0
        ("e4", "zz", "A", 30.0, 1.0, False, 120.0, 120.0),        # an unknown decision
        ("e5", "b1", "A", 30.0, 1.0, False, 120.0, 120.0),        # b1 is session B's: another session's decision is unknown
        ("e6", "b1", "B", 0.0, 0.0, True, 50.0 + HORIZON_S + 1, 50.0 + HORIZON_S + 1),  # late: past B's horizon
        ("e7", "a0", "A", 0.0, None, None, 10.0, 10.0),           # before A's first decision: outside
    ])
    weights, join = step_weights(steps, episodes, reports, W, HORIZON_S)
    np.testing.assert_allclose(weights, [1.0, 1.0, 1.5, 1.0])
    assert join.to_dict() == {"n_reports": 8, "n_duplicates": 1, "n_unknown_decision": 2, "n_outside_horizon": 2, "n_superseded": 1,
                              "n_steps_weighted": 2, "n_steps": 4, "mean_weight": pytest.approx(4.5 / 4)}


def test_no_reports_weigh_every_step_one() -> None:
    decisions = _decisions([("a1", "A", 100.0), ("a2", "A", 160.0)])
    steps, episodes = _episodes(decisions, _outcomes([]))
    weights, join = step_weights(steps, episodes, ENGAGEMENTS.empty_table(), W, HORIZON_S)
    assert weights.tolist() == [1.0, 1.0] and join.n_steps_weighted == 0 and join.mean_weight == 1.0


def test_returns_with_weights_scale_each_steps_reward_before_discounting() -> None:
    """G_t = Σ_k γ^k w_{t+k} r_{t+k}: the weights enter per step, before the returns."""
    decisions = _decisions([("a1", "A", 100.0), ("a2", "A", 160.0), ("a3", "A", 220.0)])
    outcomes = _outcomes([("a1", "A", int(Outcome.ORDER), 10.0, 120.0), ("a3", "A", int(Outcome.ORDER), 100.0, 230.0)])
    steps, episodes = _episodes(decisions, outcomes)
    reports = _reports([("e1", "a1", "A", None, None, True, 150.0, 150.0), ("e3", "a3", "A", 30.0, 1.0, False, 240.0, 240.0)])
    weights, _ = step_weights(steps, episodes, reports, W, HORIZON_S)
    rewards = episodes.rewards * weights
    g = discounted_returns(rewards, episodes.starts, episodes.lengths, 0.5)
    np.testing.assert_allclose(g, [0.5 * 10 + 0.25 * 1.5 * 100, 0.5 * 1.5 * 100, 1.5 * 100])


def test_signals_merge_across_reports_ids_are_per_session_and_row_order_does_not_matter() -> None:
    decisions = _decisions([("a1", "A", 100.0), ("a2", "A", 160.0), ("b1", "B", 50.0), ("late", "B", 50.0 + HORIZON_S + 5)])
    steps, episodes = _episodes(decisions, _outcomes([]))
    assert steps.column("decision_id").to_pylist() == ["a1", "a2", "b1"]  # the horizon cut "late": it is no step
    reports = _reports([
        ("e1", "a2", "A", 30.0, 1.0, None, 170.0, 170.0),          # dwell and scroll of a2 ...
        ("e2", "a2", "A", None, None, False, 175.0, 175.0),        # ... then only the bounce: 1 + ¼ + ¼ = 1½, not 1
        ("e1", "b1", "B", 0.0, 0.0, True, 60.0, 60.0),             # the same id in another session is another report
        ("e1", "b1", "B", 30.0, 1.0, False, 60.0, 60.0),           # a copy of it received at the same time: ties broken
        ("e3", "a1", "A", 0.0, 0.0, True, 99.0, 99.0),             # timed before the decision it names: outside
        ("e4", "late", "B", 0.0, 0.0, True, 50.0 + HORIZON_S + 6, 50.0 + HORIZON_S + 6),  # names the cut decision: unknown
    ])
    expected = [1.0, 1.5, 0.25]  # the tie between b1's copies goes to the smaller dwell (0.0): nothing, bounced, floored
    weights, join = step_weights(steps, episodes, reports, W, HORIZON_S)
    np.testing.assert_allclose(weights, expected)
    assert (join.n_duplicates, join.n_unknown_decision, join.n_outside_horizon, join.n_superseded) == (1, 1, 1, 1)
    for seed in range(5):  # any order of the rows gives the same weights
        shuffled = reports.take(pa.array(np.random.default_rng(seed).permutation(reports.num_rows)))
        np.testing.assert_allclose(step_weights(steps, episodes, shuffled, W, HORIZON_S)[0], expected)
