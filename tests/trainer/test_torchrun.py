"""`torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1) trains the same policy as one process on the whole batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.harness import ROOT
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

# The whole Fisher (fisher_fraction 1): a subsample would be drawn per shard, not over the union.
CONFIG = {"updates": 2, "batch": 4096, "value_epochs": 1, "fisher_fraction": 1.0, "guard": {"epochs": 1}, "max_behavior_kl": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_take_the_same_steps_as_one(sim_logs: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    options = ["--logs", str(sim_logs), "--config", str(config), "--device", "cpu", "--version", "dp-test"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "server", "train", *options, "--out", str(tmp_path / "one.bundle")], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = Path(sys.executable).parent / "torchrun"
    two = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                          # options after "--": torchrun's parser would take --logs for its --logs-specs
                          "--master_port", str(_free_port()), "-m", "trainer", "train", "--", *options, "--out",
                          str(tmp_path / "two.bundle")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    options = LoadOptions(device="cpu", warmup_batch=1)
    a = ModelSet.load(read_bundle(tmp_path / "one.bundle"), options)
    b = ModelSet.load(read_bundle(tmp_path / "two.bundle"), options)
    assert a.manifest["training_metrics"]["updates_accepted"] == b.manifest["training_metrics"]["updates_accepted"] >= 1
    states = np.random.default_rng(0).standard_normal((512, a.encoder.spec.state_dim)).astype(np.float32) * 0.05
    (la, ga), (lb, gb) = a.infer(states), b.infer(states)
    np.testing.assert_allclose(lb, la, atol=2e-4)  # the same steps, up to float32 summation order across ranks
    np.testing.assert_allclose(gb, ga, atol=1e-5)
    start = ModelSet.load(read_bundle(ROOT / "weights" / "data" / "default.bundle"), options).infer(states)[0]
    assert np.abs(la - start).max() > 1e-2  # and the steps did move the policy
