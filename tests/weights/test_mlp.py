"""The reference forward passes against their ONNX graphs run on a real onnxruntime session."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from weights import mlp

STATE, HIDDEN, GUARD_HIDDEN, N_ACTIONS = 920, 128, 64, 5


def session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def random_params(rng: np.random.Generator, sizes: list[int]) -> mlp.Params:
    """He-initialised weights with non-zero biases, so the biases are exercised too."""
    params = mlp.init_params(rng, sizes)
    for key in list(params):
        if key.startswith("b"):
            params[key] = rng.normal(0, 0.3, size=params[key].shape).astype(np.float32)
    return params


def states(rng: np.random.Generator, n: int, dim: int = STATE) -> np.ndarray:
    return (rng.standard_normal((n, dim)) / np.sqrt(dim) * 4).astype(np.float32)


def explicit_guard(p: mlp.Params, x: np.ndarray) -> np.ndarray:
    """The guard as written in its definition: an MLP over concat(state, one_hot(a)), per action, in float64."""
    n_actions = p["w1"].shape[0] - x.shape[1]
    w = {k: v.astype(np.float64) for k, v in p.items()}
    out = np.empty((x.shape[0], n_actions))
    for a in range(n_actions):
        one_hot = np.zeros((x.shape[0], n_actions))
        one_hot[:, a] = 1.0
        z = np.concatenate([x.astype(np.float64), one_hot], axis=1)
        h = np.maximum(z @ w["w1"] + w["b1"], 0.0)
        h = np.maximum(h @ w["w2"] + w["b2"], 0.0)
        logit = (h @ w["w3"] + w["b3"])[:, 0]
        out[:, a] = 1.0 / (1.0 + np.exp(-logit))
    return out


def test_init_params_shapes_and_bounds() -> None:
    p = mlp.init_params(np.random.default_rng(0), [10, 7, 3])
    assert {k: v.shape for k, v in p.items()} == {"w1": (10, 7), "b1": (7,), "w2": (7, 3), "b2": (3,)}
    assert all(v.dtype == np.float32 for v in p.values())
    assert np.abs(p["w1"]).max() <= np.sqrt(6 / 10) and np.abs(p["w2"]).max() <= np.sqrt(6 / 7)
    assert not p["b1"].any() and not p["b2"].any()
    again = mlp.init_params(np.random.default_rng(0), [10, 7, 3])
    assert all(np.array_equal(p[k], again[k]) for k in p)


def test_policy_forward_by_hand() -> None:
    p = {"w1": np.array([[1.0, -1.0], [2.0, 0.5]], dtype=np.float32), "b1": np.array([0.0, 1.0], dtype=np.float32),
         "w2": np.eye(2, dtype=np.float32), "b2": np.array([-4.0, 0.0], dtype=np.float32),
         "w3": np.array([[1.0], [3.0]], dtype=np.float32), "b3": np.array([0.5], dtype=np.float32)}
    x = np.array([[1.0, 1.0]], dtype=np.float32)
    # h1 = relu([3, -0.5] + [0, 1]) = [3, 0.5] ; h2 = relu([3 - 4, 0.5]) = [0, 0.5] ; out = 0 + 1.5 + 0.5
    assert mlp.policy_forward(p, x).tolist() == [[2.0]]


def test_policy_graph_matches_the_numpy_forward() -> None:
    rng = np.random.default_rng(11)
    p = random_params(rng, [STATE, HIDDEN, HIDDEN, N_ACTIONS])
    sess = session(mlp.policy_onnx(p))
    assert [i.name for i in sess.get_inputs()] == ["state"] and [o.name for o in sess.get_outputs()] == ["logits"]
    for n in (1, 7, 64):
        x = states(rng, n)
        got = sess.run(None, {"state": x})[0]
        expected = mlp.policy_forward(p, x)
        assert got.shape == expected.shape == (n, N_ACTIONS)
        assert np.abs(expected).max() > 0.1  # outputs are not trivially small
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_guard_graph_matches_the_numpy_forward() -> None:
    rng = np.random.default_rng(12)
    p = random_params(rng, [STATE + N_ACTIONS, GUARD_HIDDEN, GUARD_HIDDEN, 1])
    sess = session(mlp.guard_onnx(p, STATE))
    assert [i.name for i in sess.get_inputs()] == ["state"] and [o.name for o in sess.get_outputs()] == ["allow_prob"]
    for n in (1, 5, 64):
        x = states(rng, n)
        got = sess.run(None, {"state": x})[0]
        expected = mlp.guard_forward(p, x)
        assert got.shape == expected.shape == (n, N_ACTIONS)
        assert expected.std() > 0.01  # not saturated
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("state_dim", "n_actions", "hidden"), [(STATE, N_ACTIONS, GUARD_HIDDEN), (6, 3, 4)])
def test_guard_forward_is_the_mlp_over_state_and_action_one_hot(state_dim: int, n_actions: int, hidden: int) -> None:
    rng = np.random.default_rng(13)
    p = random_params(rng, [state_dim + n_actions, hidden, hidden, 1])
    x = states(rng, 9, state_dim)
    got = mlp.guard_forward(p, x)
    expected = explicit_guard(p, x)
    assert got.shape == (9, n_actions)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    # and the graph computes the same thing
    np.testing.assert_allclose(session(mlp.guard_onnx(p, state_dim)).run(None, {"state": x})[0], expected, atol=1e-5, rtol=0)


def test_guard_forward_saturates_cleanly_for_confident_vetoes() -> None:
    """A guard that is certain (logit far below 0) gives allow-probability 0, without numpy overflow warnings."""
    rng = np.random.default_rng(14)
    p = random_params(rng, [STATE + N_ACTIONS, GUARD_HIDDEN, GUARD_HIDDEN, 1])
    p["b3"] = np.array([-120.0], dtype=np.float32)
    x = states(rng, 4)
    got = mlp.guard_forward(p, x)  # the suite turns warnings into errors
    expected = session(mlp.guard_onnx(p, STATE)).run(None, {"state": x})[0]
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert (got < 1e-40).all()


def test_graphs_are_deterministic_bytes() -> None:
    p = random_params(np.random.default_rng(15), [8, 4, 4, 2])
    assert mlp.policy_onnx(p) == mlp.policy_onnx(p)
    g = random_params(np.random.default_rng(16), [8 + 2, 4, 4, 1])
    assert mlp.guard_onnx(g, 8) == mlp.guard_onnx(g, 8)
