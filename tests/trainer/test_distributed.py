"""Two gloo ranks holding unequal halves of a batch take the step one process takes on the whole batch; their
collectives (sums, maxima, gathers of unequal lengths) and a value net fitted on disjoint shards of sessions agree with
one process too.

The test runs this file as a script in two subprocesses (torchrun's variables in their
environment, 127.0.0.1 and a free port); each writes what it computed to an ``.npz``.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if __package__ in (None, ""):  # run as a worker script: make ``policy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.advantages import fit_value
from trainer.distributed import DistEnv, LocalReducer, Reducer, TorchDistReducer, init_from_env, leave, make_reducer, shutdown
from trainer.fisher import GaussNewtonFisher, Linearization, flat_params, logits_fn, masked_log_probs, mean_kl
from trainer.minibatches import row_keys
from trainer.networks import PolicyNet
from trainer.trust_region import Evaluation, backtracking_line_search, natural_gradient_step

ROOT = Path(__file__).resolve().parents[2]
N_STATES, SPLIT, STATE_DIM, HIDDEN, N_ACTIONS = 64, 40, 9, 8, 5
DELTA = 0.01
TIMEOUT_S = 60.0


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """States, log guard weights (some blocked), logged actions (allowed) and advantages; float64, seeded."""
    gen = torch.Generator().manual_seed(11)
    states = torch.randn(N_STATES, STATE_DIM, generator=gen, dtype=torch.float64)
    log_guard = -torch.rand(N_STATES, N_ACTIONS, generator=gen, dtype=torch.float64)
    log_guard[torch.rand(N_STATES, N_ACTIONS, generator=gen) < 0.3] = float("-inf")
    actions = torch.randint(0, N_ACTIONS, (N_STATES,), generator=gen)
    log_guard[torch.arange(N_STATES), actions] = 0.0
    advantages = torch.randn(N_STATES, generator=gen, dtype=torch.float64)
    return states, log_guard, actions, advantages


def update(rows: slice, reducer: Reducer) -> dict[str, np.ndarray]:
    """One trust-region update on ``rows`` of the batch, every statistic reduced through ``reducer``."""
    torch.manual_seed(3)
    net = PolicyNet(STATE_DIM, HIDDEN, N_ACTIONS).double()
    states, log_guard, actions, advantages = (t[rows] for t in batch())
    n = states.shape[0]
    f = logits_fn(net, states)
    theta = flat_params(net)
    log_q_old = masked_log_probs(f(theta), log_guard).detach()
    picked = torch.arange(n), actions

    def surrogate(t: torch.Tensor) -> torch.Tensor:  # this shard's mean of A · log q(a|s)
        return (advantages * masked_log_probs(f(t), log_guard)[picked]).mean()

    t = theta.clone().requires_grad_(True)
    (local_grad,) = torch.autograd.grad(surrogate(t), t)
    grad = reducer.weighted_mean(local_grad, n)
    fisher = GaussNewtonFisher(Linearization(f, theta), log_guard, damping=0.1, reducer=reducer)
    probe = torch.linspace(-1.0, 1.0, theta.numel(), dtype=torch.float64)
    fvp = fisher(probe)
    step = natural_gradient_step(fisher, fisher.curvature, grad, delta=DELTA, cg_iterations=10)
    assert step.scaled.step is not None

    def evaluate() -> Evaluation:
        with torch.no_grad():
            now = flat_params(net)
            kl = reducer.weighted_mean(mean_kl(log_q_old, f(now), log_guard), n)
            gain = reducer.weighted_mean(surrogate(now), n)
        return Evaluation(float(kl), float(gain))

    before = float(reducer.weighted_mean(surrogate(theta), n))
    search = backtracking_line_search(net, step.scaled.step, evaluate, surrogate_before=before, delta=DELTA)
    return {
        "grad": grad.numpy(),
        "fvp": fvp.numpy(),
        "cg_x": step.cg.x.numpy(),
        "step": step.scaled.step.numpy(),
        "theta": flat_params(net).numpy(),
        "scalars": np.array([step.cg.iterations, step.scaled.curvature, search.fraction, search.kl, float(search.accepted)]),
    }


def sessions_data() -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """40 sessions of 1–12 rows each (session ids per row, states, returns), seeded."""
    rng = np.random.default_rng(5)
    sessions = np.repeat([f"s{i}" for i in range(40)], rng.integers(1, 13, size=40))
    states = torch.from_numpy(rng.standard_normal((len(sessions), STATE_DIM)).astype(np.float32))
    returns = torch.from_numpy((states[:, 0].numpy() * 2.0 + rng.standard_normal(len(sessions))).astype(np.float32))
    return sessions, states, returns


def value_fit(rank: int | None, reducer: Reducer) -> np.ndarray:
    """V̂ fitted on the sessions of ``rank`` (even or odd ids; None: all), evaluated on every state."""
    sessions, states, returns = sessions_data()
    mine = np.ones(len(sessions), dtype=bool) if rank is None else np.array([int(s[1:]) % 2 == rank for s in sessions])
    net = fit_value(states[mine], returns[mine], hidden=8, epochs=3, batch=32, seed=2, keys=row_keys(sessions[mine]), reducer=reducer)
    with torch.no_grad():
        return net(states).numpy()


def collectives(rank: int, reducer: Reducer) -> dict[str, np.ndarray]:
    local = np.arange(3.0) + 10 * rank if rank == 0 else np.zeros(0)  # rank 1 gathers nothing
    return {
        "total": reducer.total(torch.tensor([rank + 1.0, 2.0], dtype=torch.float64)).numpy(),
        "maximum": reducer.maximum(torch.tensor([float(rank), -float(rank)], dtype=torch.float64)).numpy(),
        "gather": reducer.gather(local),
        "gather_bytes": reducer.gather(np.frombuffer(f"r{rank}".encode(), dtype=np.uint8)),
    }


def window_checks(rank: int, reducer: Reducer) -> np.ndarray:
    """Whether ``describe_window`` raised on this rank: when the ranks chose the same sessions, and when they did not."""
    from experience.schema import SCHEMAS
    from trainer.sharded import describe_window
    from trainer.window import Window

    raised = []
    for chosen in ((10, 7), (10, 7 + rank)):
        window = Window(SCHEMAS["decisions"].empty_table(), SCHEMAS["outcomes"].empty_table(), [], chosen=chosen)
        try:
            describe_window(window, reducer)
            raised.append(0.0)
        except ValueError as exc:
            assert "different windows" in str(exc)
            raised.append(1.0)
    return np.array(raised)


def worker(out: Path) -> None:
    where = init_from_env(os.environ, timeout_s=TIMEOUT_S)
    try:
        rows = slice(0, SPLIT) if where.rank == 0 else slice(SPLIT, N_STATES)
        reducer = make_reducer(where)
        results = {**update(rows, reducer), **collectives(where.rank, reducer), "value": value_fit(where.rank, reducer),
                   "window_raised": window_checks(where.rank, reducer)}
        np.savez(out, **results)  # type: ignore[arg-type]
    finally:
        shutdown()
    print(f"rank {where.rank} left the group", flush=True)  # an abort after this line is the interpreter's teardown


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/trainer/conftest.py


def test_two_gloo_ranks_take_the_single_process_step(tmp_path: Path) -> None:
    port = free_port()
    # The group's store lives here, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE): hosted by rank 0
    # instead, it could go away while the other rank still tears its group down (an abort at exit, seen once in CI).
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=TIMEOUT_S))
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, str(Path(__file__)), str(tmp_path / f"rank{rank}.npz")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text
    del store  # (kept until every rank has left)

    whole = update(slice(0, N_STATES), LocalReducer())
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for key in ("grad", "fvp", "cg_x", "step", "theta", "scalars"):
        assert np.array_equal(ranks[0][key], ranks[1][key]), f"{key}: the ranks disagree"  # bit for bit
        np.testing.assert_allclose(ranks[0][key], whole[key], rtol=1e-9, atol=1e-12, err_msg=key)
    assert whole["scalars"][4] == 1.0  # the line search accepted a step
    assert not np.array_equal(whole["theta"], whole["theta"] - whole["step"])
    for r in ranks:
        np.testing.assert_array_equal(r["total"], [3.0, 4.0])
        np.testing.assert_array_equal(r["maximum"], [1.0, 0.0])
        np.testing.assert_array_equal(r["gather"], [0.0, 1.0, 2.0])  # rank 0's three, rank 1's none, in rank order
        assert r["gather_bytes"].dtype == np.uint8 and bytes(r["gather_bytes"]) == b"r0r1"
    for r in ranks:  # ranks that chose different sessions all raise (none waits alone); the same sessions: none does
        np.testing.assert_array_equal(r["window_raised"], [0.0, 1.0])
    # the value net fitted on disjoint halves of the sessions is the one fitted on all of them
    alone = value_fit(None, LocalReducer())
    assert np.array_equal(ranks[0]["value"], ranks[1]["value"])
    np.testing.assert_allclose(ranks[0]["value"], alone, rtol=1e-4, atol=1e-5)
    odd_alone = value_fit(1, LocalReducer())  # and not the one fitted on one half alone
    assert np.abs(odd_alone - alone).max() > 100 * np.abs(ranks[0]["value"] - alone).max()


def test_local_reducer_and_env_parsing() -> None:
    x = torch.arange(3.0)
    assert LocalReducer().weighted_mean(x, 7) is x and LocalReducer().world_size == 1
    with pytest.raises(ValueError, match="weight"):
        LocalReducer().weighted_mean(x, 0)
    assert DistEnv.parse({}) == DistEnv(0, 1, 0, "127.0.0.1", 29500)
    where = DistEnv.parse({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234"})
    assert (where.rank, where.world_size, where.local_rank, where.master_port) == (1, 4, 0, 1234)
    with pytest.raises(ValueError, match="RANK"):
        DistEnv.parse({"RANK": "2", "WORLD_SIZE": "2"})
    assert init_from_env({}) == DistEnv(0, 1, 0, "127.0.0.1", 29500)  # one process: nothing to join
    assert isinstance(make_reducer(DistEnv.parse({})), LocalReducer)
    with pytest.raises(RuntimeError, match="not initialized"):
        TorchDistReducer()


def test_a_process_that_joined_no_group_exits_as_usual() -> None:
    with pytest.raises(SystemExit) as ended:  # atexit handlers and finalisers still run: only ranks skip them
        leave(4, joined=False)
    assert ended.value.code == 4


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    leave(0, joined=True)  # as ``python -m trainer`` ends a rank: past the interpreter's teardown
