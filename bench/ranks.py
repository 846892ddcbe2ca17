"""``train`` on one process against ``torchrun --nproc_per_node 2`` on the same logs: peak RSS per rank, wall time.

    .venv/bin/python -m bench.ranks [--decisions 300000] [--data DIR] [--max-sessions N | --every-session]

Each rank reads only its shard of the window's sessions (``trainer.reading``) and the ranks fit
the guard, the advantage's nets (the critic's two by default) and the policy together (``trainer.minibatches``, ``trainer.distributed``),
so a rank should hold about half of what one process holds, less what every rank holds whole:
the session index of the narrow pass (one row a session of the whole log), the bundle, torch
itself (measured: ``train`` on a 200-session sample, the ``floor``). The logs are
``bench.log_read``'s (generated under ``--data`` when missing). Each process prints its own peak
RSS as it exits (``VmHWM``, ``core.peak_memory``); the runs go one after the other, two torch
threads for one process and one for each rank, the same seed and config. Reported: the peaks,
the largest rank's over one process's (whole, and above the floor), and how far the two bundles'
policies differ on 512 seeded states against how far training moved them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.log_read import generate
from bench.procs import HWM_CHILD, REPO
from bench.report import kept_logs

FLOOR_SESSIONS = 200
"""The floor: ``train`` on a sample of this many sessions, what every rank holds whatever its shard (torch, the
bundle, the narrow pass's session index of the whole log)."""
RANK_CHILD = HWM_CHILD.replace("from server.cli import main", "from trainer.cli import main")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peaks_mb(stderr: str) -> list[float]:
    return [int(kb) / 1024 for kb in re.findall(r"VMHWM_KB (\d+)", stderr)]  # two ranks share one stderr: not per line


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env)
    return done, time.monotonic() - started


def _agreement(one: Path, two: Path) -> dict[str, float]:
    """The largest difference of the two bundles' policy logits on 512 seeded states, and how far one moved them from
    the starting bundle (the embedded default)."""
    import numpy as np

    from weights.bundle import read_bundle
    from weights.embedded import default_bundle
    from weights.model_set import LoadOptions, ModelSet

    options = LoadOptions(device="cpu", warmup_batch=1)
    a, b = (ModelSet.load(read_bundle(p), options) for p in (one, two))
    start = ModelSet.load(default_bundle(), options)
    states = np.random.default_rng(0).standard_normal((512, a.encoder.spec.state_dim)).astype(np.float32) * 0.05
    la, lb, l0 = (m.infer(states)[0] for m in (a, b, start))
    return {"policy_logit_max_difference": float(np.abs(la - lb).max()), "policy_logit_max_change": float(np.abs(la - l0).max())}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ranks", description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=300_000)
    p.add_argument("--data", type=Path, help="the log directory (default bench/results/logs-<decisions>)")
    sample = p.add_mutually_exclusive_group()
    sample.add_argument("--max-sessions", type=int, help="TrainConfig.max_sessions (default: TrainConfig's)")
    sample.add_argument("--every-session", action="store_true", help="no sample: every session of the window")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ranks.json")
    args = p.parse_args(argv)
    root = args.data or REPO / "bench" / "results" / f"logs-{args.decisions}"
    info = kept_logs(root, lambda: generate(root, args.decisions, 0))
    torchrun = Path(sys.executable).parent / "torchrun"
    results: dict[str, Any] = {"decisions": info["decisions"], "sessions": info["sessions"]}
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        options = ["--logs", str(root), "--device", "cpu", "--version", "bench-ranks"]
        if args.max_sessions is not None or args.every_session:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps({"max_sessions": None if args.every_session else args.max_sessions}))
            options += ["--config", str(config)]
        floor_config = Path(tmp) / "floor.json"
        floor_config.write_text(json.dumps({"max_sessions": FLOOR_SESSIONS}))
        floor = ["--logs", str(root), "--device", "cpu", "--config", str(floor_config), "--out", f"{tmp}/floor.bundle"]
        runs = {
            "floor": ([sys.executable, "-c", RANK_CHILD, "train", *floor], "2"),
            "one_process": ([sys.executable, "-c", RANK_CHILD, "train", *options, "--out", f"{tmp}/one.bundle"], "2"),
            "two_ranks": ([str(torchrun), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                           # options after "--": torchrun's parser would take --logs for its --logs-specs
                           str(_free_port()), "--no-python", sys.executable, "-c", RANK_CHILD, "train", "--", *options,
                           "--out", f"{tmp}/two.bundle"], "1"),
        }
        for name, (cmd, threads) in runs.items():
            env = {**os.environ, "OMP_NUM_THREADS": threads}
            done, seconds = _run(cmd, env, args.timeout)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name}: exit {done.returncode}")
            peaks = _peaks_mb(done.stderr)
            results[name] = {"seconds": round(seconds, 1), "peak_rss_mb": [round(x, 1) for x in peaks]}
            print(f"{name}: {seconds:.0f} s, peak RSS {', '.join(f'{x:,.0f}' for x in peaks)} MB", file=sys.stderr)
        one, rank, base = (max(results[k]["peak_rss_mb"]) for k in ("one_process", "two_ranks", "floor"))
        results["largest_rank_over_one_process"] = round(rank / one, 3)
        results["above_floor_largest_rank_over_one_process"] = round((rank - base) / (one - base), 3)
        results |= _agreement(Path(tmp) / "one.bundle", Path(tmp) / "two.bundle")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
