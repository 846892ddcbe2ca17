"""`torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1): each rank reads half the sessions, and the two train what one
process trains on all of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import ROOT, strict_json
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

# The default Fisher subsample (fisher_fraction 0.1), a fit sample and batches smaller than the logs (about 2,000 rows):
# all keyed by row, the same rows over the union of the shards as in one process.
CONFIG = {"updates": 2, "batch": 1024, "max_fit_rows": 1500, "value_epochs": 1, "critic_epochs": 1,
          "guard": {"epochs": 1}, "max_behavior_kl": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# With the masked softmax's Fisher the logits agree to float32 summation order across ranks (2e-4).
# The served distribution's Fisher is far worse conditioned (the sampled majority is flat in many
# directions), so 10 CG iterations amplify that rounding: the same steps (same count, the applied
# served KL within 1 %), the logits' change agreeing to 10 % of its size.


# Each trust region and each sharded advantage fit once (("policy", "baseline") cost 17 s a run): the served case fits the
# value baseline on two ranks, its metrics pinned to 1e-4 but its logits only to a tenth of their move (the served
# Fisher's conditioning); the critic case pins the logits to 2e-4. The baseline fit's own two-rank equality to one
# process is tests/trainer/test_distributed.py's (fit_value on gloo ranks).
@pytest.mark.parametrize(("trust_region", "advantage"), [("served", "baseline"), ("policy", "critic")])
def test_two_processes_take_the_same_steps_as_one(sim_logs: Path, tmp_path: Path, trust_region: str, advantage: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "trust_region": trust_region, "advantage": advantage}))  # the critic's fit weighted
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
    ma, mb = a.manifest["training_metrics"], b.manifest["training_metrics"]
    wa, wb = a.manifest["trainer"]["window"], b.manifest["trainer"]["window"]
    shares = wb["shard_decisions"]  # what each rank read: disjoint halves of the window by session
    assert len(shares) == 2 and sum(shares) == wb["decisions"] == wa["decisions"] and min(shares) > 0.35 * wa["decisions"]
    assert "shard_decisions" not in wa and wb["sessions"] == wa["sessions"] and wb["model_versions"] == wa["model_versions"]
    assert wb["newest_time_s"] == wa["newest_time_s"] and b.manifest["created_at"] == a.manifest["created_at"]
    assert b.manifest["trainer"]["reward_scale"] == a.manifest["trainer"]["reward_scale"]  # the union's quantiles
    for key in ("train_steps", "train_episodes", "guard_n_train", "guard_n_train_harmful", "guard_n_heldout_sessions"):
        assert mb[key] == ma[key], key  # counts of the union, not of rank 0's shard
    assert mb["train_steps"] > CONFIG["max_fit_rows"] and mb["guard_eta_spike_rows"] == ma["guard_eta_spike_rows"]
    if advantage == "critic":  # its fit on the keyed sample, standardised and scored over the union
        for key in ("critic_return_r2", "critic_return_r2_heldout"):  # each half's critic, scored on the other half
            assert mb[key] == pytest.approx(ma[key], abs=1e-4), key
    for key in ("guard_auc", "guard_threshold", "guard_accuracy", "return_variance_ratio"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-9), key  # the gathered held-out pairs, reduced sums
    assert mb["trajectory_ess_fraction"] == pytest.approx(ma["trajectory_ess_fraction"], rel=0.02)  # of the final policies
    assert ma["updates_accepted"] == mb["updates_accepted"] >= 1
    assert mb["kl_served_to_start"] == pytest.approx(ma["kl_served_to_start"], rel=0.01)
    states = np.random.default_rng(0).standard_normal((512, a.encoder.spec.state_dim)).astype(np.float32) * 0.05
    (la, ga), (lb, gb) = a.infer(states), b.infer(states)
    start = ModelSet.load(read_bundle(ROOT / "weights" / "data" / "default.bundle"), options).infer(states)[0]
    moved = np.abs(la - start).max()
    assert moved > 1e-2  # the steps did move the policy
    np.testing.assert_allclose(lb, la, atol=2e-4 if trust_region == "policy" else 0.1 * moved)
    np.testing.assert_allclose(gb, ga, atol=1e-5)


def test_a_cycle_on_two_ranks_gates_on_every_shards_heldout_sessions(sim_logs: Path, tmp_path: Path) -> None:
    """Rank 0 trained on its shard; the gate judges the current bundle on the same held-out sessions as one process."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "bootstrap": 50}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cycle(name: str, launcher: list[str]) -> dict[str, object]:
        # --force: torchrun reports a rank's exit 3 (refused) as its own failure, 1
        options = ["--logs", str(sim_logs), "--weights-dir", str(tmp_path / name), "--config", str(config), "--device", "cpu", "--json",
                   "--force"]
        done = subprocess.run([*launcher, "cycle", *(["--"] if "torchrun" in launcher[0] else []), *options], capture_output=True,
                              text=True, cwd=ROOT, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return strict_json(done.stdout.strip().splitlines()[-1])

    torchrun = str(Path(sys.executable).parent / "torchrun")
    one = cycle("one", [sys.executable, "-m", "trainer"])
    two = cycle("two", [torchrun, "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                        str(_free_port()), "-m", "trainer"])
    assert two["current"] == one["current"]  # the same held-out sessions (not rank 0's half), the same estimates
    n_one, n_two = (r["new"]["diagnostics"]["n_episodes"] for r in (one, two))  # type: ignore[index]
    assert n_two == n_one > 50
    assert two["dr_difference"]["value"] == pytest.approx(one["dr_difference"]["value"], abs=0.5)  # type: ignore[index]


STOPPED_PEER = """
import os, sys, time
import trainer.cli as cli
from trainer.distributed import init_from_env, leave

def crashing_peer(args):  # rank 1 dies (an OOM kill, say) while rank 0 works; torchrun then stops rank 0
    if init_from_env(os.environ).rank == 1:
        time.sleep(1)
        os._exit(1)
    import torch
    import torch.distributed as dist

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if IN_COLLECTIVE:  # an update's all-reduce: the dead peer's error reaches rank 0 there
            dist.all_reduce(torch.ones(1))
        time.sleep(0.05)

cli._evaluate = crashing_peer
sys.argv = ["trainer", "evaluate", "default", "--logs", "/nowhere"]
leave(cli.process_main(), joined=True)
"""


@pytest.mark.parametrize("in_collective", [False, True])
def test_a_rank_whose_peer_dies_ends_with_its_own_outcome_not_with_the_barriers_error(tmp_path: Path, in_collective: bool) -> None:
    """Two reviews found a rank's way out ran the leaving barrier with a dead peer: its error replaced the rank's own
    outcome (a double traceback, ``leave`` skipped), whether torchrun stopped the rank while it worked in Python or the
    dead peer's error reached it in a collective. Now only a rank that finished waits for the others."""
    script = tmp_path / "stopped_peer.py"
    script.write_text(f"IN_COLLECTIVE = {in_collective}\n" + STOPPED_PEER)
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                           str(_free_port()), str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "dist.barrier()" not in out and "shutdown(together" not in out, out[-3000:]
    if in_collective:  # the peer's error, caught as a failure (exit 1), or torchrun's stop if it came first
        assert "shopping-agent evaluate: failed: " in out or "shopping-agent evaluate: stopped by SIGTERM" in out, out[-3000:]
    else:
        assert "shopping-agent evaluate: stopped by SIGTERM" in out, out[-3000:]
        assert "rank      : 0 (local_rank: 0)\n  exitcode  : 143" in out and "Connection closed by peer" not in out, out[-3000:]
