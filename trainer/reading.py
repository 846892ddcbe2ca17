"""Reading a run's logs in two passes, so what is held is the window's sample, not the whole history.

1. The narrow pass: ``session_id``, ``time_s`` and ``model_version`` of every logged decision,
   segment by segment, reduced as it goes to each session's first decision (``trainer.session_index``:
   one row a session, never a Python object per id). On them the run's window and sample are
   chosen (``trainer.window.choose``): which sessions it reads.
2. The wide pass: the segments again, each filtered to those sessions before it is kept (one
   set lookup a segment), decisions, outcomes and (with ``engagement_weights``) engagement reports
   alike, the kept rows gathered into large batches.
   A decision segment whose newest row is older than the earliest first decision of the chosen
   sessions holds none of their rows (no decision of a session precedes its first), so it is not
   decoded again: the narrow pass noted each segment's newest ``time_s``. With a window (the last
   model version, the last hours) over a directory that keeps the whole history, the wide pass
   then decodes the window's segments, not every embedding ever logged. Outcome and engagement segments are
   all read (their rows carry no embeddings, and the server's ``received_s`` need not follow
   the decision's ``time_s`` across two servers' clocks); so is a segment the narrow pass did
   not see (one compacted in between is read from its parts).

Under torchrun each rank keeps only its shard of the chosen sessions (``shard``: those whose keyed
hash is ``rank`` modulo the world size), and the held-out side alone can be read for the gate
(``part``): the narrow pass is the same on every rank, so every rank chooses the same window and
sample, and the shards are disjoint and cover it.

Peak memory is then the session index, the chosen sessions' rows and one segment, where reading
every segment whole (``DirectorySource.table``) holds every row ever logged (about 2 KB a
decision, most of it the item embedding). The result is the same window ``for_config`` gives on
the whole tables (tested), with the window's session count from before the sample; ``for_config``
has no engagement reports to give (a run on whole tables with ``engagement_weights`` is warned that
every step weighs 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.progress import progress
from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from experience.sessions import session_hashes
from trainer.log_checks import DEFAULT_LIMITS, SessionLimits, usable
from trainer.session_index import NARROW, SessionIndex
from trainer.window import GateSessions, Window, digest_of, gate_sample, in_window, sample_of, settings_of, versions_by_first_time

GATHER_ROWS = 1 << 16


SHARD_SALT = b"rank-shard"  # independent of the sample's, the gate's and the guard's hashes


def shard_of(session_ids: pa.ChunkedArray | pa.Array, rank: int, world: int) -> npt.NDArray[np.bool_]:
    """Per session id: whether it is in ``rank``'s shard of ``world`` (a keyed hash modulo ``world``)."""
    if not 0 <= rank < world:
        raise ValueError(f"shard: expected 0 <= rank < world, got rank {rank} of {world}")
    ids = session_ids.to_numpy(zero_copy_only=False)
    return np.asarray(session_hashes(ids, SHARD_SALT) % np.uint64(world) == np.uint64(rank), dtype=np.bool_)


def read_window(source: DirectorySource, config: Any, shard: tuple[int, int] | None = None, serving: Sequence[str] = (),
                gate: bool = False) -> Window:
    """The decisions and outcomes of ``config``'s window and sample, read in two passes (see the module doc): of its
    sessions those of ``shard = (rank, world)``, else all of them. ``serving``: the versions served now, in a versions
    window whatever their age (``trainer.window``). With ``gate``, the window also names the gate's held-out sessions
    (``TrainConfig.gate_sessions``, of every shard), which ``read_gate`` reads when the gate runs."""
    newest: dict[str, float] = {}
    index = SessionIndex.of(read_segments(source, "decisions", "read.narrow", NARROW, newest=newest))
    window_ids = in_window(index, config.window_hours, config.window_versions, serving)
    sessions, window_count = sample_of(window_ids, config.max_sessions, config.sample_key)
    chosen = digest_of(sessions)
    judged = _gate_sessions(index, window_ids, newest, config) if gate else None
    del window_ids
    if shard is not None and shard[1] > 1:
        sessions = sessions.filter(pa.array(shard_of(sessions, *shard)))
    skip = older_than(newest, earliest_start(index, sessions))
    del index  # only the chosen ids are needed from here
    decisions = pa.Table.from_batches(list(rows_of(read_segments(source, "decisions", "read.decisions", skip=skip), sessions)),
                                      schema=SCHEMAS["decisions"])
    outcomes = pa.Table.from_batches(list(rows_of(read_segments(source, "outcomes", "read.outcomes"), sessions)),
                                     schema=SCHEMAS["outcomes"])
    decisions, outcomes, _ = usable(decisions, outcomes, source.spec, config.session_limits())  # sessions with rows no
    # server writes, or past the config's limits: left out
    engagements = SCHEMAS["engagements"].empty_table()  # none read unless the run weighs its rewards with them
    if config.engagement_weights is not None and source.has("engagements"):
        engagements = pa.Table.from_batches(list(rows_of(read_segments(source, "engagements", "read.engagements"), sessions)),
                                            schema=SCHEMAS["engagements"])
    return Window(decisions, outcomes, versions_by_first_time(decisions), settings_of(config, serving), window_count, chosen,
                  engagements, judged)


def _gate_sessions(index: SessionIndex, window: pa.ChunkedArray, newest: dict[str, float], config: Any) -> GateSessions:
    """The gate's sessions of the ``window`` (its session ids, before the sample; ``TrainConfig.gate_sessions``), and the
    segments that cannot hold them."""
    from trainer.data import heldout_sessions

    ids = gate_sample(window, lambda s: heldout_sessions(s, config.heldout_fraction, config.seed), config.gate_sessions,
                      config.sample_key)
    return GateSessions(ids, older_than(newest, earliest_start(index, ids)))


def read_gate(source: DirectorySource, gate: GateSessions, limits: SessionLimits = DEFAULT_LIMITS
              ) -> tuple[pa.Table, pa.Table]:
    """The decisions and outcomes of the gate's sessions (a third pass, after training: so training's peak memory does
    not hold them), without the sessions ``trainer.log_checks.usable`` leaves out (``limits``: the run's
    ``TrainConfig.session_limits()``)."""
    decisions = pa.Table.from_batches(list(rows_of(read_segments(source, "decisions", "read.gate", skip=gate.skip), gate.ids)),
                                      schema=SCHEMAS["decisions"])
    outcomes = pa.Table.from_batches(list(rows_of(read_segments(source, "outcomes", "read.gate-outcomes"), gate.ids)),
                                     schema=SCHEMAS["outcomes"])
    decisions, outcomes, _ = usable(decisions, outcomes, source.spec, limits)
    return decisions, outcomes


def earliest_start(index: SessionIndex, sessions: pa.ChunkedArray) -> float | None:
    """The earliest first-decision ``time_s`` of these sessions: ``inf`` when there are none (no segment can hold a
    row of theirs), None when one of them has no finite time (then nothing may be left out)."""
    if len(sessions) == 0:
        return math.inf
    return earliest_time(index.sessions.filter(pc.is_in(index.sessions.column("session_id"), sessions.combine_chunks()))
                         .column("time_s"))


def earliest_time(times: pa.ChunkedArray) -> float | None:
    """The earliest of these ``time_s``: None when there are none, or when one of them is null or not finite (a time
    that orders nothing, never logged by a server's clock: then nothing may be left out by time)."""
    if len(times) == 0 or _orders_nothing(times):
        return None
    return float(pc.min(times).as_py())


def newest_time(table: pa.Table) -> float:
    """A segment's newest ``time_s``: ``-inf`` without rows (nothing of any session there), ``inf`` when any of its times
    is null or not finite (Arrow's max would pass over those rows, and the segment must then always be read)."""
    if table.num_rows == 0:
        return -math.inf
    times = table.column("time_s")
    return math.inf if _orders_nothing(times) else float(pc.max(times).as_py())


def _orders_nothing(times: pa.ChunkedArray) -> bool:
    """Whether any of these times is null or not finite (Arrow's min and max pass over such values)."""
    return bool(times.null_count) or bool(pc.any(pc.invert(pc.is_finite(times))).as_py())


def older_than(newest: dict[str, float], start: float | None) -> frozenset[str]:
    """The segments whose newest decision is before ``start``: none of their rows belongs to a session that began at or
    after it. ``start`` None: none is left out."""
    if start is None:
        return frozenset()
    return frozenset(path for path, t in newest.items() if t < start)


def read_segments(source: DirectorySource, kind: str, stage: str, columns: tuple[str, ...] | None = None, *,
          newest: dict[str, float] | None = None, skip: frozenset[str] = frozenset(),
          paths: list[str] | None = None) -> Iterator[pa.Table]:
    """Each segment of ``kind`` (of ``paths``, when given: say the segments an earlier pass listed, so none written since
    is read; else the source's listing now) but those in ``skip`` as one table (only ``columns``, when given, kept from
    each batch as it is read), with the stage's progress (segments read and left out, rows read); ``newest``, when
    given, gets each segment's newest ``time_s``. A segment at a time, not a batch at a time: the recorder writes small batches, and
    every filter on a batch would build its set of session ids again."""
    paths = source.segments(kind) if paths is None else paths
    schema = SCHEMAS[kind] if columns is None else pa.schema([SCHEMAS[kind].field(c) for c in columns])
    with progress(stage, total=len(paths), unit="segment") as bar:
        for path in paths:
            if path in skip:
                bar.update(1, skipped=1)
                continue
            batches = list(source.segment_batches(path, kind, columns))  # a columnar part reads only these
            table = pa.Table.from_batches(batches, schema=schema)
            del batches
            if newest is not None:
                newest[path] = newest_time(table)
            bar.update(1, rows=table.num_rows)
            yield table
            del table  # one decoded segment alive at a time, not two


def rows_of(segments: Iterator[pa.Table], sessions: pa.ChunkedArray, rows: int = GATHER_ROWS) -> Iterator[pa.RecordBatch]:
    """The rows of these sessions, gathered into batches of at least ``rows`` (the last: what is left): a sample keeps
    a few rows of each logged batch, and thousands of tiny batches would each hold their own buffers (and make every
    later column op slow)."""
    ids = sessions.combine_chunks()
    kept: list[pa.RecordBatch] = []
    held = 0
    for table in segments:
        part = table.filter(pc.is_in(table.column("session_id"), ids))
        if part.num_rows:
            kept.extend(part.to_batches())
            held += part.num_rows
        del table, part
        if held >= rows:
            yield pa.concat_batches(kept)
            kept, held = [], 0
    if kept:
        yield pa.concat_batches(kept)
