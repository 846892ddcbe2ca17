"""Trained networks → a bundle the server loads, checked against torch, reproducible.

The policy and guard go through ``weights.mlp`` (the same ONNX graph builders as every
bundle) and ``weights.initial.assemble_bundle`` (golden self-test data from a seeded
generator). Before the bytes are returned, the bundle is loaded as the server loads it
(``ModelSet.load``: checksums, schema, golden self-test) and its ONNX outputs are compared
with the torch networks on random states: the largest difference (relative beyond magnitude 1,
``weights.golden``) must stay within ``tolerance``. ``created_at`` comes from the caller (the trainer derives it from the logs),
so the same logs and seed give the same bytes (at the same thread count: docs/training.md, step 8).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from policy.features import FeatureSpec
from trainer.networks import GuardNet, PolicyNet, to_arrays
from weights import mlp
from weights.bundle import read_bundle
from weights.golden import golden_error
from weights.initial import assemble_bundle
from weights.model_set import LoadOptions, ModelSet


class ExportError(RuntimeError):
    """The exported graphs do not compute what the torch networks compute."""


def export_bundle(policy: PolicyNet, guard: GuardNet, behavior_table: npt.NDArray[np.float32], spec: FeatureSpec,
                  manifest: dict[str, Any], seed: int, tolerance: float = 1e-4, checks: int = 256,
                  product: dict[str, mlp.Params] | None = None) -> bytes:
    """The bundle bytes; raises ``ExportError`` when ONNX and torch disagree beyond ``tolerance``. ``product``: the
    starting bundle's ``RecommendProduct`` networks, carried over as they are (the trainer does not train them yet), so
    a trained bundle keeps serving them (format version 2; ``manifest`` then has their ``product`` section)."""
    rng = np.random.default_rng(seed)
    data = assemble_bundle(to_arrays(policy), to_arrays(guard), behavior_table, spec, manifest, rng, product)
    model = ModelSet.load(read_bundle(data), LoadOptions(device="cpu", warmup_batch=1))
    states = np.zeros((checks, spec.state_dim), dtype=np.float32)
    states[:, : spec.item_dim] = rng.standard_normal((checks, spec.item_dim)) / np.sqrt(spec.item_dim)
    states[:, spec.item_dim : spec.item_dim + spec.behavior_dim] = behavior_table[rng.integers(0, spec.behavior_buckets, checks)]
    states[np.arange(checks), spec.item_dim + spec.behavior_dim + rng.integers(0, 24, checks)] = 1.0
    logits, allow = model.infer(states)
    with torch.no_grad():
        x = torch.from_numpy(states)
        ref_logits = policy.cpu()(x).numpy()
        ref_allow = torch.sigmoid(guard.cpu()(x)).numpy()
    error = max(golden_error(logits, ref_logits), golden_error(allow, ref_allow))
    if not error <= tolerance:
        raise ExportError(f"ONNX and torch differ by {error:.3g} > {tolerance:.3g}")
    return data
