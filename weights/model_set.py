"""ModelSet: one loaded bundle as one immutable object, and NoModel, the explicit empty state.

Swapping models is one reference assignment (``server.models.ModelHolder``); a request
reads that reference once and finishes on the object it got, so nothing here is ever
mutated after ``load`` returns.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from guard.action_guard import ActionGuard
from guard.rules import RuleAnswer, RuleEngine
from policy import guardrails as gr
from policy.conditions import SchemaError
from policy.decoder import MajorityDecoder, uniforms_batch
from policy.domain import ACTIONS, N_ACTIONS, Context, Decision, DecisionRequest, FloatArray, Source
from policy.features import FeatureEncoder, FeatureSpec
from policy.onnx_model import OnnxModel, RuntimeMissing
from weights.bundle import Bundle, BundleError

log = logging.getLogger(__name__)
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


class _Policies:
    """Guardrails and fallback rules: the part of a bundle that needs no model."""

    guardrails: gr.Guardrails
    rules: RuleEngine

    def _rule_fallback(self, ctx: Context, source: Source, version: str) -> Decision:
        weights, hits = self.guardrails.weights(ctx)
        permitted = weights > 0
        answer = self.rules.decide(ctx, permitted, permitted)
        return _certain(answer, source, version, np.zeros(N_ACTIONS), np.zeros(N_ACTIONS), ~permitted, hits=hits)


_NO_VETO = (False,) * N_ACTIONS


def _certain(answer: RuleAnswer, source: Source, version: str, policy_probs: FloatArray, allow: FloatArray,
             blocked: npt.NDArray[np.bool_], samples: int = 0, vetoed: tuple[bool, ...] = _NO_VETO,
             hits: tuple[str, ...] = ()) -> Decision:
    served = np.zeros(N_ACTIONS)
    served[answer.action.index] = 1.0
    return Decision(answer.action, source, 1.0, 0, samples, served, policy_probs, allow, blocked, version, answer.rule,
                    vetoed=vetoed, guardrail_hits=hits)


@dataclass(slots=True)
class DecisionInputs:
    """Per row of a batch: what the decoder works on (``ModelSet.decision_inputs``)."""

    fired: list[tuple[FloatArray, tuple[str, ...]]]  # guardrail weights and the rules that fired
    weights: FloatArray  # (N, A) guardrail weights; 0 = banned
    policy_probs: FloatArray  # (N, A) softmax(logits + log weights)
    allow: FloatArray  # (N, A) guard allow-probabilities
    vetoed: npt.NDArray[np.bool_]  # (N, A) permitted but vetoed by the guard
    allowed: npt.NDArray[np.bool_]  # (N, A) neither banned nor vetoed
    fallbacks: list[RuleAnswer]  # the rule engine's answer per row
    q: FloatArray  # (N, A) the masked, renormalised policy the decoder samples from
    ok: npt.NDArray[np.bool_]  # (N,) some allowed action has probability (else the rules answer)


class ModelSet(_Policies):
    def __init__(self, manifest: dict[str, Any], encoder: FeatureEncoder, policy: OnnxModel, guard_model: OnnxModel,
                 guard: ActionGuard, guardrails: gr.Guardrails, rules: RuleEngine, decoder: MajorityDecoder) -> None:
        self.manifest = manifest
        self.version = str(manifest["model_version"])
        self.encoder = encoder
        self.policy = policy
        self.guard_model = guard_model
        self.guard = guard
        self.guardrails = guardrails
        self.rules = rules
        self.decoder = decoder
        self.item_dim = encoder.spec.item_dim
        self.loaded_at = time.time()

    ready = True

    @classmethod
    def load(cls, bundle: Bundle, options: LoadOptions | None = None) -> ModelSet:
        """Validate every part, build the sessions, self-test on the golden data, warm up."""
        options = options or LoadOptions()
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
        try:
            policy = OnnxModel("policy", bundle.parts["policy.onnx"], options.device, options.threads)
            guard_model = OnnxModel("guard", bundle.parts["guard.onnx"], options.device, options.threads)
        except RuntimeMissing:
            raise
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise BundleError("onnx", f"cannot load the ONNX graphs: {str(exc).splitlines()[0][:300]}") from None
        model = cls(m, FeatureEncoder(spec, table), policy, guard_model, guard, guardrails, rules, decoder)
        model._self_test(bundle, spec, _number(_section(m, "golden"), "tolerance", "golden"))
        model.infer(np.zeros((max(1, options.warmup_batch), spec.state_dim), dtype=np.float32))
        return model

    def _self_test(self, bundle: Bundle, spec: FeatureSpec, tolerance: float) -> None:
        states, expected = bundle.array("golden_states.npy"), bundle.array("golden_outputs.npy")
        if states.ndim != 2 or states.shape[1] != spec.state_dim or states.dtype != np.float32 or len(states) == 0:
            raise BundleError("shape", f"golden_states.npy: expected float32 (G, {spec.state_dim}), got {states.dtype} {states.shape}")
        if expected.shape != (len(states), 2 * N_ACTIONS):
            raise BundleError("shape", f"golden_outputs.npy: expected ({len(states)}, {2 * N_ACTIONS}), got {expected.shape}")
        try:  # the raw graphs: infer() would reject non-finite outputs before we could name them
            logits, allow = self.policy.run(states), self.guard_model.run(states)
        except Exception as exc:
            raise BundleError("shape", f"the graphs do not run on the feature spec's state: {str(exc).splitlines()[0][:300]}") from None
        if logits.shape != (len(states), N_ACTIONS) or allow.shape != (len(states), N_ACTIONS):
            raise BundleError("shape", f"graph outputs have shapes {logits.shape} and {allow.shape}, expected (G, {N_ACTIONS})")
        got = np.concatenate([logits, allow], axis=1)
        if not np.isfinite(got).all():
            raise BundleError("nonfinite", "the graphs produce NaN or Inf on the golden inputs")
        error = float(np.abs(got - expected).max())
        if not error <= tolerance:
            raise BundleError("golden", f"golden self-test failed: max error {error:.3g} > tolerance {tolerance:.3g}")

    def infer(self, states: F32) -> tuple[F32, F32]:
        """Policy logits and guard allow-probabilities for a batch of states.

        Non-finite outputs raise: a NaN allow-probability would otherwise pass the veto
        (NaN < threshold is false). The batcher then reruns the batch request by request,
        so only the request that produced them degrades.
        """
        logits, allow = self.policy.run(states), self.guard_model.run(states)
        if not (np.isfinite(logits).all() and np.isfinite(allow).all()):
            raise FloatingPointError("the model produced NaN or Inf for this input")
        return logits, allow

    def run(self, requests: Sequence[DecisionRequest], contexts: Sequence[Context], decision_ids: Sequence[str]) -> list[Decision]:
        """The whole decision for a batch: encode, infer, decide. What the micro-batcher calls."""
        states = self.encoder.encode_batch(requests, [c.hour for c in contexts])
        logits, allow = self.infer(states)
        return self.decide_batch(contexts, logits, allow, decision_ids)

    def decide(self, ctx: Context, logits: F32, allow: F32, decision_id: str) -> Decision:
        """``decide_batch`` for one request."""
        return self.decide_batch([ctx], logits[None, :], allow[None, :], [decision_id])[0]

    def decide_batch(self, contexts: Sequence[Context], logits: F32, allow: F32, decision_ids: Sequence[str]) -> list[Decision]:
        """Guardrails → guard veto → sampled majority (or exploration, or the rules), with exact propensities.

        Vectorised over the batch; only the guardrail and fallback rules (data-driven, per
        request) loop in Python. A single request goes through the same code, so a logged
        decision replays identically whether it was served alone or in a batch.
        """
        n = len(contexts)
        inputs = self.decision_inputs(contexts, logits, allow)
        fired, policy_probs, allow64, allowed, q, ok = (inputs.fired, inputs.policy_probs, inputs.allow, inputs.allowed,
                                                        inputs.q, inputs.ok)
        vetoed_rows = [tuple(v) for v in inputs.vetoed.tolist()]
        fallbacks = inputs.fallbacks
        samples = self.decoder.samples
        served = np.zeros((n, N_ACTIONS))
        decisions: list[Decision | None] = [None] * n
        rows = np.flatnonzero(ok).tolist()
        if rows:
            fallback_index = np.array([fallbacks[i].action.value - 1 for i in rows])
            served[rows] = self.decoder.served_batch(q[rows], fallback_index)
            draws = self.decoder.draw_batch(q[rows], uniforms_batch([decision_ids[i] for i in rows], samples + 2))
            counts = draws.counts.tolist()
            explored, decisive, drawn = draws.explored.tolist(), draws.decisive.tolist(), draws.index.tolist()
            for j, i in enumerate(rows):
                if explored[j]:
                    index, source, rule = drawn[j], Source.EXPLORATION, ""
                elif decisive[j]:
                    index, source, rule = drawn[j], Source.POLICY, ""
                else:
                    index, source, rule = fallbacks[i].action.value - 1, Source.FALLBACK_LOW_CONSENSUS, fallbacks[i].rule
                decisions[i] = Decision(ACTIONS[index], source, float(served[i, index]),
                                        0 if explored[j] else counts[j][index], samples, served[i], policy_probs[i],
                                        allow64[i], ~allowed[i], self.version, rule, tuple(counts[j]),
                                        vetoed_rows[i], fired[i][1])
        for i in np.flatnonzero(~ok).tolist():  # every permitted action vetoed (or underflowed): the rules answer
            decisions[i] = _certain(fallbacks[i], Source.FALLBACK_GUARD, self.version, policy_probs[i], allow64[i],
                                    ~allowed[i], samples, vetoed_rows[i], fired[i][1])
        assert all(d is not None for d in decisions), "every row is decided by the decoder or the rules"
        return decisions  # type: ignore[return-value]

    def decision_inputs(self, contexts: Sequence[Context], logits: F32, allow: F32, guard: ActionGuard | None = None) -> DecisionInputs:
        """Everything before the draw: guardrail weights, veto, the rule engine's answer, the masked ``q``.

        The trainer builds its differentiable copy of the decoder on exactly these (with its
        newly trained guard's allow-probabilities and threshold: ``guard``).
        """
        guard = guard or self.guard
        fired = [self.guardrails.weights(ctx) for ctx in contexts]
        weights = np.stack([w for w, _ in fired]) if fired else np.zeros((0, N_ACTIONS))
        policy_probs = gr.apply_batch(logits, weights)
        allow64 = allow.astype(np.float64)
        permitted = weights > 0
        vetoed = permitted & guard.vetoed(allow64)
        allowed = permitted & ~vetoed
        fallbacks = [
            self.rules.decide(ctx, a, p, s)
            for ctx, a, p, s in zip(contexts, allowed.tolist(), permitted.tolist(), allow64.tolist(), strict=True)
        ]
        q = np.where(allowed, policy_probs, 0.0)
        total = q.sum(axis=1)
        ok = total > 0  # rows where some allowed action has probability: the decoder decides
        q[ok] /= total[ok, None]
        return DecisionInputs(fired, weights, policy_probs, allow64, vetoed, allowed, fallbacks, q, ok)

    def fallback(self, ctx: Context, source: Source) -> Decision:
        """A rule-engine answer without model outputs (overload, inference error, short deadline)."""
        return self._rule_fallback(ctx, source, self.version)


class NoModel(_Policies):
    """No model is loaded: every decision is the rule engine's, with source FALLBACK_NO_MODEL.

    Its guardrails and rules come from a manifest (the embedded default's), which needs no
    onnxruntime.
    """

    ready = False
    version = ""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.item_dim = int(manifest["feature_spec"]["item_dim"])  # requests are still validated
        self.guardrails = gr.Guardrails.parse(manifest["guardrails"])
        self.rules = RuleEngine.parse(manifest["fallback_rules"], self.guardrails.static)

    def fallback(self, ctx: Context) -> Decision:
        return self._rule_fallback(ctx, Source.FALLBACK_NO_MODEL, self.version)
