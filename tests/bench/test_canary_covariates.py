"""The cross-fitted R² of ``bench.canary_covariates``: near 1 where the covariates determine the outcome, near 0 (or
below) where they are noise, and out of sample (an over-parameterised fit of noise does not score high)."""

import numpy as np
import pytest

from bench.canary_covariates import cross_fitted_r2, main


def test_r2_is_high_for_a_linear_signal_and_near_zero_for_noise() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4000, 20))
    signal = x @ rng.standard_normal(20)
    assert cross_fitted_r2(x, signal + 0.1 * rng.standard_normal(4000)) > 0.98
    assert abs(cross_fitted_r2(x, rng.standard_normal(4000))) < 0.02


def test_r2_is_out_of_sample() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 200))  # nearly as many covariates as rows: in sample, the fit explains much of the noise
    assert cross_fitted_r2(x, rng.standard_normal(300), ridge=1e-6) < 0.05


def test_bench_runs_on_a_few_sessions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sessions", "400"]) == 0
    out = capsys.readouterr().out
    assert "always add_to_cart" in out and "intent policy" in out and "R² first request" in out
