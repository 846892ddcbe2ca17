"""Training the Action Guard: harm labels from the logs, a supervised GuardNet, a threshold from held-out data.

**Labels** (``harmful_labels``). A logged decision is *harmful* when an outcome that names it
(by ``decision_id``, after de-duplication by ``outcome_id`` as the episodes do) is one of
``GuardConfig.harmful_outcomes`` (COMPLAINT by default), or, when ``exit_counts``, is an EXIT
whose gap ``outcome.event_time_s − decision.event_time_s ≤ exit_within_s`` (the shopper left
right after the action). The outcome names its decision, so it follows it; a negative gap is
clock skew and counts as within the window. An EXIT after a served action in
``exit_exempt_actions`` (EXIT itself by default: serving it asks the shopper to leave) is not
harm. Outcomes naming decisions not in the table are ignored.

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

**Threshold** (``choose_threshold``). The guard vetoes ``(s, a)`` iff ``allow_prob < threshold``
(``guard.action_guard.ActionGuard``). On the held-out harmless pairs ``p_1 ≤ … ≤ p_n`` (the
served actions of the held-out rows that did no harm), the false-block rate of ``t`` is
``FBR(t) = #{i : p_i < t} / n``. The threshold is the largest ``t`` with ``FBR(t) ≤ r``
(``max_false_block_rate``): with ``k`` the largest integer such that ``k / n ≤ r``, that is
``t = p_(k+1)``, the ``r``-quantile of the harmless allow-probabilities. Pairs tied with it are
allowed, so ties only lower the rate reached; any larger ``t`` blocks ``p_(k+1)`` too and
exceeds the cap. With no held-out harmless pair nothing bounds the rate: the threshold is 0
(no veto).

**Metrics** (``guard_metrics``), on the held-out pairs at the chosen threshold, "blocked" meaning
vetoed and "positive" meaning harmful: accuracy (blocked ⇔ harmful), false-block rate, recall
(share of harmful pairs blocked), precision (share of blocked pairs that were harmful), AUC of
``1 − allow_prob`` as a harm score (rank-based, ties count one half), base rate and counts. A
rate with an empty denominator is reported as 0 and an AUC with one class empty as 0.5; the
counts tell these cases apart.

Auto-labels from update steps where η spikes are not derived here: ``train_guard`` only takes
them as ``extra_harmful``, extra harmful rows for training (the held-out metrics and the
threshold keep to the outcome labels, so figures stay comparable with and without them).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F  # noqa: N812

from core.domain import N_ACTIONS, Action, Outcome
from experience.sessions import OUTCOME_COLUMNS, dedupe_outcomes, session_codes, split_by_session
from trainer.networks import GuardNet

log = logging.getLogger(__name__)

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

_EVAL_BATCH = 8192


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """How the Action Guard is labelled, trained and thresholded."""

    harmful_outcomes: tuple[Outcome, ...] = (Outcome.COMPLAINT,)
    """Outcomes that make the decision they name harmful, whenever they happen."""
    exit_counts: bool = True
    """Whether an EXIT soon after a decision (``exit_within_s``) makes it harmful."""
    exit_within_s: float = 30.0
    """Largest gap in seconds from the decision's to the EXIT's event time that counts as "right after"
    (inclusive). The simulator reports the EXIT at the end of the page dwell (median 40 s)."""
    exit_exempt_actions: tuple[Action, ...] = (Action.EXIT,)
    """Served actions after which an EXIT is never harm (serving EXIT asks the shopper to leave)."""
    hidden: int = 64
    """Width of the two hidden layers (64, as the bundled guard); ignored when warm-starting from ``init``."""
    epochs: int = 10
    """Passes over the training side."""
    batch_size: int = 1024
    """Rows per gradient step."""
    learning_rate: float = 1e-3
    """AdamW step size."""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay."""
    holdout_fraction: float = 0.2
    """Expected share of sessions held out for the threshold and the metrics (whole sessions)."""
    split_seed: int = 0
    """Key of the session hash that splits train / held-out; keep it fixed across retrainings."""
    max_false_block_rate: float = 0.015
    """Cap on the held-out false-block rate (share of harmless served pairs vetoed), in [0, 1)."""
    harmful_weight: float | None = None
    """Loss weight of a harmful row (harmless rows weigh 1); None: ``n_harmless / n_harmful`` on the training side."""
    seed: int = 0
    """Seed of the initialisation and the shuffling."""

    def __post_init__(self) -> None:
        if not all(isinstance(o, Outcome) for o in self.harmful_outcomes):
            raise ValueError(f"harmful_outcomes: expected Outcome values, got {self.harmful_outcomes!r}")
        if not all(isinstance(a, Action) for a in self.exit_exempt_actions):
            raise ValueError(f"exit_exempt_actions: expected Action values, got {self.exit_exempt_actions!r}")
        if not math.isfinite(self.exit_within_s):
            raise ValueError(f"exit_within_s: expected a finite number, got {self.exit_within_s!r}")
        for name in ("hidden", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate: expected > 0, got {self.learning_rate!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay!r}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction: expected in (0, 1), got {self.holdout_fraction!r}")
        if not 0.0 <= self.max_false_block_rate < 1.0:
            raise ValueError(f"max_false_block_rate: expected in [0, 1), got {self.max_false_block_rate!r}")
        if self.harmful_weight is not None and not (self.harmful_weight > 0 and math.isfinite(self.harmful_weight)):
            raise ValueError(f"harmful_weight: expected > 0 or None, got {self.harmful_weight!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (enums by key), for the bundle manifest's training record."""
        return {
            "harmful_outcomes": [o.key for o in self.harmful_outcomes],
            "exit_counts": self.exit_counts,
            "exit_within_s": self.exit_within_s,
            "exit_exempt_actions": [a.key for a in self.exit_exempt_actions],
            "hidden": self.hidden,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "holdout_fraction": self.holdout_fraction,
            "split_seed": self.split_seed,
            "max_false_block_rate": self.max_false_block_rate,
            "harmful_weight": self.harmful_weight,
            "seed": self.seed,
        }


# --- labels ---------------------------------------------------------------------------------


def _require(table: pa.Table, columns: tuple[str, ...], kind: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{kind} table lacks column(s) {missing}")


def harmful_labels(decisions: pa.Table, outcomes: pa.Table, config: GuardConfig | None = None) -> BoolArray:
    """Per decision row (in table order): did it do harm? See the module doc for the rule.

    Reads ``decision_id``, ``event_time_s`` and ``action`` of the decisions and the outcome
    columns that ``dedupe_outcomes`` keys on. Vectorised: one set-membership test for the
    harmful outcomes, one group-by (earliest EXIT per decision) and one hash lookup.
    """
    config = config or GuardConfig()
    _require(decisions, ("decision_id", "event_time_s", "action"), "decisions")
    _require(outcomes, OUTCOME_COLUMNS, "outcomes")
    ids = decisions["decision_id"]
    harmful = np.zeros(decisions.num_rows, dtype=np.bool_)
    kept = outcomes.select(["decision_id", "outcome", "event_time_s"]).take(dedupe_outcomes(outcomes))
    kind = kept["outcome"]
    if config.harmful_outcomes:
        codes = pa.array([int(o) for o in config.harmful_outcomes], type=kind.type)
        named = kept.filter(pc.is_in(kind, value_set=codes))["decision_id"].combine_chunks()
        harmful |= np.asarray(pc.is_in(ids, value_set=named).to_numpy(zero_copy_only=False), dtype=np.bool_)
    if config.exit_counts:
        harmful |= _early_exit(decisions, kept.filter(pc.equal(kind, int(Outcome.EXIT))), config)
    return harmful


def _early_exit(decisions: pa.Table, exits: pa.Table, config: GuardConfig) -> BoolArray:
    """Per decision row: its earliest EXIT is within ``exit_within_s`` and its action is not exempt."""
    first = exits.group_by("decision_id").aggregate([("event_time_s", "min")])
    where = pc.index_in(decisions["decision_id"], value_set=first["decision_id"].combine_chunks())
    found = np.asarray(where.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    t_exit = np.full(decisions.num_rows, np.inf)
    t_exit[found] = first["event_time_s_min"].to_numpy()[where.to_numpy(zero_copy_only=False)[found].astype(np.int64)]
    gap = t_exit - np.asarray(decisions["event_time_s"].to_numpy(), dtype=np.float64)
    exempt = np.isin(decisions["action"].to_numpy(), [int(a) for a in config.exit_exempt_actions])
    return np.asarray(found & (gap <= config.exit_within_s) & ~exempt, dtype=np.bool_)


# --- split, threshold, metrics: numpy kernels -------------------------------------------------


def choose_threshold(harmless_allow: FloatArray, max_false_block_rate: float) -> float:
    """The largest ``t`` with ``#{p_i < t} / n ≤ r``: ``p_(k+1)`` of the sorted harmless allow-probabilities,
    ``k = max{k : k / n ≤ r}`` (see the module doc); 0 (no veto) when there is no harmless pair."""
    if not 0.0 <= max_false_block_rate < 1.0:
        raise ValueError(f"max_false_block_rate: expected in [0, 1), got {max_false_block_rate!r}")
    p = np.sort(np.asarray(harmless_allow, dtype=np.float64))
    n = len(p)
    if n == 0:
        return 0.0
    k = math.floor(max_false_block_rate * n)
    while k > 0 and k / n > max_false_block_rate:  # guard against rounding in r·n
        k -= 1
    while k + 1 < n and (k + 1) / n <= max_false_block_rate:
        k += 1
    return float(p[k])


def rank_auc(harm_score: FloatArray, harmful: BoolArray) -> float:
    """P(score of a harmful pair > score of a harmless one) + ½ P(tie), from average ranks
    (Mann–Whitney U / (n₊ n₋)); 0.5 when either class is empty."""
    score = np.asarray(harm_score, dtype=np.float64)
    pos = np.asarray(harmful, dtype=np.bool_)
    n_pos, n = int(pos.sum()), len(score)
    if n_pos == 0 or n_pos == n:
        return 0.5
    order = np.argsort(score, kind="stable")
    s = score[order]
    new = np.concatenate([[True], s[1:] != s[:-1]])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n)
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = ((starts + 1 + ends) / 2.0)[np.cumsum(new) - 1]  # 1-based ranks, ties averaged
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * (n - n_pos)))


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def guard_metrics(allow: FloatArray, harmful: BoolArray, threshold: float) -> dict[str, float]:
    """Held-out figures at ``threshold`` (vetoed iff ``allow < threshold``); keys ``guard_*`` (see the module doc)."""
    allow = np.asarray(allow, dtype=np.float64)
    harmful = np.asarray(harmful, dtype=np.bool_)
    blocked = allow < threshold
    n, n_harm = len(allow), int(harmful.sum())
    n_false_blocks, n_caught = int((blocked & ~harmful).sum()), int((blocked & harmful).sum())
    return {
        "guard_threshold": float(threshold),
        "guard_accuracy": _rate(int((blocked == harmful).sum()), n),
        "guard_false_block_rate": _rate(n_false_blocks, n - n_harm),
        "guard_recall": _rate(n_caught, n_harm),
        "guard_precision": _rate(n_caught, int(blocked.sum())),
        "guard_auc": rank_auc(1.0 - allow, harmful),
        "guard_base_rate": _rate(n_harm, n),
        "guard_n_heldout": float(n),
        "guard_n_heldout_harmful": float(n_harm),
    }


# --- training -----------------------------------------------------------------------------------


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
