"""A fresh, valid bundle from a seed: the bootstrap weights before any training.

Used by ``scripts/build_default_bundle.py`` (the embedded default) and by tests. The
networks are He-initialised from ``numpy.random.default_rng(seed)``; the policy's output
bias carries a hand-set prior (view_detail > add_to_cart > apply_coupon > share_social), so
an untrained policy still reaches a majority most of the time; the guard's output bias
starts it permissive (allow ≈ 0.9). Needs the ``onnx`` package to build the graphs.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.typing as npt

from core.domain import ACTIONS
from policy.features import FeatureSpec
from weights import mlp
from weights import product_heads as product_heads_module
from weights.bundle import npy_bytes, write_bundle
from weights.golden import one_blas_thread

DEFAULT_GUARDRAILS: dict[str, Any] = {
    "static": {"add_to_cart": 1.0, "view_detail": 1.0, "apply_coupon": 0.8, "share_social": 0.5, "exit": 0.0},
    "rules": [
        {"name": "full_cart_damp_add", "when": {"cart_item_count_min": 3}, "action": "add_to_cart", "multiplier": 0.3},
    ],
}
DEFAULT_RULES: list[dict[str, Any]] = [
    {"name": "cart_page_coupon", "when": {"page_type": ["cart"]}, "actions": ["apply_coupon", "view_detail"]},
    {"name": "full_cart_coupon", "when": {"cart_item_count_min": 3}, "actions": ["apply_coupon", "view_detail"]},
    {"name": "detail_page_add", "when": {"page_type": ["detail"]}, "actions": ["add_to_cart", "view_detail"]},
    {"name": "default", "actions": ["view_detail", "add_to_cart", "apply_coupon", "share_social"]},
]
POLICY_PRIOR = {"add_to_cart": 0.8, "view_detail": 1.6, "apply_coupon": 0.2, "share_social": -0.6, "exit": 0.0}
POLICY_HIDDEN = 128
GUARD_HIDDEN = 64
GOLDEN_COUNT = 8


def make_bundle(seed: int, model_version: str, created_at: str, spec: FeatureSpec | None = None,
                provenance: dict[str, Any] | None = None, product_heads: bool = False) -> bytes:
    """The bytes of a complete bundle; the same arguments give the same bytes. With ``product_heads``, also
    ``RecommendProduct``'s untrained networks (format version 2; ``weights.product_heads``), from their own stream of
    the seed, so the rest of the bundle is the same as without them."""
    spec = spec or FeatureSpec()
    rng = np.random.default_rng(seed)
    n = len(ACTIONS)
    policy = mlp.init_params(rng, [spec.state_dim, POLICY_HIDDEN, POLICY_HIDDEN, n])
    policy["w3"] *= np.float32(0.1)
    policy["b3"] = np.array([POLICY_PRIOR[a.key] for a in ACTIONS], dtype=np.float32)
    guard = mlp.init_params(rng, [spec.state_dim + n, GUARD_HIDDEN, GUARD_HIDDEN, 1])
    guard["w3"] *= np.float32(0.1)
    guard["b3"] = np.array([2.2], dtype=np.float32)
    table = (rng.standard_normal((spec.behavior_buckets, spec.behavior_dim)) / np.sqrt(spec.behavior_dim)).astype(np.float32)

    manifest: dict[str, Any] = {
        "model_version": model_version,
        "created_at": created_at,
        "feature_spec": spec.to_json(),
        "actions": [a.key for a in ACTIONS],
        "guardrails": DEFAULT_GUARDRAILS,
        "fallback_rules": DEFAULT_RULES,
        "guard": {"threshold": 0.2},
        "decoder": {"samples": 10, "min_votes": 4, "exploration_epsilon": 0.05, "exploration_temperature": 1.2},
        "golden": {"tolerance": 1e-4},
        "training_metrics": {},
        "provenance": {"kind": "initial", "seed": seed, "builder": "weights.initial.make_bundle", **(provenance or {})},
    }
    product = None
    if product_heads:
        product = product_heads_module.init_params(np.random.default_rng([seed, 1]), spec)
        manifest["product"] = product_heads_module.manifest_section()
    return assemble_bundle(policy, guard, table, spec, manifest, rng, product)


def assemble_bundle(policy: mlp.Params, guard: mlp.Params, table: npt.NDArray[np.float32], spec: FeatureSpec,
                    manifest: dict[str, Any], rng: np.random.Generator, product: dict[str, mlp.Params] | None = None) -> bytes:
    """A bundle from network arrays, the behaviour table and a manifest: builds the ONNX graphs and
    the golden self-test data (``GOLDEN_COUNT`` states drawn from ``rng``, with the reference outputs)."""
    golden = np.zeros((GOLDEN_COUNT, spec.state_dim), dtype=np.float32)
    golden[:, : spec.item_dim] = rng.standard_normal((GOLDEN_COUNT, spec.item_dim)) / np.sqrt(spec.item_dim)
    golden[:, spec.item_dim : spec.item_dim + spec.behavior_dim] = table[rng.integers(0, spec.behavior_buckets, GOLDEN_COUNT)]
    golden[np.arange(GOLDEN_COUNT), spec.item_dim + spec.behavior_dim + rng.integers(0, 24, GOLDEN_COUNT)] = 1.0
    with one_blas_thread():
        outputs = np.concatenate([mlp.policy_forward(policy, golden), mlp.guard_forward(guard, golden)], axis=1)
    parts = {
        "policy.onnx": mlp.policy_onnx(policy),
        "guard.onnx": mlp.guard_onnx(guard, spec.state_dim),
        "behavior_table.npy": npy_bytes(table),
        "golden_states.npy": npy_bytes(golden),
        "golden_outputs.npy": npy_bytes(outputs.astype(np.float32)),
    }
    if product is not None:
        parts.update(product_heads_module.parts(product, spec, golden))
    buf = io.BytesIO()
    write_bundle(buf, manifest, parts)
    return buf.getvalue()
