"""The learned critic R_ψ(s, a) − V_φ(s) against closed forms: returns that depend only on the action."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from trainer.config import TrainConfig
from trainer.critic import Critic, critic_action_advantages, critic_advantages, cross_fitted_critic, fit_critic

MEANS = torch.tensor([0.0, 1.0, 3.0, -1.0, 2.0])  # E[G | a]: the state says nothing about the return
RANK = [2, 4, 1, 0, 3]  # the actions from best to worst


def _bandit(n: int, seed: int = 0, noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniformly served actions, G = MEANS[a] + noise, and a state-dependent π = softmax(s W)."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(n, 4, generator=gen)
    actions = torch.randint(0, 5, (n,), generator=gen)
    returns = MEANS[actions] + noise * torch.randn(n, generator=gen)
    pi = torch.softmax(states @ torch.randn(4, 5, generator=gen), dim=1)
    return states, actions, returns, pi


@pytest.fixture(scope="module")
def fitted(one_thread: None) -> tuple[Critic, tuple[torch.Tensor, ...]]:
    data = _bandit(8192)
    return fit_critic(*data, hidden=64, epochs=6, batch=256, lr=3e-3, seed=1), data


def test_the_critic_learns_the_action_values_and_their_value_under_pi(fitted: tuple[Critic, tuple[torch.Tensor, ...]]) -> None:
    critic, (states, _, _, pi) = fitted
    r = critic.action_values(states)
    assert r.shape == (len(states), 5) and r.dtype == torch.float32
    assert float((r - MEANS).abs().mean()) < 0.1  # R_ψ(s, a) ≈ E[G | a] at every state
    v = critic.values(states)
    assert float((v - (pi * r).sum(dim=1)).abs().mean()) < 0.05  # V_φ(s) ≈ Σ_a π(a|s) R_ψ(s, a) ...
    assert float((v - pi @ MEANS).abs().mean()) < 0.1  # ... ≈ Σ_a π(a|s) E[G | a], state by state
    assert float(v.std()) > 0.5  # not the behaviour's mean return (1.0 everywhere): V follows π
    assert critic.metrics["critic_value_rmse"] < 0.1
    r2 = 1 - 0.25 / float(MEANS.var(correction=0) + 0.25)  # the share of Var G the action explains
    assert abs(critic.metrics["critic_return_r2"] - r2) < 0.03


def test_the_advantages_rank_the_actions_and_are_centred_under_pi(fitted: tuple[Critic, tuple[torch.Tensor, ...]]) -> None:
    critic, (states, actions, returns, pi) = fitted
    adv = critic_advantages(critic, states, actions)
    assert adv.shape == (len(states),) and adv.dtype == torch.float64
    expected = MEANS[actions] - pi @ MEANS  # Â(s, a) = E[G | a] − Σ_b π(b|s) E[G | b]
    assert float((adv - expected.double()).abs().mean()) < 0.1
    # every action at every state: Â(s, a) − Â(s, b) ≈ E[G | a] − E[G | b] ≥ 1, so the ranking holds row by row
    all_actions = [critic_advantages(critic, states, torch.full_like(actions, a)) for a in range(5)]
    order = torch.argsort(torch.stack(all_actions, dim=1), dim=1, descending=True)
    assert float((order == torch.tensor(RANK)).all(dim=1).double().mean()) > 0.95
    centred = (pi.double() * torch.stack(all_actions, dim=1)).sum(dim=1)  # E_{a∼π} Â(s, a) ≈ 0
    assert float(centred.abs().mean()) < 0.05
    # the option: the observed return against V_φ, exactly
    observed = critic_advantages(critic, states, actions, returns, observed_returns=True)
    torch.testing.assert_close(observed, returns.double() - critic.values(states).double())


def test_chunks_do_not_change_the_advantages_and_no_rows_give_none(fitted: tuple[Critic, tuple[torch.Tensor, ...]]) -> None:
    critic, (states, actions, _, _) = fitted
    torch.testing.assert_close(critic_advantages(critic, states, actions, chunk=1000), critic_advantages(critic, states, actions))
    empty = critic_advantages(critic, states[:0], actions[:0])
    assert empty.shape == (0,) and empty.dtype == torch.float64


def test_the_fit_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone(one_thread: None) -> None:
    data = _bandit(1024, seed=3)
    before = torch.random.get_rng_state()
    a, b = (fit_critic(*data, hidden=8, epochs=2, seed=5) for _ in range(2))
    assert torch.equal(torch.random.get_rng_state(), before)
    c = fit_critic(*data, hidden=8, epochs=2, seed=6)
    for net in ("returns", "value"):
        pa_, pb_, pc_ = (list(getattr(x, net).parameters()) for x in (a, b, c))
        assert all(torch.equal(x, y) for x, y in zip(pa_, pb_, strict=True))
        assert not all(torch.equal(x, y) for x, y in zip(pa_, pc_, strict=True))
    assert a.metrics == b.metrics
    torch.testing.assert_close(critic_advantages(a, data[0], data[1]), critic_advantages(b, data[0], data[1]), rtol=0, atol=0)


def test_a_constant_return_gives_zero_advantages(one_thread: None) -> None:
    states, actions, _, pi = _bandit(512, seed=4)
    critic = fit_critic(states, actions, torch.full((512,), 2.5), pi, hidden=8, epochs=1, seed=0)
    adv = critic_advantages(critic, states, actions)
    assert float(adv.abs().max()) == 0.0  # standardised targets all 0 = the zero-initialised outputs: no gradient, R = V = μ
    assert critic.metrics["critic_return_r2"] == 0.0


def _bad(name: str) -> dict[str, Any]:
    states, actions, returns, pi = _bandit(16, seed=2)
    cases: dict[str, dict[str, Any]] = {
        "states": {"states": states[:, 0]},
        "states0": {"states": states[:0], "actions": actions[:0], "returns": returns[:0], "pi": pi[:0]},
        "actions": {"actions": actions.float()},
        "actions_range": {"actions": actions + 5},
        "actions_len": {"actions": actions[:3]},
        "returns": {"returns": returns[:3]},
        "returns_nan": {"returns": returns * torch.nan},
        "pi": {"pi": pi[:, :4]},
        "pi_sum": {"pi": pi * 2},
        "pi_neg": {"pi": torch.cat([pi[:, :1] * 0 + 1.5, pi[:, 1:2] * 0 - 0.5, pi[:, 2:] * 0], dim=1)},  # sums to 1, one < 0
        "pi_shape": {"pi": pi[:3]},
        "hidden": {"hidden": 0},
        "epochs": {"epochs": 0},
        "batch": {"batch": 0},
        "lr": {"lr": 0.0},
    }
    return {"states": states, "actions": actions, "returns": returns, "pi": pi, "hidden": 8, "epochs": 1, **cases[name]}


@pytest.mark.parametrize("case", ["states", "states0", "actions", "actions_range", "actions_len", "returns", "returns_nan", "pi",
                                  "pi_sum", "pi_neg", "pi_shape", "hidden", "epochs", "batch", "lr"])
def test_bad_inputs_raise_value_error_naming_the_argument(case: str) -> None:
    argument = case.split("_")[0].rstrip("0")
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        fit_critic(**_bad(case))


def test_bad_advantage_inputs_raise_value_error_naming_the_argument(fitted: tuple[Critic, tuple[torch.Tensor, ...]]) -> None:
    critic, (states, actions, returns, _) = fitted
    with pytest.raises(ValueError, match=r"^states:"):
        critic_advantages(critic, states[:, 0], actions)
    with pytest.raises(ValueError, match=r"^actions:"):
        critic_advantages(critic, states, actions[:5])
    with pytest.raises(ValueError, match=r"^actions:"):
        critic_advantages(critic, states, actions + 5)
    with pytest.raises(ValueError, match=r"^returns:"):
        critic_advantages(critic, states, actions, observed_returns=True)
    with pytest.raises(ValueError, match=r"^returns:"):
        critic_advantages(critic, states, actions, returns[:5], observed_returns=True)
    with pytest.raises(ValueError, match=r"^chunk:"):
        critic_advantages(critic, states, actions, chunk=0)


def test_the_config_accepts_the_critic_and_checks_its_fields() -> None:
    config = TrainConfig(advantage="critic", critic_hidden=16, critic_epochs=2)
    assert config.to_dict()["advantage"] == "critic" and config.to_dict()["critic_hidden"] == 16
    for name in ("critic_hidden", "critic_epochs"):
        with pytest.raises(ValueError, match=f"{name}: expected >= 1"):
            TrainConfig.with_overrides(**{name: 0})
    with pytest.raises(ValueError, match="advantage: expected baseline, group or critic"):
        TrainConfig(advantage="q")


def test_the_expected_surrogate_needs_the_critic() -> None:
    assert TrainConfig(advantage="critic", surrogate="expected").to_dict()["surrogate"] == "expected"
    assert TrainConfig().surrogate == "logged"
    assert TrainConfig(surrogate="expected").advantage == "critic"  # the default advantage serves it
    with pytest.raises(ValueError, match="surrogate: expected needs advantage critic, got advantage 'baseline'"):
        TrainConfig(advantage="baseline", surrogate="expected")
    with pytest.raises(ValueError, match="surrogate: expected needs advantage critic, got advantage 'group'"):
        TrainConfig(advantage="group", surrogate="expected")
    with pytest.raises(ValueError, match="surrogate: expected logged or expected, got 'all'"):
        TrainConfig(surrogate="all")


def test_every_actions_advantage_is_its_return_less_the_value() -> None:
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(300, 6, generator=gen)
    actions = torch.randint(0, 5, (300,), generator=gen)
    returns = torch.randn(300, generator=gen)
    critic = fit_critic(states, actions, returns, torch.full((300, 5), 0.2), hidden=8, epochs=1)
    every = critic_action_advantages(critic, states)
    assert every.shape == (300, 5) and every.dtype == torch.float64
    torch.testing.assert_close(every.gather(1, actions[:, None])[:, 0], critic_advantages(critic, states, actions))
    with pytest.raises(ValueError, match=r"^chunk:"):
        critic_action_advantages(critic, states, chunk=0)


def _folds(n: int) -> npt.NDArray[np.bool_]:
    return np.arange(n) % 2 == 1  # alternate rows in the two halves (a session a row here)


def test_a_rows_cross_fitted_advantage_never_saw_its_own_return(one_thread: None) -> None:
    """Each half's Â comes from the critic of the other half: changing the returns of one half leaves that half's
    advantages exactly as they were (a critic fitted on every row would follow them), and moves the other half's."""
    states, actions, returns, pi = _bandit(8192, seed=3)
    fold, rows = _folds(8192), np.arange(8192)
    kwargs: dict[str, Any] = {"hidden": 64, "epochs": 6, "batch": 256, "lr": 3e-3, "seed": 1}
    base, metrics = cross_fitted_critic(states, actions, returns, pi, fold, rows, **kwargs)
    shifted = returns.clone()
    shifted[torch.as_tensor(fold)] += 5.0 * torch.randn(int(fold.sum()), generator=torch.Generator().manual_seed(9))
    moved, _ = cross_fitted_critic(states, actions, shifted, pi, fold, rows, **kwargs)
    assert base.shape == (8192,) and base.dtype == torch.float64
    assert torch.equal(moved[torch.as_tensor(fold)], base[torch.as_tensor(fold)])
    assert float((moved[torch.as_tensor(~fold)] - base[torch.as_tensor(~fold)]).abs().mean()) > 0.01
    expected = MEANS[actions] - pi @ MEANS  # and it is still the critic's advantage, fitted on half the rows each
    assert float((base - expected.double()).abs().mean()) < 0.25
    assert {"critic_return_r2", "critic_value_rmse", "critic_return_r2_heldout"} <= set(metrics)


def test_the_held_out_r2_tells_a_critic_that_learnt_from_one_that_memorised(one_thread: None) -> None:
    states, actions, returns, pi = _bandit(4096, seed=4)
    fold, rows = _folds(4096), np.arange(4096)
    _, learnt = cross_fitted_critic(states, actions, returns, pi, fold, rows, hidden=32, epochs=6, batch=256, lr=3e-3, seed=1)
    r2 = 1 - 0.25 / float(MEANS.var(correction=0) + 0.25)  # the share of Var G the action explains
    assert learnt["critic_return_r2_heldout"] > r2 - 0.08  # what the action explains carries to unseen rows ...
    assert abs(learnt["critic_return_r2_heldout"] - learnt["critic_return_r2"]) < 0.02  # ... as well as to the fitted ones
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(5))  # nothing to learn: only noise to memorise
    _, memorised = cross_fitted_critic(states, actions, noise, pi, fold, rows, hidden=128, epochs=30, batch=256, lr=3e-3, seed=1)
    assert memorised["critic_return_r2"] > 0.05 > memorised["critic_return_r2_heldout"]


def test_a_half_whose_other_half_has_no_fit_rows_gets_no_direction_and_expected_gives_every_action(one_thread: None) -> None:
    states, actions, returns, pi = _bandit(1024, seed=6)
    fold = _folds(1024)
    rows = np.flatnonzero(fold)  # only one half may be fitted on
    adv, metrics = cross_fitted_critic(states, actions, returns, pi[torch.as_tensor(rows)], fold, rows, expected=True,
                                       hidden=16, epochs=2, seed=1)
    assert adv.shape == (1024, 5)
    assert torch.equal(adv[torch.as_tensor(fold)], torch.zeros(int(fold.sum()), 5, dtype=torch.float64))
    assert float(adv[torch.as_tensor(~fold)].abs().sum()) > 0  # the other half, from the critic of the fitted one
    assert "critic_return_r2_heldout" not in metrics  # no fit row that its critic did not see
    with pytest.raises(ValueError, match="pi: expected one row per fit row"):
        cross_fitted_critic(states, actions, returns, pi, fold, rows)


def test_weighted_rows_pull_each_actions_value_towards_their_own_returns(one_thread: None) -> None:
    """R_ψ's fit is a weighted least squares when given weights: each action's value is its rows' weighted mean return
    (the state says nothing here), not their plain mean; the standardisation and the in-sample metrics stay unweighted."""
    states, actions, _, pi = _bandit(8192, seed=7)
    heavy = torch.arange(8192) % 4 == 0  # a quarter of the rows, weighted 5: returns 2 above the others'
    returns = MEANS[actions] + 2.0 * heavy
    weights = torch.where(heavy, 5.0, 1.0)
    plain = fit_critic(states, actions, returns, pi, hidden=32, epochs=6, batch=256, lr=3e-3, seed=1)
    weighted = fit_critic(states, actions, returns, pi, hidden=32, epochs=6, batch=256, lr=3e-3, seed=1, weights=weights)
    shift = 2.0 * 5.0 / (5.0 + 3.0)  # the weighted mean of the offset: 5 parts at +2 against 3 at 0
    assert float((plain.action_values(states) - (MEANS + 0.5)).abs().mean()) < 0.15
    assert float((weighted.action_values(states) - (MEANS + shift)).abs().mean()) < 0.15
    with pytest.raises(ValueError, match="weights"):
        fit_critic(states, actions, returns, pi, hidden=8, epochs=1, weights=weights[:10])
