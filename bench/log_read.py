"""Logs on disk → trainer input: read a million logged decisions and build their returns.

    .venv/bin/python -m bench.log_read                      # generates the logs once (~3 min), then times
    .venv/bin/python -m bench.log_read --decisions 100000   # smaller
    .venv/bin/python -m bench.log_read --json               # also write bench/results/log_read.json

The logs are real: the in-process simulator (``shopping-agent simulate --bundle ...
--log-dir``, the server's decision code and its ``ExperienceRecorder``) writes Arrow IPC
segments to ``--data`` (default ``bench/results/logs-<N>``, kept between runs; delete it
to regenerate). Then, timed in one process, each step once:

1. ``DirectorySource.table`` for decisions and for outcomes: list, open, decompress (zstd)
   and concatenate every segment, all columns (the trainer needs the embeddings too);
2. ``build_episodes``: sort, de-duplicate, join, attribute rewards;
3. ``discounted_returns`` over every step and ``session_returns`` + ``mean_return``.

Target: under 30 s for 1 million decisions on this machine. The baseline in the same run is
the cost of the file bytes alone (reading every segment into memory, no decoding), so the
ratio says what decoding and the maths add to the I/O.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from bench.procs import REPO
from bench.report import INFO_NAME, kept_logs
from experience.recorder import resolve_salt
from experience.returns import discounted_returns, mean_return, session_returns
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World

TARGET_S = 30.0
DECISIONS_PER_SESSION = 6.5  # the default bundle on the default world, measured


def generate(root: Path, decisions: int, seed: int) -> dict[str, Any]:
    from weights.embedded import default_bundle
    from weights.model_set import LoadOptions, ModelSet

    model = ModelSet.load(default_bundle(), LoadOptions(warmup_batch=256))
    world = World(SimConfig(), seed)
    salt = resolve_salt(root, "")
    started, first, total, written = time.monotonic(), 0, 0, {"decisions": 0, "outcomes": 0}
    while total < decisions:  # chunks of sessions until enough decisions (bounded: each chunk adds > 0)
        n = max(1, int((decisions - total) / DECISIONS_PER_SESSION) + 1)
        trace, chunk = run_logged(world, model, range(first, first + n), ZoneInfo("UTC"), root, salt)
        first, total = first + n, total + len(trace.decision_ids)
        written = {k: written[k] + chunk[k] for k in written}
        print(f"  generated {total:,} decisions ({first:,} sessions)", file=sys.stderr)
    return {"decisions": written["decisions"], "outcomes": written["outcomes"], "sessions": first,
            "seed": seed, "generate_s": round(time.monotonic() - started, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.log_read", description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, help="log directory (default bench/results/logs-<decisions>)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 1000 <= args.decisions <= 5_000_000:
        p.error("--decisions: 1000 .. 5,000,000")
    root = args.data or REPO / "bench" / "results" / f"logs-{args.decisions}"
    if not (root / INFO_NAME).exists():
        print(f"generating {args.decisions:,} logged decisions in {root} ...", file=sys.stderr)
    info = kept_logs(root, lambda: generate(root, args.decisions, args.seed))
    source = DirectorySource(root)
    segments = [Path(s) for s in (*source.segments("decisions"), *source.segments("outcomes"))]
    size = sum(s.stat().st_size for s in segments)

    t0 = time.perf_counter()
    raw = sum(len(s.read_bytes()) for s in segments)
    t_bytes = time.perf_counter() - t0

    t0 = time.perf_counter()
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    episodes = build_episodes(decisions, outcomes)
    t_join = time.perf_counter() - t0
    t0 = time.perf_counter()
    returns = discounted_returns(episodes.rewards, episodes.starts, episodes.lengths)
    value = mean_return(session_returns(episodes))
    t_returns = time.perf_counter() - t0
    total = t_read + t_join + t_returns
    assert raw == size and len(returns) == episodes.n_steps

    result = {
        "data": str(root), "segments": len(segments), "bytes_on_disk": size, "decisions": decisions.num_rows,
        "outcomes": outcomes.num_rows, "episodes": episodes.n_episodes, "steps": episodes.n_steps,
        "read_bytes_s": t_bytes, "read_tables_s": t_read, "build_episodes_s": t_join, "returns_s": t_returns,
        "total_s": total, "target_s": TARGET_S, "total_over_bytes": total / t_bytes if t_bytes > 0 else None,
        "mean_return": value.mean, "generated": info,
    }
    print(f"logs: {decisions.num_rows:,} decisions, {outcomes.num_rows:,} outcomes in {len(segments)} segments, "
          f"{size / 1e6:.0f} MB on disk")
    print(f"  file bytes only (baseline)   {t_bytes:6.2f} s")
    print(f"  read tables (all columns)    {t_read:6.2f} s")
    print(f"  build_episodes               {t_join:6.2f} s   ({episodes.n_episodes:,} episodes)")
    print(f"  returns + mean_return        {t_returns:6.2f} s")
    print(f"  total                        {total:6.2f} s   target <= {TARGET_S:.0f} s  {'met' if total <= TARGET_S else 'MISSED'}"
          f"   ({result['total_over_bytes']:.1f}x the bytes alone)")
    if args.json:
        out = REPO / "bench" / "results" / "log_read.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if total <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
