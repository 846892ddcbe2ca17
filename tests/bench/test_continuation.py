"""``bench.continuation``: the logs' first-action returns read back as the trainer reads them, and first actions played
with a continuation on the simulator's own sessions."""

from pathlib import Path

import numpy as np
import pytest

from bench.continuation import bundle_chooser, by_intent, first_then, logged_first_returns, main, played
from bench.loop import UTC, constant, per_session, play
from bench.offline_learners import explored_logs
from core.domain import Action
from simulator.config import SimConfig
from simulator.drive import run_in_process
from simulator.world import World
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet


def test_the_logged_returns_are_the_sessions_objectives_by_first_action(tmp_path: Path) -> None:
    world = World(SimConfig(), 7)
    sessions = range(200)
    init = explored_logs(world, None, 1.0, 1e6, len(sessions), tmp_path)  # uniform exploration: every first action logged
    logged = logged_first_returns(tmp_path / "logs", init, world, sessions)
    assert len(logged["value"]) == len(sessions)  # one entry per session, each session's first step
    # replayed in process with the same bundle and decision ids, each session's objective is the logged return
    model = ModelSet.load(read_bundle(init), LoadOptions(device="cpu", warmup_batch=8))
    truth = per_session(run_in_process(world, model, sessions, UTC), world, sessions)["objective"]
    assert sorted(np.round(logged["value"], 6)) == pytest.approx(sorted(np.round(truth, 6)), abs=1e-6)
    intents = {world.session(i).intent.key for i in sessions}
    assert set(logged["intent"].tolist()) == intents
    assert set(logged["first"].tolist()) == {a.index for a in (Action.ADD_TO_CART, Action.VIEW_DETAIL, Action.APPLY_COUPON,
                                                                 Action.SHARE_SOCIAL)}


def test_a_first_action_then_a_continuation_is_played_as_asked() -> None:
    world = World(SimConfig(), 7)
    truth = range(1_000_000, 1_000_150)
    table = played(world, truth, constant(Action.ADD_TO_CART))
    always = per_session(play(world, truth, constant(Action.ADD_TO_CART)), world, truth)["objective"]
    # add_to_cart first, then add_to_cart: always add_to_cart, session by session (the counts add up to every session)
    assert sum(row["add_to_cart"]["n"] for row in table.values()) == len(truth)
    total = sum(row["add_to_cart"]["mean"] * row["add_to_cart"]["n"] for row in table.values())
    assert total == pytest.approx(always.sum())
    coupon_first = per_session(play(world, truth, first_then(Action.APPLY_COUPON, constant(Action.ADD_TO_CART))), world,
                               truth)["objective"]
    assert not np.array_equal(coupon_first, always)  # the first action changes sessions
    assert sum(row["apply_coupon"]["mean"] * row["apply_coupon"]["n"] for row in table.values()) == pytest.approx(coupon_first.sum())


def test_the_bundle_continuation_serves_what_run_in_process_serves(tmp_path: Path) -> None:
    world = World(SimConfig(), 7)
    init = explored_logs(world, None, 0.5, 100.0, 100, tmp_path)
    model = ModelSet.load(read_bundle(init), LoadOptions(device="cpu", warmup_batch=8))
    sessions = range(100, 160)
    by_bundle = per_session(run_in_process(world, model, sessions, UTC), world, sessions)["objective"]
    by_chooser = per_session(play(world, sessions, bundle_chooser(model, world.seed)), world, sessions)["objective"]
    assert np.array_equal(by_bundle, by_chooser)  # the same decision ids: the same draws, the same sessions


def test_by_intent_counts_and_means() -> None:
    table = by_intent(np.array([0, 0, 2, 2, 2]), np.array([1.0, 3.0, 5.0, 7.0, 9.0]),
                      np.array(["buyer", "buyer", "buyer", "browser", "browser"]))
    assert table["buyer"]["add_to_cart"]["n"] == 2 and table["buyer"]["add_to_cart"]["mean"] == 2.0
    assert table["buyer"]["apply_coupon"] == {"n": 1, "mean": 5.0}  # one session: no interval
    assert table["browser"]["apply_coupon"]["mean"] == 8.0 and table["browser"]["add_to_cart"] == {"n": 0}


def test_bad_arguments_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, name in ((["--log-sessions", "5"], "--log-sessions"), (["--eval-sessions", "5"], "--eval-sessions"),
                       (["--untrained-logs", "2,1"], "--untrained-logs")):
        with pytest.raises(SystemExit):
            main(argv)
        assert name in capsys.readouterr().err
