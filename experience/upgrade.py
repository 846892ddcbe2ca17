"""Older log segments read as the current schema: version 1 (raw ids on disk) becomes version 2 on read.

A version-1 decision row gets its ids hashed exactly as the writer hashes them today
(``experience.records``) and its ``recent_behavior_ids`` turned into the buckets the encoder
reads (``policy.features.behavior_buckets`` under ``V1Reading.spec``), so old logs still
train and join. The hashes match those of version-2 rows only under the same salt: with the
servers' salt a session that spans the upgrade stays one session; without it (``salt=b""``,
an unkeyed hash, in memory only) its version-1 and version-2 rows are two sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from core.domain import N_ACTIONS
from experience.kinds import DECISIONS_KIND, OUTCOMES_KIND
from experience.records import ITEM, OUTCOME, REQUEST, SESSION, hash_id, outcome_decision_id
from policy.features import FeatureSpec, behavior_buckets

_V1_DECISION_FIELDS = [
    ("schema_version", pa.int16()), ("decision_id", pa.string()), ("time_s", pa.float64()), ("event_time_s", pa.float64()),
    ("session_id", pa.string()), ("user_hash", pa.string()), ("item_id", pa.string()), ("request_id", pa.string()),
    ("item_embedding", pa.list_(pa.float16())), ("recent_behavior_ids", pa.list_(pa.string())), ("page_type", pa.int8()),
    ("cart_item_count", pa.int32()), ("hour", pa.int8()), ("action", pa.int8()), ("source", pa.int8()),
    ("propensity", pa.float64()), ("votes", pa.int16()), ("samples", pa.int16()),
    ("served_probs", pa.list_(pa.float64(), N_ACTIONS)), ("policy_probs", pa.list_(pa.float64(), N_ACTIONS)),
    ("allow_probs", pa.list_(pa.float64(), N_ACTIONS)), ("blocked", pa.list_(pa.bool_(), N_ACTIONS)),
    ("vetoed", pa.list_(pa.bool_(), N_ACTIONS)), ("guardrail_hits", pa.list_(pa.string())), ("rule", pa.string()),
    ("model_version", pa.string()), ("sample_rate", pa.float64()),
]
_V1_OUTCOME_FIELDS = [
    ("schema_version", pa.int16()), ("outcome_id", pa.string()), ("decision_id", pa.string()), ("session_id", pa.string()),
    ("outcome", pa.int8()), ("value", pa.float64()), ("coupon_discount", pa.float64()), ("event_time_s", pa.float64()),
    ("received_s", pa.float64()), ("sample_rate", pa.float64()),
]
V1_SCHEMAS = {
    DECISIONS_KIND: pa.schema([pa.field(n, t, nullable=False) for n, t in _V1_DECISION_FIELDS],
                              metadata={"kind": DECISIONS_KIND, "schema_version": "1"}),
    OUTCOMES_KIND: pa.schema([pa.field(n, t, nullable=False) for n, t in _V1_OUTCOME_FIELDS],
                             metadata={"kind": OUTCOMES_KIND, "schema_version": "1"}),
}
"""The version-1 schemas, as the writer of that version wrote them (for readers and tests)."""


@dataclass(frozen=True, slots=True)
class V1Reading:
    """How version-1 segments are brought to the current schema."""

    salt: bytes = b""
    """The servers' salt (the key of their ``user_hash``): ids hash as version-2 rows do. Empty: an unkeyed hash."""
    spec: FeatureSpec = field(default_factory=FeatureSpec)
    """The feature spec whose buckets the behaviour ids become (the bundle that will read the states)."""


def segment_version(batch: pa.RecordBatch) -> int:
    """The schema version of a batch: its segment's metadata, else its ``schema_version`` column."""
    metadata = batch.schema.metadata or {}
    if b"schema_version" in metadata:
        return int(metadata[b"schema_version"])
    column = batch.column("schema_version") if "schema_version" in batch.schema.names else None
    return int(column[0].as_py()) if column is not None and len(column) else 1


def _hashed(column: pa.Array, salt: bytes, person: bytes) -> pa.Array:
    return pa.array([hash_id(v, salt, person) for v in column.to_pylist()], type=pa.string())


def upgrade_v1(batch: pa.RecordBatch, kind: str, reading: V1Reading) -> pa.RecordBatch:
    """A version-1 batch in version-2 columns (the caller conforms it to the current schema)."""
    salt = reading.salt
    names = batch.schema.names
    columns = dict(zip(names, batch.columns, strict=True))
    if kind == OUTCOMES_KIND:
        columns["outcome_id"] = _hashed(columns["outcome_id"], salt, OUTCOME)
        columns["decision_id"] = pa.array([outcome_decision_id(v, salt) for v in columns["decision_id"].to_pylist()],
                                          type=pa.string())
        columns["session_id"] = _hashed(columns["session_id"], salt, SESSION)
        return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    columns["session_id"] = _hashed(columns["session_id"], salt, SESSION)
    columns["item_id"] = _hashed(columns["item_id"], salt, ITEM)
    columns["request_id"] = _hashed(columns["request_id"], salt, REQUEST)
    ids = columns.pop("recent_behavior_ids").to_pylist()
    columns["behavior_bucket_indices"] = pa.array([behavior_buckets(row, reading.spec) for row in ids], type=pa.list_(pa.int32()))
    columns["behavior_bucket_count"] = pa.array([reading.spec.behavior_buckets] * len(ids), type=pa.int32())
    columns["n_recent_behaviors"] = pa.array([len(row) for row in ids], type=pa.int32())
    return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
