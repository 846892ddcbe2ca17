"""The torch networks compute what weights.mlp (the reference of the ONNX graphs) computes."""

from __future__ import annotations

import numpy as np
import torch

from trainer.networks import guard_from_arrays, policy_from_arrays, to_arrays
from weights import mlp


def test_policy_and_guard_match_the_reference_and_round_trip() -> None:
    rng = np.random.default_rng(0)
    policy = mlp.init_params(rng, [20, 16, 16, 5])
    guard = mlp.init_params(rng, [25, 8, 8, 1])
    states = rng.standard_normal((7, 20)).astype(np.float32)
    with torch.no_grad():
        logits = policy_from_arrays(policy)(torch.from_numpy(states)).numpy()
        allow = torch.sigmoid(guard_from_arrays(guard, 20)(torch.from_numpy(states))).numpy()
    np.testing.assert_allclose(logits, mlp.policy_forward(policy, states), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(allow, mlp.guard_forward(guard, states), rtol=1e-5, atol=1e-6)
    back = to_arrays(policy_from_arrays(policy))
    assert all(np.array_equal(back[k], policy[k]) for k in policy)
