"""Columnar parts against stream segments: the trainer's two passes over the same logged decisions, both formats.

    .venv/bin/python -m bench.compact [--decisions 1000000] [--data DIR]

The logs are ``bench.log_read``'s (stream segments; generated under ``--data`` when missing).
The bench copies them, compacts the copy (``experience.columnar.compact``, timed), and then, in
one process, one after the other, reads both with the trainer's two-pass reader
(``trainer.reading.read_window``, the default ``TrainConfig``: its 30,000-session sample): the
narrow pass (three columns of every decision, reduced to one row a session) and the whole
read, each timed; the baseline is the stream segments in the same run. Both directories were
just written or read, so both sit in the page cache: the figures are decoding, not disk. Also
reported: bytes on disk, and that both reads give the same window.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.log_read import generate
from bench.procs import REPO
from bench.report import kept_logs


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _passes(root: Path) -> tuple[dict[str, float], Any]:
    from experience.segments import DirectorySource
    from trainer.config import TrainConfig
    from trainer.reading import read_segments, read_window
    from trainer.session_index import NARROW, SessionIndex

    started = time.perf_counter()
    index = SessionIndex.of(read_segments(DirectorySource(root), "decisions", "bench.narrow", NARROW))
    narrow = time.perf_counter() - started
    started = time.perf_counter()
    window = read_window(DirectorySource(root), TrainConfig())
    whole = time.perf_counter() - started
    return {"narrow_pass_s": round(narrow, 2), "read_window_s": round(whole, 2), "sessions": index.sessions.num_rows}, window


def main(argv: Sequence[str] | None = None) -> int:
    from experience.columnar import compact
    from experience.segments import DirectorySource

    p = argparse.ArgumentParser(prog="python -m bench.compact", description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=1_000_000)
    p.add_argument("--data", type=Path, help="the log directory (default bench/results/logs-<decisions>)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compact.json")
    args = p.parse_args(argv)
    root = args.data or REPO / "bench" / "results" / f"logs-{args.decisions}"
    info = kept_logs(root, lambda: generate(root, args.decisions, 0))
    results: dict[str, Any] = {"decisions": info["decisions"]}
    with tempfile.TemporaryDirectory(prefix="bench-compact-", dir=root.parent) as tmp:
        parts = Path(shutil.copytree(root, Path(tmp) / "logs"))
        started = time.perf_counter()
        done = {kind: compact(DirectorySource(parts), kind, float("inf")).to_dict() for kind in ("decisions", "outcomes")}
        results["compact_s"] = round(time.perf_counter() - started, 1)
        results["compacted"] = done
        results["bytes"] = {"streams": _bytes(root), "parts": _bytes(parts)}
        results["streams"], a = _passes(root)
        results["parts"], b = _passes(parts)
        key = "decision_id"
        results["same_window"] = bool(a.decisions.sort_by(key).equals(b.decisions.sort_by(key)) and a.describe() == b.describe())
    for name in ("narrow_pass_s", "read_window_s"):
        results[f"{name}_parts_over_streams"] = round(results["parts"][name] / results["streams"][name], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0 if results["same_window"] else 1


if __name__ == "__main__":
    sys.exit(main())
