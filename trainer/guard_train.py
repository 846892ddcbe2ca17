"""Training the Action Guard: a supervised GuardNet on the harm labels, thresholded on held-out sessions.

Labels come from ``trainer.guard_labels``; the threshold and the held-out figures from
``trainer.guard_threshold``; the configuration is ``trainer.config.GuardConfig``.

**Training** (``train_guard``). ``GuardNet`` outputs an allow logit for every action, but only
the served action of each row has a label, so the loss is a binary cross-entropy on the
served action's logit alone, target ``allow = not harmful``. Harmful rows are rare; each is
weighted ``harmful_weight`` (by default ``n_harmless / n_harmful`` on the training side:
both classes weigh the same in total). The weighting shifts the probabilities away from
calibrated P(allow), which is why the threshold is chosen on held-out data and not fixed.
Seeded and deterministic on CPU: the initialisation under ``torch.manual_seed`` (in a forked
RNG state, the caller's global RNG is left alone), the shuffling from its own
``torch.Generator``.

**Split** (``split_by_session``). Rows are split by session, never by row: a session is held
out iff a keyed 64-bit BLAKE2b hash of its id, as a fraction of 2⁶⁴, is below
``holdout_fraction``. A session's side depends only on its id and ``split_seed``, not on the
other rows, so on growing logs a session keeps its side from one retraining to the next and a
warm-started guard is never evaluated on sessions it was trained on.

Auto-labels from update steps where η spikes are not derived here: ``train_guard`` only takes
them as ``extra_harmful``, extra harmful rows for training (the held-out metrics and the
threshold keep to the outcome labels, so figures stay comparable with and without them).

"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812

from core.domain import N_ACTIONS
from experience.sessions import session_codes, split_by_session
from trainer.config import GuardConfig
from trainer.guard_threshold import choose_threshold, guard_metrics
from trainer.networks import GuardNet

log = logging.getLogger(__name__)

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

_EVAL_BATCH = 8192


@dataclass(frozen=True, slots=True, eq=False)
class GuardResult:
    """A trained guard (on CPU, eval mode), its threshold and its held-out figures."""

    net: GuardNet
    threshold: float
    """Veto iff allow-probability < threshold; goes to the bundle's ``guard.threshold``."""
    metrics: dict[str, float]
    """``guard_metrics`` plus training counts (``guard_n_train*``, ``guard_harmful_weight``, ``guard_train_loss``)."""
    heldout: BoolArray = field(repr=False)
    """Per input row: held out (True) or trained on."""


def _check_inputs(states: torch.Tensor, actions: torch.Tensor, harmful: torch.Tensor, sessions: npt.NDArray[Any]) -> None:
    n = states.shape[0]
    if states.dim() != 2 or states.dtype != torch.float32:
        raise ValueError(f"states: expected float32 (N, S), got {states.dtype} {tuple(states.shape)}")
    if actions.shape != (n,) or actions.dtype != torch.int64:
        raise ValueError(f"actions: expected int64 ({n},), got {actions.dtype} {tuple(actions.shape)}")
    if harmful.shape != (n,) or harmful.dtype != torch.bool:
        raise ValueError(f"harmful: expected bool ({n},), got {harmful.dtype} {tuple(harmful.shape)}")
    if np.shape(sessions) != (n,):
        raise ValueError(f"sessions: expected ({n},), got {np.shape(sessions)}")
    if n and (int(actions.min()) < 0 or int(actions.max()) >= N_ACTIONS):
        raise ValueError(f"actions: expected indices in [0, {N_ACTIONS})")
    if not bool(torch.isfinite(states).all()):
        raise ValueError("states: contains NaN or Inf")


def _new_net(state_dim: int, config: GuardConfig, init: GuardNet | None) -> GuardNet:
    """A copy of ``init`` (checked against ``state_dim``), or a fresh net initialised under ``config.seed``."""
    if init is not None:
        if init.state_dim != state_dim or init.n_actions != N_ACTIONS:
            raise ValueError(f"init: a guard for ({init.state_dim}, {init.n_actions}), expected ({state_dim}, {N_ACTIONS})")
        return copy.deepcopy(init)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return GuardNet(state_dim, config.hidden, N_ACTIONS)


def served_allow(net: GuardNet, states: torch.Tensor, actions: torch.Tensor) -> FloatArray:
    """Allow-probability of the served action of each row, float64 on the host, in batches."""
    device = next(net.parameters()).device
    out = []
    net.eval()
    with torch.no_grad():
        for lo in range(0, states.shape[0], _EVAL_BATCH):
            logits = net(states[lo : lo + _EVAL_BATCH].to(device))
            a = actions[lo : lo + _EVAL_BATCH].to(device)
            out.append(torch.sigmoid(logits.gather(1, a[:, None])[:, 0]).cpu().numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0, dtype=np.float64)


def _fit(
    net: GuardNet, states: torch.Tensor, actions: torch.Tensor, allow: torch.Tensor, weights: torch.Tensor, config: GuardConfig
) -> float:
    """Minimise the weighted BCE of the served action's allow logit; the last epoch's mean loss."""
    optimiser = torch.optim.AdamW(net.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    shuffle = torch.Generator().manual_seed(config.seed)
    n, total_weight, mean_loss = states.shape[0], weights.sum(), 0.0
    net.train()
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=shuffle).to(states.device)
        loss_sum = torch.zeros((), device=states.device)  # summed on the device: no host sync per step
        for lo in range(0, n, config.batch_size):
            idx = order[lo : lo + config.batch_size]
            z = net(states[idx]).gather(1, actions[idx, None])[:, 0]
            w = weights[idx]
            weighted = (F.binary_cross_entropy_with_logits(z, allow[idx], reduction="none") * w).sum()
            optimiser.zero_grad(set_to_none=True)
            (weighted / w.sum()).backward()  # type: ignore[no-untyped-call]
            optimiser.step()
            loss_sum += weighted.detach()
        mean_loss = float(loss_sum / total_weight)
        log.info("guard epoch %d/%d: weighted BCE %.5f", epoch + 1, config.epochs, mean_loss)
    return mean_loss


def train_guard(
    states: torch.Tensor,
    actions: torch.Tensor,
    harmful: torch.Tensor,
    sessions: npt.NDArray[Any],
    config: GuardConfig | None = None,
    init: GuardNet | None = None,
    device: str | torch.device = "cpu",
    extra_harmful: BoolArray | None = None,
) -> GuardResult:
    """Train a guard on the training sessions and choose its threshold on the held-out ones (module doc).

    ``states`` (N, S) float32, ``actions`` (N,) int64 action indices served, ``harmful`` (N,)
    bool outcome labels (``harmful_labels``), ``sessions`` (N,) session ids for the split.
    ``init`` warm-starts from a copy of a guard (its width wins over ``config.hidden``).
    ``extra_harmful`` (N,) bool marks further harmful rows for training only (η-spike
    auto-labels; not derived in this module). The whole training side is moved to ``device``
    once; the returned net is on the CPU.
    """
    config = config or GuardConfig()
    _check_inputs(states, actions, harmful, sessions)
    heldout = split_by_session(sessions, config.holdout_fraction, config.split_seed)
    if heldout.all() or not heldout.any():
        raise ValueError(f"the session split left one side empty ({int(heldout.sum())} of {len(heldout)} rows held out)")
    labels = harmful.cpu().numpy()
    train_harm = labels.copy()
    if extra_harmful is not None:
        if np.shape(extra_harmful) != train_harm.shape:
            raise ValueError(f"extra_harmful: expected {train_harm.shape}, got {np.shape(extra_harmful)}")
        train_harm |= np.asarray(extra_harmful, dtype=np.bool_)
    tr = torch.from_numpy(np.flatnonzero(~heldout))
    y = torch.from_numpy(train_harm)[tr]
    n_harm = int(y.sum())
    weight = config.harmful_weight if config.harmful_weight is not None else (len(y) - n_harm) / n_harm if n_harm else 1.0
    net = _new_net(states.shape[1], config, init).to(device)
    loss = _fit(
        net,
        states[tr].to(device),
        actions[tr].to(device),
        (~y).to(torch.float32).to(device),
        torch.where(y, weight, 1.0).to(torch.float32).to(device),
        config,
    )
    net = net.cpu().eval()
    ho = torch.from_numpy(np.flatnonzero(heldout))
    allow, ho_harm = served_allow(net, states[ho], actions[ho]), labels[heldout]
    threshold = choose_threshold(allow[~ho_harm], config.max_false_block_rate)
    metrics = guard_metrics(allow, ho_harm, threshold)
    codes = session_codes(sessions)[1]
    n_sessions = [len(np.unique(codes[side])) for side in (~heldout, heldout)]
    metrics |= {
        "guard_n_train": float(len(y)),
        "guard_n_train_harmful": float(n_harm),
        "guard_n_train_sessions": float(n_sessions[0]),
        "guard_n_heldout_sessions": float(n_sessions[1]),
        "guard_harmful_weight": float(weight),
        "guard_train_loss": loss,
    }
    log.info(
        "guard: threshold %.4f, held-out accuracy %.4f, false-block rate %.4f, recall %.4f, AUC %.4f",
        threshold, metrics["guard_accuracy"], metrics["guard_false_block_rate"], metrics["guard_recall"], metrics["guard_auc"],
    )
    return GuardResult(net=net, threshold=threshold, metrics=metrics, heldout=heldout)
