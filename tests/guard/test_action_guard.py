"""The guard's veto rule."""

from __future__ import annotations

import numpy as np
import pytest

from guard.action_guard import ActionGuard


def test_vetoes_strictly_below_the_threshold() -> None:
    guard = ActionGuard(0.2)
    allow = np.array([0.0, 0.19999, 0.2, 0.20001, 1.0])
    assert guard.vetoed(allow).tolist() == [True, True, False, False, False]


def test_threshold_zero_vetoes_nothing_and_one_vetoes_all_but_certain() -> None:
    allow = np.array([0.0, 0.5, 0.999, 1.0, 0.2])
    assert not ActionGuard(0.0).vetoed(allow).any()
    assert ActionGuard(1.0).vetoed(allow).tolist() == [True, True, True, False, True]


@pytest.mark.parametrize("threshold", [-0.01, 1.01, float("nan"), float("inf")])
def test_rejects_thresholds_outside_the_unit_interval(threshold: float) -> None:
    with pytest.raises(ValueError, match=r"^guard threshold: expected 0\.\.1"):
        ActionGuard(threshold)
