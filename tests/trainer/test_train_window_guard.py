"""What a run reads and ships: the window of the logs, the guard's budget on what is served, applied steps reported as applied.

Real simulator logs through the real recorder, the real trainer (a short config), real bundles.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest
import torch

from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import fresh_bundle
from tests.weights import hostile
from trainer.config import GuardConfig, TrainConfig
from trainer.train import TrainResult, train
from weights import mlp
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

FAST = TrainConfig(updates=2, batch=4096, value_epochs=1, critic_epochs=1, guard=GuardConfig(epochs=1), bootstrap=50)
SESSIONS = 1500


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    """Two versions in one directory, as the CronJob leaves it: the fresh bundle's logs, then a trained bundle's."""
    root = tmp_path_factory.mktemp("window-logs")
    world = World(SimConfig(), 23)
    run_logged(world, ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8)), range(SESSIONS), ZoneInfo("UTC"), root, b"w" * 32,
               clock=lambda: 1_000_000.0)
    source = DirectorySource(root)
    first = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), FAST, device="cpu", model_version="second")
    run_logged(world, ModelSet.load(read_bundle(first.bundle), LoadOptions(warmup_batch=8)), range(SESSIONS, 2 * SESSIONS),
               ZoneInfo("UTC"), root, b"w" * 32, clock=lambda: 1_003_600.0)
    return root, first


def test_the_window_reads_the_last_version_only(logs: tuple[Path, TrainResult]) -> None:
    root, first = logs
    source = DirectorySource(root)
    d, o = source.table("decisions"), source.table("outcomes")
    result = train(d, o, read_bundle(first.bundle), FAST, device="cpu")
    window = result.manifest["trainer"]["window"]
    assert window["model_versions"] == ["second"] and window["versions"] == 1
    second_rows = int(np.sum(np.asarray(d.column("model_version").to_pylist()) == "second"))
    assert window["decisions"] == second_rows < d.num_rows
    everything = train(d, o, read_bundle(first.bundle), dataclasses.replace(FAST, window_versions=None), device="cpu")
    assert everything.manifest["trainer"]["window"]["model_versions"] == ["default-init-20261130", "second"]
    assert everything.metrics["train_steps"] > result.metrics["train_steps"]


def test_a_keyed_sample_of_the_window_is_what_a_run_reads_and_records(logs: tuple[Path, TrainResult]) -> None:
    root, first = logs
    source = DirectorySource(root)
    d, o = source.table("decisions"), source.table("outcomes")
    config = dataclasses.replace(FAST, max_sessions=500, sample_key=7)
    sampled = train(d, o, read_bundle(first.bundle), config, device="cpu")
    window = sampled.manifest["trainer"]["window"]
    assert window["sessions"] == 500 and window["sessions_in_window"] == SESSIONS
    assert window["max_sessions"] == 500 and window["sample_key"] == 7 and window["model_versions"] == ["second"]
    assert sampled.manifest["trainer"]["config"]["max_sessions"] == 500
    again = train(d, o, read_bundle(first.bundle), config, device="cpu")
    assert again.bundle == sampled.bundle  # the same logs and key: the same sample, the same bytes


def test_a_guard_change_over_the_budget_keeps_the_starting_guard(logs: tuple[Path, TrainResult]) -> None:
    root, _ = logs
    source = DirectorySource(root)
    init = fresh_bundle()
    # a guard allowed to block half of the harmless pairs, and worth it when a harm costs 1,000 false blocks,
    # changes what is served far more than a budget of 1e-9
    config = dataclasses.replace(FAST, window_versions=None, guard_kl_budget=1e-9,
                                 guard=GuardConfig(epochs=1, max_false_block_rate=0.5, harm_cost_ratio=1000.0))
    result = train(source.table("decisions"), source.table("outcomes"), init, config, device="cpu")
    assert result.metrics["guard_kept_from_start"] == 1.0
    assert any("guard_kl_budget" in w for w in result.warnings)  # the warning names the candidate's KL
    shipped = mlp.guard_params_from_onnx(read_bundle(result.bundle).parts["guard.onnx"])
    start = mlp.guard_params_from_onnx(init.parts["guard.onnx"])
    for a, b in zip(shipped, start, strict=True):
        np.testing.assert_array_equal(a, b)
    threshold = result.manifest["guard"]["threshold"]
    assert threshold in (init.manifest["guard"]["threshold"], 0.0)  # 0.0: it no longer earns a veto
    if threshold == init.manifest["guard"]["threshold"]:
        assert result.metrics["guard_served_kl"] == 0.0  # what ships is the starting guard: no change to report
    roomy = train(source.table("decisions"), source.table("outcomes"), init, dataclasses.replace(config, guard_kl_budget=None),
                  device="cpu")
    assert roomy.metrics["guard_kept_from_start"] == 0.0


def test_a_kept_guard_whose_veto_no_longer_earns_its_place_is_shipped_without_it_and_says_so(logs: tuple[Path, TrainResult]) -> None:
    """The starting guard vetoing every action below allow-probability 0.9001 (about 8 % of these pages wholly vetoed):
    any retrained guard moves what is served far past the budget, so the starting one is kept, and judged again its veto
    does not beat never blocking. It ships without it; the warning, ``guard_veto_dropped`` and ``guard_served_kl`` say
    so, where the warning said only that the guard was kept (a review: the served distribution moved by KL 4.9-5.6)."""
    root, _ = logs
    source = DirectorySource(root)
    base = fresh_bundle()
    init = read_bundle(hostile.rebuilt(base=base, guard={"threshold": 0.9001}, model_version="veto-9001"))
    result = train(source.table("decisions"), source.table("outcomes"), init, dataclasses.replace(FAST, window_versions=None),
                   device="cpu")
    assert result.metrics["guard_kept_from_start"] == 1.0 and result.metrics["guard_veto_dropped"] == 1.0
    assert result.manifest["guard"]["threshold"] == 0.0
    assert FAST.guard_kl_budget is not None and result.metrics["guard_served_kl"] > FAST.guard_kl_budget  # its cost, reported
    warning = next(w for w in result.warnings if "guard_kl_budget" in w)
    assert warning.endswith(f"is dropped, which moves the served distribution by KL {result.metrics['guard_served_kl']:.3f}")
    assert logs[1].metrics["guard_veto_dropped"] == 0.0  # the fixture's run kept no guard


def test_a_step_shrunk_to_nothing_is_not_reported_as_applied(logs: tuple[Path, TrainResult]) -> None:
    root, _ = logs
    source = DirectorySource(root)
    config = dataclasses.replace(FAST, window_versions=None, max_behavior_kl=1e-12, guard_kl_budget=None)
    result = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), config, device="cpu")
    assert result.metrics["updates_accepted"] == 0.0 and result.metrics["surrogate_improvement"] == 0.0
    assert result.metrics["kl_served_policy_steps"] == pytest.approx(0.0, abs=1e-12)
    # nor are the steps the support stop undid: no binding rate or multiplier of theirs, and the run says none was taken
    assert result.metrics["constraint_activation_rate"] == 0.0 and "lagrange_multiplier" not in result.metrics  # (nan: left out)
    assert "no natural-gradient step was taken: the bundle's policy is the starting one" in result.warnings
    # what is served still changed: the retrained guard and the shipped exploration (ε 0.05 → 0.1) count against the start
    assert result.metrics["kl_served_to_start"] > 1e-4
    same = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(),
                 dataclasses.replace(config, exploration_epsilon=None, guard_kl_budget=0.0), device="cpu")
    assert same.metrics["kl_served_to_start"] <= result.metrics["kl_served_to_start"]
    free = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(),
                 dataclasses.replace(config, max_behavior_kl=None), device="cpu")
    assert free.metrics["updates_accepted"] >= 1 and free.metrics["kl_served_policy_steps"] > 0.0
    # each step is sized to δ on the served distribution; n aligned steps compose to at most about (n √δ)²
    assert free.metrics["kl_served_policy_steps"] <= 1.5 * FAST.updates**2 * FAST.kl_delta
    on_policy = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(),
                      dataclasses.replace(config, max_behavior_kl=None, trust_region="policy"), device="cpu")
    assert on_policy.metrics["kl_served_policy_steps"] > free.metrics["kl_served_policy_steps"]  # δ on q overshoots what is served


def test_the_critic_option_trains_and_reports_its_fit(logs: tuple[Path, TrainResult]) -> None:
    root, _ = logs
    source = DirectorySource(root)
    runs = {}
    for surrogate in ("logged", "expected"):
        config = dataclasses.replace(FAST, window_versions=None, advantage="critic", surrogate=surrogate)
        result = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), config, device="cpu")
        assert result.metrics["updates_accepted"] >= 1 and result.metrics["kl_served_policy_steps"] > 0.0
        assert {"critic_return_r2", "critic_value_rmse", "critic_return_r2_heldout"} <= set(result.metrics)
        assert result.manifest["trainer"]["config"]["advantage"] == "critic"
        assert result.manifest["trainer"]["config"]["surrogate"] == surrogate
        assert result.policy is not None
        runs[surrogate] = torch.cat([p.detach().reshape(-1) for p in result.policy.parameters()])
    # the same critic (same seed, same rows): only the surrogate differs, so must the steps it took
    assert not torch.allclose(runs["logged"], runs["expected"])
    # R_ψ fitted without the rows' capped inverse propensities (the default weighs them): another critic, another step
    config = dataclasses.replace(FAST, window_versions=None, advantage="critic", critic_weight_cap=None)
    plain = train(source.table("decisions"), source.table("outcomes"), fresh_bundle(), config, device="cpu")
    assert plain.manifest["trainer"]["config"]["critic_weight_cap"] is None and plain.policy is not None
    assert TrainConfig().critic_weight_cap == 100.0  # the runs above weighed their rows
    assert not torch.allclose(torch.cat([p.detach().reshape(-1) for p in plain.policy.parameters()]), runs["logged"])
