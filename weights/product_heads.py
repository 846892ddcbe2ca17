"""``RecommendProduct``'s networks: one shared encoder of the shopper's state and three small heads, as four ONNX graphs.

- **Encoder** ``product_encoder.onnx``: state (N, S) → h (N, ``HIDDEN``), an MLP S → 64 → 64 → ``HIDDEN`` (the last
  layer linear): what every layer knows of the shopper.
- **Heads** ``product_category.onnx``, ``product_sku.onnx``, ``product_band.onnx``: one row per candidate,
  ``[h, features]`` → a logit, an MLP (``HIDDEN`` + F) → 32 → 32 → 1. No head reads another's output, so the layers
  are separate functions of the shared ``h`` and their own candidates' features (``policy.product_features``).

Four graphs of the same kind as the policy (``weights.mlp.policy_onnx``: one input, one output, Gemm and Relu) rather
than one graph with four inputs: the same builder, the same ``weights.onnx_check`` allowlist and the same single-input
sessions (``policy.onnx_model.OnnxModel``), and a head runs on exactly its candidates. The load-time self-test runs
each graph on ``golden_states.npy`` and on seeded candidate rows (``golden_features``: data from a fixed seed, the
same at build and at load) against ``golden_product_outputs.npy``: per golden state, h and one logit per head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from core.product import MAX_CATEGORIES, MAX_PRICE_BANDS, MAX_SKUS_PER_CATEGORY
from policy.features import FeatureSpec
from policy.onnx_model import OnnxModel
from weights import mlp
from weights.bundle import PRODUCT_GUARD_PARTS, Bundle, BundleError, npy_bytes, rewritten
from weights.golden import golden_error, one_blas_thread
from weights.onnx_check import check_model

F32 = npt.NDArray[np.float32]
HIDDEN = 32
ENCODER_WIDTH = 64
HEAD_WIDTH = 32
SKU_EXTRA = 4
"""SKU features besides the embedding: log price, competitor known, log(price / competitor), log(1 + stock)."""
CATEGORY_EXTRA = 4
"""Category features besides the mean embedding: log mean price, share in stock, log SKU count, log(1 + stock)."""
BAND_FEATURES = 4
"""Band features: log multiplier, rank among the bands (0 lowest, 1 highest), first visit, log(price paid)."""
HEADS = ("category", "sku", "band")
PART = {"encoder": "product_encoder.onnx", "category": "product_category.onnx", "sku": "product_sku.onnx",
        "band": "product_band.onnx"}
GOLDEN = "golden_product_outputs.npy"
GOLDEN_SEED = 20261203


def feature_widths(spec: FeatureSpec) -> dict[str, int]:
    """Each head's candidate feature width for a bundle's item dimension."""
    return {"category": spec.item_dim + CATEGORY_EXTRA, "sku": spec.item_dim + SKU_EXTRA, "band": BAND_FEATURES}


def golden_features(width: int, count: int) -> F32:
    """``count`` seeded candidate rows of ``width`` features for the self-test (the same wherever computed)."""
    return (np.random.default_rng([GOLDEN_SEED, width]).standard_normal((count, width)) / np.sqrt(width)).astype(np.float32)


def init_params(rng: np.random.Generator, spec: FeatureSpec) -> dict[str, mlp.Params]:
    """Fresh encoder and head weights (He-uniform; each head's output layer scaled down: near-uniform choices at first)."""
    params = {"encoder": mlp.init_params(rng, [spec.state_dim, ENCODER_WIDTH, ENCODER_WIDTH, HIDDEN])}
    for head, width in feature_widths(spec).items():
        p = mlp.init_params(rng, [HIDDEN + width, HEAD_WIDTH, HEAD_WIDTH, 1])
        p["w3"] *= np.float32(0.1)
        params[head] = p
    return params


def forward(params: dict[str, mlp.Params], states: F32, features: dict[str, F32]) -> F32:
    """The reference outputs for the self-test: per state row g, h_g and each head's logit of [h_g, features[head][g]]."""
    with one_blas_thread():
        h = mlp.policy_forward(params["encoder"], states)
        logits = [mlp.policy_forward(params[head], np.concatenate([h, features[head]], axis=1)) for head in HEADS]
    return np.concatenate([h, *logits], axis=1).astype(np.float32)


def parts(params: dict[str, mlp.Params], spec: FeatureSpec, golden_states: F32) -> dict[str, bytes]:
    """The bundle parts of these weights, with their golden outputs on ``golden_states``."""
    widths = feature_widths(spec)
    features = {head: golden_features(widths[head], len(golden_states)) for head in HEADS}
    out = {PART[name]: mlp.policy_onnx(p) for name, p in params.items()}
    out[GOLDEN] = npy_bytes(forward(params, golden_states, features))
    return out


def with_heads(bundle: Bundle, params: dict[str, mlp.Params], spec: FeatureSpec, manifest: dict[str, Any],
               guard: tuple[dict[str, bytes], dict[str, Any]] | None = None) -> bytes:
    """``bundle`` with these product networks (and their golden outputs on its golden states) and ``manifest`` merged
    over its own: the flat decision's parts stay byte for byte. A bundle without a ``product`` section gets the default
    decoder settings (``manifest_section``). ``guard``: the product guards' parts and ``product.guard`` section
    (``weights.product_guard``); without it the result has no guards (a bundle's guards read its encoder's h, so new
    heads never keep old guards). Unsigned: a signature covers the old manifest, not this one."""
    members = parts(params, spec, bundle.array("golden_states.npy"))
    product = {k: v for k, v in (bundle.manifest.get("product") or manifest_section()).items() if k != "guard"}
    if guard is not None:
        members.update(guard[0])
        product["guard"] = guard[1]
    return rewritten(bundle, {"product": product, **manifest}, members, drop=PRODUCT_GUARD_PARTS)


@dataclass(frozen=True)
class ProductHeads:
    """The loaded product networks of a bundle (format version 2)."""

    encoder: OnnxModel
    heads: dict[str, OnnxModel]
    widths: dict[str, int]

    @classmethod
    def load(cls, bundle: Bundle, spec: FeatureSpec, device: str, threads: int, tolerance: float) -> ProductHeads:
        for name in PART.values():
            check_model(name, bundle.parts[name])
        try:
            models = {name: OnnxModel(f"product_{name}", bundle.parts[part], device, threads) for name, part in PART.items()}
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise BundleError("onnx", f"cannot load the product graphs: {str(exc).splitlines()[0][:300]}") from None
        heads = cls(models["encoder"], {h: models[h] for h in HEADS}, feature_widths(spec))
        heads._self_test(bundle, tolerance)
        heads._run_at_the_limits(spec)
        return heads

    def _run_at_the_limits(self, spec: FeatureSpec) -> None:
        """Run the encoder on one state and each head on as many candidates as a request may offer it: what a graph
        allocates can grow faster than its rows, and the self-test's 8 rows would not show it. So the bounded load
        (``weights.sandbox``) sees the largest request's memory, and a graph that cannot take those shapes is refused."""
        try:
            h = self.encode(np.zeros((1, spec.state_dim), dtype=np.float32))
            many = self.encode(np.zeros((RUN_ROWS, spec.state_dim), dtype=np.float32))  # the most states one run is given
        except Exception as exc:
            raise BundleError("shape", f"the product encoder does not run: {str(exc).splitlines()[0][:300]}") from None
        if not (np.isfinite(h).all() and np.isfinite(many).all()):
            raise BundleError("nonfinite", "the product encoder produces NaN or Inf")
        run_at_the_limits(self.score, h, self.widths, "head")


    def _self_test(self, bundle: Bundle, tolerance: float) -> None:
        states = bundle.array("golden_states.npy")

        def outputs() -> F32:
            h = self.encode(states)
            logits = [self.score(head, h, golden_features(self.widths[head], len(states))) for head in HEADS]
            return np.concatenate([h, *[x[:, None] for x in logits]], axis=1)

        golden_check(outputs, bundle.array(GOLDEN), (len(states), HIDDEN + len(HEADS)), GOLDEN, "product", tolerance)

    def encode(self, states: F32) -> F32:
        """h (N, ``HIDDEN``) for a batch of shopper states, run on at most ``RUN_ROWS`` of them at a time (as the heads:
        a batch of ``--max-batch`` states must not reach the encoder in one run larger than its probe's)."""
        return run_in_pieces(self.encoder, "product encoder", states, HIDDEN)

    def score(self, head: str, h: F32, features: F32) -> F32:
        """One logit per candidate row: ``h`` (1, H) (or one row per candidate) beside each row of ``features``."""
        return candidate_rows(self.heads[head], f"product {head} head", h, features)


def golden_check(outputs: Callable[[], F32], expected: F32, shape: tuple[int, int], name: str, kind: str,
                 tolerance: float) -> None:
    """The self-test of a bundle's product graphs (``kind``: "product", "product guard"): ``outputs()`` against the
    golden array ``name`` of ``shape``, within ``tolerance``; ``BundleError`` naming what is wrong."""
    if expected.shape != shape:
        raise BundleError("shape", f"{name}: expected {shape}, got {expected.shape}")
    try:
        got = outputs()
    except BundleError:
        raise
    except Exception as exc:
        raise BundleError("shape", f"the {kind} graphs do not run on their inputs: {str(exc).splitlines()[0][:300]}") from None
    if not np.isfinite(got).all():
        raise BundleError("nonfinite", f"the {kind} graphs produce NaN or Inf on the golden inputs")
    error = golden_error(got, expected)
    if not error <= tolerance:
        raise BundleError("golden", f"{kind} golden self-test failed: max error {error:.3g} > tolerance {tolerance:.3g}")


LARGEST_ROWS = {"category": MAX_CATEGORIES, "sku": MAX_SKUS_PER_CATEGORY, "band": MAX_PRICE_BANDS}
"""Per head, the most candidate rows one request gives it."""
RUN_ROWS = 1024
"""The most candidate rows one run of a product head or guard graph is given (``candidate_rows``), and the rows each is
probed at when its bundle is loaded (``run_at_the_limits``), in the bounded validating child first: a batch of requests
is run in pieces of at most this many rows, so no run allocates more than the probe did. Probed at one request's
largest sizes only (32, 64, 8), a head that broadcast its rows against each other passed, and 64 requests of 19 SKUs
(1,216 rows in one run) took a server to 1.73 GB (an attack review, 2026-12-07). 1,024 rows: 16 requests of a
category's largest SKU list in one run."""


def run_at_the_limits(score: Callable[[str, F32, F32], F32], h: F32, widths: dict[str, int], kind: str) -> None:
    """``score`` (a head's or a guard's) on as many candidates as a request may offer each layer, and on ``RUN_ROWS``
    (as many as one run is ever given), beside ``h`` (one row): ``BundleError`` when it cannot take those shapes or
    gives NaN or Inf."""
    try:
        for head, most in LARGEST_ROWS.items():
            for rows in (most, RUN_ROWS):
                if not np.isfinite(score(head, h, golden_features(widths[head], rows))).all():
                    raise BundleError("nonfinite", f"the product {head} {kind} produces NaN or Inf on {rows} candidates")
    except BundleError:
        raise
    except Exception as exc:
        raise BundleError("shape", f"the product {kind} graphs do not run at a request's largest sizes: "
                                   f"{str(exc).splitlines()[0][:300]}") from None

def candidate_rows(graph: OnnxModel, name: str, h: F32, features: F32) -> F32:
    """``graph``'s one output per candidate row ``[h, features]`` (``h``: one row, or one per candidate), run on at most
    ``RUN_ROWS`` rows at a time."""
    rows = np.concatenate([np.broadcast_to(h, (len(features), h.shape[1])), features], axis=1).astype(np.float32)
    return run_in_pieces(graph, name, rows, 1)[:, 0]


def run_in_pieces(graph: OnnxModel, name: str, rows: F32, width: int) -> F32:
    """``graph`` on ``rows``, at most ``RUN_ROWS`` of them a run (what the load probed), each run's output checked to be
    (its rows, ``width``): ``BundleError`` naming ``name`` otherwise."""
    outs = []
    for lo in range(0, max(len(rows), 1), RUN_ROWS):
        piece = rows[lo : lo + RUN_ROWS]
        out = graph.run(piece)
        if out.shape != (len(piece), width):
            raise BundleError("shape", f"{name}: expected output ({len(piece)}, {width}), got {out.shape}")
        outs.append(out)
    return outs[0] if len(outs) == 1 else np.concatenate(outs)


def manifest_section() -> dict[str, Any]:
    """The manifest's ``product`` section: the layers' decoder settings (as ``decoder`` for ``RecommendAction``)."""
    return {"decoder": {"samples": 10, "min_votes": 4, "exploration_epsilon": 0.05, "exploration_temperature": 1.2}}
