"""Row-keyed samples and minibatches: a row's key, sample and minibatch do not depend on which other rows are held."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from trainer.distributed import LocalReducer
from trainer.minibatches import epoch_batches, fraction, mix, position_keys, row_keys, salt_of, sample
from trainer.reading import shard_of


def _sessions(n_sessions: int = 300, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.repeat([f"session-{i}" for i in range(n_sessions)], rng.integers(1, 20, size=n_sessions))


def test_a_rows_key_is_its_session_and_step_whatever_else_is_held() -> None:
    sessions = _sessions()
    keys = row_keys(sessions)
    assert len(np.unique(keys)) == len(keys)  # one key a row
    odd = np.array([int(s.rsplit("-", 1)[1]) % 2 == 1 for s in sessions])
    np.testing.assert_array_equal(row_keys(sessions[odd]), keys[odd])  # a shard's rows keep their keys
    # sessions held in another order (each one's rows still in order) keep their rows' keys
    index = np.array([int(s.rsplit("-", 1)[1]) for s in sessions])
    order = np.argsort(-index, kind="stable")
    np.testing.assert_array_equal(row_keys(sessions[order]), keys[order])
    assert row_keys(np.zeros(0, dtype=str)).shape == (0,)
    assert row_keys(np.array(["a", "b", "a"]))[0] != row_keys(np.array(["a", "b", "a"]))[2]  # steps differ


def test_fractions_are_uniform_and_salts_independent() -> None:
    keys = position_keys(200_000)
    f, g = fraction(keys, salt_of("a", 0)), fraction(keys, salt_of("a", 1))
    assert f.min() >= 0.0 and f.max() < 1.0
    assert abs(f.mean() - 0.5) < 0.005 and abs(np.mean(f < 0.1) - 0.1) < 0.003
    assert abs(np.corrcoef(f, g)[0, 1]) < 0.01
    assert len(np.unique(mix(np.arange(100_000, dtype=np.uint64)))) == 100_000  # a bijection on these


def test_minibatches_of_two_shards_are_the_minibatches_of_the_whole() -> None:
    sessions = _sessions()
    keys = row_keys(sessions)
    mask = shard_of(pa.array(sessions), 0, 2)
    whole = epoch_batches(keys, len(keys), 64, salt_of("value", 3, 0))
    parts = [epoch_batches(keys[m], len(keys), 64, salt_of("value", 3, 0)) for m in (mask, ~mask)]
    assert len(whole) == len(parts[0]) == len(parts[1]) == int(np.ceil(len(keys) / 64))
    for b, rows in enumerate(whole):
        union = set(keys[mask][parts[0][b]].tolist()) | set(keys[~mask][parts[1][b]].tolist())
        assert union == set(keys[rows].tolist())
    assert sorted(np.concatenate(whole).tolist()) == list(range(len(keys)))  # every row once an epoch
    sizes = np.array([len(r) for r in whole])
    assert sizes.min() > 64 * 0.4 and sizes.max() < 64 * 1.6  # binomially many, about `batch` each
    other = epoch_batches(keys, len(keys), 64, salt_of("value", 3, 1))
    assert not all(np.array_equal(a, b) for a, b in zip(whole, other, strict=True))  # a new shuffle each epoch


def test_a_keyed_sample_is_every_row_below_its_size_and_about_its_size_above() -> None:
    keys = position_keys(10_000)
    reducer = LocalReducer()
    np.testing.assert_array_equal(sample(keys, 10_000, salt_of("fit", 0), reducer), np.arange(10_000))
    picked = sample(keys, 2_000, salt_of("fit", 0), reducer)
    assert abs(len(picked) - 2_000) < 200 and np.all(np.diff(picked) > 0)
    assert not np.array_equal(picked, sample(keys, 2_000, salt_of("fit", 1), reducer))


def test_the_local_reducer_is_the_identity_for_every_collective() -> None:
    reducer = LocalReducer()
    x = torch.tensor([1.0, -2.0])
    assert reducer.total(x) is x and reducer.maximum(x) is x
    np.testing.assert_array_equal(reducer.gather(np.arange(3)), [0, 1, 2])


def test_a_shard_is_a_keyed_third_and_the_shards_cover_the_sessions() -> None:
    ids = pa.array([f"s{i}" for i in range(4_000)])
    shards = [shard_of(ids, r, 3) for r in range(3)]
    assert np.array_equal(np.sum(shards, axis=0), np.ones(4_000))  # each id in exactly one shard
    assert all(abs(s.mean() - 1 / 3) < 0.03 for s in shards)
    with pytest.raises(ValueError, match="rank"):
        shard_of(ids, 3, 3)
