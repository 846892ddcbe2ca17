"""The business objective in closed form (net GMV minus complaint costs, per session), and as rewards that sum to it."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Outcome
from experience.objective import GAMMA, BusinessObjective
from experience.returns import session_returns
from experience.sessions import EpisodeConfig, build_episodes
from simulator.config import SimConfig
from simulator.drive import run_in_process
from simulator.world import World
from tests.harness import fresh_bundle
from tests.log_tables import outcome_table
from weights.model_set import LoadOptions, ModelSet


def outcomes(*rows: tuple[str, str, Outcome, float, float]) -> pa.Table:
    """(outcome_id, session_id, outcome, value, coupon_discount); times and decision ids are filler."""
    keys = ("outcome_id", "session_id", "outcome", "value", "coupon_discount")
    return outcome_table(dict(zip(keys, r, strict=True)) for r in rows)

def test_net_gmv_minus_complaints_per_session() -> None:
    table = outcomes(
        ("o1", "a", Outcome.ORDER, 100.0, 15.0),
        ("o1", "a", Outcome.ORDER, 100.0, 15.0),  # a resend: counted once
        ("o2", "a", Outcome.COMPLAINT, 0.0, 0.0),
        ("o3", "b", Outcome.ORDER, 40.0, 0.0),
        ("o4", "b", Outcome.ADD_TO_CART, 999.0, 0.0),  # not an order: no GMV
        ("o5", "zz", Outcome.ORDER, 1e6, 0.0),  # a session not asked about
    )
    b = BusinessObjective(complaint_cost=10.0).per_session(["a", "b", "c"], table)
    assert b.gmv.tolist() == [100.0, 40.0, 0.0]
    assert b.net_gmv.tolist() == [85.0, 40.0, 0.0]
    assert b.complaints.tolist() == [1.0, 0.0, 0.0]
    assert b.objective.tolist() == [75.0, 40.0, 0.0]
    summary = BusinessObjective(complaint_cost=10.0).summary(["a", "b", "c"], table)
    assert summary["objective"].mean == pytest.approx(115.0 / 3)
    assert summary["net_gmv"].low < summary["net_gmv"].mean < summary["net_gmv"].high


def test_coupons_for_all_cost_what_they_give_away() -> None:
    """The same orders with a coupon on each: mean_return's attribution may pay for it; net GMV does not."""
    plain = outcomes(*[(f"o{i}", f"s{i}", Outcome.ORDER, 100.0, 0.0) for i in range(4)])
    couponed = outcomes(*[(f"o{i}", f"s{i}", Outcome.ORDER, 100.0, 15.0) for i in range(4)])
    sessions = [f"s{i}" for i in range(4)]
    objective = BusinessObjective()
    assert objective.summary(sessions, couponed)["net_gmv"].mean == objective.summary(sessions, plain)["net_gmv"].mean - 15.0


def test_no_outcomes_and_bad_costs() -> None:
    assert BusinessObjective().per_session(["a"], outcomes()).objective.tolist() == [0.0]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="complaint_cost"):
            BusinessObjective(complaint_cost=bad)
    assert BusinessObjective(complaint_cost=0.0).complaint_cost == 0.0  # net GMV alone: complaints cost nothing


# --- the objective as rewards: placed where each outcome is observed -------------------------------------------------


@pytest.mark.parametrize("complaint_cost", [10.0, 3.5])
def test_the_objective_rules_sum_to_the_objective_of_simulated_sessions(complaint_cost: float) -> None:
    """Σ over a session's steps of the rule rewards (γ = 1) is its ``per_session`` objective, session by session."""
    objective = BusinessObjective(complaint_cost=complaint_cost)
    trace = run_in_process(World(SimConfig(), 5), ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8)), range(1000),
                           ZoneInfo("UTC"))
    decisions, outcomes = trace.tables()
    episodes = build_episodes(decisions, outcomes, objective.episode_config())
    b = objective.per_session(episodes.session_ids, outcomes)
    assert episodes.report.n_outcomes_outside_horizon == 0  # (a late order after 72 h would count only on the right)
    assert (b.discounts > 0).sum() >= 5 and (b.complaints > 0).sum() >= 5 and (b.gmv > 0).sum() >= 20  # the check has teeth
    np.testing.assert_allclose(session_returns(episodes, gamma=GAMMA), b.objective, rtol=1e-12, atol=1e-9)
    assert trace.value(objective.episode_config(), gamma=GAMMA).mean == pytest.approx(trace.business(objective)["objective"].mean)


def test_the_objective_episode_config() -> None:
    config = BusinessObjective(complaint_cost=2.0).episode_config(3600.0)
    assert config.horizon_s == 3600.0 and config.open_terminal_reward == 0.0
    assert config.attribution.rules == BusinessObjective(complaint_cost=2.0).rules(3600.0)
    assert [r.weight for r in config.attribution.rules] == [1.0, -2.0]
    assert EpisodeConfig.from_dict(config.to_dict()) == config
