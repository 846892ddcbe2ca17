"""RecommendProduct's networks in a bundle (format version 2): built, checked, self-tested and loaded like the flat
decision's; a bundle without them is version 1, unchanged; a bad or hostile product part is refused."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from weights import mlp
from weights import product_heads as ph
from weights.bundle import MANIFEST, PARTS, PRODUCT_PARTS, BundleError, npy_bytes, read_bundle, write_bundle, write_members
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet

ARGS = (5, "heads-test", "2026-12-03T00:00:00Z")
OPTIONS = LoadOptions(warmup_batch=1)


@pytest.fixture(scope="module")
def heads_bytes() -> bytes:
    return make_bundle(*ARGS, product_heads=True)


def _rewritten(data: bytes, parts: dict[str, bytes] | None = None, **manifest: Any) -> bytes:
    bundle = read_bundle(data)
    out = io.BytesIO()
    write_bundle(out, {**bundle.manifest, **manifest}, {**bundle.parts, **(parts or {})})
    return out.getvalue()


def test_the_heads_are_version_2_and_leave_the_rest_of_the_bundle_as_it_was(heads_bytes: bytes) -> None:
    with_heads, without = read_bundle(heads_bytes), read_bundle(make_bundle(*ARGS))
    assert with_heads.manifest["format_version"] == 2 and without.manifest["format_version"] == 1
    assert set(with_heads.parts) == set(PARTS + PRODUCT_PARTS) and set(without.parts) == set(PARTS)
    assert all(with_heads.parts[name] == without.parts[name] for name in PARTS)  # their own random stream
    assert "product" in with_heads.manifest and "product" not in without.manifest
    assert ModelSet.load(without, OPTIONS).product is None


def test_the_loaded_graphs_compute_the_reference_forward_pass(heads_bytes: bytes) -> None:
    bundle = read_bundle(heads_bytes)
    model = ModelSet.load(bundle, OPTIONS)
    assert model.product is not None
    heads = model.product.heads
    params = {name: mlp.policy_params_from_onnx(bundle.parts[part]) for name, part in ph.PART.items()}
    rng = np.random.default_rng(1)
    states = rng.standard_normal((3, model.encoder.spec.state_dim)).astype(np.float32)
    h = heads.encode(states)
    np.testing.assert_allclose(h, mlp.policy_forward(params["encoder"], states), rtol=1e-5, atol=1e-5)
    for head, width in ph.feature_widths(model.encoder.spec).items():
        features = rng.standard_normal((7, width)).astype(np.float32)
        expected = mlp.policy_forward(params[head], np.concatenate([np.repeat(h[:1], 7, axis=0), features], axis=1))[:, 0]
        np.testing.assert_allclose(heads.score(head, h[:1], features), expected, rtol=1e-5, atol=1e-5)


def test_wrong_golden_outputs_are_refused(heads_bytes: bytes) -> None:
    golden = read_bundle(heads_bytes).array(ph.GOLDEN)
    for bad, reason in ((golden + np.float32(0.01), "golden"), (golden[:, :5], "shape"),
                        (np.full_like(golden, np.nan), "golden")):
        with pytest.raises(BundleError) as info:
            ModelSet.load(read_bundle(_rewritten(heads_bytes, {ph.GOLDEN: npy_bytes(bad)})), OPTIONS)
        assert info.value.reason == reason, str(info.value)


def test_a_head_swapped_for_another_fails_its_self_test(heads_bytes: bytes) -> None:
    bundle = read_bundle(heads_bytes)
    swapped = _rewritten(heads_bytes, {"product_category.onnx": bundle.parts["product_sku.onnx"]})
    with pytest.raises(BundleError) as info:
        ModelSet.load(read_bundle(swapped), OPTIONS)
    assert info.value.reason in {"shape", "golden"}


def test_a_product_graph_with_external_data_is_refused_before_onnxruntime_sees_it(heads_bytes: bytes) -> None:
    model = onnx.load_from_string(read_bundle(heads_bytes).parts["product_band.onnx"])
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    with pytest.raises(BundleError, match=r"product_band\.onnx") as info:
        ModelSet.load(read_bundle(_rewritten(heads_bytes, {"product_band.onnx": model.SerializeToString()})), OPTIONS)
    assert "external" in str(info.value)


@pytest.mark.parametrize("product", [None, {}, {"decoder": {"samples": 0, "min_votes": 4, "exploration_epsilon": 0.05,
                                                            "exploration_temperature": 1.2}},
                                     {"decoder": {"samples": 10, "min_votes": 4, "exploration_epsilon": 2.0,
                                                  "exploration_temperature": 1.2}}])
def test_a_bad_product_decoder_section_is_refused_naming_it(heads_bytes: bytes, product: Any) -> None:
    bundle = read_bundle(heads_bytes)
    manifest = {k: v for k, v in bundle.manifest.items() if k != "product"}
    if product is not None:
        manifest["product"] = product
    out = io.BytesIO()
    write_bundle(out, manifest, dict(bundle.parts))
    with pytest.raises(BundleError, match=r"product\.decoder") as info:
        ModelSet.load(read_bundle(out.getvalue()), OPTIONS)
    assert info.value.reason == "schema"


def test_a_bundle_with_only_some_product_parts_is_refused(heads_bytes: bytes) -> None:
    bundle = read_bundle(heads_bytes)
    with pytest.raises(ValueError, match="missing parts"):
        write_bundle(io.BytesIO(), bundle.manifest, {k: v for k, v in bundle.parts.items() if k != "product_sku.onnx"})
    manifest = json.loads(bundle.manifest_bytes)
    assert manifest["parts"].keys() == set(PARTS + PRODUCT_PARTS)
    out = io.BytesIO()  # written by hand: the manifest still says version 2, one product part is missing
    write_members(out, {MANIFEST: bundle.manifest_bytes, **{k: v for k, v in bundle.parts.items() if k != "product_sku.onnx"}})
    with pytest.raises(BundleError) as info:
        read_bundle(out.getvalue())
    assert info.value.reason == "format" and "product_sku.onnx" in str(info.value)


def test_a_head_that_allocates_with_its_candidates_is_stopped_at_load_not_at_serving(heads_bytes: bytes) -> None:
    """Allowed operators, a passing self-test on 8 rows; but on a request's 64 SKUs about 1 GB. The load runs every head
    at a request's largest sizes, so the bounded child (512 MiB) refuses it before a server does."""
    from tests.weights import hostile
    from weights.onnx_check import check_model
    from weights.sandbox import SandboxLimits, validate_in_child

    head = hostile.inflating_head(read_bundle(heads_bytes).parts["product_sku.onnx"])
    check_model("product_sku.onnx", head)  # allowed, operator by operator
    data = _rewritten(heads_bytes, {"product_sku.onnx": head})
    with pytest.raises(BundleError) as caught:
        validate_in_child(data, OPTIONS, SandboxLimits())
    assert caught.value.reason in ("limits", "shape", "invalid"), caught.value


def test_a_head_that_allocates_with_a_batchs_rows_is_stopped_at_load_and_a_batch_runs_in_pieces(heads_bytes: bytes) -> None:
    """A head that broadcasts its rows against each other passed a probe at one request's largest sizes (4 MB on 64
    SKUs), and a batch of requests, concatenated, took a server to 1.73 GB (an attack review, 2026-12-07). The load now
    probes at ``RUN_ROWS`` too, as many rows as a run is ever given, and a batch runs in pieces of at most that many."""
    from tests.weights import hostile
    from weights.onnx_check import check_model
    from weights.product_heads import HIDDEN, RUN_ROWS
    from weights.sandbox import SandboxLimits, validate_in_child

    for part in ("product_sku.onnx", "product_encoder.onnx"):  # the encoder takes a batch's states in one run too (a review)
        graph = hostile.pairwise_head(read_bundle(heads_bytes).parts[part])
        check_model(part, graph)
        with pytest.raises(BundleError) as caught:
            validate_in_child(_rewritten(heads_bytes, {part: graph}), OPTIONS, SandboxLimits())
        assert caught.value.reason in ("limits", "shape", "invalid"), (part, caught.value)
    model = ModelSet.load(read_bundle(heads_bytes), OPTIONS)
    assert model.product is not None
    heads = model.product.heads
    graph, runs = heads.heads["sku"], []
    real_run = graph.run

    def counted(x: np.ndarray) -> np.ndarray:  # the real session, its batch sizes recorded
        runs.append(len(x))
        return real_run(x)

    graph.run = counted  # type: ignore[method-assign]
    rows = 2 * RUN_ROWS + 300
    rng = np.random.default_rng(3)
    h = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    features = rng.standard_normal((rows, heads.widths["sku"])).astype(np.float32)
    pieces = heads.score("sku", h, features)
    assert runs == [RUN_ROWS, RUN_ROWS, 300]
    whole = real_run(np.concatenate([h, features], axis=1).astype(np.float32))[:, 0]
    np.testing.assert_allclose(pieces, whole, rtol=1e-5, atol=1e-6)
    states = rng.standard_normal((rows, model.encoder.spec.state_dim)).astype(np.float32)
    np.testing.assert_allclose(heads.encode(states), heads.encoder.run(states), rtol=1e-5, atol=1e-6)


def test_a_head_that_takes_only_the_self_tests_shape_is_refused(heads_bytes: bytes) -> None:
    """A SKU head declared for exactly 8 rows passes the 8-row self-test, and would degrade every real request."""
    model = onnx.load_from_string(read_bundle(heads_bytes).parts["product_sku.onnx"])
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.ClearField("dim_param")
    dim.dim_value = 8
    with pytest.raises(BundleError, match="largest sizes") as info:
        ModelSet.load(read_bundle(_rewritten(heads_bytes, {"product_sku.onnx": model.SerializeToString()})), OPTIONS)
    assert info.value.reason == "shape"


def test_a_head_whose_work_grows_with_a_batchs_rows_is_refused_by_its_cpu_time(heads_bytes: bytes) -> None:
    """Cheap on one request (64 SKUs), costly on the 1,024 rows a batch gives one run: 40 Tanh layers over an N × N × 16
    intermediate (well within memory). Timing one request alone passed it (a review of the CPU budget, 2026-12-07); the
    budget also shares out the largest runs' time over the requests they serve."""
    from tests.weights import hostile
    from weights.compute_budget import MAX_INFERENCE_CPU_S, inference_cpu_s, largest_run_cpu_s
    from weights.validate import verify

    data = _rewritten(heads_bytes, {"product_sku.onnx": hostile.pairwise_head(read_bundle(heads_bytes).parts["product_sku.onnx"],
                                                                             copies=16, layers=40)})
    model = ModelSet.load(read_bundle(data), OPTIONS)
    assert inference_cpu_s(model) < MAX_INFERENCE_CPU_S < largest_run_cpu_s(model, 64)
    with pytest.raises(BundleError, match=r"in the largest runs \(64 states, 1024 candidate rows\), over the 5 ms") as caught:
        verify(data)
    assert caught.value.reason == "limits"
