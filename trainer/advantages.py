"""Advantages from Monte Carlo returns: a learned value baseline, group-relative normalisation (or ``trainer.critic``).

``baseline`` (the default until 2026-12-07; ``critic`` is now, ``trainer.critic``): Â_t = G_t − V̂(s_t), V̂ a small
MLP fitted to the returns by least
squares on the training states (minibatch Adam, seeded), **cross-fitted**: the sessions are split
in two halves by a keyed hash (``baseline_folds``), and a row's V̂ is the net fitted on the other
half. Fitted on the very rows it is subtracted from, the net learned part of each row's own return,
which depends on the action taken: on 20,000 sessions of the untrained bundle's logs (world 7) it
took R² 0.18 of the returns in sample against 0.03 on sessions it had not seen, and with random
states and pure-noise returns 84 % of their variance. That baseline leaks the action into itself
and shrinks the advantages of the rows that paid; cross-fitted it removes only what the state
predicts, which on this simulator's returns is little (R² 0.03: a session's luck dominates).

``group``: Â_t = (G_t − mean_g) / max(std_g, floor) within a group g of comparable steps
(the page type of the request, as GRPO normalises within the group of answers to one
prompt). No model to fit, but it only removes what the group explains.

``critic`` (``trainer.critic``, the seed design's learned critic): Â = R_ψ(s, a) − V_φ(s), a
return-mapping network with one output per action fitted to the served actions' returns, and
V_φ fitted to Σ_a π(a|s) R_ψ(s, a) under the starting policy. Lower variance than G − V̂(s)
(no single session's luck), but biased wherever R_ψ is wrong; the value baseline is not.

Measured on the simulator (``python -m bench.trainer_sim``: 6,000 sessions logged by the
untrained bundle, same seed, true values on 4,000 unseen sessions): ``baseline`` and ``group`` give the same policy
to within noise (true mean_return 2.502 both, from 1.195; offline DR 2.331 / 2.330), because
one support-limited natural-gradient step points the same way with either; ``group`` trains
5 s faster (no value fit). ``baseline`` was kept over ``group`` as the default then: it conditions on the whole
state, so it keeps working when the traffic mix within a page type shifts, which the simulator does not exercise.
Through the whole loop in nine worlds the weighted critic then did better than either (docs/performance.md, *Which
advantage is the default*), and it is the default since 2026-12-07.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from core.progress import progress
from experience.sessions import split_by_session
from trainer.distributed import LocalReducer, Reducer
from trainer.minibatches import U64, Fit, global_count, position_keys

FloatArray = npt.NDArray[np.float64]
VALUE_FOLD_SALT = b"value-fold"  # a baseline's two halves of the sessions (``baseline_folds``)


class ValueNet(nn.Module):
    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(state_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.body(states)[:, 0]  # type: ignore[no-any-return]


def fit_value(states: torch.Tensor, returns: torch.Tensor, hidden: int, epochs: int, batch: int = 1024, lr: float = 1e-3,
              seed: int = 0, keys: U64 | None = None, reducer: Reducer | None = None,
              rows: npt.NDArray[np.int64] | None = None) -> ValueNet:
    """Least-squares fit of V̂(s) ≈ G on (states, returns), minibatch Adam, deterministic on CPU for a seed; the width
    and the passes have no default here (the trainer's: ``TrainConfig.value_hidden`` and ``value_epochs``).

    ``rows``: fit on those rows of ``states`` and ``returns`` only (each minibatch gathered from them: the states,
    the run's largest array, are not copied); ``keys`` (one per fitted row) pick the minibatches
    (``trainer.minibatches.row_keys``; default: by position); with a ``reducer`` the rows are this rank's shard and
    every rank fits the net of all ranks' rows together.
    """
    torch.manual_seed(seed)
    net = ValueNet(states.shape[1], hidden).to(states.device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    chosen = None if rows is None else torch.as_tensor(rows, device=states.device)
    n = len(states) if chosen is None else len(chosen)
    target = returns.to(states.dtype)
    fit = Fit(list(net.parameters()), opt, position_keys(n) if keys is None else keys, batch, seed, reducer, purpose="value")

    def loss(idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        at = idx if chosen is None else chosen[idx]
        return torch.mean((net(states[at]) - target[at]) ** 2), float(len(idx))

    with progress("train.value", total=epochs, unit="epoch") as bar:
        for epoch in range(epochs):
            fit.run_epoch(epoch, loss, states.device)
            bar.update(1, rows=n)
    return net


def baseline_folds(sessions: npt.NDArray[Any], seed: int) -> npt.NDArray[np.bool_]:
    """Per row (``sessions``: each row's session id), its session's half for ``cross_fitted_baseline``: keyed by the
    session id alone, so a session's rows are on one side on any shard, and the split is independent of the gate's."""
    return split_by_session(sessions, 0.5, seed, VALUE_FOLD_SALT)


def cross_fit_halves(fold: npt.NDArray[np.bool_], fit_rows: npt.NDArray[np.int64], reducer: Reducer, device: torch.device
                     ) -> Iterator[tuple[npt.NDArray[np.bool_], int, torch.Tensor]]:
    """The two halves of a cross-fit (``baseline_folds``), one at a time: which fit rows the half's model is fitted on
    (a mask over ``fit_rows``: the *other* half's), how many there are over every rank, and the rows (all of this half's,
    on ``device``) it is applied to. A half whose other half has no fit row on any rank is skipped (every rank skips
    it alike: the count is the ranks' total)."""
    for side in (False, True):
        other = fold[fit_rows] != side
        fitted = global_count(int(other.sum()), reducer)
        if fitted:
            yield other, fitted, torch.from_numpy(np.flatnonzero(fold == side)).to(device)


def cross_fitted_baseline(states: torch.Tensor, returns: torch.Tensor, fold: npt.NDArray[np.bool_], fit_rows: npt.NDArray[np.int64],
                          hidden: int = 64, epochs: int = 8, batch: int = 1024, lr: float = 1e-3, seed: int = 0,
                          keys: U64 | None = None, reducer: Reducer | None = None, chunk: int = 65536) -> torch.Tensor:
    """Â = G − V̂(s) per row, V̂ cross-fitted: a row's V̂ is a net fitted on the *other* fold's sessions' fit rows.

    ``fold`` (N,): each row's session's half (``baseline_folds``); ``fit_rows``: the rows the
    fits may use (the fit sample), ``keys`` theirs. Fitted on the rows it is subtracted from, V̂ learns part of each
    row's own return (and its session's), which depends on the action taken: the baseline then leaks the action
    into itself and shrinks the advantages of exactly the rows that paid. A fold whose other half has no fit row
    on any rank gets no baseline (V̂ = 0: Â = G, still unbiased).
    """
    reducer = reducer or LocalReducer()
    values = torch.zeros(len(states), dtype=states.dtype, device=states.device)
    for other, _, apply in cross_fit_halves(fold, fit_rows, reducer, states.device):
        net = fit_value(states, returns, hidden, epochs, batch, lr, seed, None if keys is None else keys[other], reducer,
                        rows=fit_rows[other])
        with torch.no_grad():
            for i in range(0, len(apply), chunk):
                at = apply[i : i + chunk]
                values[at] = net(states[at])
    return returns.to(values.dtype) - values


def group_advantages(returns: FloatArray, groups: npt.NDArray[np.int64], floor: float = 1e-3,
                     total: Callable[[FloatArray], FloatArray] | None = None, width: int | None = None) -> FloatArray:
    """Â = (G − mean_g) / max(std_g, floor), mean and std (ddof 0) within each group label (non-negative integers).

    ``total`` (ranks on disjoint shards: ``Reducer.total``) sums each per-group statistic over the ranks, so the
    means and deviations are those of every rank's rows; ``width`` (required with it) is the number of labels.
    """
    if len(returns) != len(groups):
        raise ValueError("returns and groups must have the same length")
    if len(groups) and int(np.min(groups)) < 0:
        raise ValueError("groups: expected non-negative labels")
    if total is not None and width is None:
        raise ValueError("width: required with total (the ranks must agree on the number of labels)")
    add = total or (lambda x: x)
    width = width if width is not None else int(np.max(groups)) + 1 if len(groups) else 0
    counts = add(np.bincount(groups, minlength=width).astype(np.float64))
    safe = np.maximum(counts, 1.0)
    mean = add(np.bincount(groups, weights=returns, minlength=width).astype(np.float64)) / safe
    var = add(np.bincount(groups, weights=(returns - mean[groups]) ** 2, minlength=width).astype(np.float64)) / safe
    return (returns - mean[groups]) / np.maximum(np.sqrt(var), floor)[groups]
