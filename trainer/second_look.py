"""A second look at a candidate the gate refused: judged again, one cycle later, on logs it never saw.

Why. The gate judges a candidate on the held-out share of one window (20 % of a cycle's
sessions). The business objective per session is noisy (order values), so a candidate a few
currency units per session better, the gain one trust-region step brings, can sit inside the
interval and be refused: in ``bench.loop`` the refused candidates of cycles 3–5 were +2.2 to
+3.4 better by the simulator's truth while the gate's intervals were ±5–6 wide. The next
cycle's logs are served by the same bundle and the candidate never saw them: a judge about
six times the size.

How (``trainer.cycle``). A refused candidate is kept in the weights directory
(``WeightsStore.hold``, validated as a publish is; servers never read it). The next run,
before training, looks at it once more if it was trained from the bundle now active: new and
current are evaluated on the window's sessions the candidate never trained on
(``candidate_record``, ``unseen_sessions``: those first logged after the newest record it read,
``trainer.window.newest_time_s`` in its manifest, and those its own split held out) and gated
as before, with the interval at ``TrainConfig.second_look_level`` and at least 1,000
bootstrap resamples. Passed: it is published, with this look's estimates in its manifest, and
the run ends (the next cycle trains from it, on its own logs). Refused, stale (trained from
another bundle, or without the manifest fields) or unreadable: dropped, and the run trains a
new candidate as always. While fewer sessions than its first look had have been logged since,
it waits (kept; the run trains as always, and a new refused candidate replaces it).

What makes "never saw" true: the logs are append-only and a session's id is stable between
runs. A run reads whole sessions (``trainer.window``), so every session it trained on was first
logged at or before the newest record it read; pruning a session's early segments, or ids
rehashed with another salt between the runs, would break that (the trainer never prunes and
the salt is kept next to the logs).

Error rate, nominally. Each candidate is looked at twice at most: first at the gate's level
(the paired lower bound is one-sided 97.5 %), then at ``second_look_level`` (0.99: one-sided
99.5 %). By the union bound a candidate worse by more than ``tolerance`` (0) is published with
probability at most 2.5 % + 0.5 % = 3 %, against 2.5 % for one look; the percentile bootstrap
and the truncated weights make both figures approximate (``bench.gate_calibration`` measures
the first look's coverage).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from trainer.data import heldout_sessions
from trainer.session_index import SessionIndex
from trainer.window import Window, sessions_of


@dataclass(frozen=True, slots=True)
class Record:
    """What a kept candidate's manifest says about the logs it trained on."""

    newest_time_s: float
    """The newest ``time_s`` it read (``trainer.window.newest_time_s``)."""
    heldout_fraction: float
    seed: int
    """With ``heldout_fraction``: the split that held its gate's sessions out (``trainer.data.split``)."""


@dataclass(frozen=True, slots=True)
class Unseen:
    """The sessions of a window a candidate never trained on."""

    decisions: pa.Table
    outcomes: pa.Table
    newest_time_s: float
    """The newest ``time_s`` the candidate read."""
    n_fresh: int
    """Sessions first logged after ``newest_time_s``."""
    n_heldout: int
    """Sessions first logged before it that the candidate's own split held out."""

    def describe(self) -> dict[str, Any]:
        return {"newest_time_s": self.newest_time_s, "fresh_sessions": self.n_fresh, "heldout_sessions": self.n_heldout}


def candidate_record(manifest: dict[str, Any], current_version: str, same_flat_as: Sequence[str] = ()) -> Record | str:
    """What the kept candidate read, or why it cannot be judged against ``current_version`` (it is stale).
    ``same_flat_as``: the versions whose flat decision the current bundle serves byte for byte (new product heads
    published alone, ``trainer.cycle_products``): a candidate trained from one of them is not stale."""
    trainer = manifest.get("trainer")
    if not isinstance(trainer, dict):
        return "its manifest has no trainer record"
    init = trainer.get("init_model_version")
    if init != current_version and init not in same_flat_as:
        return f"it was trained from {init!r}, not from the active {current_version!r}"
    window = trainer.get("window")
    newest = window.get("newest_time_s") if isinstance(window, dict) else None
    if isinstance(newest, bool) or not isinstance(newest, int | float) or not math.isfinite(newest):
        return "its manifest does not say which logs it read (trainer.window.newest_time_s)"
    config = trainer.get("config")
    fraction, seed = (config.get("heldout_fraction"), config.get("seed")) if isinstance(config, dict) else (None, None)
    if (isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction < 1.0
            or isinstance(seed, bool) or not isinstance(seed, int)):
        values = {"heldout_fraction": fraction, "seed": seed} if isinstance(config, dict) else None
        return f"its manifest's trainer.config has no valid heldout_fraction in (0, 1) and integer seed: {values!r}"
    return Record(float(newest), float(fraction), seed)


def unseen_sessions(window: Window, record: Record) -> Unseen:
    """The whole sessions of ``window`` the candidate of ``record`` never trained on."""
    after = record.newest_time_s
    if window.decisions.num_rows == 0:
        return Unseen(window.decisions, window.outcomes, after, 0, 0)
    first = SessionIndex.of([window.decisions]).sessions  # each session's first decision
    ids = first.column("session_id")
    fresh = first.column("time_s").to_numpy() > after
    held = heldout_sessions(ids, record.heldout_fraction, record.seed)
    keep = fresh | held
    d, o = sessions_of(window.decisions, window.outcomes, ids.filter(pa.array(keep)))
    return Unseen(d, o, after, int(fresh.sum()), int((held & ~fresh).sum()))
