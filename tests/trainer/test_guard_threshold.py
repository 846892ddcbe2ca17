"""The guard threshold rule, the AUC and the held-out metrics, in closed form and by brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.guard_threshold import choose_threshold, guard_metrics, rank_auc

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


