"""The product decisions a CronJob run trains the heads on: the window's model versions, bounded, in two passes.

A ``products`` record carries every candidate's features (tens of KB a row on a real shelf), so reading the whole
history as ``train-products`` does would hold it all. ``read_products`` reads it as the flat window does:

1. a narrow pass (``session_id``, ``model_version``) over every product segment: the rows each session of the window's
   versions holds;
2. the sessions kept: every one the product gate holds out (``trainer.product_train``'s split, at most
   ``max_gate_rows`` rows of them) and, of the rest, whole sessions in the order of the sample's keyed hash up to
   ``max_rows`` (``trainer.product_train.sample_rows``'s order, so training on the result samples nothing more);
3. a wide pass that keeps those sessions' rows, batch by batch, and their outcomes.

So the peak holds what is trained and judged, not the history; a rerun on the same logs reads the same rows.
"""

from __future__ import annotations

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
                  max_rows: int, max_gate_rows: int) -> ProductWindow:
    """The product decisions of ``versions`` to train and judge on, and their sessions' outcomes (module doc)."""
    wanted = pa.array(sorted(set(versions)), type=pa.string())
    ids: list[pa.Array] = []
    for path in source.segments(PRODUCTS):
        for batch in source.segment_batches(path, PRODUCTS, ("session_id", "model_version")):
            ids.append(batch.column(0).filter(pc.is_in(batch.column(1), value_set=wanted)))
    sessions = np.asarray(pa.concat_arrays(ids).to_numpy(zero_copy_only=False), dtype=object) if ids else np.array([], object)
    keep = pa.array(sorted(chosen_sessions(sessions, gate_share, seed, gate_salt, max_rows, max_gate_rows)), type=pa.string())
    products = _rows(source, PRODUCTS, keep, wanted)
    outcomes = _rows(source, "outcomes", keep) if source.has("outcomes") else SCHEMAS["outcomes"].empty_table()
    return ProductWindow(products, outcomes, len(set(sessions.tolist())), len(sessions))


def _rows(source: DirectorySource, kind: str, sessions: pa.Array, versions: pa.Array | None = None) -> pa.Table:
    """The rows of ``kind`` of these sessions (and these model versions), one batch held at a time."""
    kept = []
    for batch in source.batches(kind):
        mask = pc.is_in(batch.column("session_id"), value_set=sessions)
        if versions is not None:
            mask = pc.and_(mask, pc.is_in(batch.column("model_version"), value_set=versions))
        if pc.any(mask).as_py():
            kept.append(batch.filter(mask))
    return pa.Table.from_batches(kept, schema=SCHEMAS[kind])
