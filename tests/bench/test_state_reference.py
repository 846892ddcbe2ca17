"""``bench.state_reference``: the imitator learns a rule its state determines (and the mix of actions where the state
says nothing), the recorder labels each page with the intent policy's action before the shopper responds, and the bench runs
end to end on a few sessions."""

import json
from pathlib import Path

import numpy as np
import pytest

from bench.state_reference import Imitator, StateFeatures, main, recording
from core.domain import ACTIONS, Action
from simulator.config import SimConfig
from simulator.reference import intent_policy
from simulator.world import World
from weights.embedded import default_bundle
from weights.model_set import ModelSet


def test_the_imitator_learns_what_the_state_determines_and_no_more() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3000, 12)).astype(np.float32)
    y = np.where(x[:, 0] > 0, 2, 0).astype(np.int64)  # apply_coupon where the first feature is positive, else add_to_cart
    model = Imitator(12, hidden=16)
    assert model.fit(x, y, epochs=20, batch=64) > 0.97
    test = rng.standard_normal((500, 12)).astype(np.float32)
    predicted = np.array([np.argmax(model.probabilities(s)) for s in test])
    assert (predicted == np.where(test[:, 0] > 0, 2, 0)).mean() > 0.95
    same = np.tile(x[:1], (3000, 1))  # one state, a 70/30 mix of labels: what "sampled" plays is the mix, as a hedge
    mixed = np.where(rng.random(3000) < 0.7, 0, 3).astype(np.int64)
    model.fit(same, mixed, epochs=10, batch=64)
    p = model.probabilities(same[0])
    assert abs(p[0] - (mixed == 0).mean()) < 0.05 and abs(p[3] - (mixed == 3).mean()) < 0.05 and p[[1, 2, 4]].sum() < 0.03
    assert np.allclose(sum(model.probabilities(test[0])), 1.0)


def test_each_page_is_labelled_with_the_intent_policys_action_before_the_response() -> None:
    world = World(SimConfig(), 7)
    features = StateFeatures(ModelSet.load(default_bundle()).encoder, context=True)
    states: list[np.ndarray] = []
    labels: list[int] = []
    choose = recording(features, lambda state, session, page: Action.VIEW_DETAIL, states, labels)
    expected = []
    for index in range(4_000_000, 4_000_040):
        session, twin = world.session(index), world.session(index)  # the twin plays the same dice alongside
        while (page := session.page()) is not None:
            twin_page = twin.page()
            assert twin_page is not None
            expected.append(ACTIONS.index(intent_policy(twin, twin_page)))
            session.respond(choose(session, page))
            twin.respond(Action.VIEW_DETAIL)
    assert labels == expected and len(states) == len(labels) > 40
    assert set(labels) - {ACTIONS.index(Action.ADD_TO_CART)}, "some page is labelled with a prompt"
    assert all(s.shape == (features.dim,) for s in states)
    assert features.dim == ModelSet.load(default_bundle()).encoder.spec.state_dim + 10


def test_bench_runs_on_a_few_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["--sessions", "300", "--rounds", "1", "--eval-sessions", "300", "--epochs", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "intent policy" in printed and "round 1" in printed and "last round, drawn" in printed
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [0, 1]
    assert result["rounds"][1]["pages"] > result["rounds"][0]["pages"] > 300
    for entry in result["rounds"]:  # an imitation from its labels does not beat the intent policy (300 sessions: loose)
        assert entry["sampled"]["share_of_intent_policy"] < 1.2 and entry["sampled"]["minus_intent_policy"]["mean"] < 5
    assert result["last_round_drawn_share_of_intent_policy"] == result["rounds"][-1]["sampled"]["share_of_intent_policy"]
