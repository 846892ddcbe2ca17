"""Export: torch networks → a bundle the server loads, computing what torch computes, the same bytes every time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from policy.features import FeatureSpec
from trainer.export import ExportError, export_bundle
from trainer.networks import GuardNet, PolicyNet, guard_from_arrays, policy_from_arrays
from weights import mlp
from weights.bundle import Bundle, read_bundle
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet


def _nets(init: Bundle, spec: FeatureSpec) -> tuple[PolicyNet, GuardNet]:
    policy = policy_from_arrays(mlp.policy_params_from_onnx(init.parts["policy.onnx"]))
    guard = guard_from_arrays(mlp.guard_params_from_onnx(init.parts["guard.onnx"]), spec.state_dim)
    with torch.no_grad():  # move away from the default, so the test is not about the default's own numbers
        gen = torch.Generator().manual_seed(4)
        for p in (*policy.parameters(), *guard.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy, guard


@pytest.fixture(scope="module")
def exported(one_thread: None) -> tuple[bytes, PolicyNet, GuardNet, Bundle]:
    init = default_bundle()
    spec = FeatureSpec.parse(init.manifest["feature_spec"])
    policy, guard = _nets(init, spec)
    manifest = {**init.manifest, "model_version": "export-test"}
    return export_bundle(policy, guard, init.array("behavior_table.npy"), spec, manifest, seed=3), policy, guard, init


def test_the_export_loads_as_the_server_loads_it_and_computes_what_torch_computes(exported: tuple) -> None:
    data, policy, guard, init = exported
    model = ModelSet.load(read_bundle(data), LoadOptions(device="cpu", warmup_batch=1))  # checksums, schema, golden self-test
    assert model.version == "export-test"
    states = np.random.default_rng(9).standard_normal((300, model.encoder.spec.state_dim)).astype(np.float32) * 0.1
    logits, allow = model.infer(states)
    with torch.no_grad():
        x = torch.from_numpy(states)
        np.testing.assert_allclose(logits, policy(x).numpy(), atol=1e-4)
        np.testing.assert_allclose(allow, torch.sigmoid(guard(x)).numpy(), atol=1e-5)
    np.testing.assert_array_equal(model.encoder.behavior_table, init.array("behavior_table.npy"))


def test_the_same_networks_and_seed_give_the_same_bytes(exported: tuple) -> None:
    data, policy, guard, init = exported
    spec = FeatureSpec.parse(init.manifest["feature_spec"])
    manifest = {**init.manifest, "model_version": "export-test"}
    assert export_bundle(policy, guard, init.array("behavior_table.npy"), spec, manifest, seed=3) == data
    other = export_bundle(policy, guard, init.array("behavior_table.npy"), spec, manifest, seed=4)
    assert other != data  # the seed draws the golden self-test states
    assert read_bundle(other).parts["policy.onnx"] == read_bundle(data).parts["policy.onnx"]


def test_a_disagreement_beyond_the_tolerance_is_refused(exported: tuple) -> None:
    _, policy, guard, init = exported
    spec = FeatureSpec.parse(init.manifest["feature_spec"])
    with pytest.raises(ExportError, match="ONNX and torch differ by"):
        export_bundle(policy, guard, init.array("behavior_table.npy"), spec, {**init.manifest, "model_version": "x"}, seed=3,
                      tolerance=-1.0)  # no graph can meet it: the check itself is what is tested


def test_a_trained_bundle_keeps_the_starting_bundles_product_networks(sim_logs: Path) -> None:
    """The trainer does not train RecommendProduct's heads yet; it carries them over unchanged (weights and decoder
    settings), also through the gate's re-export, so the trained bundle keeps serving them (format version 2)."""
    from experience.segments import DirectorySource
    from trainer.config import GuardConfig, TrainConfig
    from trainer.train import train
    from weights import product_heads as ph
    from weights.initial import make_bundle
    from weights.model_set import LoadOptions, ModelSet

    start = read_bundle(make_bundle(5, "heads-start", "2026-12-03T00:00:00Z", product_heads=True))
    source = DirectorySource(sim_logs)
    config = TrainConfig(updates=1, batch=4096, value_epochs=1, critic_epochs=1, guard=GuardConfig(epochs=1), bootstrap=50)
    result = train(source.table("decisions"), source.table("outcomes"), start, config, device="cpu")
    for data in (result.bundle, result.with_metrics({"offline_dr": 1.0})):
        trained = read_bundle(data)
        assert trained.manifest["format_version"] == 2 and trained.manifest["product"] == start.manifest["product"]
        for part in ph.PART.values():
            before, after = mlp.policy_params_from_onnx(start.parts[part]), mlp.policy_params_from_onnx(trained.parts[part])
            assert all(np.array_equal(before[k], after[k]) for k in mlp.POLICY_KEYS), part
        assert ModelSet.load(trained, LoadOptions(warmup_batch=1)).product is not None
    flat = read_bundle(make_bundle(5, "flat", "2026-12-03T00:00:00Z"))
    plain = train(source.table("decisions"), source.table("outcomes"), flat, config, device="cpu")
    assert read_bundle(plain.bundle).manifest["format_version"] == 1  # none to carry: version 1
