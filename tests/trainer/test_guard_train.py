"""The Action Guard trainer: the session split, and a guard trained on a synthetic world whose harm is a known
function of (state, action)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from core.domain import Action
from experience.sessions import split_by_session
from trainer.config import GuardConfig
from trainer.guard_threshold import guard_table
from trainer.guard_train import GuardResult, assess_guard, train_guard

# --- split ----------------------------------------------------------------------------------------


def _sides(sessions: np.ndarray, held: np.ndarray) -> dict[str, set[bool]]:
    sides: dict[str, set[bool]] = {}
    for s, h in zip(sessions.tolist(), held.tolist(), strict=True):
        sides.setdefault(s, set()).add(h)
    return sides


def test_split_is_by_session_stable_and_near_the_fraction() -> None:
    rng = np.random.default_rng(0)
    sessions = np.array([f"sess-{i}" for i in rng.integers(0, 4000, 40_000)], dtype=object)
    held = split_by_session(sessions, 0.2, seed=0)
    sides = _sides(sessions, held)
    assert all(len(v) == 1 for v in sides.values())  # no session on both sides
    assert abs(np.mean([h for (h,) in sides.values()]) - 0.2) < 0.03
    subset = rng.permutation(np.flatnonzero(rng.random(len(sessions)) < 0.3))
    assert np.array_equal(split_by_session(sessions[subset], 0.2, seed=0), held[subset])  # a session's side depends on its id alone
    assert not np.array_equal(split_by_session(sessions, 0.2, seed=1), held)


# --- training on a synthetic world ------------------------------------------------------------------

STATE_DIM = 6
RISKY = Action.APPLY_COUPON.index


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """States ~ N(0, I); the served action is RISKY 1 time in 8, else uniform over the other four.
    Harm: RISKY with feature 0 > 0 ⇒ harmful with probability 0.9; any other pair 0.3 %. Ten steps a session."""
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((n, STATE_DIM)).astype(np.float32)
    others = np.array([a.index for a in Action if a.index != RISKY])
    actions = np.where(rng.random(n) < 1 / 8, RISKY, rng.choice(others, n))
    risky = (actions == RISKY) & (states[:, 0] > 0)
    harmful = rng.random(n) < np.where(risky, 0.9, 0.003)
    sessions = np.array([f"{seed}-{i // 10}" for i in range(n)], dtype=object)
    return torch.from_numpy(states), torch.from_numpy(actions.astype(np.int64)), torch.from_numpy(harmful), sessions


CONFIG = GuardConfig(epochs=8, batch_size=256, learning_rate=3e-3, seed=7)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/trainer/conftest.py


@pytest.fixture(scope="module")
def trained(one_thread: None) -> GuardResult:
    return train_guard(*synthetic(24_000, seed=0), config=CONFIG)


def test_trained_guard_separates_the_harmful_region(trained: GuardResult) -> None:
    m = trained.metrics
    assert m["guard_auc"] > 0.9
    assert m["guard_accuracy"] > 0.95
    assert m["guard_false_block_rate"] <= CONFIG.max_false_block_rate
    assert m["guard_recall"] > 0.8
    assert 0.03 < m["guard_base_rate"] < 0.09 and m["guard_n_heldout"] + m["guard_n_train"] == 24_000
    # Fresh states, every candidate action: the risky action is vetoed in its harmful region and
    # allowed outside it; the other actions are allowed everywhere.
    states = torch.from_numpy(np.random.default_rng(99).standard_normal((4000, STATE_DIM)).astype(np.float32))
    with torch.no_grad():
        vetoed = (torch.sigmoid(trained.net(states)) < trained.threshold).numpy()
    inside, outside = states[:, 0].numpy() > 0.3, states[:, 0].numpy() < -0.3
    assert vetoed[inside, RISKY].mean() > 0.95
    assert vetoed[outside, RISKY].mean() < 0.05
    assert vetoed[:, [a.index for a in Action if a.index != RISKY]].mean() < 0.03


def test_an_informative_guard_keeps_its_veto(trained: GuardResult) -> None:
    m = trained.metrics
    assert trained.veto and trained.veto_reason.startswith("veto:")
    assert trained.threshold == trained.candidate_threshold == m["guard_threshold"] == m["guard_candidate_threshold"] > 0.0
    assert m["guard_veto_enabled"] == 1.0 and m["guard_veto_p_value"] < 1e-6
    assert m["guard_accuracy"] > m["guard_never_block_accuracy"] == pytest.approx(1.0 - m["guard_base_rate"])
    assert m["guard_precision_lower"] > m["guard_break_even_precision"] == 0.5
    assert m["guard_auc_lower"] > 0.85 and m["guard_never_block_auc"] == 0.5
    assert all(type(v) is float for v in m.values())  # into the manifest's training_metrics as they are
    assert guard_table(m).splitlines()[3].startswith("shipped: guard")


def test_a_guard_on_noise_ships_with_no_veto() -> None:
    """Harm independent of state and action (base rate 6 %): whatever the net learns, it cannot beat never blocking."""
    states, actions, _, sessions = synthetic(12_000, seed=3)
    harmful = torch.from_numpy(np.random.default_rng(4).random(12_000) < 0.06)
    result = train_guard(states, actions, harmful, sessions, config=dataclasses.replace(CONFIG, epochs=3))
    m = result.metrics
    assert not result.veto and result.veto_reason.startswith("no veto:")
    assert result.threshold == m["guard_threshold"] == 0.0 < result.candidate_threshold == m["guard_candidate_threshold"]
    assert m["guard_veto_enabled"] == 0.0 and m["guard_precision_lower"] < 0.5
    assert m["guard_false_block_rate"] <= CONFIG.max_false_block_rate and m["guard_auc_lower"] < 0.5  # no better than chance
    with torch.no_grad():
        assert not (torch.sigmoid(result.net(states)) < result.threshold).any()  # the server vetoes nothing
    assert guard_table(m).splitlines()[3].startswith("shipped: no veto")


def test_a_kept_guard_is_judged_at_its_own_threshold(trained: GuardResult) -> None:
    states, actions, harmful, sessions = synthetic(8000, seed=5)  # this run's rows, the same world
    kept = assess_guard(trained.net, trained.threshold, states, actions, harmful, sessions, CONFIG)
    assert kept.veto and kept.threshold == kept.candidate_threshold == trained.threshold and kept.net is trained.net
    assert kept.metrics["guard_accuracy"] > kept.metrics["guard_never_block_accuracy"]
    assert np.array_equal(kept.heldout, split_by_session(sessions, CONFIG.holdout_fraction, CONFIG.split_seed))
    strict = assess_guard(trained.net, 0.999, states, actions, harmful, sessions, CONFIG)  # blocks far past the cap
    assert not strict.veto and strict.threshold == 0.0 and "cap" in strict.veto_reason
    noise = torch.from_numpy(np.random.default_rng(6).random(8000) < 0.06)
    assert not assess_guard(trained.net, trained.threshold, states, actions, noise, sessions, CONFIG).veto


def test_training_split_is_by_session(trained: GuardResult) -> None:
    sessions = synthetic(24_000, seed=0)[3]
    assert all(len(v) == 1 for v in _sides(sessions, trained.heldout).values())
    assert trained.metrics["guard_n_heldout"] == trained.heldout.sum()
    assert trained.metrics["guard_n_train_sessions"] + trained.metrics["guard_n_heldout_sessions"] == 2400


def test_training_is_deterministic() -> None:
    data, config = synthetic(6000, seed=2), dataclasses.replace(CONFIG, epochs=2)
    first, again = train_guard(*data, config=config), train_guard(*data, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first.net.state_dict().values(), again.net.state_dict().values(), strict=True))
    assert again.threshold == first.threshold and again.metrics == first.metrics
    other = train_guard(*data, config=dataclasses.replace(config, seed=8))
    assert not torch.equal(other.net.l1.weight, first.net.l1.weight)


def test_warm_start_leaves_init_alone_and_extra_labels_train_only(trained: GuardResult) -> None:
    data = synthetic(4000, seed=1)
    before = [p.clone() for p in trained.net.parameters()]
    extra = np.zeros(4000, dtype=np.bool_)
    extra[::50] = True
    base = train_guard(*data, config=dataclasses.replace(CONFIG, epochs=1), init=trained.net)
    more = train_guard(*data, config=dataclasses.replace(CONFIG, epochs=1), init=trained.net, extra_harmful=extra)
    assert all(torch.equal(a, b) for a, b in zip(before, trained.net.parameters(), strict=True))
    assert not torch.equal(base.net.l1.weight, trained.net.l1.weight)
    added = int((extra & ~data[2].numpy() & ~base.heldout).sum())
    assert more.metrics["guard_n_train_harmful"] == base.metrics["guard_n_train_harmful"] + added > 0
    assert more.metrics["guard_n_heldout_harmful"] == base.metrics["guard_n_heldout_harmful"]
    with pytest.raises(ValueError, match="init"):
        train_guard(data[0][:, :3].contiguous(), *data[1:], init=trained.net)


def test_an_action_index_past_the_last_action_is_refused() -> None:
    states, actions, harmful, sessions = synthetic(200, seed=2)
    for bad in (len(Action), -1):
        wrong = actions.clone()
        wrong[7] = bad
        with pytest.raises(ValueError, match=r"^actions: expected indices in \[0, 5\)"):
            train_guard(states, wrong, harmful, sessions, config=CONFIG)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_false_block_rate"):
        GuardConfig(max_false_block_rate=1.0)
    with pytest.raises(ValueError, match="holdout_fraction"):
        GuardConfig(holdout_fraction=0.0)
    assert GuardConfig().to_dict()["harmful_outcomes"] == ["complaint"]
