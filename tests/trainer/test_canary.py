"""The canary judge on logs the simulator served through the servers' routing, and the cycle that starts, judges,
promotes and drops canaries."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
from collections.abc import Iterator
from pathlib import Path
from statistics import NormalDist
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core.domain import Outcome
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import FAST_CYCLE, fresh_bundle_bytes, strict_json, trainer_in_process, variant_bytes
from tests.log_tables import outcome_table
from tests.small_disk import SmallDisk, mounted
from trainer.canary import CanarySettings, Sides, judge, look, read_sides, sides_of
from trainer.session_index import SessionIndex
from weights.bundle import read_bundle
from weights.canary import CanaryRoute, Routed, fraction_of
from weights.model_set import LoadOptions, ModelSet
from weights.store import WeightsStore
from weights.validate import verify

UTC = ZoneInfo("UTC")
SALT = b"c" * 32


def _model(data: bytes) -> ModelSet:
    return ModelSet.load(read_bundle(data), LoadOptions(warmup_batch=8))


def _logs(root: Path, current: bytes, canary: bytes, sessions: range, world_seed: int = 5) -> None:
    model = _model(canary)
    run_logged(World(SimConfig(), world_seed), Routed(_model(current), CanaryRoute(model, fraction_of(model.manifest))),
               sessions, UTC, root, SALT)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DirectorySource]:
    """1,600 sessions, half on a canary, for a canary better than the untrained bundle, one worse, one the same."""
    out = {}
    for name, only in (("better", "add_to_cart"), ("worse", "view_detail"), ("same", None)):
        root = tmp_path_factory.mktemp(name)
        _logs(root, fresh_bundle_bytes(), variant_bytes(f"canary-{name}", canary=0.5, only=only), range(1600))
        out[name] = DirectorySource(root)
    return out


CURRENT = read_bundle(fresh_bundle_bytes()).model_version


def _sides(served: dict[str, DirectorySource], name: str, max_sessions: int | None = None) -> Sides:
    return read_sides(served[name], f"canary-{name}", CURRENT, max_sessions)


def test_a_better_canary_is_promoted_a_worse_one_dropped_and_one_alike_waits_then_is_dropped(
        served: dict[str, DirectorySource]) -> None:
    settings = CanarySettings(0.5, 0.99, 3, 200)
    better = judge(_sides(served, "better"), settings, 0)
    assert better.action == "promote" and better.ci_low > 0 and better.look == 1, better
    assert 650 < better.canary_sessions < 950 and better.canary_sessions + better.control_sessions == 1600  # half each
    worse = judge(_sides(served, "worse"), settings, 0)
    assert worse.action == "drop" and worse.ci_high < 0 and "worse" in worse.reason, worse
    alike = [judge(_sides(served, "same"), settings, looks) for looks in range(3)]
    assert [v.action for v in alike] == ["wait", "wait", "drop"] and [v.look for v in alike] == [1, 2, 3]
    assert alike[0].ci_low < 0 < alike[0].ci_high and "undecided after 3 looks" in alike[2].reason


def test_a_look_without_outcomes_waits_and_never_promotes(served: dict[str, DirectorySource]) -> None:
    """An attack review (2026-12-07): with the outcomes gone (the directory lost, ReportOutcome broken, orders not yet
    reported) every session on both sides scored 0, the interval was 0 ± 0, and its lower bound 0 ≥ −0 promoted a
    canary that served only view_detail; the run then trained from it and published. No spread is no evidence."""
    worse = _sides(served, "worse")
    blind = dataclasses.replace(worse, outcomes=worse.outcomes.slice(0, 0))
    settings = CanarySettings(0.5, 0.99, 3, 200)
    looks = [judge(blind, settings, before) for before in range(3)]
    assert [v.action for v in looks] == ["wait", "wait", "drop"], looks
    assert "nothing to judge" in looks[0].reason and "no outcome reports" in looks[0].reason
    assert judge(worse, settings, 0).action == "drop"  # with its outcomes, the same canary is worse


def test_the_sides_hold_every_outcome_of_their_sessions_and_a_cap_samples_each(served: dict[str, DirectorySource]) -> None:
    whole, capped = _sides(served, "better"), _sides(served, "better", max_sessions=300)
    everything = served["better"].table("outcomes")
    mine = set(whole.canary.to_pylist()) | set(whole.control.to_pylist())
    assert whole.outcomes.num_rows == sum(s in mine for s in everything.column("session_id").to_pylist()) > 0
    assert len(capped.canary) == len(capped.control) == 300
    assert set(capped.canary.to_pylist()) <= set(whole.canary.to_pylist())
    assert set(capped.control.to_pylist()) <= set(whole.control.to_pylist())
    assert _sides(served, "better", max_sessions=300).canary.to_pylist() == capped.canary.to_pylist()  # keyed: the same


def test_the_interval_is_welchs_for_sides_of_unequal_size() -> None:
    """A 5 % canary's side is a twentieth of the control's: each side's variance is divided by its own count (a
    variance over the wrong count makes the interval far too wide, and canaries are dropped undecided)."""
    rng = np.random.default_rng(5)
    values = {"a": rng.exponential(40.0, 240), "b": rng.exponential(30.0, 4800)}
    rows = [{"outcome_id": f"{side}{i}", "session_id": f"{side}{i}", "outcome": Outcome.ORDER, "value": float(v)}
            for side, drawn in values.items() for i, v in enumerate(drawn)]
    sides = Sides(pa.chunked_array([[f"a{i}" for i in range(240)]]), pa.chunked_array([[f"b{i}" for i in range(4800)]]),
                  outcome_table(rows))
    verdict = judge(sides, CanarySettings(0.05, 0.95, 3, 200), 0)
    a, b = values["a"], values["b"]
    half = NormalDist().inv_cdf(0.975) * math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    assert (verdict.canary_sessions, verdict.control_sessions) == (240, 4800)
    assert verdict.estimate == pytest.approx(a.mean() - b.mean())
    assert verdict.ci_low == pytest.approx(a.mean() - b.mean() - half) and verdict.ci_high == pytest.approx(a.mean() - b.mean() + half)


def test_too_few_sessions_wait_but_count_so_a_canary_too_quiet_to_judge_is_dropped_in_time(
        served: dict[str, DirectorySource]) -> None:
    few = CanarySettings(0.5, 0.99, 3, 5000, None)
    waits = [judge(_sides(served, "better"), few, looks) for looks in range(3)]
    assert [(v.action, v.look) for v in waits] == [("wait", 1), ("wait", 2), ("drop", 3)]
    assert all("each side needs 5000" in v.reason and v.estimate != v.estimate for v in waits)  # no interval: NaN
    verdict = judge(read_sides(served["better"], "canary-never-served", CURRENT, None), CanarySettings(0.5), 0)
    assert verdict.action == "wait" and verdict.canary_sessions == 0


def test_sides_go_by_the_first_decision_and_the_control_shares_the_canarys_hours() -> None:
    decisions = pa.table({"session_id": ["early", "a", "a", "began-v1", "began-v1", "c", "late", "other"],
                          "model_version": ["v1", "v1", "v1", "v1", "v2", "v2", "v1", "v0"],
                          "time_s": [1.0, 5.0, 6.0, 4.6, 9.0, 4.5, 20.0, 7.0]})
    canary, control = sides_of(SessionIndex.of([decisions]), "v2", "v1")
    assert canary.to_pylist() == ["c"] and sorted(control.to_pylist()) == ["a", "began-v1", "late"]  # not "early"


@pytest.mark.parametrize(("values", "match"), [({"fraction": 0.7}, "fraction"), ({"level": 1.0}, "level"),
                                               ({"max_looks": 0}, "max_looks"), ({"min_sessions": 1}, "min_sessions")])
def test_settings_out_of_range_are_refused_by_name(values: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CanarySettings(**values)


def _cycle(logs: Path, weights: Path, config: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code, out, err = trainer_in_process("cycle", "--logs", str(logs), "--weights-dir", str(weights), "--config", str(config),
                                        "--device", "cpu", "--json", *extra)
    assert code in (0, 2, 3), err[-2000:]
    lines = out.strip().splitlines()
    return code, strict_json(lines[-1]) if lines else {"stderr": err}


def test_cycle_promotes_a_better_canary_drops_a_worse_one_and_starts_a_refused_candidate_as_the_next(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({**FAST_CYCLE, "gate_min_ess": 1e9}))  # a gate that cannot pass: every candidate is refused

    def active() -> str:
        return read_bundle(store.active_path).model_version

    code, bad = _cycle(tmp_path / "none", weights, fast, "--canary", "0.7")
    assert code == 2 and "--canary: expected in [0, 0.5], got 0.7" in bad["stderr"]  # the flag, as every cycle error names it
    code, bad = _cycle(tmp_path / "none", weights, fast, "--canary", "0.2", "--canary-level", "1.5", "--canary-max-looks", "0")
    assert code == 2 and bad["stderr"].strip().endswith(
        "--canary-level: expected in [0.5, 1), got 1.5; --canary-max-looks: expected >= 1, got 0"), bad["stderr"]

    # A better canary, served next to the active bundle on half the sessions: promoted, its very bytes. The run goes on
    # from it (without --canary its refused successor is kept for a second look) and exits 0: it published.
    better = variant_bytes("canary-better", canary=0.5, lean="add_to_cart")  # successors can differ from it
    store.start_canary(better)
    _logs(tmp_path / "logs-1", fresh_bundle_bytes(), better, range(1600))
    code, report = _cycle(tmp_path / "logs-1", weights, fast)
    look = report["canary"]
    assert code == 0 and look["action"] == "promote" and look["published"] == "published", report
    assert report["current_version"] == "canary-better" and report["kept_for_second_look"] == report["model_version"]
    assert active() == "canary-better" and store.active_path.read_bytes() == better and store.canary() is None
    store.drop_pending()

    # A worse canary next to it: dropped; the run then trains, the gate refuses, and the candidate becomes the canary.
    worse = variant_bytes("canary-worse", canary=0.5, only="view_detail")
    store.start_canary(worse)
    _logs(tmp_path / "logs-2", better, worse, range(1600, 3200))
    code, report = _cycle(tmp_path / "logs-2", weights, fast, "--canary", "0.5")
    assert code == 3 and report["canary"]["action"] == "drop" and "worse" in report["canary"]["reason"]
    assert report["canary_started"] == report["model_version"] and active() == "canary-better"
    started = read_bundle(store.canary() or b"")
    assert started.model_version == report["model_version"] and fraction_of(started.manifest) == 0.5
    window = started.manifest["trainer"]["window"]
    assert window["serving"] == ["canary-better", "canary-worse"] and set(window["model_versions"]) == {"canary-better",
                                                                                                      "canary-worse"}

    # The same logs again: the new canary served none of them, so it waits (a look counted), and nothing is trained.
    code, report = _cycle(tmp_path / "logs-2", weights, fast, "--canary", "0.5")
    assert code == 0 and report["canary"]["action"] == "wait" and report["canary"]["look"] == 1 and "model_version" not in report
    assert store.canary_looks(started.model_version) == 1 and read_bundle(store.canary() or b"") == started

    # A canary file that is not a bundle is dropped with its reason, and the run goes on as without one.
    store.canary_path.write_bytes(b"PK\x03\x04 garbage")
    code, report = _cycle(tmp_path / "logs-2", weights, fast)
    assert code == 3 and "no canary look" in report["canary"]["reason"] and "canary_started" not in report
    assert store.canary() is None and report["kept_for_second_look"] == report["model_version"]


def test_a_candidate_that_serves_what_the_active_bundle_serves_is_not_canaried(tmp_path: Path) -> None:
    """Every update undone (a behaviour-KL limit of 0) and the decoder's settings the active bundle's: the candidate serves
    the same distribution on every held-out page, so starting it as a canary would spend sessions on a difference of
    exactly zero (a lifted-limits loop canaried such a candidate for three cycles). It is reported same_as_active instead."""
    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    decoder = read_bundle(fresh_bundle_bytes()).manifest["decoder"]
    still = tmp_path / "still.json"
    still.write_text(json.dumps({**FAST_CYCLE, "gate_min_ess": 1e9, "max_behavior_kl": 0.0,
                                 "exploration_epsilon": decoder["exploration_epsilon"],
                                 "exploration_temperature": decoder["exploration_temperature"]}))
    _logs(tmp_path / "logs", fresh_bundle_bytes(), fresh_bundle_bytes(), range(800))
    code, report = _cycle(tmp_path / "logs", weights, still, "--canary", "0.5")
    assert code == 3 and "canary_started" not in report and "kept_for_second_look" not in report, report
    assert "nothing for a canary" in report["same_as_active"]
    assert report["dr_difference"] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0}  # the gate saw exactly no difference
    assert store.canary() is None and read_bundle(store.active_path).model_version == read_bundle(fresh_bundle_bytes()).model_version
    # a candidate that does serve differently (the same run without the limit) is still started as a canary, and the
    # person reading the run's output is told so, not only that the gate refused it
    moving = tmp_path / "moving.json"
    moving.write_text(json.dumps({**json.loads(still.read_text()), "max_behavior_kl": None}))
    code, out, err = trainer_in_process("cycle", "--logs", str(tmp_path / "logs"), "--weights-dir", str(weights), "--config",
                                        str(moving), "--device", "cpu", "--canary", "0.5")
    started = read_bundle(store.canary() or b"")
    assert code == 3 and out.splitlines() == [out.splitlines()[0], f"canary started: {started.model_version} now serves 50 % of "
                                              f"the sessions from {store.canary_path}; the next runs judge it"], out + err[-2000:]
    assert out.startswith("refused: ") and fraction_of(started.manifest) == 0.5


def test_an_outcome_no_server_writes_leaves_its_session_out_of_the_look(served: dict[str, DirectorySource],
                                                                         tmp_path: Path) -> None:
    """One order of NaN (or inf) on a canary session made the look's estimate NaN, undecided until dropped."""
    import shutil

    root = Path(shutil.copytree(served["better"].root, tmp_path / "logs"))
    sides = read_sides(DirectorySource(root), "canary-better", CURRENT, None)
    victim = sides.canary.to_pylist()[0]
    poison = sides.outcomes.filter(pc.equal(sides.outcomes.column("session_id"), victim)).slice(0, 1)
    poison = poison.set_column(poison.schema.get_field_index("value"), poison.schema.field("value"),
                               pa.array([float("nan")], pa.float64()))
    with pa.OSFile(str(root / "outcomes" / "outcomes-poison.arrows"), "wb") as sink, \
            pa.ipc.new_stream(sink, poison.schema) as writer:
        writer.write_table(poison)
    looked = read_sides(DirectorySource(root), "canary-better", CURRENT, None)
    assert victim not in looked.canary.to_pylist() and len(looked.canary) == len(sides.canary) - 1
    assert looked.control.to_pylist() == sides.control.to_pylist()
    assert victim not in looked.outcomes.column("session_id").to_pylist()
    verdict = judge(looked, CanarySettings(0.5, 0.99, 3, 200), 0)
    assert verdict.action == "promote" and math.isfinite(verdict.estimate)


def test_a_canary_due_for_promotion_waits_when_the_active_bundle_changed_meanwhile(tmp_path: Path) -> None:
    """The look judged the canary against the bundle active when the run began; an operator has published another since
    (a review: promotions and publishes replaced it unseen). Promoting would undo that publish: the canary serves on."""
    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    judged = store.active_sha256()
    better = variant_bytes("canary-better", canary=0.5, only="add_to_cart")
    store.start_canary(better)
    _logs(tmp_path / "logs", fresh_bundle_bytes(), better, range(1600))
    operator = variant_bytes("operator-1")
    store.publish(operator)  # after the run read the active bundle, before its look promotes
    current = _model(fresh_bundle_bytes())
    report = look(store, 0.0, current, lambda: DirectorySource(tmp_path / "logs"), LoadOptions(warmup_batch=1),
                  CanarySettings(0.5), replacing=judged)
    assert report is not None and report["action"] == "wait" and "changed" in report["reason"] and "published" not in report
    assert store.active_path.read_bytes() == operator and store.canary() == better
    assert look(store, 0.0, current, lambda: DirectorySource(tmp_path / "logs"), LoadOptions(warmup_batch=1),
                CanarySettings(0.5), replacing=store.active_sha256())["action"] == "promote"  # judged against it: promoted


@pytest.fixture
def full_weights_dir(tmp_path: Path) -> Iterator[SmallDisk]:
    """A 12 MiB tmpfs as the weights volume (room for the active bundle, its history copy, a canary and its
    promotion), to be filled by the test."""
    yield from mounted(tmp_path, "12m", tmp_path / "weights")


def test_a_full_volume_leaves_the_canary_serving_and_its_evidence_whole(tmp_path: Path, full_weights_dir: SmallDisk) -> None:
    """Promoting (or counting a look) writes to the volume; on a full one that failed and the canary was dropped with all
    its sessions' evidence (a review). A full disk passes: the run fails, visibly, the canary serves on, its look
    uncounted, and it is judged again once there is room. The kernel's own ENOSPC (tests/small_disk.py)."""
    store = WeightsStore(tmp_path / "weights", lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    better = variant_bytes("canary-better", canary=0.5, only="add_to_cart")
    store.start_canary(better)
    _logs(tmp_path / "logs", fresh_bundle_bytes(), better, range(1600))
    current = _model(fresh_bundle_bytes())

    def looked() -> dict[str, Any] | None:
        return look(store, 0.0, current, lambda: DirectorySource(tmp_path / "logs"), LoadOptions(warmup_batch=1),
                    CanarySettings(0.5))

    full_weights_dir.fill()
    with pytest.raises(OSError) as info:
        looked()
    assert info.value.errno == errno.ENOSPC
    assert store.canary() == better and store.canary_looks("canary-better") == 0
    full_weights_dir.free()
    report = looked()
    assert report is not None and report["action"] == "promote" and store.active_path.read_bytes() == better


def test_a_canary_promoted_within_a_cycle_is_checked_before_the_run_trains_from_it(served: dict[str, DirectorySource],
                                                                                  tmp_path: Path) -> None:
    """Its graphs served well and every server accepted them, in a layout the trainer does not read back: the run went on
    to train from it and failed inside training (exit 1, retried). Now bad usage (exit 2), naming it, once promoted."""
    from tests.weights import hostile

    weights = tmp_path / "weights"
    store = WeightsStore(weights, lambda data: verify(data))
    store.publish(fresh_bundle_bytes())
    renamed = hostile.renamed_policy(variant_bytes("canary-better", canary=0.5, only="add_to_cart"))  # as served["better"]
    store.start_canary(renamed)
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(FAST_CYCLE))
    code, _, err = trainer_in_process("cycle", "--logs", served["better"].root, "--weights-dir", str(weights), "--config",
                                      str(fast), "--device", "cpu")
    assert code == 2 and "(the canary just promoted)" in err and "no initializer 'b1'" in err, err[-2000:]
    assert store.active_path.read_bytes() == renamed and store.canary() is None  # promoted: the look's verdict stands
