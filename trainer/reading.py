"""Reading a run's logs in two passes, so what is held is the window's sample, not the whole history.

1. The narrow pass: ``session_id``, ``time_s`` and ``model_version`` of every logged decision,
   segment by segment (three columns, about 100 bytes a decision). On them the run's window and
   sample are chosen (``trainer.window.for_config``): which sessions it reads.
2. The wide pass: every segment again, each batch filtered to those sessions before it is kept,
   decisions and outcomes alike.

Peak memory is then the narrow columns, the chosen sessions' rows and one segment, where reading
every segment whole (``DirectorySource.table``) holds every row ever logged (about 2 KB a
decision, most of it the item embedding). The result is the same window ``for_config`` gives on
the whole tables (tested), with the window's session count from before the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from trainer.window import Window, for_config

NARROW = ("session_id", "time_s", "model_version")


def read_window(source: DirectorySource, config: Any) -> Window:
    """The decisions and outcomes of ``config``'s window and sample, read in two passes (see the module doc)."""
    narrow_schema = pa.schema([SCHEMAS["decisions"].field(name) for name in NARROW])
    narrow = pa.Table.from_batches([batch.select(list(NARROW)) for batch in source.batches("decisions")], schema=narrow_schema)
    chosen = for_config(narrow, SCHEMAS["outcomes"].empty_table(), config)
    sessions = pc.unique(chosen.decisions.column("session_id"))
    del narrow  # only the chosen ids are needed from here
    decisions = pa.Table.from_batches(list(_rows_of(source.batches("decisions"), sessions)), schema=SCHEMAS["decisions"])
    outcomes = pa.Table.from_batches(list(_rows_of(source.batches("outcomes"), sessions)), schema=SCHEMAS["outcomes"])
    return Window(decisions, outcomes, chosen.versions, chosen.settings, chosen.sessions_in_window)


def _rows_of(batches: Iterator[pa.RecordBatch], sessions: pa.Array) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        kept = batch.filter(pc.is_in(batch.column("session_id"), sessions))
        if kept.num_rows:
            yield kept
