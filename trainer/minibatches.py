"""Row-keyed samples and minibatches: the same rows however the logs are sharded across ranks.

Ranks that each hold a disjoint shard of the sessions (``trainer.reading``) take the step one
process takes on all of them only if every sample and every minibatch is the same *set* of rows
in both, and every gradient is that of the whole set's mean loss. So a row is never picked by its
position (``randperm`` over a rank's rows depends on what else the rank holds) but by a 64-bit
key of its own, ``row_keys``: a hash of its session id and its step within the session.

* ``fraction(keys, salt)``: a uniform number in [0, 1) per row. A sample of about ``k`` of ``N``
  rows keeps those below ``k / N`` (``N`` summed over the ranks).
* ``epoch_batches``: in epoch ``e`` a row goes to minibatch ``⌊fraction · B⌋`` of
  ``B = ⌈N / batch⌉``; a minibatch holds about ``batch`` rows (binomially many, not exactly).
* ``Fit.step``: each rank backpropagates its part's mean loss, and the ranks average the
  gradients weighted by each part's weight (its rows, or its loss weights' sum): the gradient
  of the union's mean loss, one all-reduce per minibatch, and the optimiser then takes the same
  step everywhere. A part with no rows adds weight 0; a minibatch empty on every rank is skipped.

The mixing function is SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014), vectorised in numpy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from experience.sessions import session_codes, session_hashes
from trainer.distributed import LocalReducer, Reducer

U64 = npt.NDArray[np.uint64]
ROW_SALT = b"row-key"


def mix(x: U64) -> U64:
    """SplitMix64's finaliser, elementwise (a bijection of uint64 with full avalanche)."""
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def salt_of(*parts: int | str) -> np.uint64:
    """A 64-bit salt from a purpose and integers (seed, epoch, step): independent streams of ``fraction``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def row_keys(sessions: npt.NDArray[Any]) -> U64:
    """Per row, a key of its session id and its occurrence among that session's rows (in the given order).

    A session's rows are all on one rank and in episode order there, so each row's key is the
    same on one process and on any shard that holds it.
    """
    n = len(sessions)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    uniques, codes = session_codes(sessions)
    order = np.argsort(codes, kind="stable")
    starts = np.flatnonzero(np.r_[True, codes[order][1:] != codes[order][:-1]])
    runs = np.diff(np.r_[starts, n])
    occurrence = np.empty(n, dtype=np.uint64)
    occurrence[order] = (np.arange(n) - np.repeat(starts, runs)).astype(np.uint64)
    hashes = session_hashes(uniques, ROW_SALT)
    return mix(hashes[codes] ^ mix(occurrence))


def position_keys(n: int) -> U64:
    """Keys of rows by their position alone: for one process's fits whose callers have no sessions to key by."""
    return mix(np.arange(n, dtype=np.uint64))


def fraction(keys: U64, salt: np.uint64) -> npt.NDArray[np.float64]:
    """A uniform number in [0, 1) per key for this salt: the top 53 bits of ``mix(key ⊕ salt)``."""
    return (mix(np.asarray(keys, dtype=np.uint64) ^ salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def global_count(n: int, reducer: Reducer) -> int:
    return int(reducer.total(torch.tensor([float(n)], dtype=torch.float64))[0])


def union_ratio(numerator: float | torch.Tensor, denominator: float | torch.Tensor, reducer: Reducer) -> float:
    """Σ numerator / Σ denominator over the ranks, in one reduction (0 when the denominators sum to 0): the mean over
    every rank's rows of a statistic from its sum (or weighted sum) and its count (or weight) on each rank."""
    both = torch.stack([torch.as_tensor(numerator, dtype=torch.float64).detach().cpu().reshape(()),
                        torch.as_tensor(denominator, dtype=torch.float64).detach().cpu().reshape(())])
    total = reducer.total(both)
    return float(total[0] / total[1]) if float(total[1]) != 0.0 else 0.0


def sample(keys: U64, k: int, salt: np.uint64, reducer: Reducer) -> npt.NDArray[np.int64]:
    """This rank's rows of a keyed sample of about ``k`` rows of the union (every row when the union has ≤ ``k``)."""
    total = global_count(len(keys), reducer)
    if total <= k:
        return np.arange(len(keys), dtype=np.int64)
    return np.flatnonzero(fraction(keys, salt) < k / total).astype(np.int64)


def epoch_batches(keys: U64, n_total: int, batch: int, salt: np.uint64) -> list[npt.NDArray[np.int64]]:
    """This rank's rows of each of the epoch's ``⌈n_total / batch⌉`` minibatches (see the module doc), each sorted."""
    n_batches = max(1, math.ceil(n_total / batch))
    which = np.minimum((fraction(keys, salt) * n_batches).astype(np.int64), n_batches - 1)
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(n_batches + 1))
    return [order[bounds[b] : bounds[b + 1]].astype(np.int64) for b in range(n_batches)]


class Fit:
    """Minibatch optimisation of ``params`` on keyed rows: the same steps on one process and on shards."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimiser: torch.optim.Optimizer, keys: U64, batch: int, seed: int,
                 reducer: Reducer | None = None, purpose: str = "fit") -> None:
        self.params = list(params)
        self.optimiser = optimiser
        self.keys = keys
        self.batch = batch
        self.seed = seed
        self.purpose = purpose
        self.reducer = reducer or LocalReducer()
        self.n_total = global_count(len(keys), self.reducer)

    def epoch(self, epoch: int) -> Iterator[npt.NDArray[np.int64]]:
        """This rank's rows of each minibatch of ``epoch`` that is non-empty on some rank (possibly none here)."""
        parts = epoch_batches(self.keys, self.n_total, self.batch, salt_of(self.purpose, self.seed, epoch))
        sizes = self.reducer.total(torch.tensor([float(len(p)) for p in parts], dtype=torch.float64))
        for part, size in zip(parts, sizes.tolist(), strict=True):
            if size > 0:
                yield part

    def run_epoch(self, epoch: int, loss_of: Callable[[torch.Tensor], tuple[torch.Tensor, float | torch.Tensor]],
                  device: torch.device) -> None:
        """One optimiser step per minibatch of ``epoch``: ``loss_of(rows)`` gives this rank's part's mean loss and what
        it is a mean over (``rows``: indices on ``device``); a rank with no rows in a minibatch still takes part."""
        for part in self.epoch(epoch):
            if len(part) == 0:
                self.step(None, 0.0)
            else:
                self.step(*loss_of(torch.from_numpy(part).to(device)))

    def step(self, loss: torch.Tensor | None, weight: float | torch.Tensor) -> None:
        """One optimiser step on the union's mean loss: ``loss`` is this rank's part's mean (None: no rows here),
        ``weight`` what that mean is over (rows, or summed loss weights; a tensor is read only with more than one rank,
        so one process on a GPU does not wait for the device at every step)."""
        self.optimiser.zero_grad(set_to_none=False)
        if loss is not None:
            loss.backward()  # type: ignore[no-untyped-call]
        if self.reducer.world_size > 1:
            weight = float(weight)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads]).double()
            mean = self.reducer.weighted_mean(flat, weight if loss is not None else 0.0).to(grads[0].dtype)
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                p.grad = mean[offset : offset + g.numel()].reshape(g.shape).to(p.device)
                offset += g.numel()
        self.optimiser.step()
