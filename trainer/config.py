"""The trainer's configuration: frozen dataclasses (the run, and its guard), a docstring per field, recorded in the manifest."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, TypedDict

from core.domain import Action, Outcome
from experience.engagement import EngagementWeights
from trainer.bootstrap import MAX_BOOTSTRAP, MIN_BOOTSTRAP
from trainer.log_checks import MAX_SESSION_COMPLAINTS, MAX_SESSION_DECISIONS, MAX_SESSION_ORDER_VALUE, SessionLimits

MAX_SEED = 2**63 - 1
"""The largest seed: seeds are hashed as signed 8-byte integers (``trainer.product_train``); one past it trained, then
failed (``int too big to convert``, exit 1, which the CronJob retries)."""
_SCALARS: dict[str, tuple[type, ...]] = {"int": (numbers.Integral,), "float": (numbers.Real,), "bool": (bool,), "str": (str,)}
_SAID = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "None": "null"}


def type_problems(config: Any) -> list[str]:
    """Each field of a config dataclass whose value is not of its annotated scalar type (``int``, ``float``, ``bool``,
    ``str``, or one of them ``| None``), named: a JSON ``--config`` can hold anything, and a wrong type met later
    fails deep in a run (a traceback, exit 1, which the CronJob retries) or not at all. A bool is no number here."""
    problems = []
    for f in dataclasses.fields(config):
        names = _type_names(f)
        if not set(names) <= {*_SCALARS, "None"}:
            continue  # tuples of enums, nested configs: checked where they are built
        value = getattr(config, f.name)
        if value is None and "None" in names:
            continue
        if not any(isinstance(value, _SCALARS[n]) and (n == "bool" or not isinstance(value, bool)) for n in names if n != "None"):
            problems.append(f"{f.name}: expected {' or '.join(_SAID[n] for n in names)}, got {value!r}")
        elif "float" in names and "int" not in names and not _fits_a_float(value):  # JSON's 1e999 is inf; 10**400 is an int
            problems.append(f"{f.name}: expected a number, got an integer beyond a float's range")
        elif "float" in names and value != value:  # NaN (JSON's NaN: Python's json reads it) passes every `x < limit` check
            problems.append(f"{f.name}: expected a number, got NaN")
    return problems


def _type_names(f: dataclasses.Field[Any]) -> list[str]:
    """A field's annotation as the names it is a union of (``float | None``: ``["float", "None"]``)."""
    return [n.strip() for n in str(f.type).split("|")]


def _fits_a_float(value: Any) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def floats_as_floats(config: Any) -> None:
    """Make an integer given for a ``float`` field that float (``100`` becomes ``100.0``), after ``type_problems`` found
    none. JSON writes both spellings, and a run's configuration, as JSON, names the versions it trains
    (``trainer.train``): ``{"critic_weight_cap": 100}`` and the default's ``100.0`` must be one configuration, not two
    runs with other version names and so other canary sessions (a nine-world run drew other sessions for that)."""
    for f in dataclasses.fields(config):
        names = _type_names(f)
        value = getattr(config, f.name)
        if "float" in names and "int" not in names and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            object.__setattr__(config, f.name, float(value))


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
    harm_cost_ratio: float = 1.0
    """What a harmful action let through costs, in false blocks (``trainer.guard_threshold.VetoCriterion``):
    the guard keeps its veto only if its held-out precision beats ``1 / (1 + ratio)`` at ``veto_confidence``."""
    veto_confidence: float = 0.95
    """One-sided confidence of the exact binomial test that the guard beats never blocking."""
    harmful_weight: float | None = None
    """Loss weight of a harmful row (harmless rows weigh 1); None: ``n_harmless / n_harmful`` on the training side."""
    seed: int = 0
    """Seed of the initialisation and the shuffling."""

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as exc:  # named as the guard's: a run's config has a seed and epochs of its own
            raise ValueError(f"guard: {exc}") from None
        floats_as_floats(self)  # after the checks, whose messages quote the values as given

    def _check(self) -> None:
        if problems := type_problems(self):
            raise ValueError("; ".join(problems))
        if not all(isinstance(o, Outcome) for o in self.harmful_outcomes):
            raise ValueError(f"harmful_outcomes: expected Outcome values, got {self.harmful_outcomes!r}")
        if not all(isinstance(a, Action) for a in self.exit_exempt_actions):
            raise ValueError(f"exit_exempt_actions: expected Action values, got {self.exit_exempt_actions!r}")
        if not math.isfinite(self.exit_within_s):
            raise ValueError(f"exit_within_s: expected a finite number, got {self.exit_within_s!r}")
        for name in ("seed", "split_seed"):  # torch's seed and the split's key take signed 64-bit integers
            if not -MAX_SEED - 1 <= getattr(self, name) <= MAX_SEED:
                raise ValueError(f"{name}: expected a signed 64-bit integer, got {getattr(self, name)!r}")
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
        if not (self.harm_cost_ratio > 0 and math.isfinite(self.harm_cost_ratio)):
            raise ValueError(f"harm_cost_ratio: expected > 0, got {self.harm_cost_ratio!r}")
        if not 0.0 < self.veto_confidence < 1.0:
            raise ValueError(f"veto_confidence: expected in (0, 1), got {self.veto_confidence!r}")
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
            "harm_cost_ratio": self.harm_cost_ratio,
            "veto_confidence": self.veto_confidence,
            "harmful_weight": self.harmful_weight,
            "seed": self.seed,
        }


@dataclass(frozen=True, slots=True)
class ProductStepConfig:
    """``cycle``'s product step (``trainer.cycle_products``), as ``train-products``' flags set it; a field left None keeps
    that command's default (``trainer.product_train``), ``max_rows`` the step's own (``cycle_products.MAX_ROWS``)."""

    delta_category: float | None = None
    """Trust region of the category layer's step (KL of its served distribution)."""
    delta_sku: float | None = None
    """... of the SKU layer's."""
    delta_price_band: float | None = None
    """... of the price band layer's."""
    delta_encoder: float | None = None
    """The shared encoder's region on the sum of the layers' KL; 0 holds it fixed."""
    encoder_layers: str | None = None
    """The layers whose data teach the encoder, comma-separated (``sku,price_band``); None: all three."""
    max_rows: int | None = None
    """Product decisions a run trains on at most (whole sessions)."""
    guard: bool = True
    """Train the per-layer complaint guards (false: the published heads carry none)."""
    guard_max_complaint: float | None = None
    """The guards' veto threshold (a complaint probability in (0, 1])."""
    guard_steps: int | None = None
    """Optimiser steps of each layer's guard."""

    def __post_init__(self) -> None:
        problems = type_problems(self)
        if not problems:
            for name in ("delta_category", "delta_sku", "delta_price_band"):
                value = getattr(self, name)
                if value is not None and not (value > 0 and math.isfinite(value)):
                    problems.append(f"{name}: expected > 0, got {value}")
            if self.delta_encoder is not None and not (self.delta_encoder >= 0 and math.isfinite(self.delta_encoder)):
                problems.append(f"delta_encoder: expected >= 0, got {self.delta_encoder}")
            if self.encoder_layers is not None:
                from trainer.product_data import parse_layers

                try:
                    parse_layers(self.encoder_layers)
                except ValueError as exc:
                    problems.append(f"encoder_layers: {exc}")
                if self.delta_encoder == 0:
                    problems.append("encoder_layers: the encoder is held fixed (delta_encoder 0), so nothing teaches it")
            for name in ("max_rows", "guard_steps"):
                if getattr(self, name) is not None and getattr(self, name) < 1:
                    problems.append(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
            limit = self.guard_max_complaint
            if limit is not None and not (0 < limit <= 1 and self.guard):
                problems.append(f"guard_max_complaint: expected a probability in (0, 1] for guards that are trained, got {limit}")
            if self.guard_steps is not None and not self.guard:
                problems.append("guard_steps: the guards are not trained (guard false)")
        if problems:
            raise ValueError("products: " + "; ".join(problems))
        floats_as_floats(self)  # after the checks, whose messages quote the values as given

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class GateLimits(TypedDict):
    """The keyword arguments of ``trainer.evaluation.gate`` a ``TrainConfig`` sets."""

    min_ess_fraction: float
    min_ess: float
    max_unsupported: float
    max_pareto_k: float


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    """Seed of every random choice (splits, subsamples, initialisation, golden data): same logs + seed ⇒ same bundle bytes on CPU,
    on the same kind of CPU with the same thread count (docs/training.md, step 8)."""
    window_versions: int | None = 1
    """Read only the decisions of the last this-many model versions (by when each was first logged), whole
    sessions (``trainer.window``): the run learns from what the policy it starts from served. None: all."""
    window_hours: float | None = None
    """Read only the decisions logged within this many hours of the newest one (with ``window_versions``,
    both must hold). None: no limit by time."""
    max_sessions: int | None = 30_000
    """Read at most this many of the window's sessions: a sample by keyed hash of the session id (``trainer.window``),
    the same on every rerun of the same logs and key. None: every session of the window. The default keeps a
    cycle's peak memory under 3 GB (2.2 GB on 1 M logged decisions, 2.7 GB on 10 M: ``bench/cycle.py``,
    docs/performance.md); the gate reads up to ``gate_sessions`` held-out sessions of the whole window apart from this
    sample. More sessions narrow the intervals, at about 38 KB of memory each."""
    sample_key: int = 0
    """Key of that sample's hash; change it for another sample of the same logs."""
    heldout_fraction: float = 0.2
    """Share of sessions (by hash) kept out of training for the gate's offline estimates."""
    gate_sessions: int | None = 50_000
    """The gate (``cycle``) judges on at most this many held-out sessions of the whole window, not only of the training
    sample (``trainer.window.gate_sample``: the window's held-out share, bottom-k by the sample's hash, so it holds the
    sample's own held-out sessions): more logs give the gate more power while training still reads its sample. They are
    read after training, in a third pass, and judged a chunk of states at a time (``trainer.evaluation``): each costs
    its Arrow rows (about 1.6 KB a decision) and a few numbers a decision. None: every held-out session of the window.
    When the window fits in the sample, this is the sample's held-out side, as without it."""
    max_session_order_value: float = MAX_SESSION_ORDER_VALUE
    """A session whose orders total more than this is left out of the run (training, the gate and the canary's look),
    counted (``trainer.log_checks``). Set it to the servers' ``--max-outcome-value``: each report is capped there, and
    many reports of one session must not add up to more than one may carry."""
    max_session_decisions: int = MAX_SESSION_DECISIONS
    """A session of more decisions is left out of the run (training and the gate), counted: a caller of the port can
    make one session as long as it likes, and each step adds a term to the gate's DR estimate (``trainer.log_checks``)."""
    max_session_complaints: int = MAX_SESSION_COMPLAINTS
    """A session with more complaints is left out of the run (training, the gate and the canary's look), counted: each
    costs the objective ``complaint_cost``, and a caller can report as many as it likes (``trainer.log_checks``)."""
    gamma: float = 0.85
    """Discount of the Monte Carlo returns (the same γ as mean_return)."""
    horizon_hours: float = 72.0
    """Sessions are cut this long after their first decision."""
    open_terminal_reward: float = 0.0
    """Added to the last step of sessions cut open (no EXIT seen)."""
    engagement_weights: EngagementWeights | None = None
    """Confidence weights on each step's reward from the shopper's engagement with its page (dwell, scroll, bounce:
    ``experience.engagement``, where the function and its defaults' reasons are), applied before the returns; a step
    without a report weighs 1. In a JSON config an object of the function's fields (``{}``: the defaults). None: off,
    every step weighs 1 (on the simulator the weights did not help: docs/training.md, "Engagement weights")."""
    normalize_rewards: bool = True
    """Quantile-normalise the rewards (5 % / 95 % of the non-zero ones) before the returns; the step is
    KL-scaled so this changes the baseline's numerics, not the step size."""
    advantage: str = "critic"
    """``critic`` (R_ψ(s, a) − V_φ(s): a return-mapping net per action and its value under the starting policy,
    ``trainer.critic``), ``baseline`` (G − V̂(s), a learned value net) or ``group`` (z-score of G within the page type).
    The critic is the default: over nine simulated worlds its loop ended above the baseline's in seven and below in none,
    +1.68 a session on average, t-interval over worlds [+0.59, +2.77] (docs/performance.md, *Which advantage is the
    default*)."""
    surrogate: str = "logged"
    """``logged``: the importance-weighted surrogate over the logged actions, min(ρ_i, c) Â_i; ``expected`` (needs
    ``advantage = critic``): Σ_a P_θ(a | s_i) (R_ψ(s_i, a) − V_φ(s_i)) over every allowed action at each logged state,
    no ratio (``trainer.update``)."""
    group_std_floor: float = 1e-3
    """Floor of the group standard deviation (``advantage = group``)."""
    value_hidden: int = 64
    """Hidden width of the value baseline (``advantage = baseline``)."""
    value_epochs: int = 4
    """Passes of the value fit over its rows (``advantage = baseline``)."""
    critic_hidden: int = 64
    """Hidden width of the critic's two networks, R_ψ and V_φ (``advantage = critic``)."""
    critic_epochs: int = 8
    """Passes over the fit rows of each of the critic's two fits (``advantage = critic``); 8, the setting the nine-world
    comparison ran."""
    critic_weight_cap: float | None = 100.0
    """R_ψ's fit weights each row by min(1 / logged propensity, this) (read with ``advantage = critic`` only; None: every
    row 1). Unweighted, each action's output learns from the states where the behaviour served that action and guesses
    elsewhere; weighted, from every logged state alike, as an importance-weighted (direct-method) regression does. On a
    trained bundle's logs the unweighted critic ranked a detail page first for every intent and its loop's candidates
    lost 6.7–8.0 a session (docs/performance.md, *Five learners on the loop's cycle-5 window*). 100 is the offline
    estimators' weight cap (``trainer.offline.MAX_WEIGHT``)."""
    max_fit_rows: int = 262_144
    """About this many training rows fit the value baseline, the critic and the guard: every row when there are no more,
    else a keyed sample that keeps each row with probability max_fit_rows / rows (binomially many, within a few
    hundred of it; the same rows on any sharding, ``trainer.minibatches``)."""
    max_ratio: float = 10.0
    """Importance ratios (new served probability / logged propensity) are truncated at this value."""
    kl_delta: float = 0.05
    """Trust region: mean KL(old ‖ new) of the masked policy over the update's states."""
    updates: int = 4
    """Natural-gradient steps per run. The sampled-majority decoder sharpens whatever the policy does, so
    a few steps of δ on the policy already move the served distribution far (see ``kl_to_behavior``)."""
    batch: int = 65_536
    """About this many states per step: every eligible training row when there are no more, else a keyed sample of
    them, a new one each step (binomially many, as ``max_fit_rows``)."""
    cg_iters: int = 10
    """Conjugate-gradient iterations per step."""
    cg_residual_tol: float = 1e-10
    """Stop CG once the residual's squared norm falls below this."""
    damping: float = 0.1
    """λ in (F + λI) for CG only; the step is scaled with the undamped curvature."""
    fisher_fraction: float = 0.1
    """Share of the step's states the Fisher-vector products use (subsampled Fisher; a keyed sample, binomially many,
    every state if it would be empty on some rank)."""
    line_search_steps: int = 10
    """Backtracking tries (halving the step) before a step is given up."""
    max_behavior_kl: float | None = 0.3
    """Keep the served distribution within this mean KL(new ‖ behaviour) of the logged one: a step that would
    go further is shrunk and the run stops there (off-policy estimates, the gate's included, are only reliable
    where the logs have support). None: no limit (the run still warns above ``behavior_kl_warn``)."""
    min_trajectory_ess: float | None = 0.15
    """Stop where the gate can still judge the run: a step that would bring the ESS of the training sessions'
    whole-trajectory weights below this fraction of them is shrunk (halving) and the run stops. The gate
    refuses below 0.05 of the held-out sessions (``trainer.evaluation.MIN_ESS_FRACTION``); 0.15 leaves room
    for the held-out sample's own noise. None: no limit."""
    logit_damping: float = 0.1
    """κ of the served trust region (``trust_region = "served"``): a step also pays κ/2 per unit of the squared change of
    the logits (on the allowed actions, less their mean), so a step cannot push the logits of actions the served
    distribution hardly sees hundreds apart (``trainer.fisher``). 0: the served KL alone."""
    trust_region: str = "served"
    """What δ constrains: ``served``, the distribution the bundle serves (the decoder's sampled majority,
    fallback and exploration; its Fisher through the decoder's Jacobian), or ``policy``, the masked
    softmax before the decoder (cheaper; the served distribution then moves several times δ)."""
    exploration_epsilon: float | None = 0.1
    """The new bundle's exploration share (``decoder.exploration_epsilon``): the behaviour that the next run
    learns from stays broad (every allowed action keeps at least about ε·q_T). None: the starting bundle's."""
    exploration_temperature: float | None = None
    """The new bundle's exploration temperature T (draws from q^(1/T)); a large T (say 100) makes exploration
    nearly uniform over the allowed actions, an ε floor. None: the starting bundle's."""
    guard_kl_budget: float | None = 0.05
    """Largest mean KL(served under the retrained guard ‖ served under the starting guard), the starting
    policy on the training states, that a run may spend on the guard: above it the starting bundle's guard
    (and threshold) is kept, so a re-chosen veto cannot move what is served past the trust region. None: no limit."""
    behavior_kl_warn: float = 0.3
    """Above this mean KL(new ‖ behaviour) on the logged states the run warns and marks the manifest."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """How the Action Guard is labelled, trained and thresholded."""
    products: ProductStepConfig = field(default_factory=ProductStepConfig)
    """``cycle``'s ``RecommendProduct`` step (a bundle with product heads): its regions, data and guards."""
    tolerance: float = 0.0
    """Gate: publish when the paired lower bound of (new − current) DR value is ≥ −tolerance (in the business
    objective's units: currency per session)."""
    gate_min_ess_fraction: float = 0.05
    """Gate: refuse when the new bundle's ESS on the held-out sessions is below this share of them
    (``trainer.evaluation.MIN_ESS_FRACTION``, where the reasons are)."""
    gate_min_ess: float = 100.0
    """Gate: ... or below this many sessions (``trainer.evaluation.MIN_ESS``)."""
    gate_max_unsupported: float = 0.01
    """Gate: refuse when the new bundle puts more than this mean probability per decision on actions the
    logs never served at that state (``trainer.evaluation.MAX_UNSUPPORTED``)."""
    gate_max_pareto_k: float = 0.7
    """Gate: refuse when the tail of the new bundle's importance weights is heavier than this Pareto k̂
    (``trainer.evaluation.MAX_PARETO_K``, ``trainer.pareto``); ``math.inf`` for no such check."""
    bootstrap: int = 200
    """Bootstrap resamples of the offline confidence intervals."""
    second_look_level: float | None = 0.99
    """``cycle``: keep a refused candidate and judge it once more, on the next run's logs it never saw, with the
    paired interval at this level (``trainer.second_look``: with the first look at 0.95, a candidate worse by more
    than ``tolerance`` is published with probability at most about 2.5 % + (1 − level) / 2, nominally). None: a
    refused candidate is discarded."""

    def __post_init__(self) -> None:
        problems = type_problems(self)
        if problems:  # before the ranges, which compare the values
            raise ValueError("; ".join(problems))
        if not -(2**63) <= self.sample_key < 2**63:  # hashed as 8 signed bytes (trainer.window)
            problems.append(f"sample_key: expected a signed 64-bit integer, got {self.sample_key}")
        if not 0 < self.heldout_fraction < 1:
            problems.append(f"heldout_fraction: expected in (0, 1), got {self.heldout_fraction}")
        if not 0 < self.max_session_order_value < math.inf:
            problems.append(f"max_session_order_value: expected a finite number > 0, got {self.max_session_order_value}")
        for name, least in (("max_session_decisions", 1), ("max_session_complaints", 0), ("seed", 0)):
            count = getattr(self, name)
            if count < least:  # an integer: type_problems
                problems.append(f"{name}: expected an integer >= {least}, got {count!r}")
        if self.seed > MAX_SEED:
            problems.append(f"seed: expected an integer <= {MAX_SEED} (2**63 - 1), got {self.seed!r}")
        if not 0 <= self.gamma <= 1:
            problems.append(f"gamma: expected in [0, 1], got {self.gamma}")
        if self.window_versions is not None and self.window_versions < 1:
            problems.append(f"window_versions: expected >= 1 or None, got {self.window_versions}")
        if self.gate_sessions is not None and self.gate_sessions < 1:
            problems.append(f"gate_sessions: expected an integer >= 1 or None, got {self.gate_sessions!r}")
        if self.critic_weight_cap is not None and not (self.critic_weight_cap >= 1 and math.isfinite(self.critic_weight_cap)):
            problems.append(f"critic_weight_cap: expected >= 1 and finite, or None, got {self.critic_weight_cap}")
        if self.max_sessions is not None and self.max_sessions < 1:
            problems.append(f"max_sessions: expected >= 1 or None, got {self.max_sessions}")
        if self.window_hours is not None and not (self.window_hours > 0 and math.isfinite(self.window_hours)):
            problems.append(f"window_hours: expected > 0 or None, got {self.window_hours}")
        if self.exploration_epsilon is not None and not 0.0 <= self.exploration_epsilon <= 1.0:
            problems.append(f"exploration_epsilon: expected in [0, 1] or None, got {self.exploration_epsilon}")
        temperature = self.exploration_temperature
        if temperature is not None and not (temperature > 0 and math.isfinite(temperature)):
            problems.append(f"exploration_temperature: expected > 0 or None, got {self.exploration_temperature}")
        if self.second_look_level is not None and not 0.5 <= self.second_look_level < 1.0:
            problems.append(f"second_look_level: expected in [0.5, 1) or None, got {self.second_look_level}")
        if self.min_trajectory_ess is not None and not 0.0 < self.min_trajectory_ess <= 1.0:
            problems.append(f"min_trajectory_ess: expected in (0, 1] or None, got {self.min_trajectory_ess}")
        if not isinstance(self.products, ProductStepConfig):
            problems.append(f"products: expected ProductStepConfig, got {type(self.products).__name__}")
        if self.engagement_weights is not None and not isinstance(self.engagement_weights, EngagementWeights):
            problems.append(f"engagement_weights: expected EngagementWeights or None (EngagementWeights.from_dict for JSON), got "
                            f"{type(self.engagement_weights).__name__}")
        if self.trust_region not in ("served", "policy"):
            problems.append(f"trust_region: expected served or policy, got {self.trust_region!r}")
        if self.surrogate not in ("logged", "expected"):
            problems.append(f"surrogate: expected logged or expected, got {self.surrogate!r}")
        elif self.surrogate == "expected" and self.advantage != "critic":
            problems.append(f"surrogate: expected needs advantage critic, got advantage {self.advantage!r}")
        if self.advantage not in ("baseline", "group", "critic"):
            problems.append(f"advantage: expected baseline, group or critic, got {self.advantage!r}")
        for name in ("value_hidden", "value_epochs", "critic_hidden", "critic_epochs", "max_fit_rows", "updates", "batch", "cg_iters",
                     "line_search_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.bootstrap < MIN_BOOTSTRAP:
            problems.append(f"bootstrap: expected >= {MIN_BOOTSTRAP} resamples (a 95 % interval of fewer is their extremes), "
                            f"got {self.bootstrap}")
        elif self.bootstrap > MAX_BOOTSTRAP:
            problems.append(f"bootstrap: expected <= {MAX_BOOTSTRAP} resamples (each holds memory until the interval), "
                            f"got {self.bootstrap}")
        for name in ("max_ratio", "kl_delta", "horizon_hours"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                problems.append(f"{name}: expected > 0, got {getattr(self, name)}")
        if not 0 < self.fisher_fraction <= 1:
            problems.append(f"fisher_fraction: expected in (0, 1], got {self.fisher_fraction}")
        if not (0.0 <= self.gate_min_ess_fraction <= 1.0 and self.gate_min_ess >= 0 and 0.0 <= self.gate_max_unsupported <= 1.0):
            problems.append("gate_min_ess_fraction and gate_max_unsupported must be in [0, 1], gate_min_ess >= 0")
        if not self.gate_max_pareto_k > 0:
            problems.append(f"gate_max_pareto_k: expected > 0, got {self.gate_max_pareto_k}")
        for name in ("damping", "tolerance", "cg_residual_tol", "open_terminal_reward"):
            value = getattr(self, name)
            if not math.isfinite(value) or (value < 0 and name != "open_terminal_reward"):
                problems.append(f"{name}: expected a finite number{'' if name == 'open_terminal_reward' else ' >= 0'}, got {value}")
        for name in ("group_std_floor", "behavior_kl_warn"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                problems.append(f"{name}: expected a finite number > 0, got {getattr(self, name)}")
        for name in ("max_behavior_kl", "guard_kl_budget"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                problems.append(f"{name}: expected a finite number >= 0, or None, got {value}")
        if math.isfinite(self.horizon_hours) and not math.isfinite(self.horizon_hours * 3600.0):
            problems.append(f"horizon_hours: expected a number of hours whose seconds are finite, got {self.horizon_hours}")
        if not (self.logit_damping >= 0 and math.isfinite(self.logit_damping)):
            problems.append(f"logit_damping: expected >= 0, got {self.logit_damping}")
        if problems:
            raise ValueError("; ".join(problems))
        floats_as_floats(self)  # after the checks, whose messages quote the values as given

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("guard", "products", "engagement_weights")}
        out["guard"] = self.guard.to_dict()
        out["products"] = self.products.to_dict()
        out["engagement_weights"] = None if self.engagement_weights is None else self.engagement_weights.to_dict()
        return out

    def session_limits(self) -> SessionLimits:
        """What one session may hold before the run leaves it out (``trainer.log_checks.usable``)."""
        return SessionLimits(self.max_session_order_value, self.max_session_decisions, self.max_session_complaints)

    def gate_limits(self) -> GateLimits:
        """The keyword arguments of ``trainer.evaluation.gate`` that this config sets."""
        return {"min_ess_fraction": self.gate_min_ess_fraction, "min_ess": self.gate_min_ess,
                "max_unsupported": self.gate_max_unsupported, "max_pareto_k": self.gate_max_pareto_k}

    @classmethod
    def with_overrides(cls, **values: Any) -> TrainConfig:
        return dataclasses.replace(cls(), **values)
