"""The model's forward pass on each device: ``ModelSet.infer`` (policy and guard) per batch size.

    .venv/bin/python -m bench.infer_device                          # the CPU alone (1 thread and every core)
    .venv/bin/python -m bench.infer_device --devices cpu,cuda --json   # on a GPU machine: CUDA against the CPU

The embedded default bundle is loaded through ``ModelSet.load`` (the server's loader) once per
device (and, on the CPU, once per ``--threads`` setting); each batch size is timed as the median
of ``--calls`` calls after ``--warmup`` untimed ones, on real-shaped states (standard normal, the
bundle's state width). The baseline in the same run is the CPU with one intra-op thread, the
server's setting: ``vs_cpu1`` is its median over the device's (above 1: the device is faster).
The server batches at most ``--max-batch`` requests (default 64), so batch 1-64 is what serving
sees; the larger batches are what the offline gate's scoring and the trainer's replay see.
Every loop is bounded by ``--calls`` and ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet

RESULTS = Path(__file__).resolve().parent / "results"


def time_infer(model: ModelSet, states: np.ndarray, calls: int, warmup: int) -> float:
    """Median seconds of ``model.infer(states)`` over ``calls`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        model.infer(states)
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        model.infer(states)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(devices: list[str], batches: list[int], calls: int, warmup: int) -> dict[str, Any]:
    bundle = default_bundle()
    setups = [("cpu1", "cpu", 1), (f"cpu{os.cpu_count()}", "cpu", os.cpu_count() or 1)]
    setups += [(d, d, 1) for d in devices if d != "cpu"]
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"batches": batches, "calls": calls, "setups": {}}
    for name, device, threads in setups:
        model = ModelSet.load(bundle, LoadOptions(device=device, threads=threads, warmup_batch=max(batches)))
        width = model.policy.input_shape[-1]
        rows = {}
        for b in batches:
            states = rng.standard_normal((b, width), dtype=np.float32)
            rows[b] = time_infer(model, states, calls, warmup)
        out["setups"][name] = {"device": device, "threads": threads, "providers": list(model.policy.providers),
                               "median_us": {b: round(s * 1e6, 1) for b, s in rows.items()}}
    base = out["setups"]["cpu1"]["median_us"]
    for setup in out["setups"].values():
        setup["vs_cpu1"] = {b: round(base[b] / us, 2) for b, us in setup["median_us"].items()}
        setup["rows_per_s"] = {b: round(b / (us * 1e-6)) for b, us in setup["median_us"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.infer_device", description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="cpu", help="comma-separated: cpu and/or cuda (default cpu)")
    p.add_argument("--batches", default="1,8,64,512,4096,32768", help="batch sizes (default 1,8,64,512,4096,32768)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per batch size (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    p.add_argument("--json", action="store_true", help="also write bench/results/infer_device.json")
    args = p.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices or any(d not in ("cpu", "cuda") for d in devices):
        p.error(f"--devices: expected cpu and/or cuda, got {args.devices!r}")
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1 or args.calls < 1 or args.warmup < 0:
        p.error("--batches must be positive integers, --calls ≥ 1, --warmup ≥ 0")
    result = run(devices, batches, args.calls, args.warmup)
    print(f"{'setup':<8} {'providers':<24} " + " ".join(f"{b:>10}" for b in batches) + "   (median µs; ×cpu1)")
    for name, s in result["setups"].items():
        print(f"{name:<8} {s['providers'][0]:<24} " + " ".join(f"{s['median_us'][b]:>10}" for b in batches))
        print(f"{'':<8} {'':<24} " + " ".join(f"{s['vs_cpu1'][b]:>9}×" for b in batches))
    if args.json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "infer_device.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
