"""The guard threshold rule, the AUC, the held-out metrics, never blocking and the veto verdict, in closed form
and by brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.guard_threshold import (
    VetoCriterion,
    auc_lower_bound,
    binomial_tail,
    choose_threshold,
    decide_veto,
    guard_metrics,
    guard_table,
    heldout_report,
    never_block_metrics,
    precision_lower_bound,
    rank_auc,
)

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




# --- never blocking and the veto verdict --------------------------------------------------------


def test_never_block_figures() -> None:
    harmful = np.array([True] + [False] * 15)
    assert never_block_metrics(harmful) == {
        "guard_never_block_accuracy": 15 / 16,
        "guard_never_block_false_block_rate": 0.0,
        "guard_never_block_recall": 0.0,
        "guard_never_block_precision": 0.0,
        "guard_never_block_auc": 0.5,
    }
    # a guard whose threshold blocks nothing has exactly never blocking's figures
    allow = np.random.default_rng(0).random(16)
    m = guard_metrics(allow, harmful, 0.0)
    assert all(m[f"guard_{k}"] == v for k, v in (("accuracy", 15 / 16), ("false_block_rate", 0.0), ("recall", 0.0)))


def test_binomial_tail_closed_forms_and_brute_force() -> None:
    assert binomial_tail(5, 5, 0.5) == pytest.approx(1 / 32, rel=1e-12)
    assert binomial_tail(0, 7, 0.3) == 1.0 and binomial_tail(8, 7, 0.3) == 0.0
    assert binomial_tail(1, 7, 0.0) == 0.0 and binomial_tail(7, 7, 1.0) == 1.0
    for m in (1, 2, 9, 40):
        for p in (0.01, 0.25, 0.5, 0.9):
            for k in range(m + 1):
                brute = sum(math.comb(m, j) * p**j * (1 - p) ** (m - j) for j in range(k, m + 1))
                assert binomial_tail(k, m, p) == pytest.approx(brute, rel=1e-9, abs=1e-300)
    assert binomial_tail(300, 3000, 0.05) == pytest.approx(5.639872710794272e-29, rel=1e-9)  # exact (fractions); no underflow


def test_precision_lower_bound_closed_forms_and_duality() -> None:
    for m in (1, 4, 5, 30):
        assert precision_lower_bound(m, m, 0.95) == pytest.approx(0.05 ** (1 / m), abs=1e-12)  # all harmful: α^{1/m}
    assert precision_lower_bound(0, 10, 0.95) == 0.0 and precision_lower_bound(0, 0, 0.95) == 0.0
    for k, m in ((1, 10), (7, 12), (40, 100)):
        low = precision_lower_bound(k, m, 0.9)
        assert binomial_tail(k, m, low) == pytest.approx(0.1, abs=1e-9)  # P(X ≥ k | m, L) = α
        assert low < k / m


def _pairs(tp: int, fp: int, tn: int, fn: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out pairs with the given confusion counts at threshold 0.5 (blocked: allow 0.1)."""
    allow = np.array([0.1] * (tp + fp) + [0.9] * (tn + fn))
    harmful = np.array([True] * tp + [False] * fp + [False] * tn + [True] * fn)
    return allow, harmful


@pytest.mark.parametrize(
    ("tp", "fp", "ratio", "veto"),
    [
        (5, 0, 1.0, True),  # p = ½⁵ = 0.031 < 0.05
        (4, 0, 1.0, False),  # p = ½⁴ = 0.0625: four of four could be luck
        (3, 0, 3.0, True),  # break-even ¼: p = ¼³ = 0.016
        (2, 0, 3.0, False),  # p = ¼² = 0.0625
        (0, 10, 1.0, False),  # nothing caught
        (0, 0, 1.0, False),  # nothing blocked
        (60, 40, 1.0, True),  # P(X ≥ 60 | 100, ½) = 0.028
        (58, 42, 1.0, False),  # P(X ≥ 58 | 100, ½) = 0.067: more right than wrong, not beyond noise
    ],
)
def test_veto_verdict_at_its_edges(tp: int, fp: int, ratio: float, veto: bool) -> None:
    allow, harmful = _pairs(tp, fp, tn=1000, fn=50)
    criterion = VetoCriterion(harm_cost_ratio=ratio)
    d = decide_veto(allow, harmful, 0.5, criterion)
    assert d.veto is veto and d.reason.startswith("veto:" if veto else "no veto:")
    m = tp + fp
    p0 = 1 / (1 + ratio)
    assert d.p_value == pytest.approx(binomial_tail(tp, m, p0) if m else 1.0)
    assert (d.precision_lower > p0) is veto  # the interval and the test agree
    assert d.net_benefit == pytest.approx((ratio * tp - fp) / len(allow))


def test_a_threshold_past_the_cap_beyond_noise_never_earns_the_veto() -> None:
    # ten of eleven blocked pairs harmful: p = P(X ≥ 10 | 11, ½) = 12 / 2048, the precision earns the veto;
    # the one harmless held-out pair is blocked: P(X ≥ 1 | 1, c) = c, beyond noise iff c < α = 0.05
    allow, harmful = _pairs(tp=10, fp=1, tn=0, fn=0)
    assert decide_veto(allow, harmful, 0.5).p_value == pytest.approx(12 / 2048)
    assert decide_veto(allow, harmful, 0.5, max_false_block_rate=0.06).veto
    d = decide_veto(allow, harmful, 0.5, max_false_block_rate=0.04)
    assert not d.veto and "cap" in d.reason
    allow, harmful = _pairs(tp=50, fp=3, tn=97, fn=0)  # 3 % against a cap of 2 %: P(X ≥ 3 | 100, 0.02) = 0.32, noise
    assert decide_veto(allow, harmful, 0.5, max_false_block_rate=0.02).veto
    allow, harmful = _pairs(tp=50, fp=10, tn=90, fn=0)  # 10 %: P(X ≥ 10 | 100, 0.02) ≈ 3e-5
    assert not decide_veto(allow, harmful, 0.5, max_false_block_rate=0.02).veto


def test_equal_costs_are_the_accuracy_criterion() -> None:
    """With r = 1 the net benefit is the accuracy gain over never blocking, and a veto implies it is positive."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(20, 400))
        harmful = rng.random(n) < rng.uniform(0.01, 0.3)
        allow = np.clip(rng.random(n) - rng.uniform(0, 0.5) * harmful, 0, 1)
        t = float(rng.uniform(0, 0.6))
        d = decide_veto(allow, harmful, t)
        gain = guard_metrics(allow, harmful, t)["guard_accuracy"] - never_block_metrics(harmful)["guard_never_block_accuracy"]
        assert d.net_benefit == pytest.approx(gain, abs=1e-12)
        assert not d.veto or gain > 0


def test_auc_lower_bound_closed_form() -> None:
    a, n_pos, n_neg = 0.8, 10, 20
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = math.sqrt((a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg))
    assert auc_lower_bound(a, n_pos, n_neg, 0.95) == pytest.approx(a - 1.6448536269514722 * se, abs=1e-12)
    assert auc_lower_bound(a, 0, 20, 0.95) == 0.0
    assert auc_lower_bound(1.0, 10, 20, 0.95) == 1.0  # no spread at a perfect ranking
    assert auc_lower_bound(0.5, 5, 5, 0.95) < 0.5 < auc_lower_bound(0.5, 5, 5, 0.5) + 1e-12


def test_criterion_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="harm_cost_ratio"):
        VetoCriterion(harm_cost_ratio=0.0)
    with pytest.raises(ValueError, match="confidence"):
        VetoCriterion(confidence=1.0)
    assert VetoCriterion(harm_cost_ratio=4.0).break_even_precision == 0.2


def test_report_ships_no_veto_as_threshold_zero_and_the_table_says_so() -> None:
    allow, harmful = _pairs(tp=4, fp=0, tn=100, fn=6)
    decision, m = heldout_report(allow, harmful, 0.5)
    assert not decision.veto
    assert m["guard_threshold"] == 0.0 and m["guard_candidate_threshold"] == 0.5 and m["guard_veto_enabled"] == 0.0
    assert m["guard_accuracy"] == pytest.approx(110 / 110 - 6 / 110)  # the guard's own figures, at its candidate
    assert m["guard_never_block_accuracy"] == pytest.approx(100 / 110)
    assert all(isinstance(v, float) for v in m.values())
    table = guard_table(m).splitlines()
    assert table[0].split() == ["accuracy", "false-block", "recall", "precision", "AUC"]
    assert table[3].startswith("shipped: no veto") and table[3].split()[-5:] == table[2].split()[-5:]  # never blocking's figures
    decision, m = heldout_report(*_pairs(tp=5, fp=0, tn=100, fn=5), 0.5)
    assert decision.veto and m["guard_threshold"] == 0.5 and m["guard_veto_enabled"] == 1.0
    table = guard_table(m).splitlines()
    assert table[3].startswith("shipped: guard") and table[3].split()[-5:] == table[1].split()[-5:]  # the guard's figures
