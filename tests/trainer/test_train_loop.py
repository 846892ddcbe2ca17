"""The whole trainer on simulator logs: a better policy by the simulator's truth, reproducible bytes, a gate that refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core.domain import Source
from experience.returns import session_returns
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from tests.harness import FAST_CYCLE, ROOT, fresh_bundle, fresh_bundle_bytes, strict_json, trainer_in_process, variant_bytes
from trainer.config import GuardConfig, TrainConfig
from trainer.data import split
from trainer.evaluation import evaluate_bundle, gate
from trainer.train import TrainResult, train
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.store import WeightsStore
from weights.validate import verify

FAST = TrainConfig(updates=2, batch=8192, value_epochs=2, critic_epochs=2, guard=GuardConfig(epochs=2), bootstrap=100)
SESSIONS = 2500


def paired_gain(new: ModelSet, old: ModelSet, seed: int, sessions: int = 3000) -> tuple[float, float]:
    """Mean per-session difference of the true discounted returns (same shoppers, same dice) and its standard error."""
    g = []
    for model in (new, old):
        episodes = build_episodes(*run_in_process(World(SimConfig(), seed), model, range(sessions), ZoneInfo("UTC")).tables())
        g.append((episodes.session_ids, session_returns(episodes)))
    assert list(g[0][0]) == list(g[1][0])  # the same sessions, in the same order
    diff = g[0][1] - g[1][1]
    return float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff)))


def true_value(model: ModelSet, seed: int, sessions: int = 2000) -> tuple[float, float]:
    """The simulator's business objective per session of ``model`` (what the gate estimates), and its standard error."""
    objective = run_in_process(World(SimConfig(), seed), model, range(sessions), ZoneInfo("UTC")).business()["objective"]
    return objective.mean, objective.stderr


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train-logs")
    model = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    run_logged(World(SimConfig(), 11), model, range(SESSIONS), ZoneInfo("UTC"), root, b"k" * 32)
    return root


@pytest.fixture(scope="module")
def trained(logs: Path) -> TrainResult:
    source = DirectorySource(logs)
    return train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), FAST, device="cpu")


def test_trained_bundle_beats_the_behaviour_by_the_simulators_truth(trained: TrainResult) -> None:
    options = LoadOptions(warmup_batch=8)
    new, old = ModelSet.load(read_bundle(trained.bundle), options), ModelSet.load(fresh_bundle(), options)
    gain, se = paired_gain(new, old, seed=501)  # sessions the trainer never saw
    assert gain > 4 * se, (gain, se)
    metrics = trained.metrics
    assert metrics["updates_accepted"] >= 1 and 0 < metrics["kl_to_old"] < 2 * FAST.kl_delta
    for key in ("kl_to_behavior", "return_variance_ratio", "constraint_activation_rate", "effective_sample_size",
                "guard_accuracy", "guard_false_block_rate"):
        assert key in metrics
    assert metrics["guard_false_block_rate"] <= 0.015
    assert trained.manifest["trainer"]["config"]["kl_delta"] == FAST.kl_delta  # every field recorded


def test_offline_estimates_bracket_the_true_values(logs: Path, trained: TrainResult) -> None:
    source = DirectorySource(logs)
    _, (held_d, held_o) = split(source.table("decisions"), source.table("outcomes"), FAST.heldout_fraction, FAST.seed)
    options = LoadOptions(warmup_batch=8)
    behaviour = evaluate_bundle(ModelSet.load(fresh_bundle(), options), held_d, held_o, n_boot=200)  # the objective, γ = 1
    truth, se = true_value(ModelSet.load(fresh_bundle(), options), seed=11, sessions=SESSIONS)  # the logged world itself
    # On-policy, every estimator is the logged mean and its interval must contain the truth of that world
    assert behaviour.report.ips is not None and behaviour.report.ips.ci_low - 2 * se <= truth <= behaviour.report.ips.ci_high + 2 * se
    assert behaviour.behavior_kl < 1e-3
    new = evaluate_bundle(ModelSet.load(read_bundle(trained.bundle), options), held_d, held_o, n_boot=200)
    new_truth, new_se = true_value(ModelSet.load(read_bundle(trained.bundle), options), seed=11, sessions=SESSIONS)
    dr = new.report.dr
    assert dr is not None
    # Off-policy estimates of a policy far from the logs are noisy; the interval (widened by the
    # truth's own sampling error) must still contain the truth.
    assert dr.ci_low - 3 * new_se <= new_truth <= dr.ci_high + 3 * new_se, (dr, new_truth)


def test_gate_refuses_a_worse_bundle_and_passes_a_better_one(logs: Path, trained: TrainResult) -> None:
    source = DirectorySource(logs)
    _, (held_d, held_o) = split(source.table("decisions"), source.table("outcomes"), FAST.heldout_fraction, FAST.seed)
    options = LoadOptions(warmup_batch=8)
    good = evaluate_bundle(ModelSet.load(read_bundle(trained.bundle), options), held_d, held_o, n_boot=200)
    default = evaluate_bundle(ModelSet.load(fresh_bundle(), options), held_d, held_o, n_boot=200)
    refused = gate(default, good, tolerance=0.0)  # "new" = the untrained default, "current" = the trained one
    assert not refused.publish and refused.difference.value < 0 and "may be worse" in refused.reason
    # The other way round the paired difference is positive; whether its lower bound clears 0
    # depends on how many held-out sessions there are (here a few hundred: it may not).
    assert gate(good, default, tolerance=0.0).difference.value > 0


def test_no_step_is_reported_once(logs: Path) -> None:
    source = DirectorySource(logs)
    decisions = source.table("decisions")
    # every decision logged as served with certainty (a rule-engine answer): no row a ratio can use, so no step
    actions = decisions.column("action").to_numpy()
    one_hot = pa.array(list(np.eye(5)[actions]), pa.list_(pa.float64(), 5))
    certain = decisions.set_column(decisions.schema.get_field_index("served_probs"), "served_probs", one_hot)
    certain = certain.set_column(certain.schema.get_field_index("propensity"), "propensity", pa.array(np.ones(len(actions))))
    result = train(certain, source.table("outcomes"), fresh_bundle(), FAST, device="cpu")
    assert any(w.startswith("no logged row") for w in result.warnings), result.warnings
    no_step = [w for w in result.warnings if w.startswith("no natural-gradient step")]
    assert len(no_step) == 1, result.warnings
    assert result.manifest["trainer"]["warnings"] == result.warnings
    assert result.metrics["updates_accepted"] == 0.0


def test_group_advantages_train_a_better_policy_too(logs: Path) -> None:
    """``advantage="group"`` (page-type groups, no value net): the same loop, judged by the simulator's truth."""
    source = DirectorySource(logs)
    config = dataclasses.replace(FAST, advantage="group")
    result = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), config, device="cpu")
    assert result.manifest["trainer"]["config"]["advantage"] == "group"
    assert result.metrics["updates_accepted"] >= 1
    options = LoadOptions(warmup_batch=8)
    gain, se = paired_gain(ModelSet.load(read_bundle(result.bundle), options), ModelSet.load(fresh_bundle(), options), seed=23,
                           sessions=1500)
    assert gain > 2 * se, (gain, se)


def _served_with_certainty(decisions: pa.Table, share: float, seed: int) -> tuple[pa.Table, int]:
    """A share of the rows turned into rule-engine answers: the served action with probability 1 (as degraded ones are logged)."""
    n = decisions.num_rows
    pick = np.random.default_rng(seed).random(n) < share
    served_type = decisions.schema.field("served_probs").type
    served = np.array(decisions.column("served_probs").combine_chunks().flatten().to_numpy(), dtype=np.float64).reshape(n, 5)
    index = np.asarray(decisions.column("action").to_numpy(), dtype=np.int64) - 1
    served[pick] = 0.0
    served[pick, index[pick]] = 1.0
    propensity = np.where(pick, 1.0, decisions.column("propensity").to_numpy())
    source = np.where(pick, int(Source.FALLBACK_DEGRADED), decisions.column("source").to_numpy())
    columns = {
        "served_probs": pa.FixedSizeListArray.from_arrays(pa.array(served.reshape(-1), type=served_type.value_type), 5),
        "propensity": pa.array(propensity, type=decisions.schema.field("propensity").type),
        "source": pa.array(source, type=decisions.schema.field("source").type),
    }
    for name, column in columns.items():
        decisions = decisions.set_column(decisions.schema.get_field_index(name), decisions.schema.field(name), column)
    return decisions, int(pick.sum())


def test_rows_served_with_certainty_leave_the_step_alone(logs: Path, trained: TrainResult) -> None:
    """15 % of rows logged as rule-engine answers (propensity 1) carry no ratio: the step is the one the rest supports."""
    source = DirectorySource(logs)
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    polluted, n_certain = _served_with_certainty(decisions, 0.15, seed=3)
    result = train(polluted, outcomes, fresh_bundle(), FAST, device="cpu")
    clean = trained.metrics
    # the training side holds about 80 % of the sessions (the rest is the gate's)
    assert result.metrics["train_rows_served_with_certainty"] >= clean["train_rows_served_with_certainty"] + 0.6 * n_certain
    assert result.metrics["updates_accepted"] == clean["updates_accepted"] >= 1
    assert 0.5 * clean["kl_to_old"] <= result.metrics["kl_to_old"] <= 2.0 * clean["kl_to_old"]
    assert result.metrics["kl_to_behavior"] <= 2.0 * clean["kl_to_behavior"] + 0.05  # not the floor of the point masses


def test_same_logs_and_seed_give_the_same_bytes(logs: Path, trained: TrainResult) -> None:
    source = DirectorySource(logs)
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    again = train(decisions, outcomes, fresh_bundle(), FAST, device="cpu")
    assert again.bundle == trained.bundle
    # Fewer of the same logs, the newest record among them (the same newest time): another version. It was named as the
    # run on all of them (a review), so `weights publish` refused it as other bytes under a published version.
    newest = decisions.column("session_id")[int(np.argmax(decisions.column("time_s").to_numpy()))].as_py()
    sessions = sorted(set(decisions.column("session_id").to_pylist()))
    kept = pa.array([s for s in sessions[::2] if s != newest] + [newest])
    fewer = train(decisions.filter(pc.is_in(decisions.column("session_id"), kept)),
                  outcomes.filter(pc.is_in(outcomes.column("session_id"), kept)), fresh_bundle(), FAST, device="cpu")
    assert fewer.manifest["created_at"] == trained.manifest["created_at"]
    assert fewer.manifest["model_version"] != trained.manifest["model_version"]


def test_cycle_publishes_then_refuses_without_force(logs: Path, tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    cmd = _cycle_command(logs, weights, tmp_path)
    first = subprocess.run([*cmd, "--force"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    report = strict_json(first.stdout)
    assert report["published"] == "published" and "value" in report["dr_difference"]
    # the CronJob's log (not a terminal): one final JSON progress line per stage, with what it did
    final = {line["progress"]: line for line in map(json.loads, (x for x in first.stderr.splitlines() if x.startswith("{")))
             if line["final"]}
    assert {"read.narrow", "read.decisions", "read.outcomes", "train.guard", "train.critic-returns", "train.critic-value",
            "train.updates"} <= set(final)
    assert final["train.critic-returns"]["done"] == final["train.critic-returns"]["total"] == FAST_CYCLE["critic_epochs"]
    assert final["read.decisions"]["done"] == final["read.decisions"]["total"] > 0 and final["read.decisions"]["rows"] > 0
    assert final["train.updates"]["done"] >= 1 and final["train.updates"]["total"] == 2
    assert sum(1 for stage in final if stage.startswith("evaluate.")) == 2  # the gate judged the new and the current bundle
    active = ModelSet.load(read_bundle(weights / "weights_active.bundle"), LoadOptions(warmup_batch=1))
    assert active.version == report["model_version"]
    assert "offline_dr" in active.manifest["training_metrics"]
    fresh_path = tmp_path / "fresh.bundle"
    fresh_path.write_bytes(fresh_bundle_bytes())
    # A tiny step from the untrained default, judged against the trained bundle now active: worse, refused.
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"updates": 1, "batch": 8192, "value_epochs": 2, "critic_epochs": 2, "guard": {"epochs": 2},
                                "bootstrap": 100, "kl_delta": 1e-6}))
    # (the console script ran above; these two in this process: no interpreter and torch start each)
    worse = [*cmd[3:-5], "--config", str(tiny), "--init", str(fresh_path), "--version", "tiny-step", "--device", "cpu", "--json"]
    candidate = tmp_path / "candidate.bundle"
    code, out, err = trainer_in_process(*worse, "--candidate-out", str(candidate))
    assert code == 3, err[-2000:]
    verdict = strict_json(out)
    assert not verdict["publish"] and "published" not in verdict and verdict["dr_difference"]["value"] < 0
    assert verdict["candidate"] == str(candidate)  # the refused bundle is kept for inspection, not published
    assert ModelSet.load(read_bundle(candidate), LoadOptions(warmup_batch=1)).version == "tiny-step"
    assert ModelSet.load(read_bundle(weights / "weights_active.bundle"), LoadOptions(warmup_batch=1)).version == report["model_version"]
    code, out, err = trainer_in_process(*worse[:-1], "--force")  # as a person reads it
    assert code == 0, err[-2000:]
    assert out.startswith("published (forced past the gate: the new bundle may be worse"), out  # not "published:"
    assert ModelSet.load(read_bundle(weights / "weights_active.bundle"), LoadOptions(warmup_batch=1)).version == "tiny-step"


def test_exit_codes_tell_bad_usage_from_failure(logs: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "server", "train", "--logs", str(logs), "--out", str(tmp_path / "x.bundle"), "--device", "cpu"]
    bad_config = tmp_path / "bad.json"
    bad_config.write_text(json.dumps({"kl_delta": -1}))
    usage = subprocess.run([*base, "--config", str(bad_config)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert usage.returncode == 2 and "kl_delta" in usage.stderr
    named = subprocess.run([*base, "--version", "my model"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert named.returncode == 2 and "--version" in named.stderr  # refused before training, not after: no bundle could carry it
    broken = tmp_path / "broken.bundle"
    broken.write_bytes(b"PK\x03\x04 not really a bundle")
    # A bundle file the user named that cannot be read or loaded: one line naming it, bad usage (as `weights verify` says)
    for path, says in ((broken, "invalid bundle"), (tmp_path / "nosuch.bundle", "cannot read bundle")):
        code, _, err = trainer_in_process("train", "--logs", str(logs), "--out", str(tmp_path / "x.bundle"), "--init", str(path))
        assert code == 2 and err.startswith(f"shopping-agent train: --init: {says} {path}") and len(err.splitlines()) == 1, err
    for command in (["evaluate", str(broken), "--logs", str(logs)], ["cycle", "--init", str(broken), "--logs", str(logs),
                                                                     "--weights-dir", str(tmp_path / "w")]):
        code, _, err = trainer_in_process(*command)
        assert code == 2 and f"invalid bundle {broken} (format)" in err and len(err.strip().splitlines()) == 1, err
    # No logs yet (a new deployment's first runs): exit 2, not retried, without a traceback
    empty = tmp_path / "empty"
    (empty / "decisions").mkdir(parents=True)
    for command in (["train", "--out", str(tmp_path / "x.bundle")], ["cycle", "--weights-dir", str(tmp_path / "w")]):
        code, _, err = trainer_in_process(*command, "--logs", str(empty), "--device", "cpu")
        assert code == 2 and err.strip().endswith(f"--logs {empty}: no logs yet: no logged decisions on the training side"), err
    code, _, err = trainer_in_process("evaluate", "default", "--logs", str(empty))
    assert code == 2 and err.strip().endswith(f"--logs {empty}: no logs yet: no logged decisions to evaluate on"), err
    # A weights directory no run can write: refused before the logs are read, naming the flag and the OS's error
    code, _, err = trainer_in_process("cycle", "--logs", str(logs), "--weights-dir", str(broken / "store"), "--device", "cpu")
    assert code == 2 and err.strip() == f"shopping-agent cycle: --weights-dir {broken / 'store'}: cannot be created or written: " \
        f"[Errno 20] Not a directory: '{broken / 'store'}'", err
    assert not (tmp_path / "x.bundle").exists()


def test_mistakes_that_showed_only_after_training_are_refused_before_the_logs_are_read(logs: Path, tmp_path: Path) -> None:
    """A review found these ran the whole training (or read the logs) and then ended in a traceback, exit 1 (a failure
    the CronJob retries): now each is one line naming its flag, exit 2, before any log is read."""
    out = str(tmp_path / "x.bundle")

    def refused(*argv: str) -> str:
        code, _, err = trainer_in_process(*argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "read." not in err, err
        return err.strip()

    assert refused("train", "--logs", str(logs), "--out", "/proc/nosuch/x.bundle").endswith(
        "--out /proc/nosuch/x.bundle: /proc/nosuch is not a directory")
    assert refused("train", "--logs", str(logs), "--out", str(tmp_path)).endswith(f"--out {tmp_path}: is a directory")
    assert refused("cycle", "--logs", str(logs), "--weights-dir", str(tmp_path / "w"), "--candidate-out",
                   f"{out}/c.bundle").endswith(f"--candidate-out {out}/c.bundle: {out} is not a directory")
    import torch

    if not torch.cuda.is_available():  # (on a GPU machine the flag is right)
        assert "--device cuda: torch sees no CUDA device" in refused("train", "--logs", str(logs), "--out", out, "--device", "cuda")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    cycle = ("cycle", "--logs", str(logs), "--weights-dir", str(tmp_path / "w"))
    assert "--public-key: the weights directory takes only signed bundles: give --sign-key too" in refused(
        *cycle, "--public-key", str(junk))
    assert f"--public-key: {junk}: not a readable PEM public key" in refused(*cycle, "--public-key", str(junk), "--sign-key", str(junk))
    from weights.signing import keypair_pem

    (tmp_path / "k.pub").write_bytes(keypair_pem()[1])
    assert f"--sign-key: {junk}: not a readable unencrypted PEM private key" in refused(
        *cycle, "--public-key", str(tmp_path / "k.pub"), "--sign-key", str(junk))
    (tmp_path / "other.pem").write_bytes(keypair_pem()[0])  # a key of its kind, but not the one k.pub trusts
    assert f"--sign-key: {tmp_path / 'other.pem'}: its public key is not among --public-key {tmp_path / 'k.pub'}'s 1" in refused(
        *cycle, "--public-key", str(tmp_path / "k.pub"), "--sign-key", str(tmp_path / "other.pem"))
    private, public = keypair_pem()  # a pair that matches gets past the check (to the logs: here none yet)
    (tmp_path / "mine.pem").write_bytes(private)
    (tmp_path / "both.pub").write_bytes(keypair_pem()[1] + public)  # a rotation's file: the old key and this one
    (tmp_path / "none" / "decisions").mkdir(parents=True)
    code, _, err = trainer_in_process("cycle", "--logs", str(tmp_path / "none"), "--weights-dir", str(tmp_path / "w"), "--public-key",
                                      str(tmp_path / "both.pub"), "--sign-key", str(tmp_path / "mine.pem"))
    assert code == 2 and err.strip().endswith("no logs yet: no logged decisions on the training side"), err
    (tmp_path / "bogus.json").write_text(json.dumps({"updates": 1, "bogus_key": 1}))
    assert "--config: unknown key(s) ['bogus_key']; allowed: ['seed'," in refused(
        "train", "--logs", str(logs), "--out", out, "--config", str(tmp_path / "bogus.json"))
    (tmp_path / "seed.json").write_text(json.dumps({"seed": -1}))
    assert "seed: expected an integer >= 0, got -1" in refused("train", "--logs", str(logs), "--out", out, "--config",
                                                                str(tmp_path / "seed.json"))
    # the flags' values are TrainConfig's to check, named as the flags (they were "--config: …" with no --config given)
    assert refused("train", "--logs", str(logs), "--out", out, "--seed", "-2", "--updates", "0").endswith(
        "--seed: expected an integer >= 0, got -2; --updates: expected >= 1, got 0")
    (tmp_path / "both.json").write_text(json.dumps({"kl_delta": -1}))
    assert refused("train", "--logs", str(logs), "--out", out, "--config", str(tmp_path / "both.json"), "--updates", "0").endswith(
        "--updates: expected >= 1, got 0; --config: kl_delta: expected > 0, got -1")
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(None):  # evaluate's own flag: argparse, exit 2
        trainer_in_process("evaluate", "default", "--logs", str(logs), "--bootstrap", "0")
    assert exited.value.code == 2
    # Logs too few to split (one session): not enough logs yet, exit 2 as no logs at all, not a retried failure
    tiny = tmp_path / "tiny"
    run_logged(World(SimConfig(), 11), ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8)), range(1), ZoneInfo("UTC"),
               tiny, b"k" * 32)
    for argv in (("train", "--logs", str(tiny), "--out", out, "--device", "cpu"), ("evaluate", "default", "--logs", str(tiny))):
        code, _, err = trainer_in_process(*argv)
        assert code == 2 and f"--logs {tiny}: not enough logs yet: " in err and "Traceback" not in err, err


def _cycle_command(logs: Path, weights: Path, tmp_path: Path) -> list[str]:
    """``cycle`` as the CronJob runs it, on a short config written under ``tmp_path`` (two updates, one batch)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(FAST_CYCLE))
    return [sys.executable, "-m", "server", "cycle", "--logs", str(logs), "--weights-dir", str(weights), "--config",
            str(config), "--device", "cpu", "--json"]


def _once_training(run: subprocess.Popen[str]) -> Callable[[], str]:
    """Wait (up to 300 s) until the run's stderr reports training; returns what reads the rest of its stderr, after
    the run has ended."""
    assert run.stderr is not None
    stderr, lines = run.stderr, queue.Queue[str]()

    def read() -> None:
        for line in stderr:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline, seen = time.monotonic() + 300, list[str]()
    while not any(line.startswith('{"progress": "train.') for line in seen):
        remaining = deadline - time.monotonic()
        assert remaining > 0 and run.poll() is None, "the cycle never started training: " + "".join(seen)[-2000:]
        with contextlib.suppress(queue.Empty):
            seen.append(lines.get(timeout=min(remaining, 1.0)))

    def rest() -> str:
        reader.join(10)
        return "".join(seen) + "".join(lines.queue)

    return rest


@pytest.mark.parametrize("entry", ["server", "trainer"])
def test_sigterm_mid_cycle_leaves_the_store_as_it_was_and_its_lock_free(logs: Path, tmp_path: Path, entry: str) -> None:
    """The CronJob's pod deleted mid-run: the run ends as on Ctrl-C (exit 143, one line), the served bundle and its
    history are as they were, no temp file is left, and the next publisher gets the lock. The same for ``python -m
    trainer``, which torchrun runs and stops with SIGTERM (it was killed where it stood: exit -15, no line)."""
    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    before, history = store.active_path.read_bytes(), [e.model_version for e in store.history()]
    cmd = [*_cycle_command(logs, weights, tmp_path), "--force"]
    cmd[2] = entry  # python -m server (the console script's module) or python -m trainer
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as run:
        read_err = _once_training(run)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        err = read_err()
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().endswith("shopping-agent cycle: stopped by SIGTERM") and "Traceback" not in err, err[-2000:]
    assert store.active_path.read_bytes() == before and [e.model_version for e in store.history()] == history
    assert not list(weights.glob(".tmp-*"))
    assert store.publish(variant_bytes("after-the-stop")).status == "published"  # the lock is free


def test_cycle_does_not_undo_a_publish_made_while_it_ran(logs: Path, tmp_path: Path) -> None:
    """An operator publishes (or rolls back) while a CronJob run trains: the run must not replace that bundle with a
    candidate it never compared with it (a review found it did). Real processes, the store's real lock."""
    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    cmd = [*_cycle_command(logs, weights, tmp_path), "--force"]  # forced: it would publish whatever the gate says
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as run:
        read_err = _once_training(run)  # the active bundle is read before the logs: once training reports, the run has
        operator = variant_bytes("operator-1")  # read what it judges against
        assert store.publish(operator).status == "published"
        assert run.stdout is not None
        out = run.stdout.read()
        run.wait(timeout=600)
        err = read_err()
    assert run.returncode == 3, err[-2000:]
    report = strict_json(out)
    assert "published" not in report and "changed" in report["not_published"]
    assert store.active_path.read_bytes() == operator  # the operator's bundle still serves
    assert [e.model_version for e in store.history()][-1] == "operator-1"
