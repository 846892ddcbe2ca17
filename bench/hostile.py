"""Peak memory and time of refusing each hostile bundle, against verifying the valid default in the same run.

Each file is checked by the real command, ``shopping-agent weights verify FILE``, in its own
process; the figure is that process tree's peak RSS (``RUSAGE_CHILDREN`` of a wrapper: the
command and its validating child) and its wall time. ``--in-process`` adds the same with
``--validate-memory-mb 0`` (no child). The attacks are those of ``tests/weights/hostile.py``;
the first row, the valid default bundle, is the baseline.

Run: ``.venv/bin/python -m bench.hostile [--json]``
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.procs import REPO
from bench.report import add_json_flag, header, write_results

sys.path.insert(0, str(REPO))
from tests.weights import hostile

CASES: dict[str, Callable[[], bytes]] = {
    "valid default (baseline)": hostile.rebuilt,
    "external data (file read)": lambda: hostile.rebuilt(hostile.zero_golden({"guard.onnx": hostile.external_data_guard()})),
    "inflating member (256 MiB)": hostile.inflating,
    "five 256 MiB zero parts": hostile.zero_parts,
    "ConstantOfShape 1.6 GB": lambda: hostile.rebuilt({"guard.onnx": hostile.allocating_guard()}),
    "nested manifest (200k)": hostile.nested_manifest,
    "duplicate members": hostile.duplicate_member,
}

_WRAPPER = ("import resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "p = subprocess.run([sys.executable, '-m', 'server', 'weights', 'verify', *sys.argv[1:]], capture_output=True, text=True)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - t)\n"
            "print(p.stdout.strip() or p.stderr.strip().splitlines()[-1])\n")


def measure(path: Path, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _WRAPPER, str(path), *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    first, verdict = out.stdout.strip().splitlines()[:2]
    code, maxrss, seconds = first.split()
    return {"exit": int(code), "peak_rss_mb": round(int(maxrss) / 1024, 1), "seconds": round(float(seconds), 2), "verdict": verdict[:110]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-process", action="store_true", help="also verify without the child (--validate-memory-mb 0)")
    add_json_flag(parser, "hostile.json")
    args = parser.parse_args(argv)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in CASES.items():
            path = Path(tmp) / "candidate.bundle"
            path.write_bytes(make())
            row: dict[str, Any] = {"case": name, "file_bytes": path.stat().st_size, "child": measure(path)}
            if args.in_process:
                row["in_process"] = measure(path, "--validate-memory-mb", "0")
            rows.append(row)
            child = row["child"]
            print(f"{name:28} {row['file_bytes']:>10,} B  exit {child['exit']}  peak {child['peak_rss_mb']:6.1f} MB  "
                  f"{child['seconds']:5.2f} s  {child['verdict']}")
    print(f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB peak, building the files)")
    if args.json:
        write_results(args.json, {**header("bench.hostile", started, argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
