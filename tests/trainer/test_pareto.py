"""PSIS's k̂ (trainer.pareto) against tails whose shape is known, and what the offline report makes of it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.pareto import gpd_shape, pareto_k, tail_size, upper_tail_k


def pareto(k: float, n: int, seed: int) -> np.ndarray:
    """A Pareto sample whose tail index is 1/k: its generalized Pareto shape is k."""
    return np.random.default_rng(seed).pareto(1.0 / k, n) + 1.0


@pytest.mark.parametrize("k", [0.2, 0.5, 0.8, 1.1])
def test_recovers_a_known_shape(k: float) -> None:
    estimates = [pareto_k(pareto(k, 40_000, seed)) for seed in range(5)]
    assert abs(float(np.mean(estimates)) - k) < 0.08, estimates


def test_a_long_heavy_tail_is_fitted_without_overflow() -> None:
    """200,000 sessions (a CronJob's held-out fifth of a million): the grid's profile likelihoods lie thousands of nats
    apart, and the posterior over them once took exp of those gaps ("overflow encountered in exp", an error here)."""
    assert abs(pareto_k(pareto(0.9, 200_000, 0)) - 0.9) < 0.08


def test_the_upper_tail_of_any_values_is_read_from_its_excesses() -> None:
    """``upper_tail_k`` (an estimate's per-session terms, negative ones too) reads only the excesses over the tail's
    threshold: a shift changes nothing, and a heavy lower tail (large losses) is not an upper one."""
    x = pareto(0.7, 20_000, 4)
    assert upper_tail_k(x - 1e3) == pytest.approx(pareto_k(x), abs=1e-9) == pytest.approx(upper_tail_k(x), abs=0)
    assert upper_tail_k(-x) < 0.2 < 0.5 < upper_tail_k(x)
    with pytest.raises(ValueError, match="values"):
        upper_tail_k([1.0, np.nan] * 100)


def test_light_tails_read_as_light() -> None:
    rng = np.random.default_rng(0)
    assert pareto_k(rng.exponential(1.0, 40_000)) < 0.15  # exponential: k = 0
    assert pareto_k(rng.uniform(0.0, 1.0, 40_000)) < -0.3  # bounded: k = −1 (pulled towards 0.5 by the prior)
    assert 0.1 < pareto_k(rng.lognormal(0.0, 1.0, 40_000)) < 0.5  # finite variance


def test_the_scale_does_not_matter() -> None:
    w = pareto(0.6, 10_000, 3)
    assert pareto_k(w) == pytest.approx(pareto_k(w * 1e-9), abs=1e-9)


def test_equal_weights_have_no_tail_and_few_weights_nothing_to_fit() -> None:
    assert pareto_k(np.ones(10_000)) == -math.inf
    assert math.isnan(pareto_k(np.ones(20)))  # M = min(4, 13) < 5
    assert tail_size(40_000) == 600


@pytest.mark.parametrize("bad", [[1.0, np.nan] * 100, [1.0, -1.0] * 100, [1.0, np.inf] * 100])
def test_bad_weights_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="weights"):
        pareto_k(bad)
    with pytest.raises(ValueError, match="excesses"):
        gpd_shape([1.0, 2.0])


def test_ties_at_the_threshold_do_not_hide_a_heavy_tail() -> None:
    """A discrete policy's weights: products of ratios 4.5 or 0.125 over sessions of geometric length (mean 3), whose
    variance is infinite (E[ρ²] · P(another step) ≈ 2.7 > 1); many tie at the tail's threshold."""
    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / 3, size=10_000)
    w = np.array([np.prod(np.where(rng.random(n) < 0.2, 4.5, 0.125)) for n in lengths])
    assert len(np.unique(w[-tail_size(len(w)):])) < tail_size(len(w))  # ties in the tail
    assert pareto_k(w) > 0.7


def test_a_shape_is_shown_to_as_many_decimals_as_tell_it_from_the_limit() -> None:
    """A refusal at k̂ 0.7004 printed "Pareto k̂ 0.70 > 0.7" (a new-user trial of 2026-12-06)."""
    from trainer.pareto import shown_against

    assert shown_against(0.7004, 0.7) == "0.7004" and float(shown_against(0.7000001, 0.7)) > 0.7
    assert shown_against(0.83, 0.7) == "0.83" and shown_against(0.6996, 0.7) == "0.6996" and shown_against(0.7, 0.7) == "0.70"
    assert shown_against(float("nan"), 0.7) == "nan" and shown_against(-math.inf, 0.7) == "-inf"
