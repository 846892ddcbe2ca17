"""The learned critic of the seed design: Â(s, a) = R_ψ(s, a) − V_φ(s).

Two small networks of the state, fitted one after the other by minibatch least squares:

* R_ψ(s, ·), the return-mapping network, has one output per action. A logged row (s_i, a_i, G_i)
  trains only the output of the action served there::

      ψ = argmin_ψ Σ_i (R_ψ(s_i, a_i) − G_i)²

  so R_ψ(s, a) estimates E[G | s, a], the behaviour's action value; the other outputs of that
  row get no gradient (they learn from the rows that served them).
* V_φ(s) is fitted to the value of the policy being improved under that critic::

      φ = argmin_φ Σ_i (V_φ(s_i) − Σ_a π(a|s_i) R_ψ(s_i, a))²

  π is what the *starting* bundle serves at each logged state, passed in by the caller. The
  regression has noiseless targets, so V_φ ≈ Σ_a π R_ψ closely, and E_{a∼π} Â(s, a) ≈ 0 at
  every state: the advantage is centred under the policy the step moves, where the value
  baseline (``trainer.advantages``) centres it under the returns the behaviour produced.

The advantage of a logged row is Â_i = R_ψ(s_i, a_i) − V_φ(s_i), even though its Monte Carlo
return G_i is observed (every logged row's is). G_i carries the noise of everything after
s_i, the shopper's later choices and the behaviour's later draws; R_ψ averages that noise over
similar states, so the step is driven by what the action is estimated to do rather than by the
luck of one session. The price is bias wherever R_ψ is wrong, which no baseline removes;
``observed_returns=True`` gives the unbiased, noisier Â_i = G_i − V_φ(s_i) instead (the value
baseline, re-centred under π) for a comparison. V_φ's own error is a function of the state
alone: like any baseline it moves the variance of the surrogate's gradient, not its mean.

``cross_fitted_critic`` is what training uses: a row's Â comes from a critic fitted on the other half of the sessions
(``trainer.advantages.baseline_folds``), as the value baseline's V̂ does. Evaluated on the rows it was fitted on, R_ψ
memorises part of each row's own return, so its R_ψ(s_i, a_i) drifts towards G_i and the step follows the luck of the
sessions it trains on again: on 30,000 sessions of a trained bundle's logs (``bench.offline_learners``, 2026-12-07) the
critic explained R² 0.29 of the returns in sample and 0.19 on the half it did not see (``critic_return_r2_heldout``).

Both fits standardise their targets by the mean and standard deviation of the returns (the
networks learn (G − μ)/σ and the outputs are mapped back), so one step size fits any reward
scale. The initialisation is drawn on the CPU inside a forked RNG (the caller's global torch
RNG is left as it was) and the minibatches are keyed by row (``trainer.minibatches``): the same
inputs and seed give the same networks on CPU, and the same initial ones on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from core.progress import progress
from trainer.advantages import cross_fit_halves
from trainer.distributed import LocalReducer, Reducer
from trainer.minibatches import U64, Fit, global_count, position_keys, union_ratio


class StateHeads(nn.Module):
    """state → hidden → hidden → ``n_outputs`` (ReLU), outputs mapped back to return units: μ + σ·net(s).

    The last layer starts at zero, so every output starts at the mean return μ (Â = 0 before any data).
    """

    def __init__(self, state_dim: int, hidden: int, n_outputs: int, loc: float = 0.0, scale: float = 1.0) -> None:
        super().__init__()
        self.n_outputs = n_outputs
        last = nn.Linear(hidden, n_outputs)
        nn.init.zeros_(last.weight)  # every output starts at μ: no action is preferred before the data says so
        nn.init.zeros_(last.bias)
        self.body = nn.Sequential(nn.Linear(state_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), last)
        self.register_buffer("loc", torch.tensor(loc))
        self.register_buffer("scale", torch.tensor(scale))

    def standardised(self, states: torch.Tensor) -> torch.Tensor:
        """(N, n_outputs) in units of the standardised returns (what the fit's loss sees)."""
        return self.body(states)  # type: ignore[no-any-return]

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.loc + self.scale * self.body(states)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Critic:
    """R_ψ (``returns``: state → one return per action) and V_φ (``value``: state → Σ_a π(a|s) R_ψ(s, a))."""

    returns: StateHeads
    value: StateHeads
    metrics: dict[str, float] = field(default_factory=dict)
    """On the fit rows: ``critic_return_r2`` (1 − MSE(R_ψ(s, a), G) / Var G) and ``critic_value_rmse`` (of V_φ − Σ π R_ψ)."""

    @property
    def n_actions(self) -> int:
        return self.returns.n_outputs

    def action_values(self, states: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
        """R_ψ(s, ·), (N, A) float32, evaluated in chunks of rows."""
        return _chunked(self.returns, states, chunk, self.n_actions)

    def values(self, states: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
        """V_φ(s), (N,) float32, evaluated in chunks of rows."""
        return _chunked(self.value, states, chunk, 1)[:, 0]


def _chunked(net: StateHeads, states: torch.Tensor, chunk: int, width: int, standardised: bool = False) -> torch.Tensor:
    forward = net.standardised if standardised else net
    with torch.no_grad():
        if not len(states):
            return states.new_zeros((0, width))
        return torch.cat([forward(states[i : i + chunk]) for i in range(0, len(states), chunk)])


def _check_states(states: torch.Tensor) -> None:
    if states.ndim != 2 or not states.is_floating_point():
        raise ValueError(f"states: expected a 2-D floating tensor (N, state_dim), got {tuple(states.shape)} {states.dtype}")


def _check_actions(actions: torch.Tensor, n: int, n_actions: int) -> None:
    if actions.shape != (n,) or actions.is_floating_point() or actions.dtype == torch.bool:
        raise ValueError(f"actions: expected an integer tensor of shape ({n},), got {tuple(actions.shape)} {actions.dtype}")
    if n and not bool(((actions >= 0) & (actions < n_actions)).all()):
        raise ValueError(f"actions: expected action indices in [0, {n_actions}), got {int(actions.min())} .. {int(actions.max())}")


def _check_returns(returns: torch.Tensor, n: int) -> None:
    if returns.shape != (n,):
        raise ValueError(f"returns: expected shape ({n},), got {tuple(returns.shape)}")
    if n and not bool(torch.isfinite(returns).all()):
        raise ValueError("returns: expected finite values")


def fit_critic(states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, pi: torch.Tensor, hidden: int,
               epochs: int, batch: int = 1024, lr: float = 1e-3, seed: int = 0, chunk: int = 65536,
               keys: U64 | None = None, reducer: Reducer | None = None, weights: torch.Tensor | None = None) -> Critic:
    """Fit R_ψ to the served actions' returns, then V_φ to Σ_a π(a|s) R_ψ(s, a) (minibatch Adam, ``epochs`` passes each;
    the width and the passes have no default here: the trainer's are ``TrainConfig.critic_hidden`` and ``critic_epochs``).

    ``states`` (N, S) float, ``actions`` (N,) integer indices of the served actions, ``returns`` (N,)
    their Monte Carlo returns, ``pi`` (N, A) the probabilities the starting bundle serves at each
    state (rows on the simplex; A is the number of actions). Everything is moved to ``states``'s device.
    ``keys`` and ``reducer``: as for ``trainer.advantages.fit_value`` (ranks on disjoint shards fit the
    critic of all their rows together: the standardisation and the metrics are the union's too). ``weights`` (N,), when
    given: each row's weight in R_ψ's least squares (``TrainConfig.critic_weight_cap``: its inverse propensity, capped);
    the standardisation and the metrics stay unweighted.
    """
    _check_states(states)
    n = len(states)
    reducer = reducer or LocalReducer()
    if global_count(n, reducer) == 0:  # every rank's count: a rank with an empty shard still fits with the others
        raise ValueError("states: no rows to fit the critic on")
    if pi.ndim != 2 or pi.shape[0] != n or pi.shape[1] < 1 or not pi.is_floating_point():
        raise ValueError(f"pi: expected a floating tensor of shape ({n}, n_actions), got {tuple(pi.shape)} {pi.dtype}")
    if not bool(torch.isfinite(pi).all()) or bool((pi < 0).any()) or not bool(((pi.sum(dim=1) - 1).abs() <= 1e-4).all()):
        raise ValueError("pi: expected finite, non-negative rows that sum to 1")
    n_actions = int(pi.shape[1])
    _check_actions(actions, n, n_actions)
    _check_returns(returns, n)
    if weights is not None and (weights.shape != (n,) or not bool(torch.isfinite(weights).all()) or bool((weights <= 0).any())):
        raise ValueError(f"weights: expected ({n},) finite, positive row weights, got {tuple(weights.shape)}")
    for name, value in (("hidden", hidden), ("epochs", epochs), ("batch", batch), ("chunk", chunk)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr: expected > 0, got {lr!r}")

    device = states.device
    actions = actions.to(device=device, dtype=torch.long)
    target = returns.to(device=device, dtype=states.dtype)
    pi = pi.to(device=device, dtype=states.dtype)
    keys = position_keys(n) if keys is None else keys
    loc = _union_mean(target.double(), reducer)
    var = _union_mean((target.double() - loc) ** 2, reducer)  # two passes: exact when |μ| ≫ σ too
    scale = math.sqrt(var) if var > 1e-12 else 1.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ret = StateHeads(states.shape[1], hidden, n_actions, loc, scale)
        val = StateHeads(states.shape[1], hidden, 1, loc, scale)
    ret, val = ret.to(device), val.to(device)
    standard = (target - loc) / scale
    row_weights = None if weights is None else weights.to(device=device, dtype=states.dtype)
    _fit(ret, states, standard, epochs, Fit(list(ret.parameters()), torch.optim.Adam(ret.parameters(), lr=lr), keys, batch, seed,
                                            reducer, purpose="critic-returns"), actions, row_weights,
         stage="train.critic-returns")
    # V's targets in the standardised units: Σ π (μ + σ r) = μ + σ Σ π r on the simplex, and a constant
    # return gives exactly zero targets (in return units, rounding noise that Adam would follow at full step)
    action_values = _chunked(ret, states, chunk, n_actions, standardised=True)
    v_target = (pi * action_values).sum(dim=1)
    _fit(val, states, v_target, epochs, Fit(list(val.parameters()), torch.optim.Adam(val.parameters(), lr=lr), keys, batch, seed,
                                            reducer, purpose="critic-value"), None, stage="train.critic-value")

    served = action_values.gather(1, actions[:, None])[:, 0]
    gap = _chunked(val, states, chunk, 1, standardised=True)[:, 0] - v_target
    metrics = {"critic_return_r2": 1.0 - _union_mean((served - standard).double() ** 2, reducer) if var > 1e-12 else 0.0,
               "critic_value_rmse": scale * math.sqrt(_union_mean(gap.double() ** 2, reducer))}
    return Critic(ret, val, metrics)


def _union_mean(x: torch.Tensor, reducer: Reducer) -> float:
    """The mean of ``x`` over every rank's rows (a rank with no rows adds nothing)."""
    return union_ratio(x.sum(), float(len(x)), reducer)


def _fit(net: StateHeads, states: torch.Tensor, target: torch.Tensor, epochs: int, fit: Fit, actions: torch.Tensor | None,
         weights: torch.Tensor | None = None, *, stage: str) -> None:
    """Least squares of ``net``'s standardised output (the served action's, when ``actions`` is given) on ``target``,
    each row weighted by ``weights`` when given; ``stage`` names its progress (not ``fit.purpose``, which salts the
    minibatches: renaming the stage must not change the weights)."""
    def loss_of(idx: torch.Tensor) -> tuple[torch.Tensor, float | torch.Tensor]:
        out = net.standardised(states[idx])
        pred = out[:, 0] if actions is None else out.gather(1, actions[idx][:, None])[:, 0]
        if weights is None:
            return torch.mean((pred - target[idx]) ** 2), float(len(idx))
        w = weights[idx]
        total = w.sum()  # > 0: fit_critic takes positive weights only
        return (w * (pred - target[idx]) ** 2).sum() / total, total

    with progress(stage, total=epochs, unit="epoch") as bar:
        for epoch in range(epochs):
            fit.run_epoch(epoch, loss_of, states.device)
            bar.update(1, rows=len(states))


def critic_advantages(critic: Critic, states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor | None = None,
                      *, observed_returns: bool = False, chunk: int = 65536) -> torch.Tensor:
    """Â = R_ψ(s, a) − V_φ(s) per row, (N,) float64 on ``states``'s device.

    With ``observed_returns`` (``returns`` required): Â = G − V_φ(s) instead, the Monte Carlo
    return against the critic's value of π (see the module docstring for why it is not the default).
    """
    _check_states(states)
    n = len(states)
    _check_actions(actions, n, critic.n_actions)
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk!r}")
    v = critic.values(states, chunk).double()
    if observed_returns:
        if returns is None:
            raise ValueError("returns: required with observed_returns=True")
        _check_returns(returns, n)
        return returns.to(device=v.device, dtype=torch.float64) - v
    a = actions.to(device=states.device, dtype=torch.long)
    with torch.no_grad():
        served = [critic.returns(states[i : i + chunk]).gather(1, a[i : i + chunk, None])[:, 0] for i in range(0, n, chunk)]
    r = torch.cat(served).double() if served else v.new_zeros(0)
    return r - v


def critic_action_advantages(critic: Critic, states: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """Â(s, a) = R_ψ(s, a) − V_φ(s) for every action, (N, A) float64 on ``states``'s device (``surrogate = expected``)."""
    _check_states(states)
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1, got {chunk!r}")
    return critic.action_values(states, chunk).double() - critic.values(states, chunk).double()[:, None]


def cross_fitted_critic(states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, pi: torch.Tensor,
                        fold: npt.NDArray[np.bool_], fit_rows: npt.NDArray[np.int64], *, expected: bool = False,
                        hidden: int = 64, epochs: int = 4, batch: int = 1024, lr: float = 1e-3, seed: int = 0,
                        keys: U64 | None = None, reducer: Reducer | None = None, chunk: int = 65536,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Â for every row, (N,) float64 (``critic_advantages``), or (N, A) with ``expected`` (``critic_action_advantages``),
    each row's from a critic fitted on the fit rows of the *other* half's sessions; and the fits' metrics.

    ``states``, ``actions``, ``returns``: every row's; ``fold`` (N,): each row's session's half
    (``trainer.advantages.baseline_folds``); ``fit_rows``: the rows the fits may use, ``pi`` (len(fit_rows), A) what the
    starting bundle serves at them and ``keys`` their minibatch keys; ``weights`` (N,): every row's weight in R_ψ's fit
    (``fit_critic``). Everything is moved to ``states``'s device. A half whose other half has no fit row on any rank
    gets Â = 0: no critic, no direction. Each fit copies its half of the fit rows' states; the advantages are computed
    ``chunk`` rows at a time. Metrics, over every rank's rows, both R² against the variance of the fit rows' returns:
    ``critic_return_r2``, of R_ψ(s, a) on the fit rows each critic was fitted on; ``critic_return_r2_heldout``, on the
    fit rows of the half it did not see (how much of what it learnt carries over to sessions it has not seen); and
    ``critic_value_rmse`` over both fits.
    """
    reducer = reducer or LocalReducer()
    n, device = len(states), states.device
    if fold.shape != (n,) or returns.shape != (n,) or len(pi) != len(fit_rows):
        raise ValueError(f"fold and returns: expected ({n},); pi: expected one row per fit row ({len(fit_rows)}), got "
                         f"{fold.shape}, {tuple(returns.shape)}, {len(pi)}")
    actions, returns, pi = actions.to(device=device, dtype=torch.long), returns.to(device), pi.to(device)
    weights = None if weights is None else weights.to(device)
    out = torch.zeros((n, int(pi.shape[1])) if expected else (n,), dtype=torch.float64, device=device)
    fit_g = returns[torch.as_tensor(fit_rows, device=device)].double()
    g_mean = _union_mean(fit_g, reducer)
    g_var = _union_mean((fit_g - g_mean) ** 2, reducer)
    sse = {"seen": 0.0, "unseen": 0.0}
    count = {"seen": 0, "unseen": 0}
    rmse2, fitted_total = 0.0, 0
    for other, fitted, apply in cross_fit_halves(fold, fit_rows, reducer, device):
        rows = torch.as_tensor(fit_rows[other], device=device)
        critic = fit_critic(states[rows], actions[rows], returns[rows], pi[torch.as_tensor(other, device=device)],
                            hidden, epochs, batch, lr, seed=seed, chunk=chunk, keys=None if keys is None else keys[other], reducer=reducer,
                            weights=None if weights is None else weights[rows])
        rmse2 += critic.metrics["critic_value_rmse"] ** 2 * fitted
        fitted_total += fitted
        for i in range(0, len(apply), chunk):
            at = apply[i : i + chunk]
            out[at] = (critic_action_advantages(critic, states[at], chunk) if expected
                       else critic_advantages(critic, states[at], actions[at], chunk=chunk))
        for name, part in (("seen", rows), ("unseen", torch.as_tensor(fit_rows[~other], device=device))):
            for i in range(0, len(part), chunk):
                at = part[i : i + chunk]
                served = critic.action_values(states[at], chunk).gather(1, actions[at][:, None])[:, 0]
                sse[name] += float(((served.double() - returns[at].double()) ** 2).sum())
            count[name] += len(part)
    metrics: dict[str, float] = {}
    for name, key in (("seen", "critic_return_r2"), ("unseen", "critic_return_r2_heldout")):
        mse = union_ratio(sse[name], float(count[name]), reducer)
        if g_var > 1e-12 and global_count(count[name], reducer):
            metrics[key] = 1.0 - mse / g_var
    if fitted_total:
        metrics["critic_value_rmse"] = math.sqrt(rmse2 / fitted_total)
    return out, metrics
