"""The decision procedure: guardrails → guard veto → rule engine → sampled majority → propensity.

One place for the whole procedure, with the exact probability of the served action under it
(the propensity the logs and the trainer use). ``Rules`` is the part that needs no model: a
rule-engine answer under the guardrails, which is all a server without a model can give, and
what a server with one gives when inference cannot run (overload, error, short deadline).
``DecisionProcedure`` adds the guard's veto and the decoder, and decides from a batch of model
outputs. Both are immutable; a loaded model set holds one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from core.domain import ACTIONS, N_ACTIONS, Context, Decision, FloatArray, Source
from guard.action_guard import ActionGuard
from guard.rules import RuleAnswer, RuleEngine
from policy import guardrails as gr
from policy.decoder import MajorityDecoder, uniforms_batch

F32 = npt.NDArray[np.float32]
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
    """Per row of a batch: what the decoder works on (``DecisionProcedure.inputs``)."""

    fired: list[tuple[FloatArray, tuple[str, ...]]]  # guardrail weights and the rules that fired
    weights: FloatArray  # (N, A) guardrail weights; 0 = banned
    policy_probs: FloatArray  # (N, A) softmax(logits + log weights)
    allow: FloatArray  # (N, A) guard allow-probabilities
    vetoed: npt.NDArray[np.bool_]  # (N, A) permitted but vetoed by the guard
    allowed: npt.NDArray[np.bool_]  # (N, A) neither banned nor vetoed
    fallbacks: list[RuleAnswer]  # the rule engine's answer per row
    q: FloatArray  # (N, A) the masked, renormalised policy the decoder samples from
    ok: npt.NDArray[np.bool_]  # (N,) some allowed action has probability (else the rules answer)


@dataclass(frozen=True)
class Rules:
    """Guardrails and the rule engine: a decision without model outputs."""

    guardrails: gr.Guardrails
    rules: RuleEngine
    version: str  # the model version decisions carry ("" for none)

    def fallback(self, ctx: Context, source: Source) -> Decision:
        """The rule engine's answer among the actions the guardrails permit, served with certainty."""
        weights, hits = self.guardrails.weights(ctx)
        permitted = weights > 0
        answer = self.rules.decide(ctx, permitted, permitted)
        return _certain(answer, source, self.version, np.zeros(N_ACTIONS), np.zeros(N_ACTIONS), ~permitted, hits=hits)


@dataclass(frozen=True)
class DecisionProcedure(Rules):
    """The whole procedure over model outputs (policy logits, guard allow-probabilities)."""

    guard: ActionGuard
    decoder: MajorityDecoder

    def decide(self, ctx: Context, logits: F32, allow: F32, decision_id: str) -> Decision:
        """``decide_batch`` for one request."""
        return self.decide_batch([ctx], logits[None, :], allow[None, :], [decision_id])[0]

    def decide_batch(self, contexts: Sequence[Context], logits: F32, allow: F32, decision_ids: Sequence[str]) -> list[Decision]:
        """Guardrails → guard veto → sampled majority (or exploration, or the rules), with exact propensities.

        Vectorised over the batch; only the guardrail and fallback rules (data-driven, per
        request) loop in Python. A single request goes through the same code, so a logged
        decision replays identically whether it was served alone or in a batch.
        """
        decoder = self.decoder
        n = len(contexts)
        inputs = self.inputs(contexts, logits, allow)
        fired, policy_probs, allow64, q, ok = inputs.fired, inputs.policy_probs, inputs.allow, inputs.q, inputs.ok
        blocked = ~inputs.allowed
        vetoed_rows = list(map(tuple, inputs.vetoed.tolist()))
        fallbacks = inputs.fallbacks
        samples = decoder.samples
        decisions: list[Decision | None] = [None] * n
        every = bool(ok.all())  # (the usual batch: no fancy indexing)
        rows = list(range(n)) if every else np.flatnonzero(ok).tolist()
        if rows:
            fallback_index = np.array([fallbacks[i].action.value - 1 for i in rows])
            served, draws = decoder.served_and_drawn(q if every else q[rows], fallback_index,
                                                     uniforms_batch(decision_ids if every else [decision_ids[i] for i in rows],
                                                                    samples + 2))
            counts = draws.counts.tolist()
            explored, decisive, drawn = draws.explored.tolist(), draws.decisive.tolist(), draws.index.tolist()
            for j, i in enumerate(rows):
                if explored[j]:
                    index, source, rule, votes = drawn[j], Source.EXPLORATION, "", 0
                elif decisive[j]:
                    index, source, rule = drawn[j], Source.POLICY, ""
                    votes = counts[j][index]  # the winner's; 0 when exploration or the rules answered (the draws stay in counts)
                else:
                    index, source, rule, votes = fallbacks[i].action.value - 1, Source.FALLBACK_LOW_CONSENSUS, fallbacks[i].rule, 0
                row = served[j]
                decisions[i] = Decision(ACTIONS[index], source, float(row[index]), votes,
                                        samples, row, policy_probs[i], allow64[i], blocked[i], self.version, rule,
                                        tuple(counts[j]), vetoed_rows[i], fired[i][1])
        if not every:
            for i in np.flatnonzero(~ok).tolist():  # every permitted action vetoed (or underflowed): the rules answer
                decisions[i] = _certain(fallbacks[i], Source.FALLBACK_GUARD, self.version, policy_probs[i], allow64[i],
                                        blocked[i], samples, vetoed_rows[i], fired[i][1])
        assert all(d is not None for d in decisions), "every row is decided by the decoder or the rules"
        return decisions  # type: ignore[return-value]

    def inputs(self, contexts: Sequence[Context], logits: F32, allow: F32, guard: ActionGuard | None = None) -> DecisionInputs:
        """Everything before the draw: guardrail weights, veto, the rule engine's answer, the masked ``q``.

        The trainer builds its differentiable copy of the decoder on exactly these (with its
        newly trained guard's allow-probabilities and threshold: ``guard``).
        """
        guard = guard or self.guard
        fired = [self.guardrails.weights(ctx) for ctx in contexts]
        weights = np.array([w for w, _ in fired]) if fired else np.zeros((0, N_ACTIONS))  # (np.stack: 5x the cost)
        policy_probs = gr.apply_batch(logits, weights)
        allow64 = allow.astype(np.float64)
        permitted = weights > 0
        vetoed = permitted & guard.vetoed(allow64)
        allowed = permitted ^ vetoed  # (vetoed ⊆ permitted)
        fallbacks = [
            self.rules.decide(ctx, a, p, s)
            for ctx, a, p, s in zip(contexts, allowed.tolist(), permitted.tolist(), allow64.tolist(), strict=True)
        ]
        q = np.where(allowed, policy_probs, 0.0)
        total = q.sum(axis=1)
        ok = total > 0  # rows where some allowed action has probability: the decoder decides
        np.divide(q, total[:, None], out=q, where=ok[:, None])  # (no fancy indexing: rows not ok stay zero)
        return DecisionInputs(fired, weights, policy_probs, allow64, vetoed, allowed, fallbacks, q, ok)
