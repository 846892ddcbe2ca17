"""scripts/gpu_check.py on a machine without CUDA (CI's): it stops at its first check, says why, and exits 2.

What it checks on a GPU cannot run here; ``--device cpu`` (a dry run of the same code) was run by hand (docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_the_gpu_check_says_so_and_exits_2() -> None:
    run = subprocess.run([sys.executable, "scripts/gpu_check.py"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "no CUDA device" in run.stderr
    summary = json.loads(run.stdout)
    assert summary["cuda_visible"]["ok"] is False and summary["cuda_visible"]["torch_cuda"] is False
    assert "CPUExecutionProvider" in summary["cuda_visible"]["ort_providers"]
