"""Off-policy estimators against hand computations, closed forms and a synthetic MDP with a known value."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.domain import N_ACTIONS, FloatArray
from experience.returns import GAMMA, mean_return, session_returns
from experience.sessions import Episodes, JoinReport
from trainer.bootstrap import bootstrap_counts
from trainer.offline import cumulative_weights, difference, effective_sample_size, evaluate, importance_ratios
from trainer.ope_arrays import IntArray
from trainer.q_model import cross_fit_q, episode_folds, fit_q_model

ROOT = Path(__file__).resolve().parents[2]


def make_episodes(lengths: list[int] | IntArray, rewards: FloatArray) -> Episodes:
    """Episodes laid end to end over ``rewards``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, e = int(lengths.sum()), len(lengths)
    assert len(rewards) == n
    return Episodes(
        rows=np.arange(n, dtype=np.int64),
        starts=(np.cumsum(lengths) - lengths).astype(np.int64),
        lengths=lengths,
        session_ids=np.array([f"s{i:06d}" for i in range(e)], dtype=object),
        rewards=np.asarray(rewards, dtype=np.float64),
        closed=np.ones(e, dtype=np.bool_),
        truncated=np.zeros(e, dtype=np.bool_),
        report=JoinReport(0, 0, 0, 0, 0, 0),
    )


def one_hot(actions: IntArray) -> FloatArray:
    return np.eye(N_ACTIONS)[actions]


# --- a hand example ----------------------------------------------------------------------------

# Episode A has two steps, episode B one; γ = 0.5.
#   step  μ(a)  π(a)  ρ    w_{0:t}  r   π(·|s)                Q̂(s, ·)          V̂(s)  Q̂(s, a)
#   A0    0.5   0.25  0.5  0.5      2   [.25 .75 0 0 0]  a=0   [2 4 0 0 0]      3.5   2
#   A1    0.25  0.5   2    1.0      4   [.5 .5 0 0 0]    a=1   [2 6 0 0 0]      4     6
#   B0    0.5   1     2    2.0      1   [0 0 1 0 0]      a=2   [0 0 3 0 0]      3     3
HAND_PI = np.array([[0.25, 0.75, 0, 0, 0], [0.5, 0.5, 0, 0, 0], [0, 0, 1.0, 0, 0]])
HAND_Q = np.array([[2.0, 4, 0, 0, 0], [2, 6, 0, 0, 0], [0, 0, 3, 0, 0]])
HAND_ACTIONS = np.array([0, 1, 2])
HAND_MU = np.array([0.5, 0.25, 0.5])
HAND_REWARDS = np.array([2.0, 4.0, 1.0])


def test_two_episodes_by_hand() -> None:
    episodes = make_episodes([2, 1], HAND_REWARDS)
    report = evaluate(episodes, HAND_MU, HAND_PI, HAND_ACTIONS, HAND_Q, gamma=0.5, n_boot=400, seed=1)
    # IPS: A = 0.5·2 + 0.5·(1.0·4) = 3, B = 2·1 = 2; mean 2.5.
    assert report.ips.value == pytest.approx(2.5, abs=1e-12)
    # SNIPS, B absorbed with its final weight 2 at t = 1:
    #   t = 0: (0.5·2 + 2·1) / (0.5 + 2) = 1.2;  t = 1: 0.5 · (1.0·4) / (1.0 + 2) = 2/3;  total 28/15.
    assert report.snips.value == pytest.approx(28 / 15, abs=1e-12)
    # DR: A: [0.5·(2 − 2) + 1·3.5] + 0.5·[1.0·(4 − 6) + 0.5·4] = 3.5;  B: 2·(1 − 3) + 1·3 = −1;  mean 1.25.
    assert report.dr is not None and report.dr.value == pytest.approx(1.25, abs=1e-12)
    # Behaviour: G0(A) = 2 + 0.5·4 = 4, G0(B) = 1; mean 2.5.
    assert report.behavior_value.value == pytest.approx(2.5, abs=1e-12)
    # TIS: A's final weight 1.0 × G0(A) 4 = 4, B: 2 × 1 = 2; mean 3.
    assert report.tis.value == pytest.approx(3.0, abs=1e-12)
    # ESS: final weights [1, 2] → 9/5; all step weights [0.5, 1, 2] → 3.5² / 5.25 = 7/3.
    assert report.ess == pytest.approx(1.8) and report.ess_steps == pytest.approx(7 / 3)
    # Resamples are AA, AB/BA or BB, each extreme with probability 1/4, so the 95 % percentile
    # interval runs between the BB and AA values. SNIPS(AA) = 0.5·2/0.5 + 0.5·(1.0·4)/1.0 = 4,
    # SNIPS(BB) = 2·1/2 = 1 (at t = 1 only B's absorbed weight, reward 0).
    assert (report.ips.ci_low, report.ips.ci_high) == pytest.approx((2.0, 3.0))
    assert (report.snips.ci_low, report.snips.ci_high) == pytest.approx((1.0, 4.0))
    assert (report.dr.ci_low, report.dr.ci_high) == pytest.approx((-1.0, 3.5))
    assert (report.behavior_value.ci_low, report.behavior_value.ci_high) == pytest.approx((1.0, 4.0))
    # each episode's term, whose mean is the estimate: A's and B's by hand, as above
    terms = {name: report.episode_terms[name].tolist() for name in ("ips", "dr", "tis", "behavior_value")}
    assert terms == {"ips": pytest.approx([3.0, 2.0]), "dr": pytest.approx([3.5, -1.0]), "tis": pytest.approx([4.0, 2.0]),
                     "behavior_value": pytest.approx([4.0, 1.0])}
    assert "snips" not in report.episode_terms  # a ratio of sums, not a mean of terms


def test_report_json_has_exactly_the_gate_keys() -> None:
    episodes = make_episodes([2, 1], HAND_REWARDS)
    without_q = evaluate(episodes, HAND_MU, HAND_PI, HAND_ACTIONS, n_boot=20, max_weight=math.inf).to_dict()
    assert set(without_q) == {"ips", "snips", "dr", "tis", "behavior_value", "diagnostics"}
    assert without_q["dr"] is None
    for key in ("ips", "snips", "tis", "behavior_value"):
        assert set(without_q[key]) == {"value", "ci_low", "ci_high"}
    assert without_q["diagnostics"]["max_weight"] is None  # no cap: null, not Infinity
    assert json.loads(json.dumps(without_q, allow_nan=False)) == without_q
    with_q = evaluate(episodes, HAND_MU, HAND_PI, HAND_ACTIONS, HAND_Q, n_boot=20).to_dict()
    assert set(with_q["dr"]) == {"value", "ci_low", "ci_high"}


# --- on-policy: every estimator is mean_return ------------------------------------------------


def random_logs(rng: np.random.Generator, n_episodes: int) -> tuple[Episodes, FloatArray, IntArray]:
    """Random episode lengths and rewards; a stochastic behaviour policy per step; actions drawn from it."""
    lengths = rng.integers(1, 8, size=n_episodes)
    n = int(lengths.sum())
    rewards = np.where(rng.random(n) < 0.3, rng.normal(5.0, 3.0, size=n), 0.0)
    probs = rng.dirichlet(np.ones(N_ACTIONS), size=n)
    actions = (rng.random((n, 1)) > np.cumsum(probs, axis=1)).sum(axis=1).clip(0, N_ACTIONS - 1)
    return make_episodes(lengths, rewards), probs, actions.astype(np.int64)


def test_target_equal_to_behaviour_gives_the_on_policy_mean_return() -> None:
    rng = np.random.default_rng(7)
    episodes, probs, actions = random_logs(rng, 300)
    mu = probs[np.arange(len(actions)), actions]
    truth = mean_return(session_returns(episodes)).mean
    # A Q̂ that ignores the action: V̂(s) = Q̂(s, a_t), so the DR correction cancels step by step.
    q_state = np.repeat(rng.normal(size=(len(actions), 1)), N_ACTIONS, axis=1)
    report = evaluate(episodes, mu, probs, actions, q_state, n_boot=50, seed=3)
    for est in (report.ips, report.snips, report.tis, report.behavior_value):
        assert est.value == pytest.approx(truth, rel=1e-12, abs=1e-12)
    assert report.dr is not None and report.dr.value == pytest.approx(truth, rel=1e-12, abs=1e-12)
    # Every weight is 1, so every resample gives the same number to every estimator.
    for name in ("ips", "snips", "dr", "tis"):
        np.testing.assert_allclose(report.samples[name], report.samples["behavior_value"], rtol=1e-12, atol=1e-12)
    assert report.ess == report.n_episodes and report.ess_steps == report.n_steps

    # A deterministic logger evaluated against itself: DR is exact for *any* Q̂ (π(a_t|s_t) = 1,
    # so V̂(s_t) = Q̂(s_t, a_t)). For a stochastic one with an action-dependent Q̂ it is exact only in
    # expectation: Σ γ^t (V̂ − Q̂(s_t, a_t)) is a zero-mean control variate, not zero per sample.
    greedy = one_hot(actions)
    q_any = rng.normal(size=(len(actions), N_ACTIONS))
    report = evaluate(episodes, np.ones(len(actions)), greedy, actions, q_any, n_boot=10)
    assert report.dr is not None and report.dr.value == pytest.approx(truth, rel=1e-12, abs=1e-12)


# --- a synthetic MDP with a known value --------------------------------------------------------


@dataclass(frozen=True)
class Mdp:
    """States x ∈ {0, 1, 2}, at most ``H`` steps; x' = (x + a) mod 3; action 4 (exit) ends the episode.

    Rewards ``R[x, a]`` plus Gaussian noise; policies are tables over (t, x). The target's value
    is computed by backward induction: ``Q_t(x, a) = R[x, a] + γ [a ≠ 4] V_{t+1}(x')``,
    ``V_t(x) = Σ_a π_t(a|x) Q_t(x, a)``, ``V_H = 0``.
    """

    behaviour: FloatArray  # (H, 3, 5)
    target: FloatArray  # (H, 3, 5)
    rewards: FloatArray  # (3, 5)
    gamma: float = GAMMA

    @property
    def horizon(self) -> int:
        return len(self.behaviour)

    def q_values(self) -> FloatArray:
        q = np.zeros((self.horizon, 3, N_ACTIONS))
        v_next = np.zeros(3)
        nxt = (np.arange(3)[:, None] + np.arange(N_ACTIONS)[None, :]) % 3
        for t in reversed(range(self.horizon)):
            q[t] = self.rewards + self.gamma * np.where(np.arange(N_ACTIONS) == N_ACTIONS - 1, 0.0, v_next[nxt])
            v_next = (self.target[t] * q[t]).sum(axis=1)
        return q

    def value(self, start: FloatArray) -> float:
        return float(start @ (self.target[0] * self.q_values()[0]).sum(axis=1))

    def sample(self, n_episodes: int, rng: np.random.Generator, start: FloatArray, noise: float) -> dict[str, Any]:
        """Episodes under the behaviour policy, with each step's (t, x, a, μ(a), π(·), Q^π(·))."""
        x = rng.choice(3, size=n_episodes, p=start)
        alive = np.arange(n_episodes)
        q = self.q_values()
        steps: list[tuple[IntArray, ...]] = []
        for step in range(self.horizon):
            probs = self.behaviour[step, x[alive]]
            served = (rng.random((len(alive), 1)) > np.cumsum(probs, axis=1)).sum(axis=1).clip(0, N_ACTIONS - 1)
            steps.append((alive, np.full(len(alive), step), x[alive], served))
            x[alive] = (x[alive] + served) % 3
            alive = alive[served != N_ACTIONS - 1]
        ep, t, xs, a = (np.concatenate(column) for column in zip(*steps, strict=True))
        order = np.lexsort((t, ep))
        ep, t, xs, a = ep[order], t[order], xs[order], a[order]
        rewards = self.rewards[xs, a] + noise * rng.standard_normal(len(a))
        return {
            "episodes": make_episodes(np.bincount(ep, minlength=n_episodes), rewards),
            "behavior_prob": self.behaviour[t, xs, a],
            "target_probs": self.target[t, xs],
            "actions": a,
            "q": q[t, xs],
            "t": t,
            "x": xs,
            "features": np.concatenate([np.eye(self.horizon)[t], np.eye(3)[xs]], axis=1).astype(np.float32),
        }


def make_mdp(rng: np.random.Generator, horizon: int = 3) -> Mdp:
    behaviour = rng.dirichlet(np.full(N_ACTIONS, 3.0), size=(horizon, 3))
    target = rng.dirichlet(np.full(N_ACTIONS, 0.7), size=(horizon, 3))
    target[..., 3] = 0.0  # the target never takes action 3: zero ratios must be handled
    target /= target.sum(axis=2, keepdims=True)
    return Mdp(behaviour=behaviour, target=target, rewards=rng.normal(1.0, 2.0, size=(3, N_ACTIONS)))


def test_dr_with_a_perfect_q_on_a_deterministic_problem_is_exact() -> None:
    mdp = make_mdp(np.random.default_rng(11))
    start = np.array([1.0, 0.0, 0.0])
    logs = mdp.sample(500, np.random.default_rng(12), start, noise=0.0)
    report = evaluate(logs["episodes"], logs["behavior_prob"], logs["target_probs"], logs["actions"], logs["q"], n_boot=100)
    truth = mdp.value(start)
    # Each episode contributes V^π(s_0): the DR sum telescopes whatever the (truncated) weights.
    assert report.dr is not None
    assert report.dr.value == pytest.approx(truth, abs=1e-10)
    np.testing.assert_allclose(report.samples["dr"], truth, atol=1e-10)
    assert report.dr.ci_high - report.dr.ci_low < 1e-10
    assert report.ips.ci_high - report.ips.ci_low > 0.1  # the importance weights alone are noisy


def test_ips_and_dr_are_unbiased_and_their_intervals_cover_the_truth() -> None:
    # Seeded, so deterministic; over seeds 1000..1019 every |estimate − truth| stayed below 2.3 SE.
    rng = np.random.default_rng(1000)
    mdp = make_mdp(rng)
    start = np.array([0.5, 0.3, 0.2])
    logs = mdp.sample(20_000, rng, start, noise=1.0)
    truth = mdp.value(start)
    args = (logs["episodes"], logs["behavior_prob"], logs["target_probs"], logs["actions"])
    uncapped: dict[str, Any] = {"max_ratio": math.inf, "max_weight": math.inf, "n_boot": 200, "seed": 5}
    wrong_q = (mdp.q_values() + rng.normal(0.0, 1.0, size=(mdp.horizon, 3, N_ACTIONS)))[logs["t"], logs["x"]]
    fitted_q = cross_fit_q(logs["episodes"], logs["features"], logs["actions"], ridge=1e-3, seed=2)
    estimates = {
        "ips": evaluate(*args, **uncapped).ips,
        "dr wrong Q̂": evaluate(*args, wrong_q, **uncapped).dr,
        "dr cross-fitted Q̂": evaluate(*args, fitted_q, **uncapped).dr,
        "dr perfect Q̂": evaluate(*args, logs["q"], **uncapped).dr,
    }
    for name, est in estimates.items():
        assert est is not None
        stderr = (est.ci_high - est.ci_low) / (2 * 1.96)
        assert abs(est.value - truth) < 3 * stderr, name
        assert est.ci_low <= truth <= est.ci_high, name
    width = {name: est.ci_high - est.ci_low for name, est in estimates.items() if est is not None}
    assert width["dr perfect Q̂"] < width["dr cross-fitted Q̂"] < width["ips"]


def test_the_interval_shrinks_as_one_over_root_e() -> None:
    mdp = make_mdp(np.random.default_rng(31))
    start = np.full(3, 1 / 3)
    widths = []
    for n in (1_000, 16_000):
        logs = mdp.sample(n, np.random.default_rng(n), start, noise=1.0)
        est = evaluate(logs["episodes"], logs["behavior_prob"], logs["target_probs"], logs["actions"], n_boot=200).ips
        widths.append(est.ci_high - est.ci_low)
    assert 3.0 < widths[0] / widths[1] < 5.3  # √16 = 4


# --- which weights the credit assignment allows; rows served with certainty --------------------


def test_per_decision_weights_need_rewards_at_the_observation_step_and_tis_does_not() -> None:
    """Two steps, actions 0/1 uniform under μ, π(0) = p at both; an order (worth 1) follows when a₀ = 0 or a₁ = 0.

    The four episodes (a₀, a₁) ∈ {0,1}², one each, are μ's distribution exactly, so each estimate
    here *is* its expectation. True value under π: P(a₀ = 0 or a₁ = 0) = 1 − (1 − p)².
    Last-touch credit: step 1 takes the order when a₁ = 0, else step 0 when a₀ = 0; so r₀ depends
    on a₁, PDIS weighs it by w₀ only and gets E_μ = p · ½ + p instead of p (1 − p) + p. Placed where
    it is observed (step 1, whatever was served) PDIS is exact; TIS is exact with either.
    """
    p = 0.8
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]
    actions = np.array([a for pair in pairs for a in pair])
    mu = np.full(8, 0.5)
    pi = np.tile([p, 1 - p, 0, 0, 0], (8, 1))
    last_touch = np.array([r for a0, a1 in pairs for r in (float(a0 == 0 and a1 != 0), float(a1 == 0))])
    observed = np.array([r for a0, a1 in pairs for r in (0.0, float(a0 == 0 or a1 == 0))])
    truth = 1 - (1 - p) ** 2
    exact: dict[str, Any] = {"gamma": 1.0, "max_ratio": math.inf, "max_weight": math.inf, "n_boot": 5}
    biased = evaluate(make_episodes([2] * 4, last_touch), mu, pi, actions, **exact)
    assert biased.ips.value == pytest.approx(0.5 * p + p) and biased.ips.value - truth > 0.2  # 1.2 for a true 0.96
    assert biased.tis.value == pytest.approx(truth)
    at_observation = evaluate(make_episodes([2] * 4, observed), mu, pi, actions, **exact)
    assert at_observation.ips.value == pytest.approx(truth) and at_observation.tis.value == pytest.approx(truth)


def test_rows_served_with_certainty_enter_with_their_exact_ratio() -> None:
    """Rule-engine rows (μ one-hot, propensity 1) among sampled ones: π = μ is exactly the behaviour's value."""
    rng = np.random.default_rng(17)
    episodes, probs, actions = random_logs(rng, 400)
    certain = rng.random(len(actions)) < 0.3
    probs[certain] = one_hot(actions[certain])
    mu = probs[np.arange(len(actions)), actions]
    assert (mu[certain] == 1.0).all()
    q_state = np.repeat(rng.normal(size=(len(actions), 1)), N_ACTIONS, axis=1)
    report = evaluate(episodes, mu, probs, actions, q_state, n_boot=50, seed=3)
    truth = report.behavior_value.value
    assert truth == pytest.approx(mean_return(session_returns(episodes)).mean, rel=1e-12)
    for name in ("ips", "snips", "dr", "tis"):
        assert getattr(report, name).value == pytest.approx(truth, rel=1e-12, abs=1e-12), name
    assert report.ess == report.n_episodes  # every ratio is 1, the certain rows' π(a)/1 included


def test_rows_served_with_certainty_keep_the_estimates_unbiased() -> None:
    """An MDP where the behaviour is deterministic in some states (and the target answers the same there)."""
    rng = np.random.default_rng(2024)
    mdp = make_mdp(rng)
    behaviour, target = mdp.behaviour.copy(), mdp.target.copy()
    for t, x, a in ((0, 1, 2), (1, 0, 0), (2, 2, 1)):  # rule-engine states: certain in both policies
        behaviour[t, x], target[t, x] = one_hot(np.array([a]))[0], one_hot(np.array([a]))[0]
    mdp = dataclasses.replace(mdp, behaviour=behaviour, target=target)
    start = np.array([0.3, 0.4, 0.3])
    logs = mdp.sample(20_000, rng, start, noise=1.0)
    assert (logs["behavior_prob"] == 1.0).mean() > 0.1  # the certain rows are there
    truth = mdp.value(start)
    uncapped: dict[str, Any] = {"max_ratio": math.inf, "max_weight": math.inf, "n_boot": 200, "seed": 5}
    report = evaluate(logs["episodes"], logs["behavior_prob"], logs["target_probs"], logs["actions"], logs["q"], **uncapped)
    for name in ("ips", "dr", "tis"):
        est = getattr(report, name)
        assert est.ci_low <= truth <= est.ci_high, (name, est, truth)


# --- weights, truncation, ESS ------------------------------------------------------------------


def test_truncation_caps_ratios_and_cumulative_weights() -> None:
    # One episode of four steps, π(a) = 1, μ(a) = 0.2: raw ratio 5, then one with π(a) = 0.
    pi = one_hot(np.zeros(5, dtype=np.int64))
    actions = np.array([0, 0, 0, 0, 1])
    mu = np.full(5, 0.2)
    starts, lengths = np.array([0]), np.array([5])
    ratios = importance_ratios(pi, actions, mu, max_ratio=4.0)
    np.testing.assert_array_equal(ratios, [4, 4, 4, 4, 0])
    np.testing.assert_allclose(cumulative_weights(ratios, starts, lengths, max_weight=math.inf), [4, 16, 64, 256, 0], rtol=1e-14)
    capped = cumulative_weights(ratios, starts, lengths, max_weight=50.0)
    np.testing.assert_allclose(capped, [4, 16, 50, 50, 0], rtol=1e-14)
    assert capped.max() == 50.0  # exactly the cap, never a rounding above it
    assert importance_ratios(pi, actions, mu, max_ratio=10.0)[0] == 5.0

    episodes = make_episodes([5], np.ones(5))
    report = evaluate(episodes, mu, pi, actions, gamma=1.0, max_ratio=4.0, max_weight=50.0, n_boot=5)
    assert (report.n_clipped_ratios, report.n_clipped_weights) == (4, 2)
    assert report.ips.value == pytest.approx(4 + 16 + 50 + 50)
    assert report.tis.value == 0.0  # the session's final weight: the last ratio is 0
    report = evaluate(make_episodes([4], np.ones(4)), mu[:4], pi[:4], actions[:4], gamma=1.0, max_ratio=4.0, max_weight=50.0,
                      n_boot=5)
    assert report.tis.value == pytest.approx(50 * 4)  # 4 · 4 · 4 · 4 = 256 capped at 50, times the return 4
    # Uncapped weights overflow nothing: a 1000-step episode of ratio 10 has log-weight 2303.
    long = cumulative_weights(np.full(1000, 10.0), np.array([0]), np.array([1000]), max_weight=1e6)
    assert long.max() == 1e6 and np.isfinite(long).all()


def test_cumulative_weights_match_a_loop_per_episode() -> None:
    rng = np.random.default_rng(41)
    lengths = rng.integers(1, 12, size=200)
    starts = np.cumsum(lengths) - lengths
    ratios = rng.lognormal(0.0, 0.8, size=int(lengths.sum())) * (rng.random(int(lengths.sum())) > 0.05)
    got = cumulative_weights(ratios, starts, lengths, max_weight=30.0)
    expected = np.empty_like(ratios)
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        expected[s : s + n] = np.minimum(np.cumprod(ratios[s : s + n]), 30.0)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


def test_effective_sample_size() -> None:
    assert effective_sample_size(np.full(7, 3.0)) == pytest.approx(7.0)
    assert effective_sample_size(np.array([0.0, 5.0, 0.0])) == pytest.approx(1.0)
    assert effective_sample_size(np.zeros(4)) == 0.0
    # Single-step episodes with ratio 2 everywhere: every weight 2, ESS = E = N.
    n = 50
    pi = np.full((n, N_ACTIONS), 1 / N_ACTIONS)
    report = evaluate(make_episodes([1] * n, np.ones(n)), np.full(n, 0.1), pi, np.zeros(n, dtype=np.int64), n_boot=5)
    assert report.ess == pytest.approx(n) and report.ess_steps == pytest.approx(n)


# --- the bootstrap -----------------------------------------------------------------------------


def snips_reference(episodes: Episodes, weights: FloatArray, gamma: float) -> float:
    """WPDIS one step index at a time; an ended episode keeps its final weight and earns 0."""
    total = 0.0
    for t in range(int(episodes.lengths.max())):
        num = den = 0.0
        for s, n in zip(episodes.starts.tolist(), episodes.lengths.tolist(), strict=True):
            w = weights[s + min(t, n - 1)]
            den += w
            num += w * episodes.rewards[s + t] if t < n else 0.0
        total += gamma**t * num / den if den > 0 else 0.0
    return total


def test_each_bootstrap_value_is_the_estimate_on_the_resampled_episodes() -> None:
    rng = np.random.default_rng(51)
    episodes, probs, actions = random_logs(rng, 40)
    mu = probs[np.arange(len(actions)), actions]
    target = rng.dirichlet(np.ones(N_ACTIONS), size=len(actions))
    q = rng.normal(size=(len(actions), N_ACTIONS))
    report = evaluate(episodes, mu, target, actions, q, n_boot=6, seed=9)
    weights = cumulative_weights(np.minimum(target[np.arange(len(actions)), actions] / mu, 10.0), episodes.starts, episodes.lengths)
    assert report.snips.value == pytest.approx(snips_reference(episodes, weights, GAMMA), rel=1e-12)

    counts = np.concatenate(list(bootstrap_counts(episodes.n_episodes, 6, seed=9)))
    for i, row in enumerate(counts.astype(np.int64)):
        picked = np.repeat(np.arange(episodes.n_episodes), row)  # resample i, episodes in order
        steps = np.concatenate([np.arange(episodes.starts[e], episodes.starts[e] + episodes.lengths[e]) for e in picked])
        again = evaluate(
            make_episodes(episodes.lengths[picked], episodes.rewards[steps]), mu[steps], target[steps], actions[steps], q[steps], n_boot=1
        )
        assert again.dr is not None
        for name, value in (("ips", again.ips.value), ("snips", again.snips.value), ("dr", again.dr.value)):
            assert report.samples[name][i] == pytest.approx(value, rel=1e-10, abs=1e-12), (name, i)
        assert report.samples["behavior_value"][i] == pytest.approx(again.behavior_value.value, rel=1e-10, abs=1e-12)


def test_resamples_depend_on_the_seed_and_e_only_so_reports_pair() -> None:
    one = np.concatenate(list(bootstrap_counts(30, 7, seed=4)))
    assert one.shape == (7, 30) and (one.sum(axis=1) == 30).all()
    np.testing.assert_array_equal(one[:3], np.concatenate(list(bootstrap_counts(30, 3, seed=4))))
    assert not np.array_equal(one, np.concatenate(list(bootstrap_counts(30, 7, seed=5))))

    rng = np.random.default_rng(61)
    episodes, probs, actions = random_logs(rng, 400)
    mu = probs[np.arange(len(actions)), actions]
    new = evaluate(episodes, mu, rng.dirichlet(np.ones(N_ACTIONS), size=len(actions)), actions, n_boot=100)
    old = evaluate(episodes, mu, probs, actions, n_boot=100)  # the logger itself
    gap = difference(new, old, "ips")
    assert gap.value == pytest.approx(new.ips.value - old.ips.value)
    assert gap.ci_low <= gap.value <= gap.ci_high
    assert difference(old, old, "snips").ci_low == difference(old, old, "snips").ci_high == 0.0
    with pytest.raises(ValueError, match="new, old"):
        difference(new, evaluate(episodes, mu, probs, actions, n_boot=100, seed=1), "ips")
    with pytest.raises(ValueError, match="estimator"):
        difference(new, old, "dr")


# --- Q̂ ----------------------------------------------------------------------------------------


def test_q_model_recovers_a_per_action_linear_function_and_falls_back_without_data() -> None:
    rng = np.random.default_rng(71)
    n, d = 5000, 6
    x = (rng.normal(size=(n, d)) * [1, 10, 0.1, 1, 1, 1] + 3.0).astype(np.float32)
    x[:, 5] = 2.0  # a constant feature
    actions = rng.integers(0, N_ACTIONS - 1, size=n)  # action 4 never logged
    theta = rng.normal(size=(N_ACTIONS, d))
    bias = rng.normal(size=N_ACTIONS)
    y = (x.astype(np.float64) @ theta.T + bias)[np.arange(n), actions]
    model = fit_q_model(x, actions, y, ridge=1e-8)
    pred = model.predict(x)
    np.testing.assert_allclose(pred[np.arange(n), actions], y, atol=1e-5)
    np.testing.assert_allclose(pred[:, :4], x.astype(np.float64) @ theta[:4].T + bias[:4], atol=1e-5)
    np.testing.assert_allclose(pred[:, 4], y.mean())
    assert model.n_per_action.tolist()[4] == 0 and pred.shape == (n, N_ACTIONS)
    with pytest.raises(ValueError, match="features"):
        model.predict(x[:, :3])


def test_cross_fitting_predicts_each_episode_from_the_other_folds() -> None:
    rng = np.random.default_rng(81)
    episodes, _, actions = random_logs(rng, 60)
    features = rng.normal(size=(episodes.n_steps, 4)).astype(np.float32)
    q_hat = cross_fit_q(episodes, features, actions, n_folds=3, seed=8)
    folds = episode_folds(episodes.n_episodes, 3, seed=8)
    assert np.bincount(folds).tolist() == [20, 20, 20]
    # Change the rewards of one fold-0 episode: fold 0's Q̂ is unchanged, the other folds' moves.
    e = int(np.flatnonzero(folds == 0)[0])
    rewards = episodes.rewards.copy()
    rewards[episodes.starts[e]] += 100.0
    moved = cross_fit_q(make_episodes(episodes.lengths, rewards), features, actions, n_folds=3, seed=8)
    in_fold0 = (folds == 0)[episodes.episode_index()]
    np.testing.assert_array_equal(moved[in_fold0], q_hat[in_fold0])
    assert not np.allclose(moved[~in_fold0], q_hat[~in_fold0])


# --- bad inputs --------------------------------------------------------------------------------


def bad_inputs() -> list[tuple[str, dict[str, Any]]]:
    n = 3
    return [
        ("behavior_prob", {"behavior_prob": np.array([0.5, 0.0, 0.5])}),
        ("behavior_prob", {"behavior_prob": np.array([0.5, np.nan, 0.5])}),
        ("behavior_prob", {"behavior_prob": np.array([0.5, 0.5])}),
        ("target_probs", {"target_probs": HAND_PI[:, :4]}),
        ("target_probs", {"target_probs": HAND_PI * 0.5}),
        ("target_probs", {"target_probs": np.where(HAND_PI == 0.25, np.nan, HAND_PI)}),
        ("actions", {"actions": np.array([0, 1, 5])}),
        ("actions", {"actions": np.array([0.0, 1.0, 2.0])}),
        ("q_hat", {"q_hat": np.full((n, N_ACTIONS), np.inf)}),
        ("q_hat", {"q_hat": np.zeros((n, 4))}),
        ("episodes", {"episodes": make_episodes([2, 1], np.array([1.0, np.nan, 0.0]))}),
        ("episodes", {"episodes": dataclasses.replace(make_episodes([2, 1], HAND_REWARDS), starts=np.array([0, 1]))}),
        ("max_ratio", {"max_ratio": 0.0}),
        ("n_boot", {"n_boot": 0}),
        ("gamma", {"gamma": 1.5}),
    ]


@pytest.mark.parametrize(("name", "change"), bad_inputs(), ids=[f"{name}-{i}" for i, (name, _) in enumerate(bad_inputs())])
def test_bad_inputs_raise_value_error_naming_the_argument(name: str, change: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {
        "episodes": make_episodes([2, 1], HAND_REWARDS),
        "behavior_prob": HAND_MU,
        "target_probs": HAND_PI,
        "actions": HAND_ACTIONS,
        "q_hat": HAND_Q,
        "n_boot": 5,
    } | change
    with pytest.raises(ValueError, match=f"^{name}"):
        evaluate(**kwargs)


def test_bad_regression_inputs_raise_value_error_naming_the_argument() -> None:
    x = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^features"):
        fit_q_model(np.where(np.eye(4, 2) > 0, np.nan, x), np.zeros(4, dtype=np.int64), np.zeros(4))
    with pytest.raises(ValueError, match=r"^returns_to_go"):
        fit_q_model(x, np.zeros(4, dtype=np.int64), np.zeros(3))
    with pytest.raises(ValueError, match=r"^ridge"):
        fit_q_model(x, np.zeros(4, dtype=np.int64), np.zeros(4), ridge=0.0)
    with pytest.raises(ValueError, match=r"^n_folds"):
        episode_folds(10, 1)


def test_importing_the_estimators_does_not_import_torch() -> None:
    code = "import sys, trainer.offline; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
