"""Advantages: group-relative normalisation in closed form, the value baseline against what the state predicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.advantages import baseline_folds, cross_fitted_baseline, fit_value, group_advantages


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
    fold = baseline_folds(np.repeat(np.arange(1024), 4), seed=0)
    adv = cross_fitted_baseline(states, returns, fold, np.arange(4096), hidden=32, epochs=30, batch=256, lr=3e-3, seed=1)
    # what is left is about the noise: far below the returns' own variance (≈ 5.3)
    assert float(adv.var()) < 0.1 * float(returns.var())
    again = cross_fitted_baseline(states, returns, fold, np.arange(4096), hidden=32, epochs=30, batch=256, lr=3e-3, seed=1,
                                  chunk=1000)
    np.testing.assert_allclose(adv.numpy(), again.numpy(), atol=1e-6)  # chunks or not


def test_the_baseline_does_not_learn_a_rows_own_return(one_thread: None) -> None:
    """States that say nothing about the return: a value net fitted on the very rows it is subtracted from learns
    their returns (here it takes 84 % of their variance, correlation 0.9) and with them whatever the action did.
    Cross-fitted by session, the baseline of a row never saw its session: Â keeps the returns whole."""
    gen = torch.Generator().manual_seed(0)
    n = 2048
    sessions = np.repeat(np.arange(n // 4), 4)
    states = torch.randn(n // 4, 64, generator=gen)[torch.from_numpy(sessions)]  # a session's rows alike (a shopper's state)
    returns = torch.randn(n // 4, generator=gen)[torch.from_numpy(sessions)] + 0.1 * torch.randn(n, generator=gen)
    fold = baseline_folds(sessions, seed=3)
    assert all(len(set(fold[sessions == s].tolist())) == 1 for s in range(n // 4))  # a session on one side
    assert 0.4 < fold.mean() < 0.6
    adv = cross_fitted_baseline(states, returns, fold, np.arange(n), hidden=32, epochs=30, batch=256, lr=3e-3, seed=1)
    baseline = returns - adv
    assert abs(float(torch.corrcoef(torch.stack([baseline, returns]))[0, 1])) < 0.15
    assert float(adv.var()) > 0.85 * float(returns.var())
    in_sample = fit_value(states, returns, hidden=32, epochs=30, batch=256, lr=3e-3, seed=1)  # what the baseline was
    with torch.no_grad():
        assert float(torch.corrcoef(torch.stack([in_sample(states), returns]))[0, 1]) > 0.5


def test_a_rows_half_is_its_sessions_on_any_shard() -> None:
    """Under torchrun each rank holds a shard of the sessions: a row's half must not depend on which rows are beside it
    (a positional split would put a session on different sides on one process and on two)."""
    sessions = np.array([f"s{i // 3}" for i in range(300)], dtype=object)
    whole = baseline_folds(sessions, seed=4)
    shard = np.array([int(s[1:]) % 2 == 1 for s in sessions])  # every other session: one of two ranks
    np.testing.assert_array_equal(baseline_folds(sessions[shard], seed=4), whole[shard])
    np.testing.assert_array_equal(baseline_folds(sessions[::-1], seed=4), whole[::-1])
    assert not np.array_equal(baseline_folds(sessions, seed=5), whole)  # the seed draws another split


def test_a_half_without_fit_rows_gets_no_baseline_and_rows_outside_the_sample_get_one(one_thread: None) -> None:
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(400, 3, generator=gen)
    returns = 3.0 + states[:, 0] + 0.01 * torch.randn(400, generator=gen)
    fold = np.arange(400) >= 200
    only_first = np.arange(150)  # every fit row is in the first half: the second half is fitted from them, the first from none
    adv = cross_fitted_baseline(states, returns, fold, only_first, hidden=16, epochs=100, batch=32, lr=3e-3, seed=0)
    np.testing.assert_array_equal(adv[:200].numpy(), returns[:200].numpy())  # no baseline: Â = G
    assert float(adv[200:].var()) < 0.2 * float(returns[200:].var())  # rows 200.. never fitted on, yet predicted
    assert cross_fitted_baseline(states[:0], returns[:0], fold[:0], only_first[:0]).shape == (0,)


def test_value_fit_is_deterministic_for_a_seed(one_thread: None) -> None:
    states = torch.randn(512, 4, generator=torch.Generator().manual_seed(3))
    returns = states.sum(dim=1)
    a, b = (fit_value(states, returns, hidden=8, epochs=2, seed=5) for _ in range(2))
    c = fit_value(states, returns, hidden=8, epochs=2, seed=6)
    for pa_, pb_ in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa_, pb_)
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
