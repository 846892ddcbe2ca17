"""Discounted returns against hand computations and a plain Python loop; mean_return; reward normalisation."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Action, FloatArray, Outcome
from experience.returns import (
    GAMMA,
    Z_95,
    IntArray,
    discounted_returns,
    episode_returns,
    fit_reward_scale,
    mean_return,
    n_step_returns,
    normalize_rewards,
    session_returns,
)
from experience.sessions import build_episodes


def arrays(*episodes: list[float]) -> tuple[FloatArray, IntArray, IntArray]:
    """Episodes laid end to end: (rewards, starts, lengths)."""
    lengths = np.array([len(e) for e in episodes], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    rewards = np.array([r for e in episodes for r in e], dtype=np.float64)
    return rewards, starts, lengths


def reference(rewards: FloatArray, starts: IntArray, lengths: IntArray, gamma: float, n: int | None = None) -> FloatArray:
    """The definition, one step at a time: G_t = Σ_{k < min(n, L - t)} γ^k r_{t+k}."""
    out = np.zeros(len(rewards))
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        for t in range(length):
            horizon = length - t if n is None else min(n, length - t)
            out[start + t] = sum(gamma**k * rewards[start + t + k] for k in range(horizon))
    return out


def test_three_steps_by_hand() -> None:
    r, s, n = arrays([1.0, 0.0, 2.0])
    # G2 = 2; G1 = 0 + 0.85 * 2 = 1.7; G0 = 1 + 0.85 * 1.7 = 2.445
    np.testing.assert_allclose(discounted_returns(r, s, n, 0.85), [2.445, 1.7, 2.0], rtol=1e-15)
    np.testing.assert_allclose(discounted_returns(r, s, n), [2.445, 1.7, 2.0], rtol=1e-15)  # GAMMA is 0.85
    assert GAMMA == 0.85


def test_variable_lengths_and_single_steps() -> None:
    r, s, n = arrays([5.0], [1.0, 0.0, 2.0], [-3.0], [0.0, 10.0])
    np.testing.assert_allclose(discounted_returns(r, s, n, 0.85), [5.0, 2.445, 1.7, 2.0, -3.0, 8.5, 10.0], rtol=1e-15)
    np.testing.assert_allclose(discounted_returns(r, s, n, 0.0), r)  # γ = 0: the rewards themselves
    np.testing.assert_allclose(discounted_returns(r, s, n, 1.0), [5.0, 3.0, 2.0, 2.0, -3.0, 10.0, 10.0])


def test_n_step_by_hand() -> None:
    r, s, n = arrays([1.0, 0.0, 2.0], [4.0])
    np.testing.assert_array_equal(n_step_returns(r, s, n, 1, 0.85), r)
    # G0^(2) = 1 + 0.85 * 0 = 1; G1^(2) = 0 + 0.85 * 2 = 1.7; G2^(2) = 2 (cut at the end)
    np.testing.assert_allclose(n_step_returns(r, s, n, 2, 0.85), [1.0, 1.7, 2.0, 4.0], rtol=1e-15)
    np.testing.assert_allclose(n_step_returns(r, s, n, 3, 0.85), [2.445, 1.7, 2.0, 4.0], rtol=1e-15)
    np.testing.assert_allclose(n_step_returns(r, s, n, 50, 0.85), discounted_returns(r, s, n, 0.85), rtol=1e-15)


def test_n_step_keeps_sparse_zeros_exact() -> None:
    r, s, n = arrays([0.0, 0.0, 0.0, 100.0])
    assert n_step_returns(r, s, n, 2, 0.85).tolist() == [0.0, 0.0, 85.0, 100.0]


def test_empty_and_zero_length_episodes() -> None:
    empty_i = np.zeros(0, dtype=np.int64)
    assert discounted_returns(np.zeros(0), empty_i, empty_i).shape == (0,)
    assert n_step_returns(np.zeros(0), empty_i, empty_i, 3).shape == (0,)
    # A zero-length episode and a step outside every episode: untouched (0).
    r = np.array([1.0, 2.0, 3.0, 4.0])
    starts, lengths = np.array([0, 2, 3]), np.array([2, 0, 1])
    np.testing.assert_allclose(discounted_returns(r, starts, lengths, 0.5), [2.0, 2.0, 0.0, 4.0])
    np.testing.assert_allclose(n_step_returns(r, starts, lengths, 2, 0.5), [2.0, 2.0, 0.0, 4.0])


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.85, 0.99, 1.0])
def test_random_episodes_match_the_python_loop(gamma: float) -> None:
    rng = np.random.default_rng(int(gamma * 100))
    lengths = rng.integers(1, 30, size=300)
    lengths[:5] = 1
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    rewards = np.where(rng.random(total) < 0.2, rng.normal(20.0, 30.0, total), 0.0)
    order = rng.permutation(len(starts))  # episodes need not be listed in step order
    starts, lengths = starts[order], lengths[order]
    np.testing.assert_allclose(
        discounted_returns(rewards, starts, lengths, gamma), reference(rewards, starts, lengths, gamma), rtol=1e-12, atol=1e-9
    )
    for n in (1, 2, 5, 40):
        np.testing.assert_allclose(
            n_step_returns(rewards, starts, lengths, n, gamma), reference(rewards, starts, lengths, gamma, n), rtol=1e-12, atol=1e-9
        )


def test_long_episode_is_finite_and_exact() -> None:
    length = 20_000
    r, s, n = arrays([1.0] * length)
    g = discounted_returns(r, s, n, 0.85)
    t = np.arange(length)
    # Constant reward 1: G_t = (1 - γ^(L - t)) / (1 - γ); no γ^-t, so nothing overflows.
    np.testing.assert_allclose(g, (1 - 0.85 ** (length - t)) / (1 - 0.85), rtol=1e-13)
    assert np.isfinite(discounted_returns(r, s, n, 0.999)).all()


def test_bad_arguments() -> None:
    r, s, n = arrays([1.0, 2.0])
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(r, s, n, 1.5)
    with pytest.raises(ValueError, match="within the rewards"):
        discounted_returns(r, s, n + 1)
    with pytest.raises(ValueError, match="n must be"):
        n_step_returns(r, s, n, 0)


def _two_sessions() -> pa.Table:
    return pa.table(
        {
            "decision_id": ["a1", "a2", "a3", "b1"],
            "session_id": ["a", "a", "a", "b"],
            "event_time_s": [0.0, 10.0, 20.0, 0.0],
            "action": pa.array(
                [int(Action.ADD_TO_CART), int(Action.VIEW_DETAIL), int(Action.VIEW_DETAIL), int(Action.ADD_TO_CART)], pa.int8()
            ),
        }
    )


def _orders(*rows: tuple[str, float, float]) -> pa.Table:
    return pa.table(
        {
            "outcome_id": [f"o{i}" for i in range(len(rows))],
            "decision_id": ["?"] * len(rows),
            "session_id": [r[0] for r in rows],
            "outcome": pa.array([int(Outcome.ORDER)] * len(rows), pa.int8()),
            "value": [r[2] for r in rows],
            "coupon_discount": [0.0] * len(rows),
            "event_time_s": [r[1] for r in rows],
            "received_s": [r[1] for r in rows],
        }
    )


def test_session_returns_and_mean_return() -> None:
    # Session a: an order of 100 at t=25 credits a3 (the latest decision, t=20) -> G_0 = 0.85² · 100 = 72.25.
    # Session b: 10 at t=5 credits b1 -> G_0 = 10.
    episodes = build_episodes(_two_sessions(), _orders(("a", 25.0, 100.0), ("b", 5.0, 10.0)))
    g0 = session_returns(episodes)
    np.testing.assert_allclose(g0, [72.25, 10.0])
    np.testing.assert_allclose(episode_returns(episodes), [72.25, 85.0, 100.0, 10.0])
    np.testing.assert_allclose(episode_returns(episodes, n=1), [0.0, 0.0, 100.0, 10.0])
    np.testing.assert_allclose(session_returns(episodes, gamma=1.0), [100.0, 10.0])  # undiscounted: the net GMV
    # Other rewards on the same steps: r = [0, 0, 1, 0] -> G_0(a) = 0.85², G_0(b) = 0.
    np.testing.assert_allclose(session_returns(episodes, np.array([0.0, 0.0, 1.0, 0.0])), [0.7225, 0.0])
    m = mean_return(g0)
    stderr = math.sqrt(((72.25 - 41.125) ** 2 + (10 - 41.125) ** 2) / 1) / math.sqrt(2)  # sample std (ddof 1) / √n
    assert (m.mean, m.n) == (41.125, 2)
    assert m.stderr == pytest.approx(stderr)
    assert [m.low, m.high] == pytest.approx([41.125 - Z_95 * stderr, 41.125 + Z_95 * stderr])
    assert json.loads(json.dumps(m.to_dict()))["mean"] == 41.125


def test_mean_return_edge_cases() -> None:
    one = mean_return(np.array([4.0]))
    assert one.mean == 4.0 and math.isnan(one.stderr) and math.isnan(one.low)
    with pytest.raises(ValueError, match="no sessions"):
        mean_return(np.zeros(0))
    episodes = build_episodes(_two_sessions().slice(0, 0), _orders())
    assert session_returns(episodes).shape == (0,)


def test_quantile_normalisation_over_nonzero_rewards_scales_without_clipping() -> None:
    nonzero = np.arange(1.0, 101.0)  # 1 … 100
    rewards = np.concatenate([np.zeros(900), nonzero])  # 90 % zeros: all-step quantiles would be 0 and 0
    normed, scale = normalize_rewards(rewards)
    # np.quantile, linear: q05 = 1 + 0.05 · 99 = 5.95, q95 = 1 + 0.95 · 99 = 95.05; the default only divides by the spread.
    assert [scale.low, scale.high] == pytest.approx([5.95, 95.05]) and scale.scale == pytest.approx(89.1) and not scale.clip
    np.testing.assert_allclose(normed, rewards / 89.1)
    np.testing.assert_allclose(scale.apply(np.array([0.0, 1000.0, -5.0])), [0.0, 1000.0 / 89.1, -5.0 / 89.1])
    assert json.loads(json.dumps(scale.to_dict())) == scale.to_dict()


def test_quantile_normalisation_with_clipping() -> None:
    nonzero = np.arange(1.0, 101.0)  # 1 … 100
    rewards = np.concatenate([np.zeros(900), nonzero])
    normed, scale = normalize_rewards(rewards, clip=True)
    # np.quantile, linear: q05 = 1 + 0.05 · 99 = 5.95, q95 = 1 + 0.95 · 99 = 95.05
    assert [scale.low, scale.high] == pytest.approx([5.95, 95.05]) and scale.n_nonzero == 100
    assert scale.scale == pytest.approx(89.1)
    assert (normed[:900] == 0.0).all()
    np.testing.assert_allclose(normed[900:], np.clip(nonzero, 5.95, 95.05) / 89.1)
    assert normed.max() == pytest.approx(95.05 / 89.1) and normed[900] == pytest.approx(5.95 / 89.1)
    # The recorded parameters apply to new rewards the same way; below `low` means `low`, whatever the sign.
    np.testing.assert_allclose(scale.apply(np.array([0.0, 1000.0, -5.0, 50.0])), [0.0, 95.05 / 89.1, 5.95 / 89.1, 50 / 89.1])
    assert json.loads(json.dumps(scale.to_dict())) == scale.to_dict()


def test_normalisation_floor_and_degenerate_inputs() -> None:
    normed, scale = normalize_rewards(np.array([0.0, 30.0, 0.0, 30.0]))  # spread 0: floored at min_scale = 1
    assert (scale.low, scale.high, scale.scale) == (30.0, 30.0, 1.0) and normed.tolist() == [0.0, 30.0, 0.0, 30.0]
    normed, scale = normalize_rewards(np.array([0.0, 30.0, 30.0]), min_scale=10.0)
    assert normed.tolist() == [0.0, 3.0, 3.0]
    normed, scale = normalize_rewards(np.zeros(5))
    assert normed.tolist() == [0.0] * 5 and (scale.low, scale.high, scale.scale, scale.n_nonzero) == (0.0, 0.0, 1.0, 0)
    assert normalize_rewards(np.zeros(0))[0].shape == (0,)
    with pytest.raises(ValueError, match="lower_q"):
        fit_reward_scale(np.ones(3), 0.9, 0.1)
    with pytest.raises(ValueError, match="min_scale"):
        fit_reward_scale(np.ones(3), min_scale=0.0)
