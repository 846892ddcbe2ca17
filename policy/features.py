"""The feature encoder: a request becomes the policy's state vector.

state = item embedding (item_dim, 768) | behaviour embedding (behavior_dim, 128) | hour one-hot (24)

The behaviour embedding is the mean of hashing-trick rows for the first ``window`` (3)
recent behaviour ids (most recent first); zeros when there are none. An id's row is
``blake2b_64(id) mod buckets``; the table ships in the bundle. The hour is the local hour
of ``event_time`` in the configured timezone.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

import numpy as np
import numpy.typing as npt

from core.conditions import SchemaError
from core.domain import Context, DecisionRequest

HASH_NAME = "blake2b64-mod"
HOURS = 24
_GATHER_ROWS = 16384  # encode_columns: rows of behaviour vectors gathered at once (16,384 x window x dim floats)
MAX_BEHAVIOR_WINDOW = 64
"""The most recent behaviours a bundle's state may average (``behavior_window``; twice the ids a request may carry by
default). Each batch gathers batch × window vectors of ``behavior_dim``, and nothing else bounds the window: a bundle of
window 100,000 passed every check, and its first batches took a server from 138 MB to 2.7 GB (a review, 2026-12-07)."""
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    item_dim: int = 768
    behavior_dim: int = 128
    behavior_buckets: int = 2048
    behavior_window: int = 3
    behavior_hash: str = HASH_NAME

    @property
    def state_dim(self) -> int:
        return self.item_dim + self.behavior_dim + HOURS

    @classmethod
    def parse(cls, spec: Any, where: str = "feature_spec") -> FeatureSpec:
        if not isinstance(spec, dict):
            raise SchemaError(f"{where}: expected an object")
        known = {"item_dim", "behavior_dim", "behavior_buckets", "behavior_window", "behavior_hash", "hour_dim", "state_dim"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise SchemaError(f"{where}: unknown key(s) {unknown}")
        values: dict[str, Any] = {}
        for key in ("item_dim", "behavior_dim", "behavior_buckets", "behavior_window"):
            v = spec.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SchemaError(f"{where}.{key}: expected a positive integer, got {v!r}")
            values[key] = v
        if values["behavior_window"] > MAX_BEHAVIOR_WINDOW:
            raise SchemaError(f"{where}.behavior_window: expected at most {MAX_BEHAVIOR_WINDOW}, got {values['behavior_window']}")
        if spec.get("behavior_hash") != HASH_NAME:
            raise SchemaError(f"{where}.behavior_hash: only {HASH_NAME!r} is supported, got {spec.get('behavior_hash')!r}")
        out = cls(**values)
        if spec.get("hour_dim", HOURS) != HOURS or spec.get("state_dim", out.state_dim) != out.state_dim:
            raise SchemaError(f"{where}: hour_dim must be {HOURS} and state_dim {out.state_dim}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "item_dim": self.item_dim, "behavior_dim": self.behavior_dim,
            "behavior_buckets": self.behavior_buckets, "behavior_window": self.behavior_window,
            "behavior_hash": self.behavior_hash, "hour_dim": HOURS, "state_dim": self.state_dim,
        }


def local_hour(event_time_s: float, tz: tzinfo) -> int:
    return datetime.fromtimestamp(event_time_s, tz).hour


def context_of(req: DecisionRequest, tz: tzinfo) -> Context:
    """The rule-visible features of a request; the hour is local to ``tz``."""
    return Context(req.page_type, req.cart_item_count, local_hour(req.event_time_s, tz), len(req.recent_behavior_ids))


BUCKET_CACHE = 8192  # ids remembered: a session's recent behaviours repeat from page to page; bounded (ids are at most
# --max-id-length, 256 characters: about 3 MB at worst), so a client sending new ids every time only causes evictions


@functools.lru_cache(maxsize=BUCKET_CACHE)
def bucket(behavior_id: str, buckets: int) -> int:
    """The hashing-trick row of ``behavior_id``: a keyless BLAKE2b of it, modulo ``buckets`` (1 µs; 0.1 µs remembered)."""
    return int.from_bytes(hashlib.blake2b(behavior_id.encode(), digest_size=8).digest(), "little") % buckets


def behavior_buckets(behavior_ids: Sequence[str], spec: FeatureSpec) -> list[int]:
    """The hashing-trick rows the encoder reads for these behaviour ids (most recent first).

    ``bucket(id, spec.behavior_buckets)`` of the first ``spec.behavior_window`` ids: the whole
    behaviour input of the state, so the decision log keeps these instead of the ids.
    """
    return [bucket(b, spec.behavior_buckets) for b in behavior_ids[: spec.behavior_window]]


class FeatureEncoder:
    def __init__(self, spec: FeatureSpec, behavior_table: F32) -> None:
        if behavior_table.shape != (spec.behavior_buckets, spec.behavior_dim):
            raise ValueError(
                f"behavior table: expected shape {(spec.behavior_buckets, spec.behavior_dim)}, got {behavior_table.shape}"
            )
        self.spec = spec
        self._padded = np.vstack([behavior_table, np.zeros((1, spec.behavior_dim), dtype=np.float32)])
        self._behavior_at = spec.item_dim
        self._hour_at = spec.item_dim + spec.behavior_dim

    @property
    def behavior_table(self) -> F32:
        """The bundle's hashing-trick table (without the zero padding row)."""
        return self._padded[:-1]

    def encode_batch(self, reqs: Sequence[DecisionRequest], hours: Sequence[int]) -> F32:
        """States for a batch, shape (N, state_dim): one gather for all behaviour rows."""
        spec = self.spec
        n = len(reqs)
        out = np.zeros((n, spec.state_dim), dtype=np.float32)
        for i, req in enumerate(reqs):  # straight into the batch: no intermediate stack
            out[i, : spec.item_dim] = req.item_embedding
        window = spec.behavior_window
        rows = np.full((n, window), spec.behavior_buckets, dtype=np.int64)  # the padding row is zeros
        counts = np.ones(n, dtype=np.float32)
        for i, req in enumerate(reqs):
            if req.recent_behavior_ids:
                indices = behavior_buckets(req.recent_behavior_ids, spec)
                rows[i, : len(indices)] = indices
                counts[i] = len(indices)
        out[:, self._behavior_at : self._hour_at] = self._padded[rows].sum(axis=1) / counts[:, None]
        out[np.arange(n), self._hour_at + np.asarray(hours, dtype=np.int64)] = 1.0
        return out

    def encode_columns(self, buckets: Sequence[Sequence[int]], hours: npt.NDArray[np.int64]) -> F32:
        """``encode_batch`` from columns (logged decisions): ``buckets`` per row as ``behavior_buckets`` gives them;
        the item part left zero for the caller to fill (``trainer.replay`` writes it chunk by chunk from the log's
        column, never widening the whole float16 column at once)."""
        spec = self.spec
        n = len(hours)
        out = np.zeros((n, spec.state_dim), dtype=np.float32)
        window = spec.behavior_window
        rows = np.full((n, window), -1, dtype=np.int64)
        counts = np.ones(n, dtype=np.float32)
        for i, indices in enumerate(buckets):
            indices = indices[:window]
            if len(indices):
                rows[i, : len(indices)] = indices
                counts[i] = len(indices)
        if (rows >= spec.behavior_buckets).any() or (rows < -1).any():
            raise ValueError(f"behaviour buckets: expected indices in 0..{spec.behavior_buckets - 1}")
        rows[rows < 0] = spec.behavior_buckets  # the padding row is zeros
        for lo in range(0, n, _GATHER_ROWS):  # the gathered (rows, window, behavior_dim) block, a chunk at a time
            hi = min(n, lo + _GATHER_ROWS)
            out[lo:hi, self._behavior_at : self._hour_at] = self._padded[rows[lo:hi]].sum(axis=1) / counts[lo:hi, None]
        out[np.arange(n), self._hour_at + hours] = 1.0
        return out

    def encode(self, req: DecisionRequest, hour: int) -> F32:
        return self.encode_batch([req], [hour])[0]
