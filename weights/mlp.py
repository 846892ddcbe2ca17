"""The two networks as plain arrays: the reference forward passes and their ONNX graphs.

Policy: state (920) → 128 → 128 → 5 logits, ReLU. Keys ``w1 b1 w2 b2 w3 b3``; ``w`` is
``(in, out)``.

Guard: a 3-layer MLP over ``state ⊕ one-hot(action)`` → allow-probability (sigmoid), scored
for all actions at once. ``w1`` is ``(state_dim + n_actions, hidden)``; its first
``state_dim`` rows see the state, the last ``n_actions`` rows the action one-hot, so the
graph computes ``state @ w1[:S]`` once and adds the action row per candidate — exactly the
MLP over the concatenation, with one first-layer product instead of five.

The numpy forward passes are the reference that the ONNX graphs and the trainer's torch
modules are tested against. Building graphs needs the ``onnx`` package (test and train
extras); the server only runs them.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
Params = dict[str, F32]

POLICY_KEYS = ("w1", "b1", "w2", "b2", "w3", "b3")
OPSET = 17
IR_VERSION = 8


def _relu(x: F32) -> F32:
    return np.maximum(x, 0)


def policy_forward(p: Params, states: F32) -> F32:
    h = _relu(states @ p["w1"] + p["b1"])
    h = _relu(h @ p["w2"] + p["b2"])
    return h @ p["w3"] + p["b3"]


def guard_forward(p: Params, states: F32) -> F32:
    """Allow-probabilities ``(N, n_actions)``."""
    s = states.shape[1]
    h1 = (states @ p["w1"][:s] + p["b1"])[:, None, :] + p["w1"][s:][None, :, :]
    h = _relu(h1)
    h = _relu(h @ p["w2"] + p["b2"])
    z = (h @ p["w3"] + p["b3"])[..., 0]
    return np.exp(-np.logaddexp(0, -z))  # sigmoid without overflow for confident vetoes


def _model(graph: Any) -> bytes:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, producer_name="shopping-agent", opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString(deterministic=True))


def policy_onnx(p: Params) -> bytes:
    """The policy as an ONNX graph: input ``state`` (N, S) → output ``logits`` (N, A)."""
    from onnx import TensorProto, helper, numpy_helper

    s, a = p["w1"].shape[0], p["w3"].shape[1]
    inits = [numpy_helper.from_array(np.ascontiguousarray(p[k], dtype=np.float32), k) for k in POLICY_KEYS]
    nodes = [
        helper.make_node("Gemm", ["state", "w1", "b1"], ["z1"]),
        helper.make_node("Relu", ["z1"], ["h1"]),
        helper.make_node("Gemm", ["h1", "w2", "b2"], ["z2"]),
        helper.make_node("Relu", ["z2"], ["h2"]),
        helper.make_node("Gemm", ["h2", "w3", "b3"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "policy",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["N", s])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", a])],
        inits,
    )
    return _model(graph)


def guard_onnx(p: Params, state_dim: int) -> bytes:
    """The guard as an ONNX graph: input ``state`` (N, S) → output ``allow_prob`` (N, A)."""
    from onnx import TensorProto, helper, numpy_helper

    hidden = p["w1"].shape[1]
    a = p["w1"].shape[0] - state_dim
    arrays: dict[str, npt.NDArray[Any]] = {
        "w_state": p["w1"][:state_dim], "w_action": p["w1"][state_dim:], "b1": p["b1"],
        "w2": p["w2"], "b2": p["b2"], "w3": p["w3"], "b3": p["b3"],
        "shape_in": np.array([-1, 1, hidden], dtype=np.int64), "shape_out": np.array([-1, a], dtype=np.int64),
    }
    inits = [
        numpy_helper.from_array(np.ascontiguousarray(v, dtype=v.dtype if v.dtype == np.int64 else np.float32), k)
        for k, v in arrays.items()
    ]
    nodes = [
        helper.make_node("Gemm", ["state", "w_state", "b1"], ["zs"]),
        helper.make_node("Reshape", ["zs", "shape_in"], ["zs3"]),
        helper.make_node("Add", ["zs3", "w_action"], ["z1"]),
        helper.make_node("Relu", ["z1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["z2m"]),
        helper.make_node("Add", ["z2m", "b2"], ["z2"]),
        helper.make_node("Relu", ["z2"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w3"], ["z3m"]),
        helper.make_node("Add", ["z3m", "b3"], ["z3"]),
        helper.make_node("Reshape", ["z3", "shape_out"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["allow_prob"]),
    ]
    graph = helper.make_graph(
        nodes, "guard",
        [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["N", state_dim])],
        [helper.make_tensor_value_info("allow_prob", TensorProto.FLOAT, ["N", a])],
        inits,
    )
    return _model(graph)


def init_params(rng: np.random.Generator, sizes: list[int]) -> Params:
    """He-uniform weights and zero biases for a stack of ``len(sizes) - 1`` layers."""
    params: Params = {}
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes), start=1):
        bound = np.sqrt(6.0 / fan_in)
        params[f"w{i}"] = rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, dtype=np.float32)
    return params


def _initializers(model: bytes) -> dict[str, npt.NDArray[Any]]:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load_from_string(model).graph
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}


def policy_params_from_onnx(model: bytes) -> Params:
    """The arrays of a graph built by ``policy_onnx`` (to train a bundle's policy further)."""
    inits = _initializers(model)
    return {k: np.asarray(inits[k], dtype=np.float32) for k in POLICY_KEYS}


def guard_params_from_onnx(model: bytes) -> Params:
    """The arrays of a graph built by ``guard_onnx``; ``w1`` is the state rows over the action rows again."""
    inits = _initializers(model)
    params = {k: np.asarray(inits[k], dtype=np.float32) for k in ("b1", "w2", "b2", "w3", "b3")}
    params["w1"] = np.concatenate([inits["w_state"], inits["w_action"]], axis=0).astype(np.float32)
    return params
