"""Logged decisions replayed through the bundle that served them give back what was logged, states included."""

from __future__ import annotations

import warnings
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest

from core.domain import DecisionRequest, PageType
from experience.recorder import ExperienceRecorder, RecorderOptions
from experience.segments import DirectorySource
from policy.features import context_of
from trainer.replay import logged_steps, replay
from weights.model_set import ModelSet


def test_replay_of_the_serving_bundle_reproduces_the_logged_behaviour(sim_logs: Path, default_model: ModelSet) -> None:
    decisions = DirectorySource(sim_logs).table("decisions")
    steps = logged_steps(decisions, default_model)
    assert len(steps) == decisions.num_rows > 1000
    again = replay(default_model, steps, chunk=333)  # chunking changes nothing
    np.testing.assert_allclose(again.served.sum(axis=1), 1.0, atol=1e-12)
    # The logged embedding is float16: the replayed state differs from the served one by
    # rounding, so the served probabilities agree closely, not bit for bit.
    np.testing.assert_allclose(again.served, steps.behavior_probs, atol=5e-3)
    logged_action_prob = again.served[np.arange(len(steps)), steps.actions]
    np.testing.assert_allclose(logged_action_prob, steps.propensity, atol=5e-3)
    assert (again.served[~again.allowed & again.ok[:, None]] == 0).all()  # vetoed or banned: never served by the decoder
    assert np.isneginf(again.log_weights[:, 4]).all()  # exit has static weight 0 in the default bundle


def test_state_rebuilt_from_the_log_is_the_state_the_server_computed(tmp_path: Path, default_model: ModelSet) -> None:
    """Behaviour buckets, not ids, on disk: the encoder gets back exactly what it read when the server decided."""
    rng = np.random.default_rng(5)
    histories = [(), ("search:red shoes",), ("view:a", "view:a"), ("view:a", "cart:b", "search:c d", "older", "oldest")]
    requests = [
        DecisionRequest(user_id=f"u{i}", session_id=f"s{i % 3}", item_id=f"item-{i}",
                        item_embedding=rng.standard_normal(768).astype(np.float16).astype(np.float32),  # exact in float16
                        recent_behavior_ids=histories[i % len(histories)], page_type=PageType(1 + i % 3),
                        event_time_s=1.79e9 + 3_600.0 * i, cart_item_count=i % 5, request_id=f"r{i}")
        for i in range(40)
    ]
    contexts = [context_of(r, ZoneInfo("UTC")) for r in requests]
    ids = [f"{i:032x}" for i in range(len(requests))]
    served_states = default_model.encoder.encode_batch(requests, [c.hour for c in contexts])
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions())
    for req, ctx, did, decision in zip(requests, contexts, ids, default_model.run(requests, contexts, ids), strict=True):
        recorder.decision(req, ctx.hour, decision, did, default_model.encoder.spec)
    recorder.close()
    decisions = DirectorySource(tmp_path).table("decisions")
    assert decisions.column("decision_id").to_pylist() == ids
    steps = logged_steps(decisions, default_model)
    assert np.array_equal(steps.states, served_states)  # bit for bit
    assert steps.contexts == contexts  # n_recent_behaviors counts every id, not only the window's


def test_logs_of_another_bucket_count_are_refused(sim_logs: Path, default_model: ModelSet) -> None:
    decisions = DirectorySource(sim_logs).table("decisions").slice(0, 10)
    other = decisions.set_column(decisions.schema.get_field_index("behavior_bucket_count"), "behavior_bucket_count",
                                 pa.array([4096] * 10, pa.int32()))
    with pytest.raises(ValueError, match="logged with 4096 behaviour buckets, the bundle's encoder has 2048"):
        logged_steps(other, default_model)


def test_a_value_logged_past_float16_is_read_back_saturated(tmp_path: Path, default_model: ModelSet) -> None:
    """A server before the request bound logged 70,000 as inf: the trainer reads it as float16's largest, 65504, so the
    row's state and the bundle's outputs on it are finite (one such request used to stop every run on its logs)."""
    embedding = np.zeros(768, dtype=np.float32)
    embedding[:3] = (7e4, -7e4, 1.5)
    request = DecisionRequest("u", "s", "i", embedding, (), PageType.DETAIL, 1.79e9, 1)
    context = context_of(request, ZoneInfo("UTC"))
    recorder = ExperienceRecorder(tmp_path, b"k" * 32, RecorderOptions())  # not started: flushed here
    (decision,) = default_model.run([request], [context], ["0" * 32])
    recorder.decision(request, context.hour, decision, "0" * 32, default_model.encoder.spec)
    with warnings.catch_warnings():  # as a server writes it (the suite makes the cast's overflow warning an error)
        warnings.simplefilter("ignore", RuntimeWarning)
        recorder.flush()
    recorder.close()
    decisions = DirectorySource(tmp_path).table("decisions")
    assert np.isinf(decisions.column("item_embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)[:2]).all()
    steps = logged_steps(decisions, default_model)
    assert steps.states[0, :3].tolist() == [65504.0, -65504.0, 1.5]
    assert np.isfinite(replay(default_model, steps).served).all()
