"""Harm labels from hand-made logs: complaints, the exit window and its edges, duplicates, unknown decisions."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Action, Outcome
from tests.log_tables import decisions, outcome_table
from trainer.config import GuardConfig
from trainer.guard_labels import harmful_labels

ATC, VD, EXIT = int(Action.ADD_TO_CART), int(Action.VIEW_DETAIL), int(Action.EXIT)


def outcomes(*rows: tuple[str, str, Outcome, float, float], session: str | None = None) -> pa.Table:
    """Rows of (outcome_id, decision_id, outcome, event_time_s, received_s), each in the session of the decision it names
    (``session``: in that one instead); the other columns are filler."""
    keys = ("outcome_id", "decision_id", "outcome", "event_time_s", "received_s")
    return outcome_table({**dict(zip(keys, r, strict=True)), "session_id": session or _SESSION_OF.get(r[1], "s9")}
                         for r in rows)

# --- labels --------------------------------------------------------------------------------------

DECISIONS = decisions(
    ("complained", "s1", 100.0, ATC),
    ("exit_at_edge", "s1", 200.0, VD),  # EXIT exactly 30 s later: harmful
    ("exit_past_edge", "s2", 300.0, VD),  # EXIT one ulp past 30 s: not
    ("served_exit", "s2", 400.0, EXIT),  # serving EXIT then an EXIT: exempt
    ("ordered", "s3", 500.0, ATC),
    ("dup_complaint", "s3", 600.0, ATC),
    ("dup_exit", "s4", 700.0, VD),  # first-received copy 100 s later, a later copy 10 s later: the first counts
    ("skewed_exit", "s4", 800.0, VD),  # EXIT reported 5 s *before* the decision: clock skew, within
    ("quiet", "s5", 900.0, ATC),
)
_SESSION_OF = dict(zip(DECISIONS["decision_id"].to_pylist(), DECISIONS["session_id"].to_pylist(), strict=True))
OUTCOMES = outcomes(
    ("o1", "complained", Outcome.COMPLAINT, 105.0, 1.0),
    ("o2", "exit_at_edge", Outcome.EXIT, 230.0, 1.0),
    ("o3", "exit_past_edge", Outcome.EXIT, math.nextafter(330.0, math.inf), 1.0),
    ("o4", "served_exit", Outcome.EXIT, 401.0, 1.0),
    ("o5", "ordered", Outcome.ORDER, 510.0, 1.0),
    ("o5b", "ordered", Outcome.ADD_TO_CART, 505.0, 1.0),
    ("o6", "dup_complaint", Outcome.COMPLAINT, 610.0, 1.0),
    ("o6", "dup_complaint", Outcome.COMPLAINT, 610.0, 2.0),
    ("o7", "dup_exit", Outcome.EXIT, 800.0, 1.0),
    ("o7", "dup_exit", Outcome.EXIT, 710.0, 2.0),
    ("o8", "skewed_exit", Outcome.EXIT, 795.0, 1.0),
    ("o9", "not_logged", Outcome.COMPLAINT, 901.0, 1.0),
    ("o10", "not_logged", Outcome.EXIT, 901.0, 1.0),
)
EXPECTED = {"complained", "exit_at_edge", "dup_complaint", "skewed_exit"}


def _harmful_ids(table: pa.Table, labels: np.ndarray) -> set[str]:
    assert labels.dtype == np.bool_ and labels.shape == (table.num_rows,)
    return {d for d, h in zip(table["decision_id"].to_pylist(), labels.tolist(), strict=True) if h}


def test_labels_complaints_exit_window_edges_duplicates_and_unknown_decisions() -> None:
    assert _harmful_ids(DECISIONS, harmful_labels(DECISIONS, OUTCOMES)) == EXPECTED


def test_labels_follow_the_decision_rows_in_any_order() -> None:
    shuffled = DECISIONS.take(pa.array([8, 3, 0, 6, 1, 7, 2, 5, 4]))
    labels = harmful_labels(shuffled, OUTCOMES.take(pa.array(list(range(OUTCOMES.num_rows))[::-1])))
    assert _harmful_ids(shuffled, labels) == EXPECTED
    assert labels.tolist() == [d in EXPECTED for d in shuffled["decision_id"].to_pylist()]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (GuardConfig(exit_counts=False), {"complained", "dup_complaint"}),
        (GuardConfig(harmful_outcomes=()), {"exit_at_edge", "skewed_exit"}),
        (GuardConfig(exit_within_s=math.nextafter(330.0, math.inf) - 300.0), EXPECTED | {"exit_past_edge"}),  # the gap itself
        (GuardConfig(exit_within_s=29.0), EXPECTED - {"exit_at_edge"}),
        (GuardConfig(exit_exempt_actions=()), EXPECTED | {"served_exit"}),
        (GuardConfig(harmful_outcomes=(Outcome.COMPLAINT, Outcome.ORDER), exit_counts=False), {"complained", "dup_complaint", "ordered"}),
    ],
)
def test_labels_follow_the_config(config: GuardConfig, expected: set[str]) -> None:
    assert _harmful_ids(DECISIONS, harmful_labels(DECISIONS, OUTCOMES, config)) == expected


def test_labels_of_empty_tables_and_missing_columns() -> None:
    assert harmful_labels(DECISIONS, OUTCOMES.slice(0, 0)).tolist() == [False] * DECISIONS.num_rows
    assert harmful_labels(DECISIONS.slice(0, 0), OUTCOMES).shape == (0,)
    with pytest.raises(ValueError, match="received_s"):
        harmful_labels(DECISIONS, OUTCOMES.drop_columns(["received_s"]))




def test_an_outcome_counts_for_the_decision_of_its_id_in_its_own_session_only() -> None:
    """A complaint or an exit reported in another session under a decision's id labels nothing: a report counts where it
    was made (a review, 2026-12-05), as product rewards do."""
    elsewhere = outcomes(("x1", "quiet", Outcome.COMPLAINT, 905.0, 1.0), ("x2", "ordered", Outcome.EXIT, 505.0, 1.0),
                         session="s1")
    assert not harmful_labels(DECISIONS, elsewhere).any()
    assert _harmful_ids(DECISIONS, harmful_labels(DECISIONS, pa.concat_tables([OUTCOMES, elsewhere]))) == EXPECTED
