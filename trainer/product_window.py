"""The product decisions a CronJob run trains the heads on: the window's model versions, bounded, in two passes.

A ``products`` record carries every candidate's features (tens of KB a row on a real shelf), so reading the whole
history as ``train-products`` does would hold it all. ``read_products`` reads it as the flat window does:

1. a narrow pass (``session_id``, ``model_version``, ``time_s``) over every product segment
   (``trainer.reading.read_segments``): the rows each session of the window's versions holds from the window's start
   on (``since``, the flat window's earliest decision), and each segment's newest time;
2. the sessions kept: of those the product gate holds out (``trainer.product_train``'s split) and of the rest, whole
   sessions in the order of the sample's keyed hash up to ``max_gate_rows`` and ``max_rows`` rows
   (``trainer.product_train.fill_sessions``, which ``train_products`` samples with too: it then samples nothing more);
3. a wide pass over the segments the first pass listed (``trainer.reading.rows_of``; a segment older than the kept
   sessions' earliest row is not read) that keeps those sessions' rows, and their outcomes.

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
from experience.sessions import session_codes, split_by_session
from trainer.product_train import fill_sessions
from trainer.reading import earliest_time, older_than, read_segments, rows_of

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
    each filled by ``fill_sessions`` up to its row budget."""
    distinct, which = session_codes(sessions)
    if not distinct:
        return set()
    held = np.zeros(len(distinct), dtype=np.bool_)
    held[which[split_by_session(sessions, gate_share, seed, gate_salt)]] = True
    sizes = np.bincount(which, minlength=len(distinct))
    keep = fill_sessions(distinct, sizes, max_gate_rows, seed, held) | fill_sessions(distinct, sizes, max_rows, seed, ~held)
    return {distinct[i] for i in np.flatnonzero(keep).tolist()}


def read_products(source: DirectorySource, versions: Collection[str], *, gate_share: float, seed: int, gate_salt: bytes,
                  max_rows: int, max_gate_rows: int, since: float | None = None) -> ProductWindow:
    """The product decisions of ``versions`` (from ``since`` on, when given) to train and judge on, and their sessions'
    outcomes (module doc)."""
    wanted = pa.array(sorted(set(versions)), type=pa.string())
    narrow: list[pa.Table] = []
    newest: dict[str, float] = {}
    for table in read_segments(source, PRODUCTS, "read.products-narrow", ("session_id", "model_version", "time_s"),
                               newest=newest):
        narrow.append(table.filter(_in_window(table, wanted, since)))
    rows = pa.concat_tables(narrow) if narrow else SCHEMAS[PRODUCTS].empty_table().select(["session_id", "time_s"])
    sessions = np.asarray(rows.column("session_id").to_numpy(), dtype=object)
    keep = pa.chunked_array([sorted(chosen_sessions(sessions, gate_share, seed, gate_salt, max_rows, max_gate_rows))],
                            type=pa.string())
    start = math.inf if not len(keep) else earliest_time(rows.filter(pc.is_in(rows.column("session_id"),
                                                                               keep.combine_chunks())).column("time_s"))
    segments = read_segments(source, PRODUCTS, "read.products", paths=list(newest), skip=older_than(newest, start))
    products = pa.Table.from_batches([b.filter(_in_window(b, wanted, since)) for b in rows_of(segments, keep)],
                                     schema=SCHEMAS[PRODUCTS])
    outcomes = (pa.Table.from_batches(list(rows_of(read_segments(source, "outcomes", "read.product-outcomes"), keep)),
                                      schema=SCHEMAS["outcomes"]) if len(keep) and source.has("outcomes")
                else SCHEMAS["outcomes"].empty_table())
    return ProductWindow(products, outcomes, len(set(sessions.tolist())), len(sessions))


def _in_window(rows: pa.Table | pa.RecordBatch, versions: pa.Array, since: float | None) -> pa.Array:
    """Rows of these model versions, from ``since`` on."""
    mask = pc.is_in(rows.column("model_version"), value_set=versions)
    return mask if since is None else pc.and_(mask, pc.greater_equal(rows.column("time_s"), since))
