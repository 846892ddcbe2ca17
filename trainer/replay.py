"""Logged decisions replayed through a bundle's decision code: states, contexts, served probabilities.

numpy and onnxruntime only (no torch): ``evaluate`` and the gate use it as well as the
trainer. A logged row's state is rebuilt exactly as the server built it (the float16
embedding, the behaviour buckets the server's encoder read, the hour the server logged);
its context is what the guardrails and the rule engine saw. ``replay`` runs a ``ModelSet`` on them, in
chunks: the decision inputs (guardrail weights, guard veto, the rule engine's answer, the
masked ``q``) and the exact probability that the bundle serves each action — the target
policy of off-policy evaluation, computed by the server's own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from core.domain import LOGGED_EMBEDDING_MAX, N_ACTIONS, Context, FloatArray, PageType
from policy.decision import DecisionInputs
from policy.features import FeatureSpec
from weights.model_set import ModelSet

F32 = npt.NDArray[np.float32]
CHUNK = 16384


@dataclass(slots=True)
class LoggedSteps:
    """Logged decisions as the decision code's inputs, in the table's row order."""

    states: F32  # (N, state_dim)
    contexts: list[Context]
    actions: npt.NDArray[np.int64]  # (N,) served action index 0..4
    propensity: FloatArray  # (N,) logged probability of the served action
    behavior_probs: FloatArray  # (N, A) logged served probabilities (the behaviour policy)

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def certain(self) -> npt.NDArray[np.bool_]:
        """(N,) rows the behaviour served with certainty (a rule-engine answer: degraded, no model, every action vetoed).

        Such a row says nothing about any other action: its propensity is 1 for the action the
        rules chose, 0 for the rest, so an importance ratio against it is not an estimate of
        anything. The trainer leaves these rows out of the surrogate and the KL to the behaviour.
        """
        return np.asarray(self.behavior_probs.max(axis=1) >= 1.0 - 1e-12, dtype=np.bool_)


def saturated(values: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
    """Logged float16 values with ±inf as ±65504, float16's largest, in place; NaN stays NaN.

    A server older than the request bound (``core.domain.LOGGED_EMBEDDING_MAX``) logged a value past float16's range as
    ±inf, from which no state can be rebuilt: one such request would stop every later run on those logs. The largest
    finite float16 is what a saturating conversion would have written.
    """
    return np.clip(values, -LOGGED_EMBEDDING_MAX, LOGGED_EMBEDDING_MAX, out=values)


def write_embeddings(out: npt.NDArray[np.floating], column: pa.ChunkedArray, item_dim: int,
                     order: npt.NDArray[np.int64] | None = None) -> None:
    """``out[i] = column[order[i]]`` (or ``column[i]``), chunk by chunk: each chunk's values are read in place, so
    the column is never copied whole (``combine_chunks``) nor gathered into a second array before ``out``. Values
    logged as ±inf come out ``saturated``."""
    starts = np.cumsum([0, *(len(c) for c in column.chunks)])
    wanted = np.arange(starts[-1], dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    which = np.searchsorted(starts, wanted, side="right") - 1
    by_chunk = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[by_chunk], np.arange(len(column.chunks) + 1))
    for k, chunk in enumerate(column.chunks):
        targets = by_chunk[bounds[k] : bounds[k + 1]]
        if not len(targets):
            continue
        lengths = chunk.value_lengths().to_numpy(zero_copy_only=False)
        if len(lengths) and not (lengths == item_dim).all():
            bad = int(starts[k] + np.argmax(lengths != item_dim))
            raise ValueError(f"item_embedding: row {bad} has {lengths[bad - starts[k]]} values, the bundle expects {item_dim}")
        values = chunk.flatten().to_numpy(zero_copy_only=False).reshape(len(chunk), item_dim)
        out[targets] = values[wanted[targets] - starts[k]]
    saturated(out)


def buckets_of(decisions: pa.Table, spec: FeatureSpec) -> list[list[int]]:
    """Per row, the behaviour buckets the encoder reads under ``spec``; ``ValueError`` when the log cannot give them.

    The log holds the buckets of the serving bundle's spec, not the ids: a bundle with another
    bucket count, or a longer window than a row has buckets for, cannot rebuild those states.
    """
    counts = np.asarray(decisions.column("behavior_bucket_count").to_numpy(), dtype=np.int64)
    if len(counts) and (counts != spec.behavior_buckets).any():
        row = int(np.argmax(counts != spec.behavior_buckets))
        raise ValueError(f"behavior_bucket_count: row {row} was logged with {counts[row]} behaviour buckets, the bundle's "
                         f"encoder has {spec.behavior_buckets}; the logs keep buckets, not ids, so its states cannot be rebuilt")
    buckets = decisions.column("behavior_bucket_indices").to_pylist()
    n_recent = decisions.column("n_recent_behaviors").to_pylist()
    for row, (indices, n) in enumerate(zip(buckets, n_recent, strict=True)):
        if len(indices) < min(n, spec.behavior_window):
            raise ValueError(f"behavior_bucket_indices: row {row} has {len(indices)} of its {n} behaviour ids, the bundle's "
                             f"window is {spec.behavior_window}; its state cannot be rebuilt")
    return buckets


def logged_steps(decisions: pa.Table, model: ModelSet, order: npt.NDArray[np.int64] | None = None,
                 ordered: pa.Table | None = None) -> LoggedSteps:
    """States and contexts of every logged decision, for ``model``'s feature spec, in ``order`` (row indices of
    ``decisions``) when given: the table itself is never copied whole, only the columns the steps need (``ordered``:
    those columns already taken in ``order``, when the caller has them). The item embeddings go from the log's
    column straight into the float32 states."""
    spec = model.encoder.spec
    column = decisions.column("item_embedding")
    if order is not None:
        decisions = ordered if ordered is not None else decisions.drop_columns(["item_embedding"]).take(pa.array(order))
    hours = decisions.column("hour").to_numpy().astype(np.int64)
    states = model.encoder.encode_columns(buckets_of(decisions, spec), hours)
    write_embeddings(states[:, : spec.item_dim], column, spec.item_dim, order)
    pages = decisions.column("page_type").to_pylist()
    carts = decisions.column("cart_item_count").to_pylist()
    n_recent = decisions.column("n_recent_behaviors").to_pylist()
    contexts = [Context(PageType(p), c, h, b) for p, c, h, b in zip(pages, carts, hours.tolist(), n_recent, strict=True)]
    served = np.array(decisions.column("served_probs").combine_chunks().flatten().to_numpy(zero_copy_only=False),
                        dtype=np.float64).reshape(len(decisions), N_ACTIONS)
    return LoggedSteps(
        states=states,
        contexts=contexts,
        actions=decisions.column("action").to_numpy().astype(np.int64) - 1,
        propensity=decisions.column("propensity").to_numpy().astype(np.float64),
        behavior_probs=served,
    )


@dataclass(slots=True)
class Replay:
    """A bundle's view of logged steps: its decision inputs and served distribution per row."""

    log_weights: FloatArray  # (N, A) log guardrail weights, -inf where banned
    allowed: npt.NDArray[np.bool_]  # (N, A) neither banned nor vetoed by this bundle's guard
    fallback: npt.NDArray[np.int64]  # (N,) the rule engine's action index
    ok: npt.NDArray[np.bool_]  # (N,) the decoder decides (else the rule engine, with certainty)
    allow: FloatArray  # (N, A) this bundle's guard allow-probabilities
    served: FloatArray  # (N, A) the probability this bundle serves each action


def replay(model: ModelSet, steps: LoggedSteps, chunk: int = CHUNK) -> Replay:
    parts: list[tuple[DecisionInputs, FloatArray]] = []
    for start in range(0, len(steps), chunk):
        states = steps.states[start : start + chunk]
        contexts = steps.contexts[start : start + chunk]
        logits, allow = model.infer(states)
        inputs = model.decision.inputs(contexts, logits, allow)
        parts.append((inputs, served_of(model, inputs)))
    if not parts:
        empty = np.zeros((0, N_ACTIONS))
        return Replay(empty, empty.astype(bool), np.zeros(0, np.int64), np.zeros(0, bool), empty, empty)
    arrays = [decoder_arrays(p) for p, _ in parts]
    log_weights, allowed, fallback, ok = (np.concatenate([a[i] for a in arrays]) for i in range(4))
    return Replay(log_weights, allowed, fallback, ok, np.concatenate([p.allow for p, _ in parts]),
                  np.concatenate([s for _, s in parts]))


def decoder_arrays(inputs: DecisionInputs) -> tuple[FloatArray, npt.NDArray[np.bool_], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """What the decoder works on per row, as arrays: log guardrail weights (-inf banned), allowed, the rule
    engine's action index, and whether the decoder decides (the trainer's torch decoder takes the same)."""
    with np.errstate(divide="ignore"):
        log_weights = np.where(inputs.weights > 0, np.log(np.where(inputs.weights > 0, inputs.weights, 1.0)), -np.inf)
    fallback = np.array([f.action.index for f in inputs.fallbacks], dtype=np.int64)
    return log_weights, inputs.allowed, fallback, inputs.ok


def served_of(model: ModelSet, inputs: DecisionInputs) -> FloatArray:
    """Exact served distribution per row, as ``decide_batch`` computes it (without drawing)."""
    n = len(inputs.ok)
    served = np.zeros((n, N_ACTIONS))
    rows = np.flatnonzero(inputs.ok)
    fallback = decoder_arrays(inputs)[2]
    if len(rows):
        served[rows] = model.decision.decoder.served_batch(inputs.q[rows], fallback[rows])
    certain = np.flatnonzero(~inputs.ok)
    served[certain, fallback[certain]] = 1.0
    return served


def serves_alike(a: ModelSet, b: ModelSet, decisions: pa.Table) -> bool:
    """Whether two bundles serve the same distribution on every logged row, bit for bit (False on no rows).

    A candidate that does (its updates all refused, its guard and decoder the active bundle's in effect) has nothing new
    for a canary or a second look to judge: serving it would spend shoppers' sessions on a difference of exactly zero.
    """
    if decisions.num_rows == 0:
        return False
    return bool(np.array_equal(replay(a, logged_steps(decisions, a)).served, replay(b, logged_steps(decisions, b)).served))
