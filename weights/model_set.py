"""ModelSet: one loaded bundle as one immutable object, and NoModel, the explicit empty state.

Swapping models is one reference assignment (``server.models.ModelHolder``); a request
reads that reference once and finishes on the object it got, so nothing here is ever
mutated after ``load`` returns.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from core.conditions import SchemaError
from core.domain import ACTIONS, N_ACTIONS, Context, Decision, DecisionRequest, Source
from core.product import ProductDecision, ProductRequest
from guard.action_guard import ActionGuard
from guard.rules import RuleEngine
from policy import guardrails as gr
from policy.decision import DecisionProcedure, Rules
from policy.decoder import MajorityDecoder
from policy.features import HOURS, FeatureEncoder, FeatureSpec
from policy.onnx_model import OnnxModel, RuntimeMissing
from policy.plurality import PluralityDecoder
from policy.product_decision import by_rules as product_by_rules
from policy.product_policy import decide_batch as decide_products
from weights.bundle import PRODUCT_GUARD_PARTS, PRODUCT_PARTS, Bundle, BundleError, read_bundle, read_file
from weights.golden import golden_error
from weights.onnx_check import check_model
from weights.product_guard import ProductGuard
from weights.product_heads import ProductHeads

log = logging.getLogger(__name__)

PROBE_BATCHES = (1, 3)
"""Batch sizes of the load-time probe on random requests' states (``ModelSet._probe``): a graph that runs on one batch
size only cannot pass both. A graph built to fail on sizes no probe draws still can (SECURITY.md)."""
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class LoadOptions:
    """How to load a bundle on this server; ``None`` keeps the bundle's own value."""

    device: str = "auto"
    threads: int = 1
    warmup_batch: int = 64
    samples: int | None = None
    min_votes: int | None = None
    exploration_epsilon: float | None = None
    guard_threshold: float | None = None
    public_keys: tuple[bytes, ...] = ()  # raw Ed25519 keys: only bundles signed by one of them load (weights.signing)


def _section(manifest: dict[str, Any], key: str) -> Any:
    if key not in manifest:
        raise BundleError("schema", f"manifest.json: missing {key!r}")
    return manifest[key]


MAX_SAMPLES = 16  # the propensity tables grow like K^4/24 rows: 16 gives 4,845 (K = 10: 1,001)


def _count(spec: Any, key: str, where: str, override: int | None) -> int:
    value = override if override is not None else (spec.get(key) if isinstance(spec, dict) else None)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
        raise BundleError("schema", f"manifest.json: {where}.{key} must be an integer in 1..{MAX_SAMPLES}, got {value!r}")
    return value


def _number(spec: Any, key: str, where: str) -> float:
    value = spec.get(key) if isinstance(spec, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BundleError("schema", f"manifest.json: {where}.{key} must be a finite number")
    return float(value)


class ModelSet:
    """What a bundle loaded: the encoder, the two graphs and the decision procedure over them."""

    def __init__(self, manifest: dict[str, Any], encoder: FeatureEncoder, policy: OnnxModel, guard_model: OnnxModel,
                 decision: DecisionProcedure, product: ProductLayers | None = None) -> None:
        self.manifest = manifest
        self.product = product
        """``RecommendProduct``'s networks and decoder (format version 2); None: its layers answer by their rules."""
        self.version = decision.version
        self.encoder = encoder
        self.policy = policy
        self.guard_model = guard_model
        self.decision = decision
        self.item_dim = encoder.spec.item_dim
        self.loaded_at = time.time()

    ready: Literal[True] = True

    @classmethod
    def load(cls, bundle: Bundle, options: LoadOptions | None = None) -> ModelSet:
        """Validate every part, build the sessions, self-test on the golden data, warm up.

        Raises ``BundleError`` for anything wrong with the bundle, whatever went wrong inside
        (``RuntimeMissing`` only when onnxruntime itself is not installed).
        """
        options = options or LoadOptions()
        try:
            return cls._load(bundle, options)
        except (BundleError, RuntimeMissing):
            raise
        except Exception as exc:  # a hostile bundle must not escape as another type: it would skip the fallback and the count
            raise BundleError("invalid", f"cannot load bundle: {type(exc).__name__}: {str(exc)[:200]}") from None

    @classmethod
    def _load(cls, bundle: Bundle, options: LoadOptions) -> ModelSet:
        if options.public_keys:  # cryptography (about 7 MB) only in a process that verifies signatures
            from weights.signing import check_signature

            check_signature(bundle, options.public_keys)
        m = bundle.manifest
        try:
            spec = FeatureSpec.parse(_section(m, "feature_spec"))
            actions = _section(m, "actions")
            if actions != [a.key for a in ACTIONS]:
                raise SchemaError(f"actions: expected {[a.key for a in ACTIONS]}, got {actions!r}")
            guardrails = gr.Guardrails.parse(_section(m, "guardrails"))
            rules = RuleEngine.parse(_section(m, "fallback_rules"), guardrails.static)
        except SchemaError as exc:
            raise BundleError("schema", f"manifest.json: {exc}") from None
        guard_spec, dec = _section(m, "guard"), _section(m, "decoder")
        threshold = options.guard_threshold if options.guard_threshold is not None else _number(guard_spec, "threshold", "guard")
        try:
            guard = ActionGuard(threshold)
            decoder = MajorityDecoder(
                samples=_count(dec, "samples", "decoder", options.samples),
                min_votes=_count(dec, "min_votes", "decoder", options.min_votes),
                epsilon=options.exploration_epsilon if options.exploration_epsilon is not None
                else _number(dec, "exploration_epsilon", "decoder"),
                temperature=_number(dec, "exploration_temperature", "decoder"),
            )
        except ValueError as exc:
            raise BundleError("schema", str(exc)) from None

        table = bundle.array("behavior_table.npy")
        if table.dtype != np.float32 or table.shape != (spec.behavior_buckets, spec.behavior_dim):
            expected = (spec.behavior_buckets, spec.behavior_dim)
            raise BundleError("shape", f"behavior_table.npy: expected float32 {expected}, got {table.dtype} {table.shape}")
        if not np.isfinite(table).all():
            raise BundleError("nonfinite", "behavior_table.npy: contains NaN or Inf")
        table.setflags(write=False)
        for name in ("policy.onnx", "guard.onnx"):
            check_model(name, bundle.parts[name])  # before onnxruntime sees it: no external data, no allocating operators
        try:
            policy = OnnxModel("policy", bundle.parts["policy.onnx"], options.device, options.threads)
            guard_model = OnnxModel("guard", bundle.parts["guard.onnx"], options.device, options.threads)
        except RuntimeMissing:
            raise
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise BundleError("onnx", f"cannot load the ONNX graphs: {str(exc).splitlines()[0][:300]}") from None
        decision = DecisionProcedure(guardrails, rules, str(m["model_version"]), guard, decoder)
        tolerance = _number(_section(m, "golden"), "tolerance", "golden")
        product = _product_layers(bundle, spec, options, tolerance) if PRODUCT_PARTS[0] in bundle.parts else None
        model = cls(m, FeatureEncoder(spec, table), policy, guard_model, decision, product)
        model._self_test(bundle, spec, tolerance)
        model.infer(np.zeros((max(1, options.warmup_batch), spec.state_dim), dtype=np.float32))
        return model

    def _self_test(self, bundle: Bundle, spec: FeatureSpec, tolerance: float) -> None:
        states, expected = bundle.array("golden_states.npy"), bundle.array("golden_outputs.npy")
        if states.ndim != 2 or states.shape[1] != spec.state_dim or states.dtype != np.float32 or len(states) == 0:
            raise BundleError("shape", f"golden_states.npy: expected float32 (G, {spec.state_dim}), got {states.dtype} {states.shape}")
        if expected.shape != (len(states), 2 * N_ACTIONS):
            raise BundleError("shape", f"golden_outputs.npy: expected ({len(states)}, {2 * N_ACTIONS}), got {expected.shape}")
        got = self._outputs(states, "the golden inputs")
        error = golden_error(got, expected)
        if not error <= tolerance:
            raise BundleError("golden", f"golden self-test failed: max error {error:.3g} > tolerance {tolerance:.3g} (relative "
                                        "beyond magnitude 1)")
        self._probe()

    def _probe(self) -> None:
        """The graphs on states the server makes itself, alone and in a batch of three: a bundle's golden states are the
        bundle's own, so a graph could pass them and fail every request (an attack review, 2026-12-06: a ``Sqrt`` of the
        state, finite on non-negative golden states and NaN on real ones; a fixed ``Reshape`` to the golden set's rows,
        64 in that bundle). Either was swapped in and degraded every call, each batch rerun request by request."""
        rng = np.random.default_rng(0)
        for n in PROBE_BATCHES:
            self._outputs(self.random_states(n, rng), f"{n} state{'s' if n > 1 else ''} of random requests")

    def random_states(self, n: int, rng: np.random.Generator) -> F32:
        """The states of ``n`` random requests, as the encoder builds them: behaviour buckets and hours at random, and
        item embeddings of unit length in random directions (an embedding's usual scale)."""
        spec = self.encoder.spec
        buckets = [rng.integers(0, spec.behavior_buckets, rng.integers(0, spec.behavior_window + 1)).tolist()
                   for _ in range(n)]
        states = self.encoder.encode_columns(buckets, rng.integers(0, HOURS, n))
        item = rng.standard_normal((n, spec.item_dim), dtype=np.float32)
        states[:, : spec.item_dim] = item / np.linalg.norm(item, axis=1, keepdims=True)
        return states

    def _outputs(self, states: F32, what: str) -> F32:
        """The raw graphs' logits and allow-probabilities side by side, checked for shape, finiteness and range (not
        ``infer``: it would reject non-finite outputs before they could be named)."""
        try:
            logits, allow = self.policy.run(states), self.guard_model.run(states)
        except Exception as exc:
            raise BundleError("shape", f"the graphs do not run on {what}: {str(exc).splitlines()[0][:300]}") from None
        if logits.shape != (len(states), N_ACTIONS) or allow.shape != (len(states), N_ACTIONS):
            raise BundleError("shape", f"graph outputs on {what} have shapes {logits.shape} and {allow.shape}, expected "
                                       f"({len(states)}, {N_ACTIONS})")
        got: F32 = np.concatenate([logits, allow], axis=1)
        if not np.isfinite(got).all():
            raise BundleError("nonfinite", f"the graphs produce NaN or Inf on {what}")
        if not ((allow >= 0.0) & (allow <= 1.0)).all():
            raise BundleError("range", f"the guard's allow-probabilities on {what} leave [0, 1]")
        return got

    def infer(self, states: F32) -> tuple[F32, F32]:
        """Policy logits and guard allow-probabilities for a batch of states.

        Non-finite outputs raise: a NaN allow-probability would otherwise pass the veto
        (NaN < threshold is false). The batcher then reruns the batch request by request,
        so only the request that produced them degrades.
        """
        logits, allow = self.policy.run(states), self.guard_model.run(states)
        if not (np.isfinite(logits).all() and np.isfinite(allow).all()):
            raise FloatingPointError("the model produced NaN or Inf for this input")
        if not ((allow >= 0.0) & (allow <= 1.0)).all():
            raise FloatingPointError("the guard produced an allow-probability outside [0, 1] for this input")
        return logits, allow

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Context], decision_ids: Sequence[str]) -> list[Decision]:
        """The whole decision for a batch: encode, infer, decide. What the micro-batcher calls."""
        states = self.encoder.encode_batch(requests, [c.hour for c in contexts])
        logits, allow = self.infer(states)
        return self.decision.decide_batch(contexts, logits, allow, decision_ids)

    def fallback(self, ctx: Context, source: Source) -> Decision:
        """A rule-engine answer without model outputs (overload, inference error, short deadline)."""
        return self.decision.fallback(ctx, source)

    def decide_product(self, request: ProductRequest, hour: int, decision_id: str) -> ProductDecision:
        """``RecommendProduct``'s layers: sampled by the product networks when the bundle has them, else by their rules."""
        return self.decide_products([request], [hour], [decision_id])[0]

    def decide_products(self, requests: Sequence[ProductRequest], hours: Sequence[int],
                        decision_ids: Sequence[str]) -> list[ProductDecision]:
        """``decide_product`` for a batch: one encoder call and one call per head for all of them."""
        if self.product is None:
            return [product_by_rules(r, self.version) for r in requests]
        states = self.encoder.encode_batch([r.shopper for r in requests], hours)
        return decide_products(self.product.heads, self.product.decoder, states, requests, decision_ids, self.version,
                               self.product.guard)

    @functools.cached_property
    def product_batches(self) -> ProductBatches:
        """What the server's product micro-batcher runs on: one object per model set, so a batch never mixes two."""
        return ProductBatches(self)


def load_file(path: Path | str | None, options: LoadOptions | None = None) -> tuple[Bundle, ModelSet]:
    """The bundle file a person named (a command's argument; None: the embedded default) and its model set; a
    ``BundleError`` naming the file when it cannot be read or loaded."""
    if path is None:
        from weights.embedded import default_bundle

        bundle = default_bundle()
        return bundle, ModelSet.load(bundle, options)
    data = read_file(path)  # its message names the file
    try:
        bundle = read_bundle(data)
        return bundle, ModelSet.load(bundle, options)
    except BundleError as exc:
        raise BundleError(exc.reason, f"invalid bundle {path} ({exc.reason}): {exc}") from None


class ProductBatches:
    """``ModelSet.decide_products`` in the micro-batcher's terms (``server.batching.BatchModel``)."""

    __slots__ = ("_model",)

    def __init__(self, model: ModelSet) -> None:
        self._model = model

    def run(self, requests: Sequence[ProductRequest], contexts: Sequence[Context],
            decision_ids: Sequence[str]) -> list[ProductDecision]:
        return self._model.decide_products(requests, [c.hour for c in contexts], decision_ids)


@dataclass(frozen=True)
class ProductLayers:
    """A bundle's ``RecommendProduct`` networks and the decoder its layers sample with."""

    heads: ProductHeads
    decoder: PluralityDecoder
    guard: ProductGuard | None = None
    """The learned per-layer vetoes (format version 3); None: the guardrails alone."""


def _product_layers(bundle: Bundle, spec: FeatureSpec, options: LoadOptions, tolerance: float) -> ProductLayers:
    """The product networks of a format-2 or -3 bundle (the guards too), checked and self-tested, with the manifest's
    ``product.decoder`` (and ``product.guard``)."""
    section = bundle.manifest.get("product")
    dec = section.get("decoder") if isinstance(section, dict) else None
    if not isinstance(dec, dict):
        raise BundleError("schema", "manifest.json: product.decoder must be an object (a bundle with product heads needs it)")
    try:
        decoder = PluralityDecoder(samples=_count(dec, "samples", "product.decoder", options.samples),
                                   min_votes=_count(dec, "min_votes", "product.decoder", options.min_votes),
                                   epsilon=options.exploration_epsilon if options.exploration_epsilon is not None
                                   else _number(dec, "exploration_epsilon", "product.decoder"),
                                   temperature=_number(dec, "exploration_temperature", "product.decoder"))
    except ValueError as exc:
        raise BundleError("schema", f"manifest.json: product.decoder: {exc}") from None
    heads = ProductHeads.load(bundle, spec, options.device, options.threads, tolerance)
    guard = None
    if PRODUCT_GUARD_PARTS[0] in bundle.parts:
        guard = ProductGuard.load(bundle, heads.encode(bundle.array("golden_states.npy")), heads.widths, options.device,
                                  options.threads, tolerance)
    return ProductLayers(heads, decoder, guard)


class NoModel:
    """No model is loaded: every decision is the rule engine's, with source FALLBACK_NO_MODEL.

    Its guardrails and rules come from a manifest (the embedded default's), which needs no
    onnxruntime. It answers ``fallback`` as a model set does, so callers need not tell them apart.
    """

    ready: Literal[False] = False
    version = ""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.item_dim = int(manifest["feature_spec"]["item_dim"])  # requests are still validated
        guardrails = gr.Guardrails.parse(manifest["guardrails"])
        self.decision = Rules(guardrails, RuleEngine.parse(manifest["fallback_rules"], guardrails.static), self.version)

    def fallback(self, ctx: Context, source: Source) -> Decision:
        """The rule engine's answer (the servicer names the source: FALLBACK_NO_MODEL)."""
        return self.decision.fallback(ctx, source)

