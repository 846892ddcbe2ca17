"""The arrays a run continues from must be the ones the servers run (``trainable``).

The trainer reads a bundle's networks back as arrays (``weights.mlp.policy_params_from_onnx`` and
``guard_params_from_onnx``): by the initializers' names that ``policy_onnx`` and ``guard_onnx`` write, with the sizes
their shapes give. A graph the servers accept may compute the same function another way (an initializer renamed:
``cycle`` then failed on every run with a bare ``KeyError``, exit 1, retried) or another function with those arrays in
it (a node adding a constant to the logits: the trainer trained from a policy no server served and measured its trust
region from it; an attack review, 2026-12-06). So the arrays' own forward passes (``weights.mlp``) must give what the
loaded graphs serve, within the bundle's golden tolerance, on its golden states and on states of random requests;
otherwise ``BundleError`` (``graph``), before any log is read.
"""

from __future__ import annotations

import numpy as np

from weights import mlp
from weights.bundle import Bundle, BundleError
from weights.golden import golden_error
from weights.model_set import ModelSet

RANDOM_STATES = 64  # random requests' states beside the golden ones (the golden states are the bundle's own choice)


def trainable(bundle: Bundle, model: ModelSet) -> tuple[mlp.Params, mlp.Params]:
    """The policy's and the guard's arrays of ``bundle``, whose graphs ``model`` runs (``ModelSet.load(bundle)``)."""
    try:
        policy = mlp.policy_params_from_onnx(bundle.parts["policy.onnx"])
        guard = mlp.guard_params_from_onnx(bundle.parts["guard.onnx"])
    except KeyError as exc:
        raise BundleError("graph", f"the trainer continues only from graphs of the layout it writes: no initializer {exc} "
                                   "(weights/mlp.py)") from None
    except ValueError as exc:  # arrays that are not numbers, or whose guard halves do not stack
        raise BundleError("graph", f"the trainer cannot read the networks' arrays: {exc}") from None
    states = np.concatenate([bundle.array("golden_states.npy"), model.random_states(RANDOM_STATES, np.random.default_rng(0))])
    try:
        ours = np.concatenate([mlp.policy_forward(policy, states), mlp.guard_forward(guard, states)], axis=1)
    except ValueError as exc:  # shapes that do not chain
        raise BundleError("graph", f"the networks' arrays do not form the layout the trainer writes: {exc}") from None
    try:
        served = np.concatenate(model.infer(states), axis=1)
    except FloatingPointError as exc:  # NaN, Inf or an allow-probability outside [0, 1] on some random request's state
        raise BundleError("graph", f"the graphs' outputs on random requests' states: {exc}") from None
    tolerance = float(bundle.manifest["golden"]["tolerance"])
    error = golden_error(ours, served) if ours.shape == served.shape else float("inf")
    if not error <= tolerance:
        raise BundleError("graph", f"the networks' arrays do not compute what their graphs serve (max error {error:.3g} > "
                                   f"tolerance {tolerance:.3g}): the trainer continues only from graphs of the layout it "
                                   "writes (weights/mlp.py)")
    return policy, guard
