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
from trainer.guard_train import GuardResult, train_guard

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


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_false_block_rate"):
        GuardConfig(max_false_block_rate=1.0)
    with pytest.raises(ValueError, match="holdout_fraction"):
        GuardConfig(holdout_fraction=0.0)
    assert GuardConfig().to_dict()["harmful_outcomes"] == ["complaint"]
