"""The second look at a refused candidate: which sessions it never saw, when it is stale, and the cycle that keeps and publishes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pyarrow as pa
import pytest

from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import FAST_CYCLE, fresh_bundle, fresh_bundle_bytes, strict_json, trainer_in_process
from trainer.data import heldout_sessions
from trainer.second_look import Record, candidate_record, unseen_sessions
from trainer.window import select
from weights.bundle import BundleError, read_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.store import WeightsStore
from weights.validate import verify


def _tables(sessions: list[tuple[str, list[float]]]) -> tuple[pa.Table, pa.Table]:
    ids = [s for s, times in sessions for _ in times]
    times = [t for _, ts in sessions for t in ts]
    decisions = pa.table({"session_id": ids, "time_s": times, "model_version": ["v1"] * len(ids)})
    outcomes = pa.table({"session_id": [s for s, _ in sessions], "time_s": [ts[-1] + 1 for _, ts in sessions]})
    return decisions, outcomes


def _manifest(newest: Any = 100.0, init: Any = "v1", fraction: Any = 0.2, seed: Any = 0) -> dict[str, Any]:
    return {"trainer": {"init_model_version": init, "window": {"newest_time_s": newest},
                        "config": {"heldout_fraction": fraction, "seed": seed}}}


def test_unseen_sessions_are_the_fresh_ones_and_the_candidates_own_heldout() -> None:
    before = [(f"old-{i}", [10.0 + i * 0.01, 50.0]) for i in range(400)]
    spanning = [("span", [99.0, 150.0])]  # began inside what the candidate read: it may have trained on it
    after = [(f"new-{i}", [100.5, 120.0]) for i in range(30)]
    decisions, outcomes = _tables(before + spanning + after)
    window = select(decisions, outcomes)
    record = candidate_record(_manifest(), "v1")
    assert isinstance(record, Record)
    unseen = unseen_sessions(window, record)
    kept = set(unseen.decisions.column("session_id").to_pylist())
    held = {s for s, h in zip([s for s, _ in before], heldout_sessions(pa.array([s for s, _ in before]), 0.2, 0), strict=True) if h}
    assert {f"new-{i}" for i in range(30)} <= kept  # every session first logged after the candidate's newest record
    assert kept - {f"new-{i}" for i in range(30)} - {"span"} == held  # and exactly the old sessions its split held out
    assert 40 <= len(held) <= 120  # about 20 % of 400
    assert unseen.n_fresh == 30 and unseen.n_heldout == len(held) + ("span" in kept)
    assert set(unseen.outcomes.column("session_id").to_pylist()) == kept  # outcomes follow their sessions
    assert unseen.describe() == {"newest_time_s": 100.0, "fresh_sessions": 30, "heldout_sessions": unseen.n_heldout}


def test_a_session_that_began_at_the_candidates_newest_record_is_not_fresh() -> None:
    """The newest record the candidate read may have been that very session's first decision: only one that began
    after it is fresh (one at the same time was in its training window unless its split held it out)."""
    decisions, outcomes = _tables([("at", [100.0]), ("after", [100.001])])
    record = candidate_record(_manifest(), "v1")
    assert isinstance(record, Record)
    unseen = unseen_sessions(select(decisions, outcomes), record)
    assert unseen.n_fresh == 1 and "after" in unseen.decisions.column("session_id").to_pylist()
    assert ("at" in unseen.decisions.column("session_id").to_pylist()) == (unseen.n_heldout == 1)


@pytest.mark.parametrize(("manifest", "reason"), [
    ({}, "no trainer record"),
    (_manifest(init="v0"), "trained from 'v0'"),
    (_manifest(newest=None), "newest_time_s"),
    (_manifest(newest="100"), "newest_time_s"),
    (_manifest(newest=float("nan")), "newest_time_s"),
    (_manifest(newest=True), "newest_time_s"),
    (_manifest(fraction=1.5), "heldout_fraction"),
    (_manifest(seed="0"), "integer seed: {'heldout_fraction': 0.2, 'seed': '0'}"),
])
def test_a_candidate_that_cannot_be_judged_is_stale_and_says_why(manifest: dict[str, Any], reason: str) -> None:
    record = candidate_record(manifest, "v1")
    assert isinstance(record, str) and reason in record


def test_a_candidate_from_the_active_bundle_with_its_record_is_not_stale() -> None:
    assert candidate_record(_manifest(), "v1") == Record(100.0, 0.2, 0)


def test_the_store_keeps_one_validated_candidate_apart_from_what_is_served(tmp_path: Path) -> None:
    store = WeightsStore(tmp_path, lambda data: verify(data))
    assert store.pending() is None
    with pytest.raises(BundleError):
        store.hold(b"PK\x03\x04 not a bundle")
    assert store.pending() is None and not store.active_path.exists()
    version = store.hold(fresh_bundle_bytes())
    assert store.pending() == fresh_bundle_bytes() and version == read_bundle(fresh_bundle_bytes()).manifest["model_version"]
    assert not store.active_path.exists()  # nothing is served from it
    store.drop_pending()
    store.drop_pending()  # idempotent
    assert store.pending() is None


def _cycle(logs: Path, weights: Path, config: Path) -> tuple[int, dict[str, Any], str]:
    code, out, err = trainer_in_process("cycle", "--logs", str(logs), "--weights-dir", str(weights), "--config", str(config),
                                        "--device", "cpu", "--json")
    assert code in (0, 3), err[-2000:]
    return code, strict_json(out.strip().splitlines()[-1]), err


def test_cycle_keeps_a_refused_candidate_waits_for_fresh_logs_and_publishes_it_on_a_second_look(tmp_path: Path) -> None:
    logs, weights = tmp_path / "logs", tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())  # the bundle that serves the logs is the active one
    behaviour = ModelSet.load(fresh_bundle(), LoadOptions(warmup_batch=8))
    world = World(SimConfig(), 11)
    run_logged(world, behaviour, range(2500), ZoneInfo("UTC"), logs, b"k" * 32)
    early = tmp_path / "early"  # the first 2,500 sessions alone: enough for the last two runs, which only need a refusal
    shutil.copytree(logs, early)
    strict, normal = tmp_path / "strict.json", tmp_path / "normal.json"
    strict.write_text(json.dumps({**FAST_CYCLE, "gate_min_ess": 1e9}))  # a first look that cannot pass
    normal.write_text(json.dumps(FAST_CYCLE))

    def active() -> str:
        return ModelSet.load(read_bundle(store.active_path), LoadOptions(warmup_batch=1)).version

    code, first, _ = _cycle(logs, weights, strict)
    assert code == 3 and "too few effective sessions" in first["reason"] and "second_look" not in first
    assert first["kept_for_second_look"] == first["model_version"] and store.pending() is not None
    assert active() == behaviour.version
    assert read_bundle(store.pending() or b"").manifest["held"] is True  # marked: no server serves it, the store will not publish it
    with pytest.raises(BundleError, match="held for a second look, not a release"):
        store.publish(store.pending_path)

    # The same logs again: nothing logged since, so the kept candidate waits; the run trains and its refusal replaces it.
    code, again, _ = _cycle(logs, weights, strict)
    assert code == 3 and again["second_look"]["waiting"] is True and again["second_look"]["model_version"] == first["model_version"]
    assert again["second_look"]["sessions"]["fresh_sessions"] == 0
    kept = again["kept_for_second_look"]
    assert kept == again["model_version"] == first["model_version"]  # the same logs and seed: the same candidate

    # The next cycle's logs, served by the same bundle: the candidate never saw them; judged at the stricter level
    # (on 5,000 fresh sessions: 2,500 left the 0.99 lower bound of a +12.5 DR gain just below 0).
    run_logged(world, behaviour, range(2500, 7500), ZoneInfo("UTC"), logs, b"k" * 32)
    code, second, _ = _cycle(logs, weights, normal)
    assert code == 0 and second["second_look"] is True and second["model_version"] == kept and second["level"] == 0.99, second
    assert second["bootstrap"] == 1000 and second["sessions"]["fresh_sessions"] == 5000
    assert 300 < second["sessions"]["heldout_sessions"] < 700  # its own split's 20 % of the first 2,500
    assert second["published"] == "published" and store.pending() is None and active() == kept
    published = ModelSet.load(read_bundle(store.active_path), LoadOptions(warmup_batch=1)).manifest
    metrics = published["training_metrics"]
    assert "held" not in published  # published without the mark, signed again
    assert metrics["second_look"] == 1.0 and metrics["offline_dr_minus_current"] == pytest.approx(second["dr_difference"]["value"])

    # A kept file that is not a bundle (a torn write, a hostile one) is dropped with its reason; the run trains as always.
    store.pending_path.write_bytes(b"PK\x03\x04 garbage")
    code, third, _ = _cycle(early, weights, strict)
    assert code == 3 and "no second look" in third["second_look"]["reason"]
    assert third["kept_for_second_look"] == third["model_version"]
    assert read_bundle(store.pending() or b"").manifest["model_version"] == third["model_version"]

    # Keeping can fail too (here the pending directory is a file: as a full disk would, an OSError): still a refusal, exit 3.
    store.drop_pending()
    store.pending_path.parent.rmdir()
    store.pending_path.parent.write_bytes(b"in the way")
    code, fourth, _ = _cycle(early, weights, strict)
    assert code == 3 and fourth["kept_for_second_look"] is None and fourth["not_kept"]
    assert active() == kept  # the served bundle is untouched throughout
