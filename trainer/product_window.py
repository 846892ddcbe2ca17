"""The product decisions a CronJob run trains the heads on: the window's model versions, bounded, in two passes.

A ``products`` record carries every candidate's features (tens of KB a row on a real shelf), so reading the whole
history as ``train-products`` does would hold it all. ``read_products`` reads it as the flat window does:

1. a narrow pass (``session_id``, ``model_version``, ``time_s``) over every product segment: the rows each session of
   the window's versions holds from the window's start on (``since``, the flat window's earliest decision), and each
   segment's newest time;
2. the sessions kept: every one the product gate holds out (``trainer.product_train``'s split, at most
   ``max_gate_rows`` rows of them) and, of the rest, whole sessions in the order of the sample's keyed hash up to
   ``max_rows`` (``trainer.product_train.sample_rows``'s order, so training on the result samples nothing more);
3. a wide pass over the segments the first pass listed that keeps those sessions' rows, batch by batch (a segment
   older than their earliest row is not read), and their outcomes.

So the peak holds what is trained and judged, not the history; a rerun on the same logs reads the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from experience.sessions import session_codes, session_hashes, split_by_session
from trainer.window import SAMPLE_SALT

PRODUCTS = "products"


@dataclass(frozen=True)
class ProductWindow:
    products: pa.Table
    outcomes: pa.Table
    sessions_in_window: int
    rows_in_window: int

    def describe(self) -> dict[str, int]:
        return {"sessions_in_window": self.sessions_in_window, "rows_in_window": self.rows_in_window,
                "rows_read": self.products.num_rows}


def chosen_sessions(sessions: np.ndarray, gate_share: float, seed: int, gate_salt: bytes, max_rows: int,
                    max_gate_rows: int) -> set[str]:
    """The sessions to read of the window's rows (``sessions``: one id per row): the gate's side and the training side,
    each filled with whole sessions in the keyed-hash order up to its row budget."""
    distinct, which = session_codes(sessions)
    if not distinct:
        return set()
    held_row = split_by_session(sessions, gate_share, seed, gate_salt)
    held = np.zeros(len(distinct), dtype=np.bool_)
    held[which[held_row]] = True
    sizes = np.bincount(which, minlength=len(distinct))
    order = np.argsort(session_hashes(distinct, SAMPLE_SALT + int(seed).to_bytes(8, "little", signed=True)), kind="stable")
    keep = np.zeros(len(distinct), dtype=np.bool_)
    room = {True: max_gate_rows, False: max_rows}
    for code in order.tolist():
        side = bool(held[code])
        if sizes[code] <= room[side]:  # a smaller session further on may still fit
            keep[code], room[side] = True, room[side] - int(sizes[code])
    return {distinct[i] for i in np.flatnonzero(keep).tolist()}


def read_products(source: DirectorySource, versions: Collection[str], *, gate_share: float, seed: int, gate_salt: bytes,
                  max_rows: int, max_gate_rows: int, since: float | None = None) -> ProductWindow:
    """The product decisions of ``versions`` (from ``since`` on, when given) to train and judge on, and their sessions'
    outcomes (module doc)."""
    wanted = pa.array(sorted(set(versions)), type=pa.string())
    ids: list[pa.Array] = []
    times: list[pa.Array] = []
    newest: dict[str, float] = {}
    for path in source.segments(PRODUCTS):
        newest[path] = -math.inf
        for batch in source.segment_batches(path, PRODUCTS, ("session_id", "model_version", "time_s")):
            t = batch.column(2)
            if len(t):
                top = pc.max(t).as_py()
                newest[path] = max(newest[path], top if top is not None and math.isfinite(top) else math.inf)
            mask = pc.is_in(batch.column(1), value_set=wanted)
            if since is not None:
                mask = pc.and_(mask, pc.greater_equal(t, since))
            ids.append(batch.column(0).filter(mask))
            times.append(t.filter(mask))
    sessions = np.asarray(pa.concat_arrays(ids).to_numpy(zero_copy_only=False), dtype=object) if ids else np.array([], object)
    keep = pa.array(sorted(chosen_sessions(sessions, gate_share, seed, gate_salt, max_rows, max_gate_rows)), type=pa.string())
    if len(keep):
        kept_times = pa.concat_arrays(times).filter(pc.is_in(pa.array(sessions, type=pa.string()), value_set=keep))
        earliest = pc.min(kept_times).as_py()
        start = earliest if earliest is not None and math.isfinite(earliest) else -math.inf
    else:
        start = math.inf  # nothing to read
    listed = [path for path, t in newest.items() if t >= start]  # the segments of the first pass: none that came since
    products = _rows(source, PRODUCTS, keep, wanted, listed, since)
    outcomes = _rows(source, "outcomes", keep) if source.has("outcomes") else SCHEMAS["outcomes"].empty_table()
    return ProductWindow(products, outcomes, len(set(sessions.tolist())), len(sessions))


def _rows(source: DirectorySource, kind: str, sessions: pa.Array, versions: pa.Array | None = None,
          paths: list[str] | None = None, since: float | None = None) -> pa.Table:
    """The rows of ``kind`` of these sessions (and these model versions, from ``since`` on) in ``paths`` (default every
    segment), one batch held at a time."""
    kept = []
    if len(sessions):
        for path in source.segments(kind) if paths is None else paths:
            for batch in source.segment_batches(path, kind):
                mask = pc.is_in(batch.column("session_id"), value_set=sessions)
                if versions is not None:
                    mask = pc.and_(mask, pc.is_in(batch.column("model_version"), value_set=versions))
                if since is not None:
                    mask = pc.and_(mask, pc.greater_equal(batch.column("time_s"), since))
                if pc.any(mask).as_py():
                    kept.append(batch.filter(mask))
    return pa.Table.from_batches(kept, schema=SCHEMAS[kind])
