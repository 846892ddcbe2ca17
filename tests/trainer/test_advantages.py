"""Advantages: group-relative normalisation in closed form, the value baseline against what the state predicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.advantages import baseline_advantages, fit_value, group_advantages


def test_group_advantages_closed_form() -> None:
    returns = np.array([1.0, 3.0, 0.0, 6.0, 3.0])
    groups = np.array([7, 7, 2, 2, 2])
    # group 7: mean 2, std 1; group 2: mean 3, std sqrt(6)
    expected = np.array([-1.0, 1.0, -3 / np.sqrt(6), 3 / np.sqrt(6), 0.0])
    np.testing.assert_allclose(group_advantages(returns, groups), expected, rtol=1e-12)


def test_group_advantages_floor_for_a_constant_group_and_one_member_groups() -> None:
    out = group_advantages(np.array([5.0, 5.0, 2.0]), np.array([0, 0, 1]), floor=0.5)
    np.testing.assert_array_equal(out, [0.0, 0.0, 0.0])  # zero deviation, divided by the floor, not by 0
    with pytest.raises(ValueError, match="same length"):
        group_advantages(np.zeros(3), np.zeros(2, dtype=np.int64))


def test_value_baseline_removes_what_the_state_predicts(one_thread: None) -> None:
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(4096, 6, generator=gen)
    w = torch.tensor([2.0, -1.0, 0.5, 0.0, 0.0, 1.0])
    returns = states @ w + 0.1 * torch.randn(4096, generator=gen)
    value = fit_value(states, returns, hidden=32, epochs=30, batch=256, lr=3e-3, seed=1)
    adv = baseline_advantages(states, returns, value, chunk=1000)
    # what is left is about the noise: far below the returns' own variance (≈ 5.3)
    assert float(adv.var()) < 0.1 * float(returns.var())
    with torch.no_grad():
        np.testing.assert_allclose(adv.numpy(), (returns - value(states)).numpy(), atol=1e-6)  # Â = G − V̂(s), chunks or not


def test_value_fit_is_deterministic_for_a_seed(one_thread: None) -> None:
    states = torch.randn(512, 4, generator=torch.Generator().manual_seed(3))
    returns = states.sum(dim=1)
    a, b = (fit_value(states, returns, hidden=8, epochs=2, seed=5) for _ in range(2))
    c = fit_value(states, returns, hidden=8, epochs=2, seed=6)
    for pa_, pb_ in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa_, pb_)
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    assert baseline_advantages(states[:0], returns[:0], a).shape == (0,)
