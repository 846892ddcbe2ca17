"""One natural-gradient step on a small policy: the surrogate, its gradient, the trust region, the support limit.

A 8 → 16 → 16 → 5 policy under the real served-distribution decoder (10 draws, majority of 4,
ε-exploration), on logs whose propensities are the policy's own served probabilities, so
every importance ratio starts at exactly 1 and the closed forms below hold.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from policy.decoder import MajorityDecoder
from trainer import update
from trainer.config import TrainConfig
from trainer.distributed import LocalReducer
from trainer.fisher import flat_params, masked_log_probs, mean_kl
from trainer.networks import PolicyNet
from trainer.served import TorchDecoder

N, S, A = 512, 8, 5
CONFIG = TrainConfig(kl_delta=0.01, fisher_fraction=1.0, max_behavior_kl=None)


@pytest.fixture
def setup(one_thread: None) -> tuple[PolicyNet, TorchDecoder, update.Batch]:
    torch.manual_seed(0)
    policy = PolicyNet(S, 16, A)
    decoder = TorchDecoder(MajorityDecoder())
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(N, S, generator=gen)
    log_weights = torch.zeros(N, A, dtype=torch.float64)
    allowed = torch.ones(N, A, dtype=torch.bool)
    fallback = torch.zeros(N, dtype=torch.long)
    with torch.no_grad():
        served = decoder.served(decoder.masked_q(policy(states), log_weights, allowed), fallback, allowed.any(dim=1))
    actions = torch.multinomial(served.float(), 1, generator=gen)[:, 0]
    advantages = torch.where(actions == 0, 1.0, -0.25).double()  # add_to_cart paid, everything else cost a little
    batch = update.Batch(states, actions, served.gather(1, actions[:, None])[:, 0].clone(), advantages, log_weights, allowed,
                         fallback, served.clone())
    return policy, decoder, batch


def test_at_the_behaviour_the_surrogate_is_the_mean_advantage_and_the_ess_is_one(setup: tuple) -> None:
    policy, decoder, b = setup
    assert update.surrogate_value(policy, decoder, b, 10.0, LocalReducer()) == pytest.approx(float(b.advantages.mean()), rel=1e-9)
    assert update.effective_sample_size(policy, decoder, b, 10.0) == pytest.approx(1.0, abs=1e-9)
    assert update.served_kl_to_behavior(policy, decoder, b, LocalReducer()) == pytest.approx(0.0, abs=1e-12)


def test_chunked_gradient_equals_the_whole_batch_gradient(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    policy, decoder, b = setup
    whole = update.surrogate_gradient(policy, decoder, b, 10.0, LocalReducer())
    monkeypatch.setattr(update, "CHUNK", 37)  # ragged chunks
    chunked = update.surrogate_gradient(policy, decoder, b, 10.0, LocalReducer())
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-7)
    policy.zero_grad()
    update.surrogate_terms(policy, decoder, b, 10.0).mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
    torch.testing.assert_close(whole, direct, rtol=1e-5, atol=1e-7)


def test_a_step_stays_in_the_trust_region_and_moves_toward_the_advantage(setup: tuple) -> None:
    policy, decoder, b = setup
    log_guard = torch.where(b.allowed, b.log_weights, -torch.inf).float()
    with torch.no_grad():
        log_q_old = masked_log_probs(policy(b.states), log_guard)
        before = update.served_prob(policy, decoder, dataclasses.replace(b, actions=torch.zeros(N, dtype=torch.long))).mean()
    stats = update.Stats()
    outcome = update.natural_step(policy, decoder, b, CONFIG, stats, LocalReducer(), torch.Generator().manual_seed(2))
    assert outcome.accepted, outcome
    with torch.no_grad():
        kl = float(mean_kl(log_q_old, policy(b.states), log_guard))
        after = update.served_prob(policy, decoder, dataclasses.replace(b, actions=torch.zeros(N, dtype=torch.long))).mean()
    assert 0.0 < kl <= 1.5 * CONFIG.kl_delta  # the line search refits to the measured KL
    assert outcome.improvement > 0 and stats.improvements == [outcome.improvement]
    assert float(after) > float(before)  # add_to_cart, the action with the positive advantage, is served more often
    assert stats.summary()["updates_accepted"] == 1.0


def test_the_support_limit_shrinks_or_undoes_a_step(setup: tuple) -> None:
    policy, decoder, b = setup
    theta0 = flat_params(policy).clone()
    config = dataclasses.replace(CONFIG, kl_delta=0.05, max_behavior_kl=1e-5)
    stats = update.Stats()
    update.natural_step(policy, decoder, b, config, stats, LocalReducer(), torch.Generator().manual_seed(2))
    assert stats.support_limited
    kl = update.served_kl_to_behavior(policy, decoder, b, LocalReducer())
    assert kl <= 1e-5 or torch.equal(flat_params(policy), theta0)


def test_rows_without_an_allowed_action_are_refused(setup: tuple) -> None:
    policy, decoder, b = setup
    allowed = b.allowed.clone()
    allowed[3] = False
    with pytest.raises(ValueError, match="every row needs an allowed action"):
        update.natural_step(policy, decoder, dataclasses.replace(b, allowed=allowed), CONFIG, update.Stats(), LocalReducer(),
                            torch.Generator())
    assert np.isnan(update.Stats().summary()["effective_sample_size"])


def _served_kl_after_step(setup: tuple, trust_region: str) -> tuple[float, float]:
    policy, decoder, b = setup
    config = dataclasses.replace(CONFIG, trust_region=trust_region)
    p_old = update.served_probs(policy, decoder, b)
    outcome = update.natural_step(policy, decoder, b, config, update.Stats(), LocalReducer(), torch.Generator().manual_seed(2))
    assert outcome.accepted, outcome
    return float(update.served_kl(p_old, update.served_probs(policy, decoder, b)).mean()), outcome.kl


def test_served_metric_is_the_hessian_of_the_served_kl(setup: tuple) -> None:
    """M_i = Dᵀ diag(1/P) D equals ∂²/∂z² KL(P(z_old) ‖ P(z)) at z_old, row by row (autograd's Hessian)."""
    from trainer.fisher import served_metric

    policy, decoder, b = setup
    rows = slice(0, 4)
    with torch.no_grad():
        z0 = policy(b.states[rows]).double()
    lw, allowed, fallback = b.log_weights[rows], b.allowed[rows], b.fallback[rows]

    def served(z: torch.Tensor) -> torch.Tensor:
        return decoder.served_of(z, lw, allowed, fallback, allowed.any(dim=1))

    metric = served_metric(served, z0)
    p_old = served(z0).detach()
    for i in range(4):
        def kl(zi: torch.Tensor, i: int = i) -> torch.Tensor:
            z = z0.clone()
            z[i] = zi
            return update.served_kl(p_old[i : i + 1], served(z)[i : i + 1]).sum()

        hessian = torch.autograd.functional.hessian(kl, z0[i].clone())
        torch.testing.assert_close(metric[i], hessian, rtol=1e-6, atol=1e-9)
    assert torch.allclose(metric.sum(dim=2), torch.zeros(4, A, dtype=metric.dtype), atol=1e-9)  # M 1 = 0: softmax ignores a shift


def test_the_served_trust_region_bounds_what_is_served(setup: tuple) -> None:
    """δ on the served distribution: the applied served KL lands near δ; δ on the masked policy overshoots it."""
    state = {k: v.clone() for k, v in setup[0].state_dict().items()}
    served_kl, reported = _served_kl_after_step(setup, "served")
    assert 0.5 * CONFIG.kl_delta <= served_kl <= 1.5 * CONFIG.kl_delta
    assert reported == pytest.approx(served_kl, rel=1e-6)  # what the step reports is what was applied
    setup[0].load_state_dict(state)
    policy_kl, _ = _served_kl_after_step(setup, "policy")
    assert policy_kl > 1.5 * served_kl, (policy_kl, served_kl)


# --- surrogate = expected: every action's estimated advantage at each logged state ------------------


def _every_action(b: update.Batch, advantages: torch.Tensor) -> update.Batch:
    return dataclasses.replace(b, advantages=advantages.double())


def test_the_expected_surrogate_has_closed_forms_and_skips_banned_actions(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    policy, decoder, b = setup
    reducer = LocalReducer()
    # the same advantage c for every action: Σ_a P(a) c = c on every row, whatever the policy
    assert update.surrogate_value(policy, decoder, _every_action(b, torch.full((N, A), 0.7)), 10.0, reducer) == pytest.approx(0.7)
    # a one-hot advantage on action k: the mean served probability of k, as served_prob computes it
    for k in range(A):
        one_hot = torch.zeros(N, A)
        one_hot[:, k] = 1.0
        at_k = dataclasses.replace(b, actions=torch.full((N,), k, dtype=torch.long))
        with torch.no_grad():
            mean_p = float(update.served_prob(policy, decoder, at_k).mean())
        assert update.surrogate_value(policy, decoder, _every_action(b, one_hot), 10.0, reducer) == pytest.approx(mean_p, rel=1e-9)
    # a banned action's advantage never enters, not even an infinite one (0 · inf would be NaN)
    adv = torch.full((N, A), 0.7)
    adv[:7, 4] = torch.inf
    banned = dataclasses.replace(_every_action(b, adv), allowed=b.allowed.clone(), log_weights=b.log_weights.clone())
    banned.allowed[:7, 4] = False
    banned.log_weights[:7, 4] = -torch.inf
    assert update.surrogate_value(policy, decoder, banned, 10.0, reducer) == pytest.approx(0.7)
    # the chunked gradient of the 2-D surrogate is the whole batch's
    adv = torch.randn(N, A, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    whole = update.surrogate_gradient(policy, decoder, _every_action(b, adv), 10.0, reducer)
    monkeypatch.setattr(update, "CHUNK", 37)
    torch.testing.assert_close(update.surrogate_gradient(policy, decoder, _every_action(b, adv), 10.0, reducer), whole,
                               rtol=1e-5, atol=1e-7)


def test_the_expected_surrogate_moves_towards_an_action_the_logs_never_served(setup: tuple) -> None:
    """No logged row served apply_coupon; the critic says it pays on every state: the step serves it more."""
    policy, decoder, b = setup
    never = 2
    logged = dataclasses.replace(b, actions=torch.where(b.actions == never, 0, b.actions))
    adv = torch.zeros(N, A, dtype=torch.float64)
    adv[:, never] = 1.0
    coupon = dataclasses.replace(logged, actions=torch.full((N,), never, dtype=torch.long))
    with torch.no_grad():
        before = float(update.served_prob(policy, decoder, coupon).mean())
    outcome = update.natural_step(policy, decoder, _every_action(logged, adv), CONFIG, update.Stats(), LocalReducer(),
                                  torch.Generator().manual_seed(2))
    assert outcome.accepted and outcome.improvement > 0, outcome
    with torch.no_grad():
        after = float(update.served_prob(policy, decoder, coupon).mean())
    assert after > before + 0.01


# --- the logits of actions the served distribution hardly sees -------------------------------------------------

def _steps_on_a_flat_floor(setup: tuple, logit_damping: float, steps: int) -> tuple[list[update.StepOutcome], list[float]]:
    """``steps`` updates of δ 0.5 under a decoder whose exploration floor is nearly uniform (ε 0.2, T 100): once
    add_to_cart wins the vote, the other actions' logits change what is served only through that flat floor.
    Returns the outcomes and the largest logit gap between two actions over the batch after each."""
    policy, _, b = setup
    decoder = TorchDecoder(MajorityDecoder(epsilon=0.2, temperature=100.0))
    served = update.served_probs(policy, decoder, b)  # the logs of this decoder: every ratio starts at 1
    b = dataclasses.replace(b, propensity=served.gather(1, b.actions[:, None])[:, 0], behavior=served)
    config = dataclasses.replace(CONFIG, kl_delta=0.5, logit_damping=logit_damping)
    outcomes, gaps = [], []
    for k in range(steps):
        outcomes.append(update.natural_step(policy, decoder, b, config, update.Stats(), LocalReducer(),
                                            torch.Generator().manual_seed(2 + k)))
        with torch.no_grad():
            z = policy(b.states)
        gaps.append(float((z.max(dim=1).values - z.min(dim=1).values).max()))
    return outcomes, gaps


def test_without_logit_damping_the_served_trust_region_lets_the_logits_run_away(setup: tuple) -> None:
    """The defect the damping fixes, kept as a test: each step is within δ of what is served, yet the logits move apart
    by hundreds, until every trial of a step is over the limit (a probability underflows: the served KL is +inf)."""
    outcomes, gaps = _steps_on_a_flat_floor(setup, 0.0, 7)
    assert gaps[0] < 10 and gaps[2] > 300, gaps
    failed = next(k for k, o in enumerate(outcomes) if not o.accepted)  # (StopIteration: no step ever failed)
    assert all(not o.accepted for o in outcomes[failed:]), outcomes  # and none steps again from there
    assert all("over the KL limit" in (o.reason or "") or "not finite" in (o.reason or "") for o in outcomes[failed:])


def test_logit_damping_keeps_the_logits_in_bounds_and_every_step_possible(setup: tuple) -> None:
    policy, _, b = setup
    with torch.no_grad():
        z0 = policy(b.states).double()
    outcomes, gaps = _steps_on_a_flat_floor(setup, 0.1, 7)
    assert all(o.accepted for o in outcomes), outcomes
    assert gaps[-1] < 60, gaps  # a few a step, where the served distribution does not see the logits
    with torch.no_grad():
        moved = update.centred_norm2(policy(b.states).double() - z0, b.allowed).mean()
    per_step = math.sqrt(2 * 0.5 * 1.5 / 0.1)  # the most a step's logits may move, root mean square: κ/2 ‖Δz‖² ≤ δ (1 + tol)
    assert math.sqrt(float(moved)) <= 7 * per_step
    assert all(0 <= o.kl <= 0.75 for o in outcomes)  # the reported KL: the served part of the bounded divergence


def test_the_policy_trust_region_does_not_use_the_logit_damping(setup: tuple) -> None:
    """With δ on the masked policy q the Fisher is q's own, which is not singular in the logits of unlikely actions:
    κ is not used there (the same step to the bit)."""
    policy = setup[0]
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    after = []
    for kappa in (0.0, 0.1):
        policy.load_state_dict(state)
        config = dataclasses.replace(CONFIG, trust_region="policy", logit_damping=kappa)
        outcome = update.natural_step(policy, setup[1], setup[2], config, update.Stats(), LocalReducer(), torch.Generator().manual_seed(2))
        assert outcome.accepted, outcome
        after.append(flat_params(policy))
    assert torch.equal(after[0], after[1])


def test_the_config_names_a_bad_logit_damping() -> None:
    assert TrainConfig().logit_damping == 0.1 and TrainConfig(logit_damping=0.0).to_dict()["logit_damping"] == 0.0
    for bad in (-0.1, math.inf):
        with pytest.raises(ValueError, match="logit_damping: expected >= 0"):
            TrainConfig(logit_damping=bad)
    with pytest.raises(ValueError, match="logit_damping: expected a number, got NaN"):  # any number field's NaN
        TrainConfig(logit_damping=math.nan)


def test_the_served_kl_is_finite_and_differentiable_where_an_action_is_never_served() -> None:
    """0 where p_old = 0, +inf where only p_new is 0, and a gradient without NaN through a masked action (the log of
    its 0 must not reach the backward pass through ``torch.where``)."""
    p_old = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    z = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    p_new = torch.softmax(torch.where(mask, z + torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64), -torch.inf), 1)
    kl = update.served_kl(p_old, p_new)
    p1 = math.e / (1 + math.e)
    assert kl[0].item() == 0.0 and kl[1].item() == pytest.approx(0.5 * math.log(0.5 / p1) + 0.5 * math.log(0.5 / (1 - p1)))
    kl.sum().backward()
    assert z.grad is not None and bool(torch.isfinite(z.grad).all()) and z.grad[1, 0] > 0 and z.grad[0].abs().max() == 0
    assert update.served_kl(p_old[:1], torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)).item() == math.inf
