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
RNG state, the caller's global RNG is left alone), the minibatches keyed by row
(``trainer.minibatches``: by session and step, so ranks on disjoint shards of the sessions, with a
``reducer``, take the steps one process takes on all of them; the threshold and the held-out
figures are then taken on every rank's held-out pairs, gathered).

**Split** (``split_by_session``). Rows are split by session, never by row: a session is held
out iff a keyed 64-bit BLAKE2b hash of its id, as a fraction of 2⁶⁴, is below
``holdout_fraction``. A session's side depends only on its id and ``split_seed``, not on the
other rows, so on growing logs a session keeps its side from one retraining to the next and a
warm-started guard is never evaluated on sessions it was trained on.

**Veto or none.** At the threshold chosen on the held-out harmless pairs, the guard keeps its
veto only if it beats never blocking on the held-out pairs by ``guard_threshold.decide_veto``
(an exact one-sided binomial test of its precision against the cost break-even; the criterion
is ``VetoCriterion``). If it does not, the bundle ships it with threshold 0.0: the server vetoes
iff allow-probability < threshold, so nothing is ever vetoed. ``GuardResult.veto`` and
``veto_reason`` say which, and the metrics carry the guard's figures at its candidate threshold
next to never blocking's (``guard_threshold.heldout_report``). ``assess_guard`` gives the same
verdict and figures for a guard kept as it is, at its own threshold, on the same split.

Auto-labels from update steps where η spikes are derived in ``trainer.guard_spikes``;
``train_guard`` takes them as ``extra_harmful``, extra harmful rows for training only (the
held-out metrics, the threshold and the veto keep to the outcome labels, so figures stay
comparable with and without them, and a guard that learns the wrong thing from them loses its
veto).

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
from core.progress import progress
from experience.sessions import session_codes, split_by_session
from trainer.config import GuardConfig
from trainer.distributed import LocalReducer, Reducer
from trainer.guard_threshold import VetoCriterion, choose_threshold, heldout_report
from trainer.minibatches import Fit, global_count, row_keys, union_ratio
from trainer.networks import GuardNet
from trainer.window import TooFewLogs

log = logging.getLogger(__name__)

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

_EVAL_BATCH = 8192


@dataclass(frozen=True, slots=True, eq=False)
class GuardResult:
    """A trained guard (on CPU, eval mode), its threshold, whether it vetoes, and its held-out figures."""

    net: GuardNet
    threshold: float
    """Veto iff allow-probability < threshold; goes to the bundle's ``guard.threshold``. 0.0 when ``veto`` is False."""
    veto: bool
    """The guard beat never blocking on the held-out pairs (``decide_veto``) and ships with its veto."""
    veto_reason: str
    """Why (or why not), one line for the manifest."""
    candidate_threshold: float
    """The threshold at the false-block cap, whose figures the metrics report, veto or not."""
    metrics: dict[str, float]
    """``heldout_report``'s figures plus training counts (``guard_n_train*``, ``guard_harmful_weight``, ``guard_train_loss``)."""
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
    net: GuardNet, states: torch.Tensor, rows: torch.Tensor, actions: torch.Tensor, allow: torch.Tensor, weights: torch.Tensor,
    keys: npt.NDArray[np.uint64], config: GuardConfig, reducer: Reducer,
) -> float:
    """Minimise the weighted BCE of the served action's allow logit over ``states[rows]`` (gathered batch by batch,
    never copied whole; ``actions``, ``allow``, ``weights``, ``keys`` are per row of ``rows``); the last epoch's mean
    loss over every rank's rows."""
    optimiser = torch.optim.AdamW(net.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    fit = Fit(list(net.parameters()), optimiser, keys, config.batch_size, config.seed, reducer, purpose="guard")
    mean_loss = 0.0
    net.train()
    with progress("train.guard", total=config.epochs, unit="epoch") as bar:
        for epoch in range(config.epochs):
            loss_sum = torch.zeros((), device=states.device)  # summed on the device: no host sync per step

            def loss_of(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                nonlocal loss_sum
                z = net(states[rows[idx]]).gather(1, actions[idx, None])[:, 0]
                w = weights[idx]
                weighted = (F.binary_cross_entropy_with_logits(z, allow[idx], reduction="none") * w).sum()
                loss_sum = loss_sum + weighted.detach()
                return weighted / w.sum(), w.sum()

            fit.run_epoch(epoch, loss_of, states.device)
            mean_loss = union_ratio(loss_sum, weights.sum(), reducer)
            log.info("guard epoch %d/%d: weighted BCE %.5f", epoch + 1, config.epochs, mean_loss)
            bar.update(1, rows=len(rows))
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
    criterion: VetoCriterion | None = None,
    reducer: Reducer | None = None,
) -> GuardResult:
    """Train a guard on the training sessions and choose its threshold on the held-out ones (module doc).

    ``states`` (N, S) float32, ``actions`` (N,) int64 action indices served, ``harmful`` (N,)
    bool outcome labels (``harmful_labels``), ``sessions`` (N,) session ids for the split.
    ``init`` warm-starts from a copy of a guard (its width wins over ``config.hidden``).
    ``extra_harmful`` (N,) bool marks further harmful rows for training only (η-spike
    auto-labels, ``trainer.guard_spikes``). ``criterion`` decides whether the guard keeps its veto
    (default ``VetoCriterion()``); a guard that does not earn it is returned with threshold 0.0. The
    whole of ``states`` is moved to ``device`` once (minibatches are gathered there by index); the returned net is
    on the CPU. With a ``reducer`` the rows are this rank's shard (whole sessions) and the result is the one of
    all ranks' rows together.
    """
    config = config or GuardConfig()
    reducer = reducer or LocalReducer()
    _check_inputs(states, actions, harmful, sessions)
    heldout = split_by_session(sessions, config.holdout_fraction, config.split_seed)
    n_held, n_rows = global_count(int(heldout.sum()), reducer), global_count(len(heldout), reducer)
    if n_held in (0, n_rows):
        raise TooFewLogs(f"the session split left one side empty ({n_held} of {n_rows} rows held out)")
    labels = harmful.cpu().numpy()
    train_harm = labels.copy()
    if extra_harmful is not None:
        if np.shape(extra_harmful) != train_harm.shape:
            raise ValueError(f"extra_harmful: expected {train_harm.shape}, got {np.shape(extra_harmful)}")
        train_harm |= np.asarray(extra_harmful, dtype=np.bool_)
    tr = torch.from_numpy(np.flatnonzero(~heldout))
    y = torch.from_numpy(train_harm)[tr]
    n_harm, n_train = global_count(int(y.sum()), reducer), global_count(len(y), reducer)
    weight = config.harmful_weight if config.harmful_weight is not None else (n_train - n_harm) / n_harm if n_harm else 1.0
    net = _new_net(states.shape[1], config, init).to(device)
    loss = _fit(
        net,
        states.to(device),
        tr.to(device),
        actions[tr].to(device),
        (~y).to(torch.float32).to(device),
        torch.where(y, weight, 1.0).to(torch.float32).to(device),
        row_keys(np.asarray(sessions))[~heldout],
        config,
        reducer,
    )
    net = net.cpu().eval()
    allow, ho_harm = _heldout_pairs(net, states, actions, labels, heldout, reducer)
    candidate = choose_threshold(allow[~ho_harm], config.max_false_block_rate)
    codes = session_codes(sessions)[1]
    counts = {
        "guard_n_train": float(n_train),
        "guard_n_train_harmful": float(n_harm),
        "guard_n_train_sessions": float(global_count(len(np.unique(codes[~heldout])), reducer)),
        "guard_n_heldout_sessions": float(global_count(len(np.unique(codes[heldout])), reducer)),
        "guard_harmful_weight": float(weight),
        "guard_train_loss": loss,
    }
    return _judged(net, candidate, allow, ho_harm, heldout, counts, config, criterion)


def assess_guard(
    net: GuardNet,
    threshold: float,
    states: torch.Tensor,
    actions: torch.Tensor,
    harmful: torch.Tensor,
    sessions: npt.NDArray[Any],
    config: GuardConfig | None = None,
    criterion: VetoCriterion | None = None,
    reducer: Reducer | None = None,
) -> GuardResult:
    """A guard kept as it is (the starting bundle's, say, when the retrained one would move what is served too
    far): its held-out figures at its own ``threshold`` on ``train_guard``'s split of the same rows, and whether
    it still earns its veto there (its false-block rate must also keep ``config.max_false_block_rate``). The
    result's ``threshold`` is ``threshold`` if so, else 0.0; ``net`` is used as given (CPU, not copied)."""
    config = config or GuardConfig()
    reducer = reducer or LocalReducer()
    _check_inputs(states, actions, harmful, sessions)
    heldout = split_by_session(sessions, config.holdout_fraction, config.split_seed)
    if global_count(int(heldout.sum()), reducer) == 0:
        raise ValueError(f"the session split held out none of {global_count(len(heldout), reducer)} rows")
    allow, ho_harm = _heldout_pairs(net, states, actions, harmful.cpu().numpy(), heldout, reducer)
    counts = {"guard_n_heldout_sessions": float(global_count(len(np.unique(session_codes(sessions)[1][heldout])), reducer))}
    return _judged(net, float(threshold), allow, ho_harm, heldout, counts, config, criterion)


def _heldout_pairs(net: GuardNet, states: torch.Tensor, actions: torch.Tensor, labels: BoolArray, heldout: BoolArray,
                   reducer: Reducer) -> tuple[FloatArray, BoolArray]:
    """The served action's allow-probability and the harm label of every held-out pair, every rank's (gathered)."""
    ho = torch.from_numpy(np.flatnonzero(heldout))
    allow = reducer.gather(served_allow(net, states[ho], actions[ho]))
    harm = reducer.gather(labels[heldout].astype(np.uint8)).astype(np.bool_)
    return allow, harm


def _judged(
    net: GuardNet, candidate: float, allow: FloatArray, ho_harm: BoolArray, heldout: BoolArray, counts: dict[str, float],
    config: GuardConfig, criterion: VetoCriterion | None,
) -> GuardResult:
    """The verdict at ``candidate`` on the held-out pairs, its figures plus ``counts``, as a ``GuardResult``."""
    decision, metrics = heldout_report(allow, ho_harm, candidate, criterion, config.max_false_block_rate)
    metrics |= counts
    log.info(
        "guard: candidate threshold %.4f, held-out accuracy %.4f (never blocking %.4f), false-block rate %.4f, recall %.4f, "
        "AUC %.4f; %s",
        candidate, metrics["guard_accuracy"], metrics["guard_never_block_accuracy"], metrics["guard_false_block_rate"],
        metrics["guard_recall"], metrics["guard_auc"], decision.reason,
    )
    return GuardResult(net=net, threshold=metrics["guard_threshold"], veto=decision.veto, veto_reason=decision.reason,
                       candidate_threshold=candidate, metrics=metrics, heldout=heldout)
