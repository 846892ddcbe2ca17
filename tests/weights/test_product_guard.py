"""RecommendProduct's learned guard in a bundle (format version 3): built, checked, self-tested and loaded like the heads;
its veto is the threshold on its complaint probability; a bad threshold, a missing guard or a guard that fails its
golden self-test is refused, naming what is wrong."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest

from policy.features import FeatureSpec
from weights import mlp
from weights import product_guard as pg
from weights.bundle import MANIFEST, PARTS, PRODUCT_GUARD_PARTS, PRODUCT_PARTS, BundleError, read_bundle, rewritten, write_members
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.product_heads import HIDDEN, feature_widths

OPTIONS = LoadOptions(warmup_batch=1)
HEADS_BUNDLE = make_bundle(5, "guard-test", "2026-12-03T00:00:00Z", product_heads=True)
SPEC = FeatureSpec.parse(read_bundle(HEADS_BUNDLE).manifest["feature_spec"])
WIDTHS = feature_widths(SPEC)
RATIO = HIDDEN + SPEC.item_dim + 2
"""The SKU guard's input column of log(price / competitor price) (``policy.product_features.sku_features``)."""


def overpriced_guard(limit: float = math.log(1.1), vetoes_every_band: bool = False, spec: FeatureSpec = SPEC) -> dict[str, mlp.Params]:
    """A hand-made guard for bundles of feature spec ``spec``: the SKU guard's complaint logit is -5 below ``limit`` of
    log(price / competitor) and jumps to +995 just above it; the category guard never vetoes; the band guard never, or
    always."""
    params = pg.init_params(np.random.default_rng(0), feature_widths(spec))
    for p in params.values():
        for key in p:
            p[key][...] = 0.0
        p["b3"][:] = -10.0
    sku = params["sku"]
    sku["w1"][HIDDEN + spec.item_dim + 2, 0], sku["b1"][0] = 1.0, -limit - 0.005  # the log(price / competitor) column
    sku["w2"][0, 0], sku["w3"][0, 0], sku["b3"][:] = 1.0, 1e5, -5.0
    if vetoes_every_band:
        params["band"]["b3"][:] = 10.0
    return params


def guarded(**kwargs: Any) -> bytes:
    return pg.with_guard(read_bundle(HEADS_BUNDLE), overpriced_guard(**kwargs))


def test_a_guarded_bundle_is_version_3_and_keeps_every_other_part() -> None:
    bundle = read_bundle(guarded())
    assert bundle.manifest["format_version"] == 3 and set(bundle.parts) == set(PARTS + PRODUCT_PARTS + PRODUCT_GUARD_PARTS)
    heads = read_bundle(HEADS_BUNDLE)
    assert all(bundle.parts[p] == heads.parts[p] for p in PARTS + PRODUCT_PARTS)
    limits = dict.fromkeys(("category", "sku", "band"), 0.1)
    assert bundle.manifest["product"] == {**heads.manifest["product"], "guard": {"max_complaint": limits}}
    model = ModelSet.load(bundle, OPTIONS)
    assert model.product is not None and model.product.guard is not None
    assert ModelSet.load(read_bundle(HEADS_BUNDLE), OPTIONS).product.guard is None  # type: ignore[union-attr]
    bare = read_bundle(pg.without_guard(bundle))  # and back: the heads bundle, every part and the product section
    assert bare.manifest["format_version"] == 2 and bare.parts == heads.parts
    assert bare.manifest["product"] == heads.manifest["product"]


def test_the_veto_is_the_threshold_on_the_complaint_probability() -> None:
    model = ModelSet.load(read_bundle(guarded()), OPTIONS)
    assert model.product is not None and model.product.guard is not None
    guard, h = model.product.guard, np.zeros((1, HIDDEN), dtype=np.float32)
    features = np.zeros((4, WIDTHS["sku"]), dtype=np.float32)
    features[:, RATIO - HIDDEN] = [math.log(0.9), 0.0, math.log(1.09), math.log(1.2)]
    assert guard.vetoed("sku", h, features).tolist() == [False, False, False, True]
    assert not guard.vetoed("category", h, np.zeros((3, WIDTHS["category"]), dtype=np.float32)).any()
    assert 1.0 / (1.0 + math.exp(-float(guard.logits("sku", h, features)[0]))) == pytest.approx(1 / (1 + math.exp(5)), rel=1e-4)


def _with_manifest(data: bytes, **product: Any) -> bytes:
    bundle = read_bundle(data)
    return rewritten(bundle, {"product": {**bundle.manifest["product"], **product}})


@pytest.mark.parametrize("guard", [None, {"max_complaint": 0.1}, {"max_complaint": {"category": 0.1, "sku": 0.1}},
                                   {"max_complaint": {"category": 0.1, "sku": 0.0, "band": 0.1}},
                                   {"max_complaint": {"category": 0.1, "sku": float("nan"), "band": 0.1}},
                                   {"max_complaint": {"category": 0.1, "sku": True, "band": 0.1}}])
def test_a_bad_threshold_is_refused_naming_the_field(guard: Any) -> None:
    with pytest.raises(BundleError, match=r"product\.guard\.max_complaint") as info:
        ModelSet.load(read_bundle(_with_manifest(guarded(), guard=guard)), OPTIONS)
    assert info.value.reason == "schema"


def test_a_version_3_bundle_without_one_of_its_guards_is_refused() -> None:
    bundle = read_bundle(guarded())
    raw = io.BytesIO()
    write_members(raw, {MANIFEST: bundle.manifest_bytes, **{n: d for n, d in bundle.parts.items() if n != "product_guard_sku.onnx"}})
    with pytest.raises(BundleError, match="missing") as info:
        read_bundle(raw.getvalue())
    assert info.value.reason == "format"


def test_a_guard_that_does_not_compute_its_golden_outputs_is_refused() -> None:
    bundle = read_bundle(guarded())
    other = pg.parts(overpriced_guard(limit=0.0), np.zeros((1, HIDDEN), dtype=np.float32), WIDTHS)  # other weights
    tampered = rewritten(bundle, parts={"product_guard_sku.onnx": other["product_guard_sku.onnx"]})
    with pytest.raises(BundleError, match="guard golden self-test") as info:
        ModelSet.load(read_bundle(tampered), OPTIONS)
    assert info.value.reason == "golden"


def test_a_guard_needs_the_heads() -> None:
    with pytest.raises(BundleError, match="product heads"):
        pg.with_guard(read_bundle(make_bundle(5, "flat", "2026-12-03T00:00:00Z")), overpriced_guard())
