"""The CronJob's command on a million logged decisions: ``shopping-agent cycle``, timed end to end.

    .venv/bin/python -m bench.cycle [--decisions 1000000] [--data DIR] [--device cpu] [--max-sessions N | --every-session]

Uses the logs ``bench.log_read`` generates (``--data``, default ``bench/results/logs-<N>``;
generated there if missing: keep 10M decisions, 16 GB, outside the repo), a fresh temporary
weights directory (so the current bundle is the embedded default), and the default
``TrainConfig``: its sample of the window's sessions (``--max-sessions`` another size,
``--every-session`` none; ``trainer.window``). Reports the wall time, the peak RSS and the gate's
verdict (target: ≤ 10 minutes on this machine's CPU), and keeps the trained bundle next to the JSON
(``--out`` with ``.bundle``: ``shopping-agent simulate --bundle`` scores it by the truth). A child
process, bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.log_read import generate
from bench.procs import HWM_CHILD, REPO, hwm_mb
from bench.report import kept_logs
from trainer.config import TrainConfig

TARGET_S = 600.0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cycle", description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=1_000_000)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--data", type=Path, help="the log directory (default bench/results/logs-<decisions>)")
    sample = p.add_mutually_exclusive_group()
    sample.add_argument("--max-sessions", type=int, help="TrainConfig.max_sessions (default: TrainConfig's)")
    sample.add_argument("--every-session", action="store_true", help="no sample: every session of the window")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cycle.json")
    args = p.parse_args(argv)
    root = args.data or REPO / "bench" / "results" / f"logs-{args.decisions}"
    kept_logs(root, lambda: generate(root, args.decisions, 0))  # generated once, kept
    with tempfile.TemporaryDirectory(prefix="bench-cycle-") as tmp:
        cmd = [sys.executable, "-c", HWM_CHILD, "cycle", "--logs", str(root), "--weights-dir", str(Path(tmp) / "weights"),
               "--device", args.device, "--json", "--candidate-out", str(args.out.with_suffix(".bundle"))]
        if args.max_sessions is not None or args.every_session:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps({"max_sessions": None if args.every_session else args.max_sessions}))
            cmd += ["--config", str(config)]
        started = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
        seconds = time.monotonic() - started
    peak_mb = hwm_mb(run.stderr) or float("nan")
    report = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {}
    stages = [line.split(" INFO ", 1)[-1][:160] for line in run.stderr.splitlines() if " INFO " in line]
    progress = {r["progress"]: r for r in (json.loads(x) for x in run.stderr.splitlines() if x.startswith('{"progress"')) if r["final"]}
    print("\n".join(stages[-12:]))
    print(f"\ncycle on {args.decisions:,} logged decisions: {seconds:.0f} s (target <= {TARGET_S:.0f} s "
          f"{'met' if seconds <= TARGET_S else 'MISSED'}), peak RSS {peak_mb:,.0f} MB, exit {run.returncode}, "
          f"publish {report.get('publish')}, DR new − current {report.get('dr_difference')}")
    out = args.out
    sessions = None if args.every_session else args.max_sessions or TrainConfig().max_sessions
    out.write_text(json.dumps({"decisions": args.decisions, "max_sessions": sessions, "seconds": seconds,
                               "peak_rss_mb": peak_mb, "exit": run.returncode,
                               "stage_seconds": {k: v["elapsed_s"] for k, v in progress.items()},
                               "report": report, "stderr_tail": run.stderr[-4000:]}, indent=2, default=float) + "\n")
    return 0 if run.returncode in (0, 3) else 1


if __name__ == "__main__":
    sys.exit(main())
