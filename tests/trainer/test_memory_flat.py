"""A run's memory follows the sample, not the log: ``train`` on logs of two sizes, the same sample size, in child
processes that report their peak RSS (the kernel's VmHWM). Real logs (the simulator through the recorder), the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import ROOT
from weights.model_set import ModelSet

SAMPLE = 300
TOLERANCE_MB = 60.0  # allocator and import noise between two runs of the same work
SETTINGS = {"updates": 1, "batch": 2048, "value_epochs": 1, "guard": {"epochs": 1}, "bootstrap": 20, "window_versions": None}


# The child's own high-water mark (VmHWM of its address space), printed as it exits. Not wait4's ru_maxrss: on Linux
# a child's starts at its parent's RSS when forked (it carries over exec), and pytest's is past a gigabyte by then.
_CHILD = ("import sys\nfrom server.cli import main\nrc = main(sys.argv[1:])\n"
          "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
          "print('VMHWM_KB', hwm.split()[1], file=sys.stderr)\nsys.exit(rc)\n")


def _peak_mb(logs: Path, config: Path, out: Path) -> float:
    log = out.with_suffix(".log")
    with log.open("wb") as stderr:
        run = subprocess.run([sys.executable, "-c", _CHILD, "train", "--logs", str(logs), "--out", str(out), "--device", "cpu",
                              "--config", str(config)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, timeout=300)
    text = log.read_text()
    assert run.returncode == 0, text[-2000:]
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("VMHWM_KB"))) / 1024


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory, default_model: ModelSet) -> tuple[Path, Path]:
    small, large = tmp_path_factory.mktemp("small-logs"), tmp_path_factory.mktemp("large-logs")
    run_logged(World(SimConfig(), 11), default_model, range(600), ZoneInfo("UTC"), small, b"m" * 32)
    run_logged(World(SimConfig(), 11), default_model, range(4_000), ZoneInfo("UTC"), large, b"m" * 32)
    return small, large


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
    assert abs(at_large - at_small) <= TOLERANCE_MB, (at_small, at_large, unsampled)
