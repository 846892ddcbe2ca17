"""Decisions and outcomes as Arrow record batches in the log schema (``experience.schema``).

Built column by column from a list of queued items: one pass per column, the embeddings and
the per-action vectors stacked into one numpy array each. Every id a caller sent is hashed
here (keyed BLAKE2b with the salt), on the writer's thread, not on the request path, and the
behaviour ids become the encoder's bucket indices: nothing the caller typed reaches the disk.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from core.domain import N_ACTIONS, Decision, DecisionRequest, EngagementReport, OutcomeReport
from core.product import LayerChoice, ProductDecision, ProductRequest
from experience.schema import DECISIONS, ENGAGEMENTS, OUTCOMES, PRODUCTS, SCHEMA_VERSION
from policy.features import FeatureSpec, behavior_buckets
from policy.product_features import band_features, category_features, sku_features

# One BLAKE2b personalisation per column: equal ids hash alike within a column, never across
# columns (a session id and an item id that happen to be equal give unrelated hashes).
SESSION, ITEM, REQUEST, OUTCOME, DECISION = b"sa.session", b"sa.item", b"sa.request", b"sa.outcome", b"sa.decision"
ENGAGEMENT = b"sa.engagement"
CATEGORY, SKU, BAND = b"sa.category", b"sa.sku", b"sa.band"
_ISSUED_ID = re.compile(r"[0-9a-f]{32}")  # the form of a decision id the server hands out


RECORD_BYTES = 1024
"""What a queued record holds besides its embeddings and the caller's id strings, about: its Python objects and, for a
report, its amounts (a queued outcome keeps 0.5 KB alive besides its ids: tracemalloc, 2026-12-06)."""
ANSWER_BYTES = 1536
"""What an answered decision adds: the served ``Decision`` or ``ProductDecision`` and its per-action arrays (measured:
a decision of the embedded default keeps 1.3 KB alive besides its request, a 12-SKU product decision 1.7 KB besides a
``SKU_BYTES`` a SKU)."""
SKU_BYTES = 320
"""The same for each SKU of a product request (its candidate object, price and stock; its id is counted as an id):
about 285 bytes measured."""


@dataclass(slots=True)
class LoggedDecision:
    """What the request path hands the recorder: references only, nothing copied or formatted."""

    request: DecisionRequest
    hour: int
    decision: Decision
    decision_id: str
    time_s: float
    spec: FeatureSpec  # the served bundle's: its buckets are what the state was built from


@dataclass(slots=True)
class LoggedProduct:
    """A ``RecommendProduct`` decision as the request path hands it over (the features are computed on the writer)."""

    request: ProductRequest
    hour: int
    decision: ProductDecision
    decision_id: str
    time_s: float
    spec: FeatureSpec


@dataclass(slots=True)
class LoggedOutcome:
    report: OutcomeReport
    received_s: float


@dataclass(slots=True)
class LoggedEngagement:
    report: EngagementReport
    received_s: float


def retained_bytes(item: LoggedDecision | LoggedProduct | LoggedOutcome | LoggedEngagement) -> int:
    """About what a queued record keeps alive until the writer encodes it: its embeddings' bytes (views of the request's
    wire bytes, so about the message's size), every id string the caller sent (``str.__sizeof__``, as ``sys.getsizeof``
    reads it at a quarter of the cost: a 256-character id of 4-byte code points keeps 1,100 bytes alive, 13 times an
    ASCII id of 36), and a fixed amount a record and a SKU. Computed on the request path, so it reads sizes only."""
    if isinstance(item, LoggedDecision):
        return RECORD_BYTES + ANSWER_BYTES + _shopper_bytes(item.request)
    if isinstance(item, LoggedProduct):
        request = item.request
        return RECORD_BYTES + ANSWER_BYTES + _shopper_bytes(request.shopper) + _sizes(b.band_id for b in request.price_bands) + sum(
            c.category_id.__sizeof__() + sum(SKU_BYTES + s.embedding.nbytes + s.sku_id.__sizeof__() for s in c.skus)
            for c in request.categories)
    report = item.report
    return RECORD_BYTES + _sizes((report.decision_id, report.session_id,
                                  report.outcome_id if isinstance(report, OutcomeReport) else report.engagement_id))


def _shopper_bytes(request: DecisionRequest) -> int:
    return request.item_embedding.nbytes + _sizes((request.user_id, request.session_id, request.item_id,
                                                   request.request_id)) + _sizes(request.recent_behavior_ids)


def _sizes(strings: Iterable[str]) -> int:
    return sum(map(str.__sizeof__, strings))


def hash_user(user_id: str, salt: bytes) -> str:
    """Keyed BLAKE2b-128 of a user id, hex: stable for one salt, not reversible without it."""
    return hashlib.blake2b(user_id.encode(), key=salt, digest_size=16).hexdigest()


def hash_id(value: str, salt: bytes, column: bytes) -> str:
    """Keyed BLAKE2b-128 of an id for one column (``SESSION``, ``ITEM`` …), hex; ``""`` stays ``""``."""
    if not value:
        return ""
    return hashlib.blake2b(value.encode(), key=salt, digest_size=16, person=column).hexdigest()


def outcome_decision_id(decision_id: str, salt: bytes) -> str:
    """An outcome's ``decision_id`` as logged: kept when it has the form of an issued id, else hashed.

    An issued id (32 hex digits) is the server's random number, not the caller's data, and the
    decisions carry it as it is; anything else cannot name a decision the server made.
    """
    return decision_id if _ISSUED_ID.fullmatch(decision_id) else hash_id(decision_id, salt, DECISION)


def _vectors(rows: Sequence[np.ndarray], dtype: type, typ: pa.DataType) -> pa.FixedSizeListArray:
    flat: np.ndarray = np.array(rows, dtype=dtype).reshape(-1)  # one C loop; np.stack checks every row in Python
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=typ), N_ACTIONS)


def _string_lists(rows: Sequence[Sequence[str]]) -> pa.ListArray:
    return pa.array([list(r) for r in rows], type=pa.list_(pa.string()))


def _int_lists(rows: Sequence[Sequence[int]]) -> pa.ListArray:
    return pa.array(rows, type=pa.list_(pa.int32()))


def _shopper_columns(items: Sequence[LoggedDecision] | Sequence[LoggedProduct], reqs: Sequence[DecisionRequest],
                     salt: bytes) -> dict[str, pa.Array]:
    """The columns of the shopper and the page a decision was made for (a decision row's and a product row's first)."""
    n = len(items)
    specs = [i.spec for i in items]
    sessions = {s: hash_id(s, salt, SESSION) for s in {r.session_id for r in reqs}}  # a session's decisions share a flush
    embeddings = [r.item_embedding for r in reqs]
    lengths = np.fromiter((e.shape[0] for e in embeddings), dtype=np.int32, count=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(embeddings).astype(np.float16) if n else np.zeros(0, dtype=np.float16)
    embedding = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float16()))
    return {
        "schema_version": pa.array(np.full(n, SCHEMA_VERSION, dtype=np.int16)),
        "decision_id": pa.array([i.decision_id for i in items], type=pa.string()),
        "time_s": pa.array([i.time_s for i in items], type=pa.float64()),
        "event_time_s": pa.array([r.event_time_s for r in reqs], type=pa.float64()),
        "session_id": pa.array([sessions[r.session_id] for r in reqs], type=pa.string()),
        "user_hash": pa.array([hash_user(r.user_id, salt) for r in reqs], type=pa.string()),
        "item_id": pa.array([hash_id(r.item_id, salt, ITEM) for r in reqs], type=pa.string()),
        "request_id": pa.array([hash_id(r.request_id, salt, REQUEST) for r in reqs], type=pa.string()),
        "item_embedding": embedding,
        "behavior_bucket_indices": _int_lists([behavior_buckets(r.recent_behavior_ids, spec) for r, spec in zip(reqs, specs, strict=True)]),
        "behavior_bucket_count": pa.array([spec.behavior_buckets for spec in specs], type=pa.int32()),
        "n_recent_behaviors": pa.array([len(r.recent_behavior_ids) for r in reqs], type=pa.int32()),
        "page_type": pa.array([int(r.page_type) for r in reqs], type=pa.int8()),
        "cart_item_count": pa.array([r.cart_item_count for r in reqs], type=pa.int32()),
        "hour": pa.array([i.hour for i in items], type=pa.int8()),
    }


def decisions_batch(items: Sequence[LoggedDecision], salt: bytes, sample_rate: float) -> pa.RecordBatch:
    n = len(items)
    ds = [i.decision for i in items]
    columns = {
        **_shopper_columns(items, [i.request for i in items], salt),
        "action": pa.array([int(d.action) for d in ds], type=pa.int8()),
        "source": pa.array([int(d.source) for d in ds], type=pa.int8()),
        "propensity": pa.array([d.propensity for d in ds], type=pa.float64()),
        "votes": pa.array([d.votes for d in ds], type=pa.int16()),
        "samples": pa.array([d.samples for d in ds], type=pa.int16()),
        "served_probs": _vectors([d.served_probs for d in ds], np.float64, pa.float64()),
        "policy_probs": _vectors([d.policy_probs for d in ds], np.float64, pa.float64()),
        "allow_probs": _vectors([d.allow_probs for d in ds], np.float64, pa.float64()),
        "blocked": _vectors([d.blocked for d in ds], np.bool_, pa.bool_()),
        "vetoed": _vectors([np.asarray(d.vetoed or (False,) * N_ACTIONS) for d in ds], np.bool_, pa.bool_()),
        "guardrail_hits": _string_lists([d.guardrail_hits for d in ds]),
        "rule": pa.array([d.rule for d in ds], type=pa.string()),
        "model_version": pa.array([d.model_version for d in ds], type=pa.string()),
        "sample_rate": pa.array(np.full(n, sample_rate, dtype=np.float64)),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=DECISIONS)


def _reported(items: Sequence[LoggedOutcome] | Sequence[LoggedEngagement], salt: bytes, sample_rate: float, id_column: str,
              person: bytes, middle: dict[str, pa.Array]) -> list[pa.Array]:
    """A report kind's columns: its own id (hashed), the decision and session it names, ``middle``, then the times."""
    reports = [i.report for i in items]
    n = len(items)
    return [
        pa.array(np.full(n, SCHEMA_VERSION, dtype=np.int16)),
        pa.array([hash_id(getattr(r, id_column), salt, person) for r in reports], type=pa.string()),
        pa.array([outcome_decision_id(r.decision_id, salt) for r in reports], type=pa.string()),
        pa.array([hash_id(r.session_id, salt, SESSION) for r in reports], type=pa.string()),
        *middle.values(),
        pa.array([r.event_time_s for r in reports], type=pa.float64()),
        pa.array([i.received_s for i in items], type=pa.float64()),
        pa.array(np.full(n, sample_rate, dtype=np.float64)),
    ]


def outcomes_batch(items: Sequence[LoggedOutcome], salt: bytes, sample_rate: float) -> pa.RecordBatch:
    reports = [i.report for i in items]
    middle = {
        "outcome": pa.array([int(r.outcome) for r in reports], type=pa.int8()),
        "value": pa.array([r.value for r in reports], type=pa.float64()),
        "coupon_discount": pa.array([r.coupon_discount for r in reports], type=pa.float64()),
    }
    return pa.RecordBatch.from_arrays(_reported(items, salt, sample_rate, "outcome_id", OUTCOME, middle), schema=OUTCOMES)


def engagements_batch(items: Sequence[LoggedEngagement], salt: bytes, sample_rate: float) -> pa.RecordBatch:
    reports = [i.report for i in items]
    middle = {  # None: not measured (a null)
        "dwell_s": pa.array([r.dwell_s for r in reports], type=pa.float64()),
        "scroll_depth": pa.array([r.scroll_depth for r in reports], type=pa.float64()),
        "bounced": pa.array([r.bounced for r in reports], type=pa.bool_()),
    }
    return pa.RecordBatch.from_arrays(_reported(items, salt, sample_rate, "engagement_id", ENGAGEMENT, middle), schema=ENGAGEMENTS)


def _nested(rows: Sequence[np.ndarray]) -> pa.ListArray:
    """Per row, a (candidates, features) array, as a list of lists of float16."""
    inner_lengths = [a.shape[1] for a in rows for _ in range(a.shape[0])]
    flat = np.concatenate([a.reshape(-1) for a in rows]).astype(np.float16) if rows else np.zeros(0, dtype=np.float16)
    inner = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(inner_lengths)]).astype(np.int32)),
                                     pa.array(flat, type=pa.float16()))
    outer = np.concatenate([[0], np.cumsum([a.shape[0] for a in rows])]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(outer), inner)


def _layer_columns(layer: str, ids: list[list[str]], features: list[np.ndarray], choices: list[LayerChoice]) -> dict[str, pa.Array]:
    return {
        f"{layer}_ids": _string_lists(ids),
        f"{layer}_features": _nested(features),
        f"{layer}_index": pa.array([c.index for c in choices], type=pa.int16()),
        f"{layer}_propensity": pa.array([c.propensity for c in choices], type=pa.float64()),
        f"{layer}_source": pa.array([int(c.source) for c in choices], type=pa.int8()),
        f"{layer}_votes": pa.array([c.votes for c in choices], type=pa.int16()),
        f"{layer}_rule": pa.array([c.rule for c in choices], type=pa.string()),
        f"{layer}_served_probs": pa.array([list(c.served) for c in choices], type=pa.list_(pa.float64())),
        f"{layer}_permitted": pa.array([list(c.permitted) for c in choices], type=pa.list_(pa.bool_())),
        f"{layer}_fallback": pa.array([c.fallback for c in choices], type=pa.int16()),
        f"{layer}_guardrail": pa.array([list(c.guardrail) if c.guardrail else None for c in choices], type=pa.list_(pa.bool_())),
        f"{layer}_rule_rank": pa.array([list(c.rule_rank) if c.rule_rank else None for c in choices], type=pa.list_(pa.int16())),
    }


def products_batch(items: Sequence[LoggedProduct], salt: bytes, sample_rate: float) -> pa.RecordBatch:
    """Product decisions: the shopper as for a decision, then each layer's candidates (ids hashed, features as the heads
    read them) and what it served, with its distribution. The features are computed here, on the writer thread."""
    n = len(items)
    reqs = [i.request for i in items]
    ds = [i.decision for i in items]
    chosen = [r.categories[d.category.index] for r, d in zip(reqs, ds, strict=True)]
    columns = {
        **_shopper_columns(items, [r.shopper for r in reqs], salt),
        "visit_count": pa.array([r.visit_count for r in reqs], type=pa.int32()),
        **_layer_columns("category", [[hash_id(c.category_id, salt, CATEGORY) for c in r.categories] for r in reqs],
                         [category_features(r.categories) for r in reqs], [d.category for d in ds]),
        **_layer_columns("sku", [[hash_id(k.sku_id, salt, SKU) for k in c.skus] for c in chosen],
                         [sku_features(c.skus) for c in chosen], [d.sku for d in ds]),
        **_layer_columns("price_band", [[hash_id(b.band_id, salt, BAND) for b in r.price_bands] for r in reqs],
                         [band_features(r.price_bands, c.skus[d.sku.index], r.visit_count == 1)
                          for r, c, d in zip(reqs, chosen, ds, strict=True)], [d.price_band for d in ds]),
        "joint_propensity": pa.array([d.joint_propensity for d in ds], type=pa.float64()),
        "model_version": pa.array([d.model_version for d in ds], type=pa.string()),
        "sample_rate": pa.array(np.full(n, sample_rate, dtype=np.float64)),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=PRODUCTS)
