"""A run's memory follows the sample, not the log: ``train`` on logs of two sizes, the same sample size, in child
processes that report their peak RSS (the kernel's VmHWM). Real logs (the simulator through the recorder), the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from bench.procs import HWM_CHILD, hwm_mb
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import ROOT
from weights.model_set import ModelSet

SAMPLE = 300
TOLERANCE_MB = 60.0  # allocator and import noise between two runs of the same work
SETTINGS = {"updates": 1, "batch": 2048, "value_epochs": 1, "critic_epochs": 1,
            "guard": {"epochs": 1}, "bootstrap": 20, "window_versions": None}


def _peak_mb(logs: Path, config: Path, out: Path) -> float:
    """``train`` in a child that reports its own peak RSS (``bench.procs.HWM_CHILD``: pytest's RSS, past a gigabyte by
    then, would otherwise be every child's starting high-water mark)."""
    log = out.with_suffix(".log")
    try:
        with log.open("wb") as stderr:
            run = subprocess.run([sys.executable, "-c", HWM_CHILD, "train", "--logs", str(logs), "--out", str(out), "--device",
                                  "cpu", "--config", str(config)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"train did not finish in 600 s: {log.read_text()[-2000:]}")
    text = log.read_text()
    peak = hwm_mb(text)
    assert run.returncode == 0 and peak is not None, text[-2000:]
    return peak


def _largest_segment_mb(logs: Path) -> float:
    return max(path.stat().st_size for path in logs.rglob("decisions-*")) / 2**20


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory, default_model: ModelSet) -> tuple[Path, Path]:
    small, large = tmp_path_factory.mktemp("small-logs"), tmp_path_factory.mktemp("large-logs")
    run_logged(World(SimConfig(), 11), default_model, range(600), ZoneInfo("UTC"), small, b"m" * 32)
    # 6,000 sessions: unsampled, 941 MB against the sample's 512 (2026-12-06), past the 120 MB the test needs; 12,000 took 16 s more
    run_logged(World(SimConfig(), 11), default_model, range(6_000), ZoneInfo("UTC"), large, b"m" * 32)
    return small, large


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_peak_memory_does_not_grow_with_the_log_beyond_the_sample(logs: tuple[Path, Path], tmp_path: Path) -> None:
    small, large = logs
    sampled, everything = tmp_path / "sampled.json", tmp_path / "everything.json"
    sampled.write_text(json.dumps({**SETTINGS, "max_sessions": SAMPLE}))
    everything.write_text(json.dumps({**SETTINGS, "max_sessions": None}))
    at_small = _peak_mb(small, sampled, tmp_path / "a.bundle")
    at_large = _peak_mb(large, sampled, tmp_path / "b.bundle")
    unsampled = _peak_mb(large, everything, tmp_path / "c.bundle")
    print(f"peak RSS: small {at_small:.0f} MB, large {at_large:.0f} MB, large unsampled {unsampled:.0f} MB")
    # the tolerance means something: without the sample, the larger log costs well beyond it
    assert unsampled - at_large > 2 * TOLERANCE_MB, (at_small, at_large, unsampled)
    # reading is a segment at a time: one decoded segment may still be held (freed but kept by Arrow's allocator) when
    # the next is read, so the allowance adds the largest segment. At 12,000 sessions the larger log was two segments
    # (one full, 64 MB) and in 8 runs its peak was 584-599 MB three times and 531-553 MB otherwise (the smaller's
    # 523-543 MB): one run, and a CI run (69 MB), broke the bare tolerance. At 6,000 it is one segment of about 47 MB:
    # the test shows the sample's memory against ten times the sessions, not the segment-by-segment read.
    allowance = TOLERANCE_MB + _largest_segment_mb(large)
    assert abs(at_large - at_small) <= allowance, (at_small, at_large, unsampled, allowance)
