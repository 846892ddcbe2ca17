"""Data-parallel reduction: every rank averages the same statistics, so every rank takes the same step.

Each rank holds a shard of the logged states and computes *local means* over its shard: the
surrogate's gradient, Fisher-vector products, ``sᵀ F s``, the KL and the surrogate in the
line search. A ``Reducer`` turns them into the mean over the union of the shards::

    weighted_mean(x_r, n_r) = Σ_r n_r x_r / Σ_r n_r

with ``n_r`` the rank's number of states (after any subsampling). With equal shards this is
the plain average over ranks; with unequal shards the weighting is what makes it the
full-batch mean (a plain average would over-weight the states of a small shard). The
conjugate gradient and the line search only ever branch on reduced values, so their
iterates and decisions are identical on every rank (a ring all-reduce gives every rank the
same bits).

Ranks that each hold a disjoint shard of the logs (``trainer.reading``, by session hash) also need
the union's counts and extremes (``total``, ``maximum``) and, where a statistic is an order
statistic (a quantile, a threshold, an AUC), the union's values themselves (``gather``).

``init_from_env`` reads torchrun's variables from a mapping the entry point passes in (this
module never reads ``os.environ`` itself) and joins the process group, gloo on CPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)


class Reducer(Protocol):
    """Averages local statistics across the data-parallel ranks."""

    @property
    def world_size(self) -> int: ...

    def weighted_mean(self, value: Tensor, weight: float) -> Tensor:
        """``Σ_r w_r x_r / Σ_r w_r`` over the ranks; ``value`` is this rank's ``x_r``, ``weight`` its ``w_r``."""
        ...

    def total(self, value: Tensor) -> Tensor:
        """``Σ_r x_r`` elementwise (counts, sums)."""
        ...

    def maximum(self, value: Tensor) -> Tensor:
        """``max_r x_r`` elementwise."""
        ...

    def gather(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The 1-D arrays of every rank concatenated in rank order (each rank may hold a different length, 0 included)."""
        ...


class LocalReducer:
    """One process: the local mean is the mean (the identity)."""

    @property
    def world_size(self) -> int:
        return 1

    def weighted_mean(self, value: Tensor, weight: float) -> Tensor:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        return value

    def total(self, value: Tensor) -> Tensor:
        return value

    def maximum(self, value: Tensor) -> Tensor:
        return value

    def gather(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.asarray(values).reshape(-1)


class TorchDistReducer:
    """``torch.distributed``: one all-reduce (SUM) of ``[w x, w]`` per call, then a division.

    Value and weight travel in the same buffer (one collective per call). The weight is
    carried in the value's dtype: exact for counts up to 2^24 in float32.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (see init_from_env)")
        self.group = group

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def weighted_mean(self, value: Tensor, weight: float) -> Tensor:
        if not weight >= 0:
            raise ValueError(f"weight must be ≥ 0, got {weight}")
        flat = value.detach().reshape(-1)
        buf = torch.cat([flat * weight, flat.new_tensor([weight])])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        total = buf[-1]
        if not bool(total > 0):
            raise ValueError("the weights sum to zero across the ranks")
        return (buf[:-1] / total).reshape(value.shape)

    def total(self, value: Tensor) -> Tensor:
        buf = value.detach().clone()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf

    def maximum(self, value: Tensor) -> Tensor:
        buf = value.detach().clone()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return buf

    def gather(self, values: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Two collectives: the lengths, then every rank's values padded to the longest (gloo needs equal sizes)."""
        local = np.array(values, copy=True).reshape(-1)  # writable and contiguous (torch.from_numpy warns on read-only)
        size = torch.tensor([len(local)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.from_numpy(local[:0]).dtype)
        padded[: len(local)] = torch.from_numpy(local)
        parts = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return np.concatenate([p[: int(n)].numpy() for p, n in zip(parts, sizes, strict=True)]).astype(local.dtype, copy=False)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> DistEnv:
        """torchrun's ``RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT``; absent means one process."""
        world_size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad RANK={rank} / WORLD_SIZE={world_size}")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", str(rank))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )


def init_from_env(env: Mapping[str, str], *, backend: str | None = None, timeout_s: float = 60.0) -> DistEnv:
    """Join the process group described by ``env`` (torchrun's variables); returns rank and world size.

    A world of one starts nothing (use ``LocalReducer``). ``backend`` defaults to gloo (CPU
    tensors); pass ``"nccl"`` for CUDA tensors. ``timeout_s`` bounds the rendezvous and every
    collective, so a dead peer ends in an error, not a hang.
    """
    where = DistEnv.parse(env)
    if where.world_size == 1:
        return where
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    dist.init_process_group(
        backend=backend or "gloo",
        init_method=f"tcp://{where.master_addr}:{where.master_port}",
        rank=where.rank,
        world_size=where.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    log.info("joined process group: rank %d of %d (%s)", where.rank, where.world_size, dist.get_backend())
    return where


def make_reducer(where: DistEnv) -> Reducer:
    """``LocalReducer`` for a world of one, else ``TorchDistReducer`` on the default group."""
    return LocalReducer() if where.world_size == 1 else TorchDistReducer()


def shutdown(together: bool = True) -> None:
    """Leave the process group, if one was joined: all ranks together, then each tears its part down. ``together``
    False (a rank that failed or was stopped, its peers perhaps gone): no barrier. A barrier that fails (a peer gone)
    is logged, never raised: it would replace the caller's outcome and skip ``leave``.

    The barrier first: where rank 0 hosts the group's store (ranks started without torchrun), a
    rank that tears down while another is still talking to it can abort that one ("terminate
    called without an active exception", seen under load in CI; the barrier makes it rare, not
    impossible). Under torchrun the agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) and
    outlives the ranks; the two-rank test hosts it the same way. A dead peer makes the barrier
    fail after the group's timeout instead.
    """
    if dist.is_initialized():
        try:
            if together:
                dist.barrier()
        except RuntimeError as exc:  # a peer gone after all: leave anyway (the caller's own outcome stands)
            log.warning("leaving the process group without the others: %s", str(exc).splitlines()[0][:300])
        finally:
            dist.destroy_process_group()


def leave(code: int, *, joined: bool) -> NoReturn:
    """End the process with ``code``; a process that was a rank (``joined``) leaves its group and then skips the
    interpreter's teardown.

    After ``destroy_process_group`` gloo's C++ objects can still be destroyed during interpreter finalisation, where a
    worker thread still joinable ends the process in ``std::terminate`` ("terminate called without an active
    exception", SIGABRT), after the work was done and written: seen twice in CI, with either side hosting the store.
    torchrun counts that rank as failed and restarts the whole group, which would train and gate again. So a rank
    flushes its logs and streams itself and exits with ``os._exit``: nothing the trainer needs runs at exit (it starts
    no threads, and its files are written and renamed before it returns).
    """
    if not joined:
        sys.exit(code)
    shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head) must not change the exit code
            pass
    os._exit(code)
