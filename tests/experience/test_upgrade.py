"""Version-1 segments (raw ids, as servers write them before this version) read as version 2: same rows, same joins, same states.

The same simulated sessions are logged twice: by the version-1 writer (frozen here, column
for column as it was) and by today's recorder. Read back, the version-1 logs must give
today's tables, the same episodes and the same states, with the servers' salt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pytest

from experience.recorder import ExperienceRecorder, RecorderOptions
from experience.records import LoggedDecision, LoggedOutcome, hash_user
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from experience.upgrade import V1_SCHEMAS, V1Reading
from policy.features import FeatureSpec, behavior_buckets
from simulator.config import SimConfig
from simulator.drive import run_in_process
from simulator.world import World
from trainer.replay import logged_steps
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet

SALT = b"servers-salt".ljust(32, b".")
CLOCK_S = 1_795_996_800.0


def v1_decisions(items: Sequence[LoggedDecision], salt: bytes) -> pa.RecordBatch:
    """The version-1 writer's decision rows: every id as sent, the behaviour ids raw."""
    reqs, ds = [i.request for i in items], [i.decision for i in items]
    columns: dict[str, Any] = {
        "schema_version": [1] * len(items), "decision_id": [i.decision_id for i in items], "time_s": [i.time_s for i in items],
        "event_time_s": [r.event_time_s for r in reqs], "session_id": [r.session_id for r in reqs],
        "user_hash": [hash_user(r.user_id, salt) for r in reqs], "item_id": [r.item_id for r in reqs],
        "request_id": [r.request_id for r in reqs], "item_embedding": [r.item_embedding.astype(np.float16) for r in reqs],
        "recent_behavior_ids": [list(r.recent_behavior_ids) for r in reqs], "page_type": [int(r.page_type) for r in reqs],
        "cart_item_count": [r.cart_item_count for r in reqs], "hour": [i.hour for i in items],
        "action": [int(d.action) for d in ds], "source": [int(d.source) for d in ds], "propensity": [d.propensity for d in ds],
        "votes": [d.votes for d in ds], "samples": [d.samples for d in ds],
        "served_probs": [d.served_probs.tolist() for d in ds], "policy_probs": [d.policy_probs.tolist() for d in ds],
        "allow_probs": [d.allow_probs.tolist() for d in ds], "blocked": [d.blocked.tolist() for d in ds],
        "vetoed": [list(d.vetoed or (False,) * 5) for d in ds], "guardrail_hits": [list(d.guardrail_hits) for d in ds],
        "rule": [d.rule for d in ds], "model_version": [d.model_version for d in ds], "sample_rate": [1.0] * len(items),
    }
    return pa.RecordBatch.from_pydict(columns, schema=V1_SCHEMAS["decisions"])


def v1_outcomes(items: Sequence[LoggedOutcome]) -> pa.RecordBatch:
    reports = [i.report for i in items]
    return pa.RecordBatch.from_pydict({
        "schema_version": [1] * len(items), "outcome_id": [r.outcome_id for r in reports],
        "decision_id": [r.decision_id for r in reports], "session_id": [r.session_id for r in reports],
        "outcome": [int(r.outcome) for r in reports], "value": [r.value for r in reports],
        "coupon_discount": [r.coupon_discount for r in reports], "event_time_s": [r.event_time_s for r in reports],
        "received_s": [i.received_s for i in items], "sample_rate": [1.0] * len(items),
    }, schema=V1_SCHEMAS["outcomes"])


def write_v1_segment(root: Path, kind: str, batch: pa.RecordBatch, name: str = "20250101T000000000000Z-old-1-000001") -> None:
    """A finalised version-1 segment, written as that version's writer wrote them (an IPC stream, zstd)."""
    (root / kind).mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(root / kind / f"{kind}-{name}.arrows"), "w") as f, \
            pa.ipc.new_stream(f, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)


class Capture:
    """Stands in for the recorder in ``run_in_process``: keeps what it is handed."""

    def __init__(self) -> None:
        self.decisions: list[LoggedDecision] = []
        self.outcomes: list[LoggedOutcome] = []

    def decision(self, request: Any, hour: int, decision: Any, decision_id: str, spec: FeatureSpec) -> bool:
        self.decisions.append(LoggedDecision(request, hour, decision, decision_id, CLOCK_S, spec))
        return True

    def outcome(self, report: Any) -> bool:
        self.outcomes.append(LoggedOutcome(report, CLOCK_S))
        return True

    def engagement(self, report: Any) -> bool:
        return True  # version 1 had no engagement records: nothing to keep

    def flush(self) -> None:
        pass


@pytest.fixture(scope="module")
def model() -> ModelSet:
    return ModelSet.load(default_bundle(), LoadOptions(warmup_batch=8))


@pytest.fixture(scope="module")
def logged(model: ModelSet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Capture]]:
    """40 simulated sessions logged by the version-1 writer (``v1/``) and by today's recorder (``v2/``)."""
    capture = Capture()
    run_in_process(World(SimConfig(), 3), model, range(40), ZoneInfo("UTC"), capture)  # type: ignore[arg-type]
    root = tmp_path_factory.mktemp("upgrade")
    write_v1_segment(root / "v1", "decisions", v1_decisions(capture.decisions, SALT))
    write_v1_segment(root / "v1", "outcomes", v1_outcomes(capture.outcomes))
    recorder = ExperienceRecorder(root / "v2", SALT, RecorderOptions(), clock=lambda: CLOCK_S)
    for item in capture.decisions:
        recorder.decision(item.request, item.hour, item.decision, item.decision_id, item.spec)
    for o in capture.outcomes:
        recorder.outcome(o.report)
    recorder.close()
    yield root / "v1", root / "v2", capture


def tables(source: DirectorySource) -> tuple[pa.Table, pa.Table]:
    return source.table("decisions"), source.table("outcomes")


def test_version_1_segments_read_as_todays_rows(logged: tuple[Path, Path, Capture]) -> None:
    v1, v2, capture = logged
    old, new = tables(DirectorySource(v1, V1Reading(SALT))), tables(DirectorySource(v2))
    assert old[0].num_rows == new[0].num_rows == len(capture.decisions) > 50
    assert old[1].num_rows == new[1].num_rows == len(capture.outcomes) > 0
    for upgraded, current in zip(old, new, strict=True):
        assert upgraded.column("schema_version").to_pylist() == [1] * upgraded.num_rows  # where each row came from
        assert current.column("schema_version").to_pylist() == [2] * current.num_rows
        assert upgraded.drop_columns(["schema_version"]).equals(current.drop_columns(["schema_version"]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old[0].schema) as writer:  # uncompressed: every string as it is
        writer.write_table(old[0])
    upgraded_bytes = sink.getvalue().to_pybytes()
    raw = {text for i in capture.decisions for text in (i.request.session_id, i.request.item_id, *i.request.recent_behavior_ids)}
    assert raw and not [text for text in raw if text.encode() in upgraded_bytes]  # no raw id even in memory


def test_version_1_logs_join_and_give_the_same_states(logged: tuple[Path, Path, Capture], model: ModelSet) -> None:
    v1, v2, _ = logged
    old, new = tables(DirectorySource(v1, V1Reading(SALT))), tables(DirectorySource(v2))
    a, b = build_episodes(*old), build_episodes(*new)
    assert a.n_episodes == b.n_episodes == 40 and a.report == b.report
    np.testing.assert_array_equal(a.rewards, b.rewards)
    mixed = build_episodes(old[0], new[1])  # decisions from before the upgrade, outcomes from after: one key
    np.testing.assert_array_equal(mixed.rewards, b.rewards)
    assert mixed.report.n_orphan_outcomes == 0
    states_old, states_new = logged_steps(old[0], model), logged_steps(new[0], model)
    assert np.array_equal(states_old.states, states_new.states) and states_old.contexts == states_new.contexts


def test_without_the_salt_version_1_sessions_stand_apart(logged: tuple[Path, Path, Capture], caplog: pytest.LogCaptureFixture) -> None:
    v1, v2, _ = logged
    caplog.set_level(logging.WARNING)
    source = DirectorySource(v1)  # no salt: ids hashed without a key, in memory only
    old, new = tables(source), tables(DirectorySource(v2))
    assert set(old[0].column("session_id").to_pylist()).isdisjoint(new[0].column("session_id").to_pylist())
    assert build_episodes(old[0], new[1]).report.n_orphan_outcomes == new[1].num_rows  # they do not join across
    assert old[0].column("behavior_bucket_indices").equals(new[0].column("behavior_bucket_indices"))  # states still do
    assert len([r for r in caplog.records if "version-1 log segments" in r.getMessage()]) == 1  # said once per source


def test_version_1_behaviour_ids_take_the_reading_bundles_buckets(logged: tuple[Path, Path, Capture]) -> None:
    v1, _, capture = logged
    custom = FeatureSpec(behavior_buckets=97, behavior_window=5)
    decisions = DirectorySource(v1, V1Reading(SALT, custom)).table("decisions")
    assert decisions.column("behavior_bucket_indices").to_pylist() == [
        behavior_buckets(i.request.recent_behavior_ids, custom) for i in capture.decisions]
    assert set(decisions.column("behavior_bucket_count").to_pylist()) == {97}
    assert decisions.column("n_recent_behaviors").to_pylist() == [len(i.request.recent_behavior_ids) for i in capture.decisions]


def test_a_newer_version_is_refused(tmp_path: Path) -> None:
    batch = pa.RecordBatch.from_pydict({"schema_version": pa.array([9], pa.int16())},
                                       schema=pa.schema([pa.field("schema_version", pa.int16())], metadata={"schema_version": "9"}))
    write_v1_segment(tmp_path, "outcomes", batch)
    with pytest.raises(ValueError, match="log schema version 9"):
        DirectorySource(tmp_path).table("outcomes")


def test_a_version_1_batch_with_a_null_id_ends_the_read_before_its_upgrade(logged: tuple[Path, Path, Capture],
                                                                            tmp_path: Path) -> None:
    """The upgrade hashes every id: a null one raised out of the reader; now it is where the segment's rows end."""
    capture = logged[2]
    good = v1_decisions(capture.decisions[:10], SALT)
    bad = v1_decisions(capture.decisions[10:20], SALT)
    for name, values in (("session_id", [None] * 10), ("recent_behavior_ids", [["view:1", None]] * 10)):
        index = bad.schema.get_field_index(name)
        damaged = bad.set_column(index, bad.schema.field(index), pa.array(values, bad.schema.field(index).type))
        (tmp_path / "decisions").mkdir(exist_ok=True)
        with pa.OSFile(str(tmp_path / "decisions" / "decisions-old.arrows"), "w") as f, \
                pa.ipc.new_stream(f, good.schema) as writer:
            writer.write_batch(good)
            writer.write_batch(damaged)
        assert DirectorySource(tmp_path, V1Reading(SALT, FeatureSpec())).table("decisions").num_rows == 10


def test_a_version_1_batch_missing_a_column_of_its_version_is_not_read(logged: tuple[Path, Path, Capture],
                                                                        tmp_path: Path) -> None:
    """Its upgrade raised a KeyError out of the reader (no item_id to hash)."""
    write_v1_segment(tmp_path, "decisions", v1_decisions(logged[2].decisions[:10], SALT).drop_columns(["item_id"]))
    assert DirectorySource(tmp_path, V1Reading(SALT, FeatureSpec())).table("decisions").num_rows == 0
