"""The Action Guard trainer: harm labels from hand-made logs, the threshold rule and AUC in closed form,
the session split, and a guard trained on a synthetic world whose harm is a known function of (state, action)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from core.domain import Action, Outcome
from tests.log_tables import decisions
from trainer.guard_train import (
    GuardConfig,
    GuardResult,
    choose_threshold,
    guard_metrics,
    harmful_labels,
    rank_auc,
    split_by_session,
    train_guard,
)

ATC, VD, EXIT = int(Action.ADD_TO_CART), int(Action.VIEW_DETAIL), int(Action.EXIT)


def outcomes(*rows: tuple[str, str, Outcome, float, float]) -> pa.Table:
    """Rows of (outcome_id, decision_id, outcome, event_time_s, received_s); the other columns are filler."""
    oid, did, kind, t, received = zip(*rows, strict=True)
    n = len(rows)
    return pa.table(
        {
            "outcome_id": pa.array(oid, pa.string()),
            "decision_id": pa.array(did, pa.string()),
            "session_id": pa.array(["s"] * n, pa.string()),
            "outcome": pa.array([int(k) for k in kind], pa.int8()),
            "value": pa.array([0.0] * n, pa.float64()),
            "coupon_discount": pa.array([0.0] * n, pa.float64()),
            "event_time_s": pa.array(t, pa.float64()),
            "received_s": pa.array(received, pa.float64()),
        }
    )


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


# --- threshold, AUC, metrics --------------------------------------------------------------------


def _fbr(harmless: np.ndarray, t: float) -> float:
    return float((harmless < t).mean())


def test_threshold_closed_forms_ties_and_empty() -> None:
    p = np.arange(1, 11) / 10.0  # 0.1 … 1.0
    assert choose_threshold(p, 0.15) == 0.2  # k = 1: p_(2); one of ten blocked
    assert choose_threshold(p, 0.2) == 0.3 and _fbr(p, 0.3) == 0.2  # the cap reached exactly
    assert choose_threshold(p, 0.0) == 0.1 and _fbr(p, 0.1) == 0.0  # nothing blocked
    assert choose_threshold(p[::-1], 0.15) == 0.2  # order does not matter
    ties = np.array([0.3, 0.3, 0.3, 0.5, 0.9])
    assert choose_threshold(ties, 0.2) == 0.3 and _fbr(ties, 0.3) == 0.0  # ties at p_(2) stay allowed: any t > 0.3 blocks 3/5
    assert choose_threshold(ties, 0.6) == 0.5 and _fbr(ties, 0.5) == 0.6
    assert choose_threshold(np.zeros(0), 0.015) == 0.0
    with pytest.raises(ValueError):
        choose_threshold(p, 1.0)


@pytest.mark.parametrize("seed", range(5))
def test_threshold_is_the_largest_that_keeps_the_cap(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in (1, 7, 200, 1000, 1337):
        p = np.round(rng.random(n), 2)  # many ties
        for r in (0.0, 0.015, 0.05, 0.5, 0.99):
            t = choose_threshold(p, r)
            assert _fbr(p, t) <= r
            assert _fbr(p, math.nextafter(t, math.inf)) > r  # anything larger breaks the cap
            assert t in p


def test_rank_auc_closed_form_and_brute_force() -> None:
    # harmful scores 0.9, 0.5 vs harmless 0.5, 0.1: wins 0.9>0.5, 0.9>0.1, 0.5>0.1, tie 0.5=0.5 ⇒ 3.5 / 4
    assert rank_auc(np.array([0.9, 0.5, 0.5, 0.1]), np.array([True, True, False, False])) == 0.875
    assert rank_auc(np.array([0.2, 0.1]), np.array([True, True])) == 0.5
    rng = np.random.default_rng(0)
    score, label = np.round(rng.random(300), 1), rng.random(300) < 0.2
    pos, neg = score[label][:, None], score[~label][None, :]
    assert rank_auc(score, label) == pytest.approx(float(((pos > neg) + 0.5 * (pos == neg)).mean()), abs=1e-12)


def test_metrics_closed_form() -> None:
    allow = np.array([0.1, 0.4, 0.6, 0.9, 0.7])
    harmful = np.array([True, False, False, False, True])
    m = guard_metrics(allow, harmful, 0.5)  # blocked: 0.1 (harmful), 0.4 (harmless); 0.7 (harmful) passes
    assert m["guard_accuracy"] == 0.6
    assert m["guard_false_block_rate"] == pytest.approx(1 / 3)
    assert m["guard_recall"] == 0.5 and m["guard_precision"] == 0.5
    assert m["guard_auc"] == pytest.approx(4 / 6)  # 0.1 is below all three harmless, 0.7 below 0.9 only
    assert m["guard_base_rate"] == 0.4 and m["guard_n_heldout"] == 5 and m["guard_n_heldout_harmful"] == 2
    assert guard_metrics(allow[1:4], harmful[1:4], 0.5)["guard_recall"] == 0.0  # no harmful pair: 0 by convention


# --- split ----------------------------------------------------------------------------------------


def _sides(sessions: np.ndarray, held: np.ndarray) -> dict[str, set[bool]]:
    sides: dict[str, set[bool]] = {}
    for s, h in zip(sessions.tolist(), held.tolist(), strict=True):
        sides.setdefault(s, set()).add(h)
    return sides


def test_split_is_by_session_stable_and_near_the_fraction() -> None:
    rng = np.random.default_rng(0)
    sessions = np.array([f"sess-{i}" for i in rng.integers(0, 4000, 40_000)], dtype=object)
    held = split_by_session(sessions, 0.2, seed=0)
    sides = _sides(sessions, held)
    assert all(len(v) == 1 for v in sides.values())  # no session on both sides
    assert abs(np.mean([h for (h,) in sides.values()]) - 0.2) < 0.03
    subset = rng.permutation(np.flatnonzero(rng.random(len(sessions)) < 0.3))
    assert np.array_equal(split_by_session(sessions[subset], 0.2, seed=0), held[subset])  # a session's side depends on its id alone
    assert not np.array_equal(split_by_session(sessions, 0.2, seed=1), held)


# --- training on a synthetic world ------------------------------------------------------------------

STATE_DIM = 6
RISKY = Action.APPLY_COUPON.index


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """States ~ N(0, I); the served action is RISKY 1 time in 8, else uniform over the other four.
    Harm: RISKY with feature 0 > 0 ⇒ harmful with probability 0.9; any other pair 0.3 %. Ten steps a session."""
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((n, STATE_DIM)).astype(np.float32)
    others = np.array([a.index for a in Action if a.index != RISKY])
    actions = np.where(rng.random(n) < 1 / 8, RISKY, rng.choice(others, n))
    risky = (actions == RISKY) & (states[:, 0] > 0)
    harmful = rng.random(n) < np.where(risky, 0.9, 0.003)
    sessions = np.array([f"{seed}-{i // 10}" for i in range(n)], dtype=object)
    return torch.from_numpy(states), torch.from_numpy(actions.astype(np.int64)), torch.from_numpy(harmful), sessions


CONFIG = GuardConfig(epochs=8, batch_size=256, learning_rate=3e-3, seed=7)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/trainer/conftest.py


@pytest.fixture(scope="module")
def trained(one_thread: None) -> GuardResult:
    return train_guard(*synthetic(24_000, seed=0), config=CONFIG)


def test_trained_guard_separates_the_harmful_region(trained: GuardResult) -> None:
    m = trained.metrics
    assert m["guard_auc"] > 0.9
    assert m["guard_accuracy"] > 0.95
    assert m["guard_false_block_rate"] <= CONFIG.max_false_block_rate
    assert m["guard_recall"] > 0.8
    assert 0.03 < m["guard_base_rate"] < 0.09 and m["guard_n_heldout"] + m["guard_n_train"] == 24_000
    # Fresh states, every candidate action: the risky action is vetoed in its harmful region and
    # allowed outside it; the other actions are allowed everywhere.
    states = torch.from_numpy(np.random.default_rng(99).standard_normal((4000, STATE_DIM)).astype(np.float32))
    with torch.no_grad():
        vetoed = (torch.sigmoid(trained.net(states)) < trained.threshold).numpy()
    inside, outside = states[:, 0].numpy() > 0.3, states[:, 0].numpy() < -0.3
    assert vetoed[inside, RISKY].mean() > 0.95
    assert vetoed[outside, RISKY].mean() < 0.05
    assert vetoed[:, [a.index for a in Action if a.index != RISKY]].mean() < 0.03


def test_training_split_is_by_session(trained: GuardResult) -> None:
    sessions = synthetic(24_000, seed=0)[3]
    assert all(len(v) == 1 for v in _sides(sessions, trained.heldout).values())
    assert trained.metrics["guard_n_heldout"] == trained.heldout.sum()
    assert trained.metrics["guard_n_train_sessions"] + trained.metrics["guard_n_heldout_sessions"] == 2400


def test_training_is_deterministic() -> None:
    data, config = synthetic(6000, seed=2), dataclasses.replace(CONFIG, epochs=2)
    first, again = train_guard(*data, config=config), train_guard(*data, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first.net.state_dict().values(), again.net.state_dict().values(), strict=True))
    assert again.threshold == first.threshold and again.metrics == first.metrics
    other = train_guard(*data, config=dataclasses.replace(config, seed=8))
    assert not torch.equal(other.net.l1.weight, first.net.l1.weight)


def test_warm_start_leaves_init_alone_and_extra_labels_train_only(trained: GuardResult) -> None:
    data = synthetic(4000, seed=1)
    before = [p.clone() for p in trained.net.parameters()]
    extra = np.zeros(4000, dtype=np.bool_)
    extra[::50] = True
    base = train_guard(*data, config=dataclasses.replace(CONFIG, epochs=1), init=trained.net)
    more = train_guard(*data, config=dataclasses.replace(CONFIG, epochs=1), init=trained.net, extra_harmful=extra)
    assert all(torch.equal(a, b) for a, b in zip(before, trained.net.parameters(), strict=True))
    assert not torch.equal(base.net.l1.weight, trained.net.l1.weight)
    added = int((extra & ~data[2].numpy() & ~base.heldout).sum())
    assert more.metrics["guard_n_train_harmful"] == base.metrics["guard_n_train_harmful"] + added > 0
    assert more.metrics["guard_n_heldout_harmful"] == base.metrics["guard_n_heldout_harmful"]
    with pytest.raises(ValueError, match="init"):
        train_guard(data[0][:, :3].contiguous(), *data[1:], init=trained.net)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_false_block_rate"):
        GuardConfig(max_false_block_rate=1.0)
    with pytest.raises(ValueError, match="holdout_fraction"):
        GuardConfig(holdout_fraction=0.0)
    assert GuardConfig().to_dict()["harmful_outcomes"] == ["complaint"]
