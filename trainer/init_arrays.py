"""The arrays a run continues from must be the ones the servers run (``trainable``, ``trainable_product``).

The trainer reads a bundle's networks back as arrays (``weights.mlp.policy_params_from_onnx`` and
``guard_params_from_onnx``): by the initializers' names that ``policy_onnx`` and ``guard_onnx`` write, with the sizes
their shapes give. A graph the servers accept may compute the same function another way (an initializer renamed:
``cycle`` then failed on every run with a bare ``KeyError``, exit 1, retried) or another function with those arrays in
it (a node adding a constant to the logits: the trainer trained from a policy no server served and measured its trust
region from it; an attack review, 2026-12-06). So the arrays' own forward passes (``weights.mlp``,
``weights.product_heads.forward``) must give what the loaded graphs serve, within the bundle's golden tolerance, on
its golden states and on states of random requests; otherwise ``BundleError`` (``graph``), before any log is read.
The product encoder and heads (``RecommendProduct``) are read back the same way, by ``train-products`` and by a run that
carries them over, and so are the product guards, from which ``train-products`` carries the old vetoes into its new
guards (``trainer.product_guard.PreviousGuard``; a renamed initializer there had stopped that run with a bare
``KeyError``, and a shifted logit carried vetoes no server made).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from weights import mlp
from weights.bundle import Bundle, BundleError
from weights.golden import golden_error
from weights.model_set import ModelSet
from weights.product_guard import GUARD_PART
from weights.product_heads import HEADS, PART, forward, golden_features

RANDOM_STATES = 64  # random requests' states beside the golden ones (the golden states are the bundle's own choice)
F32 = mlp.F32


def trainable(bundle: Bundle, model: ModelSet) -> tuple[mlp.Params, mlp.Params]:
    """The policy's and the guard's arrays of ``bundle``, whose graphs ``model`` runs (``ModelSet.load(bundle)``)."""
    arrays = _read(lambda: {"policy": mlp.policy_params_from_onnx(bundle.parts["policy.onnx"]),
                            "guard": mlp.guard_params_from_onnx(bundle.parts["guard.onnx"])})
    states = _states(bundle, model)

    def served() -> F32:
        try:
            return np.concatenate(model.infer(states), axis=1)
        except FloatingPointError as exc:  # NaN, Inf or an allow-probability outside [0, 1] on some random request's state
            raise BundleError("graph", f"the graphs' outputs on random requests' states: {exc}") from None

    _same(lambda: np.concatenate([mlp.policy_forward(arrays["policy"], states), mlp.guard_forward(arrays["guard"], states)],
                                 axis=1), served, bundle)
    return arrays["policy"], arrays["guard"]


def trainable_product(bundle: Bundle, model: ModelSet) -> dict[str, mlp.Params]:
    """The product encoder's and heads' arrays of ``bundle`` (one with them), whose graphs ``model`` runs; seeded
    candidate rows (``golden_features``) beside each state, as the load's self-test does."""
    assert model.product is not None, "a bundle with product heads"
    heads = model.product.heads
    arrays = _read(lambda: {name: mlp.policy_params_from_onnx(bundle.parts[part]) for name, part in PART.items()})
    states = _states(bundle, model)
    features = {head: golden_features(heads.widths[head], len(states)) for head in HEADS}

    def served() -> F32:
        h = heads.encode(states)
        return np.concatenate([h, *(heads.score(head, h, features[head])[:, None] for head in HEADS)], axis=1)

    _same(lambda: forward(arrays, states, features), served, bundle)
    return arrays


def trainable_product_guards(bundle: Bundle, model: ModelSet) -> dict[str, mlp.Params]:
    """The product guards' arrays of ``bundle`` (one with them), by head, whose graphs ``model`` runs: each guard's logit
    on the encoder's h of each state beside that state's seeded candidate row, as the load's self-test computes it."""
    assert model.product is not None and model.product.guard is not None, "a bundle with product guards"
    heads, guard = model.product.heads, model.product.guard
    arrays = _read(lambda: {head: mlp.policy_params_from_onnx(bundle.parts[part]) for head, part in GUARD_PART.items()})
    h = heads.encode(_states(bundle, model))
    features = {head: golden_features(heads.widths[head], len(h)) for head in HEADS}

    def ours() -> F32:
        return np.concatenate([mlp.policy_forward(arrays[head], np.concatenate([h, features[head]], axis=1))
                               for head in HEADS], axis=1)

    _same(ours, lambda: np.stack([guard.logits(head, h, features[head]) for head in HEADS], axis=1), bundle)
    return arrays


def _read(read: Callable[[], dict[str, mlp.Params]]) -> dict[str, mlp.Params]:
    try:
        return read()
    except KeyError as exc:
        raise BundleError("graph", f"the trainer continues only from graphs of the layout it writes: no initializer {exc} "
                                   "(weights/mlp.py)") from None
    except ValueError as exc:  # arrays that are not numbers, or whose guard halves do not stack
        raise BundleError("graph", f"the trainer cannot read the networks' arrays: {exc}") from None


def _states(bundle: Bundle, model: ModelSet) -> F32:
    return np.concatenate([bundle.array("golden_states.npy"), model.random_states(RANDOM_STATES, np.random.default_rng(0))])


def _same(ours: Callable[[], F32], served: Callable[[], F32], bundle: Bundle) -> None:
    """``BundleError`` unless the arrays' forward passes (``ours``) give what the graphs serve, within the golden
    tolerance."""
    try:
        mine = ours()
    except ValueError as exc:  # shapes that do not chain
        raise BundleError("graph", f"the networks' arrays do not form the layout the trainer writes: {exc}") from None
    theirs = served()
    tolerance = float(bundle.manifest["golden"]["tolerance"])
    error = golden_error(mine, theirs) if mine.shape == theirs.shape else float("inf")
    if not error <= tolerance:
        raise BundleError("graph", f"the networks' arrays do not compute what their graphs serve (max error {error:.3g} > "
                                   f"tolerance {tolerance:.3g}): the trainer continues only from graphs of the layout it "
                                   "writes (weights/mlp.py)")
