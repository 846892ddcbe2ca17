"""Engagement weights in the trainer: read with the window, joined to the training steps, applied before the returns, recorded.

Real simulator logs through the real recorder (the simulator reports every page's engagement), the real two-pass reader,
the real trainer on a short config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from experience.engagement import EngagementWeights
from experience.returns import discounted_returns
from experience.segments import DirectorySource
from trainer.cli import UsageError, _config
from trainer.config import GuardConfig, TrainConfig
from trainer.data import Experience, experience, training_reports, training_rows
from trainer.reading import read_window
from trainer.train import train
from weights.embedded import default_bundle
from weights.model_set import ModelSet

PLAIN = TrainConfig(normalize_rewards=False)
WEIGHTED = dataclasses.replace(PLAIN, engagement_weights=EngagementWeights())


def test_the_window_carries_its_sessions_engagement_reports_when_the_run_uses_them(sim_logs: Path) -> None:
    assert read_window(DirectorySource(sim_logs), PLAIN).engagements.num_rows == 0  # weights off: not even read
    window = read_window(DirectorySource(sim_logs), WEIGHTED)
    assert window.engagements.num_rows == window.decisions.num_rows  # the simulator reports every page
    decisions = set(window.decisions.column("decision_id").to_pylist())
    assert set(window.engagements.column("decision_id").to_pylist()) == decisions
    assert pc.all(pc.is_in(window.engagements.column("session_id"), window.decisions.column("session_id"))).as_py()


def test_weighted_returns_are_the_returns_of_the_weighted_rewards(sim_logs: Path, default_model: ModelSet) -> None:
    window = read_window(DirectorySource(sim_logs), WEIGHTED)
    rows, outcomes = training_rows(window.decisions, window.outcomes, PLAIN.heldout_fraction, PLAIN.seed)
    reports = training_reports(window.engagements, PLAIN.heldout_fraction, PLAIN.seed)
    plain = experience(window.decisions, outcomes, default_model, PLAIN, rows, engagements=reports)
    weighted = experience(window.decisions, outcomes, default_model, WEIGHTED, rows, engagements=reports)
    assert plain.engagement is None
    join = weighted.engagement
    assert join is not None
    # every training step has its report, and no report of the training side is left out
    assert join["n_steps_weighted"] == join["n_steps"] == len(rows) == join["n_reports"]
    assert join["n_unknown_decision"] == join["n_outside_horizon"] == join["n_duplicates"] == 0
    rewarded = plain.episodes.rewards != 0
    assert rewarded.sum() > 20
    ratio = weighted.episodes.rewards[rewarded] / plain.episodes.rewards[rewarded]
    assert np.allclose(ratio, 1.0)  # the episodes keep the raw rewards; only the returns are weighted ...
    w = np.divide(*_returns_at_last_steps(weighted, plain))
    assert ((w >= 0.25 - 1e-9) & (w <= 1.5 + 1e-9)).all() and np.ptp(w) > 0.5  # ... by weights within the bounds, not all alike
    # and with every report's weight, the weighted returns are exactly the returns of w_t r_t
    order = {d: i for i, d in enumerate(weighted.decisions.column("decision_id").to_pylist())}
    per_step = np.ones(len(order))
    by_decision = reports.to_pylist()
    values = EngagementWeights().of(np.array([r["dwell_s"] for r in by_decision], dtype=float),
                                    np.array([r["scroll_depth"] for r in by_decision], dtype=float),
                                    np.array([float(r["bounced"]) for r in by_decision]))
    per_step[[order[r["decision_id"]] for r in by_decision]] = values
    expected = discounted_returns(plain.episodes.rewards * per_step, plain.episodes.starts, plain.episodes.lengths, PLAIN.gamma)
    np.testing.assert_allclose(weighted.returns, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(weighted.returns, plain.returns)


def _returns_at_last_steps(weighted: Experience, plain: Experience) -> tuple[np.ndarray, np.ndarray]:
    """The last step's return of sessions whose last step is rewarded: G = w r there, so G_w / G is that step's weight."""
    ends = plain.episodes.ends
    last = ends[plain.episodes.rewards[ends] != 0]
    return weighted.returns[last], plain.returns[last]


def test_a_run_with_weights_records_them_and_what_the_join_did(sim_logs: Path) -> None:
    fast = dataclasses.replace(WEIGHTED, updates=1, batch=2048, value_epochs=1, critic_epochs=1, guard=GuardConfig(epochs=1), bootstrap=20,
                               normalize_rewards=True)
    window = read_window(DirectorySource(sim_logs), fast)
    result = train(window.decisions, window.outcomes, default_bundle(), fast, device="cpu", window=window)
    trainer = result.manifest["trainer"]
    assert trainer["config"]["engagement_weights"] == EngagementWeights().to_dict()
    metrics = result.manifest["training_metrics"]
    assert metrics["engagement_n_steps_weighted"] == metrics["train_steps"] == metrics["engagement_n_reports"]
    assert 0.25 <= metrics["engagement_mean_weight"] <= 1.5 and metrics["engagement_mean_weight"] != 1.0
    off = train(window.decisions, window.outcomes, default_bundle(), dataclasses.replace(fast, engagement_weights=None), device="cpu",
                window=window)
    assert off.manifest["trainer"]["config"]["engagement_weights"] is None
    assert not any(k.startswith("engagement_") for k in off.manifest["training_metrics"])
    assert not any("engagement" in w for w in result.warnings + off.warnings)
    # weights asked for on a window with no reports (whole tables): it trains, and says every step weighed 1
    blind = train(window.decisions, window.outcomes, default_bundle(), fast, device="cpu")
    assert any("no engagement report" in w for w in blind.warnings) and blind.manifest["training_metrics"]["engagement_n_reports"] == 0


def test_a_shard_keeps_its_sessions_reports_and_only_them(sim_logs: Path) -> None:
    from trainer.reading import shard_of
    from trainer.window import restrict

    window = read_window(DirectorySource(sim_logs), WEIGHTED)
    shards = [restrict(window, lambda ids, r=r: shard_of(ids, r, 2)) for r in range(2)]  # type: ignore[misc]
    assert sum(s.engagements.num_rows for s in shards) == window.engagements.num_rows
    for s in shards:
        assert set(s.engagements.column("session_id").to_pylist()) == set(s.decisions.column("session_id").to_pylist())
    read = [read_window(DirectorySource(sim_logs), WEIGHTED, shard=(r, 2)) for r in range(2)]  # each rank's own read
    for mine, theirs in zip(read, shards, strict=True):
        ids = (sorted(w.engagements.column("engagement_id").to_pylist()) for w in (mine, theirs))
        assert next(ids) == next(ids)


def test_a_config_with_the_weights_as_a_plain_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="engagement_weights: expected EngagementWeights or None"):
        TrainConfig(engagement_weights={"bounce": 0.5})  # type: ignore[arg-type]


def test_the_cli_config_takes_the_weights_as_an_object_and_names_a_bad_field(tmp_path: Path) -> None:
    class Args:
        config = tmp_path / "c.json"

    Args.config.write_text(json.dumps({"engagement_weights": {"bounce": 0.8}}))
    assert _config(Args()).engagement_weights == EngagementWeights(bounce=0.8)  # type: ignore[arg-type]
    Args.config.write_text(json.dumps({"engagement_weights": {}}))
    assert _config(Args()).engagement_weights == EngagementWeights()  # type: ignore[arg-type]
    Args.config.write_text(json.dumps({"engagement_weights": {"low": 2}}))
    with pytest.raises(UsageError, match=r"engagement_weights\.low, high"):
        _config(Args())  # type: ignore[arg-type]


def test_the_gate_judges_the_objective_whatever_the_weights(sim_logs: Path, default_model: ModelSet) -> None:
    """The weights reshape what the trainer optimises, never what the gate estimates: the same held-out estimate with or
    without them, and it is the business objective's (evaluate_bundle's default episodes)."""
    from trainer.cycle import judged
    from trainer.data import side
    from trainer.evaluation import evaluate_bundle

    window = read_window(DirectorySource(sim_logs), PLAIN)
    held_d, held_o = side(window.decisions, window.outcomes, 0.5, 0, heldout=True)
    fast_plain, fast_weighted = (dataclasses.replace(c, bootstrap=20) for c in (PLAIN, WEIGHTED))
    plain, weighted = judged(fast_plain, default_model, held_d, held_o), judged(fast_weighted, default_model, held_d, held_o)
    objective = evaluate_bundle(default_model, held_d, held_o, n_boot=20, seed=fast_plain.seed, max_ratio=fast_plain.max_ratio)
    assert plain.report.dr == weighted.report.dr == objective.report.dr
    assert plain.report.ips == weighted.report.ips
