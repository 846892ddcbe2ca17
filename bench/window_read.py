"""A run's window over a log directory that keeps the whole history: what the history costs the read.

    .venv/bin/python -m bench.window_read                 # 5 versions of 10,000 sessions (~2 min to generate, kept)
    .venv/bin/python -m bench.window_read --versions 10   # a longer history
    .venv/bin/python -m bench.window_read --json          # also write bench/results/window_read.json

The CronJob appends to one directory, and the default window is the last model version
(``window_versions = 1``). The logs are real: ``--versions`` bundles, one after the other, each
serving ``--sessions`` sessions of the simulator through the server's decision code and its
``ExperienceRecorder`` into ``--data`` (default ``bench/results/window-<versions>x<sessions>``,
kept between runs; delete it to regenerate). Then, timed in one process, ``read_window`` of the
last version's window:

1. **baseline**: a directory holding the last version's segments only (copied from the history):
   what the window itself costs to read;
2. **history**: the whole directory, as the trainer reads it (the wide pass leaves out the
   decision segments older than the window's first session, ``trainer.reading``);
3. **history, every segment decoded**: the same read with that pruning turned off (the
   trainer's read before it), for the ratio it saves.

All three must give the same window (checked). The ratios say what the history adds: the narrow
pass reads three columns of every decision ever logged, and a stream segment has no column
index, so it is decoded whole there; compacted parts (``logs compact``) read only those columns.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock
from zoneinfo import ZoneInfo

import pyarrow as pa

from bench.procs import REPO
from bench.report import INFO_NAME, add_json_flag, header, kept_logs, write_results
from experience.recorder import resolve_salt
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from trainer import reading
from trainer.config import TrainConfig
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


def generate(root: Path, versions: int, sessions: int, seed: int) -> dict[str, Any]:
    """``versions`` bundles one after the other, each logging ``sessions`` sessions; each version's segments are its own."""
    world, salt, started = World(SimConfig(), seed), resolve_salt(root, ""), time.monotonic()
    for v in range(versions):
        model = ModelSet.load(read_bundle(make_bundle(1000 + v, f"v{v:02d}", "2026-12-01T00:00:00Z")), LoadOptions(warmup_batch=256))
        run_logged(world, model, range(v * sessions, (v + 1) * sessions), ZoneInfo("UTC"), root, salt)
        print(f"  generated version {v + 1} of {versions}", file=sys.stderr)
    return {"versions": versions, "sessions_per_version": sessions, "seed": seed, "generate_s": round(time.monotonic() - started, 1)}


def last_version_only(history: Path, target: Path, version: str) -> None:
    """A copy of ``history`` with only the segments that hold ``version``'s decisions and those sessions' outcomes."""
    source = DirectorySource(history)
    decisions = [p for p in source.segments("decisions")
                 if version in {v for b in source.segment_batches(p, "decisions", ["model_version"])
                                for v in b.column("model_version").unique().to_pylist()}]
    earliest = min(t for p in decisions for b in source.segment_batches(p, "decisions", ["time_s"])
                   for t in b.column("time_s").to_pylist())
    outcomes = [p for p in source.segments("outcomes")
                if max(t for b in source.segment_batches(p, "outcomes", ["received_s"]) for t in b.column("received_s").to_pylist())
                >= earliest]
    for path in (*decisions, *outcomes):
        dest = target / Path(path).relative_to(history)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    if (history / ".user-salt").exists():
        shutil.copy2(history / ".user-salt", target / ".user-salt")


class DecodeCounting(DirectorySource):
    """A real source that notes which decision segments it decodes whole (the wide pass asks for every column)."""

    def __init__(self, root: Path | str) -> None:
        super().__init__(root)
        self.wide: list[str] = []

    def segment_batches(self, path: str, kind: str, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        if kind == "decisions" and columns is None:
            self.wide.append(path)
        return super().segment_batches(path, kind, columns)


def timed_read(root: Path, config: TrainConfig) -> tuple[float, Any, int]:
    """Seconds, the window, and how many decision segments the wide pass decoded."""
    source = DecodeCounting(root)
    t0 = time.perf_counter()
    window = reading.read_window(source, config)
    return time.perf_counter() - t0, window, len(source.wide)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.window_read", description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--sessions", type=int, default=10_000, help="sessions logged per version")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, help="log directory (default bench/results/window-<versions>x<sessions>)")
    add_json_flag(p, "window_read.json")
    args = p.parse_args(argv)
    if not (2 <= args.versions <= 50 and 100 <= args.sessions <= 200_000):
        p.error("--versions 2..50, --sessions 100..200,000")
    started_wall = time.time()
    root = args.data or REPO / "bench" / "results" / f"window-{args.versions}x{args.sessions}"
    if not (root / INFO_NAME).exists():
        print(f"generating {args.versions} versions of {args.sessions:,} sessions in {root} ...", file=sys.stderr)
    info = kept_logs(root, lambda: generate(root, args.versions, args.sessions, args.seed))
    config = TrainConfig()  # the last version, at most max_sessions of it
    alone = root.with_name(root.name + "-last")
    if not alone.exists():
        last_version_only(root, alone, f"v{int(info['versions']) - 1:02d}")  # the data's own, if --data was reused

    t_alone, w_alone, n_alone = timed_read(alone, config)
    t_history, w_history, n_history = timed_read(root, config)
    with mock.patch.object(reading, "older_than", lambda newest, start: frozenset()):  # the read before the pruning
        t_every, w_every, n_every = timed_read(root, config)
    for w in (w_history, w_every):
        if not (w.decisions.equals(w_alone.decisions) and w.outcomes.equals(w_alone.outcomes)):
            raise SystemExit(f"{root}: the three reads gave different windows (regenerated history? delete {alone})")
    source = DirectorySource(root)
    result = {"data": str(root), "generated": info, "segments_in_history": len(source.segments("decisions")),
              "segments_of_window": len(DirectorySource(alone).segments("decisions")),
              "window_decisions": w_alone.decisions.num_rows, "window_sessions": w_alone.describe()["sessions"],
              "read_window_alone_s": t_alone, "read_history_s": t_history, "read_history_every_segment_s": t_every,
              "history_over_alone": t_history / t_alone, "every_segment_over_alone": t_every / t_alone,
              "decoded_segments": {"alone": n_alone, "history": n_history, "every_segment": n_every}}
    print(f"window: the last of {info['versions']} versions, {result['window_decisions']:,} decisions of "
          f"{result['window_sessions']:,} sessions; {result['segments_of_window']} of {result['segments_in_history']} decision segments")
    print(f"  the window's segments alone (baseline)   {t_alone:6.2f} s   1.00x   {n_alone} decision segments decoded")
    print(f"  the whole history, pruned wide pass      {t_history:6.2f} s   {result['history_over_alone']:.2f}x   {n_history}")
    print(f"  the whole history, every segment decoded {t_every:6.2f} s   {result['every_segment_over_alone']:.2f}x   {n_every}")
    if args.json:
        write_results(args.json, {**header("bench.window_read", started_wall, argv), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
