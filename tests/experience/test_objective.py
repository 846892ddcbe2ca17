"""The business objective in closed form: net GMV minus complaint costs, per session, from de-duplicated outcomes."""

from __future__ import annotations

import pyarrow as pa
import pytest

from core.domain import Outcome
from experience.objective import BusinessObjective
from tests.log_tables import outcome_table


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
