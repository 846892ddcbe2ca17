"""``bench.gate_calibration``'s difference check: the gate's interval on new − current against the true paired
difference on the same truth sessions, and the exact (Clopper–Pearson) lower bounds of the coverage proportions."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gate_calibration import Settings, behaviour_bundle, clopper_pearson_low, coverage, difference_covered, one_seed, summarise
from trainer.config import GuardConfig, TrainConfig


def test_clopper_pearson_lower_bounds_match_the_exact_values() -> None:
    # Known values of the two-sided 95 % Clopper–Pearson interval's lower end.
    assert clopper_pearson_low(18, 20) == pytest.approx(0.6830, abs=1e-4)
    assert clopper_pearson_low(20, 20) == pytest.approx(0.025 ** (1 / 20), abs=1e-9)  # k = n: (α/2)^(1/n)
    assert clopper_pearson_low(1, 1) == pytest.approx(0.025, abs=1e-9)
    assert clopper_pearson_low(10, 20) == pytest.approx(0.2720, abs=1e-4)
    assert clopper_pearson_low(0, 7) == 0.0
    with pytest.raises(ValueError):
        clopper_pearson_low(3, 2)
    assert coverage([True, True, False]) == {"covered": 2, "of": 3, "share": 2 / 3,
                                             "clopper_pearson_95_low": pytest.approx(clopper_pearson_low(2, 3))}


def test_the_difference_is_covered_by_the_true_paired_mean() -> None:
    true = np.array([1.0, 2.0, 3.0, 2.0])
    held = difference_covered(1.5, 1.0, 3.0, true)
    assert held["truth"]["mean"] == pytest.approx(2.0) and held["covered"] and held["covered_widened"]
    missed = difference_covered(5.0, 4.0, 6.0, true)
    assert not missed["covered"]


def test_one_small_seed_reports_the_difference_and_the_summary_its_coverage() -> None:
    short = TrainConfig(updates=1, batch=8192, value_epochs=1, critic_epochs=1, guard=GuardConfig(epochs=1), bootstrap=50)
    settings = Settings(sessions=400, truth_sessions=600, behaviour_seed=20261130, bootstrap=50, config=short)
    row = one_seed(1, settings, behaviour_bundle(settings.behaviour_seed))
    d = row["difference"]
    assert d["value"] == row["gate"]["dr_difference"]["value"] and d["ci_low"] == row["gate"]["dr_difference"]["ci_low"]
    # the paired truth over the same sessions: its mean is the difference of the two bundles' truths
    assert d["truth"]["mean"] == pytest.approx(row["truth"]["mean"] - row["behaviour"]["truth"]["mean"], abs=1e-9)
    assert d["covered"] == (d["ci_low"] <= d["truth"]["mean"] <= d["ci_high"])
    summary = summarise([row])
    assert summary["difference"]["coverage"]["of"] == 1 and summary["difference"]["coverage"]["covered"] == int(d["covered"])
    assert summary["dr"]["coverage_exact"]["clopper_pearson_95_low"] == pytest.approx(0.025 if row["dr"]["covered"] else 0.0)
