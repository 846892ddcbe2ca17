"""Reading a run's logs in two passes, so what is held is the window's sample, not the whole history.

1. The narrow pass: ``session_id``, ``time_s`` and ``model_version`` of every logged decision,
   batch by batch, reduced as it goes to each session's first decision (``trainer.session_index``:
   one row a session, never a Python object per id). On them the run's window and sample are
   chosen (``trainer.window.choose``): which sessions it reads.
2. The wide pass: every segment again, each batch filtered to those sessions before it is kept,
   decisions and outcomes alike.

Peak memory is then the session index, the chosen sessions' rows and one segment, where reading
every segment whole (``DirectorySource.table``) holds every row ever logged (about 2 KB a
decision, most of it the item embedding). The result is the same window ``for_config`` gives on
the whole tables (tested), with the window's session count from before the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from core.progress import progress
from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from trainer.session_index import NARROW, SessionIndex
from trainer.window import Window, choose, settings_of, versions_by_first_time

GATHER_ROWS = 1 << 16


def read_window(source: DirectorySource, config: Any) -> Window:
    """The decisions and outcomes of ``config``'s window and sample, read in two passes (see the module doc)."""
    index = SessionIndex.of(batch.select(list(NARROW)) for batch in _read(source, "decisions", "read.narrow"))
    sessions, in_window = choose(index, config.window_hours, config.window_versions, config.max_sessions, config.sample_key)
    del index  # only the chosen ids are needed from here
    decisions = pa.Table.from_batches(list(_rows_of(_read(source, "decisions", "read.decisions"), sessions)),
                                      schema=SCHEMAS["decisions"])
    outcomes = pa.Table.from_batches(list(_rows_of(_read(source, "outcomes", "read.outcomes"), sessions)),
                                     schema=SCHEMAS["outcomes"])
    return Window(decisions, outcomes, versions_by_first_time(decisions), settings_of(config), in_window)


def _read(source: DirectorySource, kind: str, stage: str) -> Iterator[pa.RecordBatch]:
    """Every batch of ``kind``, segment by segment, with the stage's progress (segments and rows read)."""
    paths = source.segments(kind)
    with progress(stage, total=len(paths), unit="segment") as bar:
        for path in paths:
            rows = 0
            for batch in source.segment_batches(path, kind):
                rows += batch.num_rows
                yield batch
            bar.update(1, rows=rows)


def _rows_of(batches: Iterator[pa.RecordBatch], sessions: pa.ChunkedArray, rows: int = GATHER_ROWS) -> Iterator[pa.RecordBatch]:
    """The rows of these sessions, gathered into batches of about ``rows``: a sample keeps a few rows of each logged
    batch, and thousands of tiny batches would each hold their own buffers (and make every later column op slow)."""
    ids = sessions.combine_chunks()
    kept: list[pa.RecordBatch] = []
    held = 0
    for batch in batches:
        part = batch.filter(pc.is_in(batch.column("session_id"), ids))
        if part.num_rows:
            kept.append(part)
            held += part.num_rows
        if held >= rows:
            yield pa.concat_batches(kept)
            kept, held = [], 0
    if kept:
        yield pa.concat_batches(kept)
