"""``RecommendProduct``'s learned guard: per layer, the probability that offering a candidate draws a complaint.

The product counterpart of the Action Guard (``guard.action_guard``). Each layer's guard graph,
``product_guard_category.onnx``, ``product_guard_sku.onnx``, ``product_guard_band.onnx``, reads what the layer's head
reads, ``[h, candidate features]`` (h: the bundle's shared product encoder), one row per candidate, and outputs the
logit of P(a complaint against the offer | the candidate is chosen at this layer). It is the same kind of MLP as a head
(``weights.mlp.policy_onnx``: Gemm and Relu, one input, one output), so the same allowlist and sessions serve it.

A candidate whose probability exceeds the manifest's ``product.guard.max_complaint[layer]`` is vetoed: the layer's
policy, exploration and rule choose among the rest (``policy.product_policy``), and when the guard vetoes every
candidate the guardrails permit, the layer's rule answers among those with ``FALLBACK_GUARD``, as ``RecommendAction``
does. Guardrails are fixed business rules; the guard is learnt from what shoppers complained about
(``trainer.product_guard``), so it can veto what no rule names: where the policy's own reward only discourages a
complaint on average, and ε-exploration may still serve it, the guard never does.

A bundle carries all three guards or none (format version 3: ``weights.bundle.VERSION_PARTS``). The load-time self-test
runs each on ``golden_states.npy`` encoded by the bundle's encoder and seeded candidate rows, against
``golden_product_guard_outputs.npy`` (one logit per guard per golden state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from policy.features import FeatureSpec
from policy.onnx_model import OnnxModel
from weights import mlp
from weights.bundle import PRODUCT_GUARD_PARTS, PRODUCT_PARTS, Bundle, BundleError, npy_bytes, rewritten
from weights.golden import one_blas_thread
from weights.onnx_check import check_model
from weights.product_heads import (
    HEAD_WIDTH,
    HEADS,
    HIDDEN,
    candidate_rows,
    feature_widths,
    golden_check,
    golden_features,
    run_at_the_limits,
)

F32 = npt.NDArray[np.float32]
GUARD_PART = {"category": "product_guard_category.onnx", "sku": "product_guard_sku.onnx", "band": "product_guard_band.onnx"}
GUARD_GOLDEN = "golden_product_guard_outputs.npy"
MAX_COMPLAINT = 0.1
"""The default veto threshold: ten times the simulator's base complaint rate, below its overpriced SKUs' 0.25."""


def init_params(rng: np.random.Generator, widths: dict[str, int], bias: float = -4.0) -> dict[str, mlp.Params]:
    """Fresh guard weights: each output near a complaint probability of sigmoid(``bias``) (about 0.018), so an untrained
    guard vetoes nothing at the default threshold."""
    params = {}
    for head in HEADS:
        p = mlp.init_params(rng, [HIDDEN + widths[head], HEAD_WIDTH, HEAD_WIDTH, 1])
        p["w3"] *= np.float32(0.01)
        p["b3"][:] = np.float32(bias)
        params[head] = p
    return params


def golden_outputs(params: dict[str, mlp.Params], h: F32, widths: dict[str, int]) -> F32:
    """Per golden state's h, each guard's logit on that state's seeded candidate row (as the self-test computes them)."""
    with one_blas_thread():
        return np.concatenate([mlp.policy_forward(params[head], np.concatenate([h, golden_features(widths[head], len(h))], axis=1))
                               for head in HEADS], axis=1).astype(np.float32)


def golden_h(encoder: mlp.Params, golden_states: F32) -> F32:
    """The encoder's h on the golden states: what the guards' golden outputs are computed from (``parts``)."""
    with one_blas_thread():
        return mlp.policy_forward(encoder, golden_states)


def parts(params: dict[str, mlp.Params], h_golden: F32, widths: dict[str, int]) -> dict[str, bytes]:
    """The bundle parts of these guards, with their golden outputs for the golden states' h."""
    out = {GUARD_PART[head]: mlp.policy_onnx(params[head]) for head in HEADS}
    out[GUARD_GOLDEN] = npy_bytes(golden_outputs(params, h_golden, widths))
    return out


def with_guard(bundle: Bundle, params: dict[str, mlp.Params], max_complaint: float | dict[str, float] = MAX_COMPLAINT) -> bytes:
    """``bundle`` (with product heads) with these guards (format version 3) and ``product.guard``; every other part byte
    for byte. Unsigned: a signature covers the old manifest. (The trainer writes guards with new heads:
    ``weights.product_heads.with_heads``.)"""
    if PRODUCT_PARTS[0] not in bundle.parts:
        raise BundleError("format", "a product guard needs the bundle's product heads (format version 2)")
    encoder = mlp.policy_params_from_onnx(bundle.parts[PRODUCT_PARTS[0]])
    widths = feature_widths(FeatureSpec.parse(bundle.manifest["feature_spec"]))
    return rewritten(bundle, {"product": {**bundle.manifest["product"], "guard": manifest_section(max_complaint)}},
                     parts(params, golden_h(encoder, bundle.array("golden_states.npy")), widths))


def without_guard(bundle: Bundle) -> bytes:
    """``bundle`` without its guards (format version 2, or 1 without heads); every other part byte for byte."""
    product = bundle.manifest.get("product")
    manifest = {"product": {k: v for k, v in product.items() if k != "guard"}} if isinstance(product, dict) else {}
    return rewritten(bundle, manifest, drop=PRODUCT_GUARD_PARTS)


def manifest_section(max_complaint: float | dict[str, float] = MAX_COMPLAINT) -> dict[str, Any]:
    """The manifest's ``product.guard`` section."""
    limits = max_complaint if isinstance(max_complaint, dict) else dict.fromkeys(HEADS, max_complaint)
    return {"max_complaint": {head: float(limits[head]) for head in HEADS}}


def thresholds(manifest: dict[str, Any]) -> dict[str, float]:
    """``product.guard.max_complaint`` per layer, checked: ``BundleError`` naming the field."""
    section = manifest.get("product")
    guard = section.get("guard") if isinstance(section, dict) else None
    limits = guard.get("max_complaint") if isinstance(guard, dict) else None
    if not isinstance(limits, dict):
        raise BundleError("schema", "manifest.json: product.guard.max_complaint must be an object (a bundle with product "
                                    "guards needs it)")
    out = {}
    for head in HEADS:
        value = limits.get(head)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise BundleError("schema", f"manifest.json: product.guard.max_complaint.{head} must be a number in (0, 1], "
                                        f"got {str(value)[:40]}")
        out[head] = float(value)
    return out


@dataclass(frozen=True)
class ProductGuard:
    """The loaded guards of a format-3 bundle and their thresholds."""

    graphs: dict[str, OnnxModel]
    max_complaint: dict[str, float]

    @classmethod
    def load(cls, bundle: Bundle, h_golden: F32, widths: dict[str, int], device: str, threads: int,
             tolerance: float) -> ProductGuard:
        """Checked, loaded, self-tested on the golden states' h, and run at a request's largest candidate counts."""
        limits = thresholds(bundle.manifest)
        for name in GUARD_PART.values():
            check_model(name, bundle.parts[name])
        try:
            graphs = {head: OnnxModel(f"product_guard_{head}", bundle.parts[GUARD_PART[head]], device, threads) for head in HEADS}
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise BundleError("onnx", f"cannot load the product guard graphs: {str(exc).splitlines()[0][:300]}") from None
        guard = cls(graphs, limits)
        guard._self_test(bundle, h_golden, widths, tolerance)
        run_at_the_limits(guard.logits, h_golden[:1], widths, "guard")  # as the heads: a request's largest sizes
        return guard

    def _self_test(self, bundle: Bundle, h_golden: F32, widths: dict[str, int], tolerance: float) -> None:
        golden_check(lambda: np.stack([self.logits(head, h_golden, golden_features(widths[head], len(h_golden)))
                                       for head in HEADS], axis=1),
                     bundle.array(GUARD_GOLDEN), (len(h_golden), len(HEADS)), GUARD_GOLDEN, "product guard", tolerance)

    def logits(self, head: str, h: F32, features: F32) -> F32:
        """One complaint logit per candidate row (``h``: one row, or one per candidate)."""
        return candidate_rows(self.graphs[head], f"product {head} guard", h, features)

    def vetoed(self, head: str, h: F32, features: F32) -> npt.NDArray[np.bool_]:
        """Where the complaint probability exceeds the layer's threshold; ``FloatingPointError`` on a non-finite logit
        (a NaN must never pass the veto: NaN > threshold is false)."""
        z = self.logits(head, h, features).astype(np.float64)
        if not np.isfinite(z).all():
            raise FloatingPointError(f"the product {head} guard produced NaN or Inf for this input")
        limit = self.max_complaint[head]
        return z > math.log(limit / (1.0 - limit)) if limit < 1.0 else np.zeros(len(z), dtype=np.bool_)
