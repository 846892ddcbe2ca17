"""Logged decisions replayed through the bundle that served them give back what was logged."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experience.segments import DirectorySource
from trainer.replay import logged_steps, replay
from weights.model_set import ModelSet


def test_replay_of_the_serving_bundle_reproduces_the_logged_behaviour(sim_logs: Path, default_model: ModelSet) -> None:
    decisions = DirectorySource(sim_logs).table("decisions")
    steps = logged_steps(decisions, default_model)
    assert len(steps) == decisions.num_rows > 1000
    again = replay(default_model, steps, chunk=333)  # chunking changes nothing
    np.testing.assert_allclose(again.served.sum(axis=1), 1.0, atol=1e-12)
    # The logged embedding is float16: the replayed state differs from the served one by
    # rounding, so the served probabilities agree closely, not bit for bit.
    np.testing.assert_allclose(again.served, steps.behavior_probs, atol=5e-3)
    logged_action_prob = again.served[np.arange(len(steps)), steps.actions]
    np.testing.assert_allclose(logged_action_prob, steps.propensity, atol=5e-3)
    assert (again.served[~again.allowed & again.ok[:, None]] == 0).all()  # vetoed or banned: never served by the decoder
    assert np.isneginf(again.log_weights[:, 4]).all()  # exit has static weight 0 in the default bundle
