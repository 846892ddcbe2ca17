"""``train``: logged decisions and outcomes → a new bundle. Reads top to bottom.

1. Split the logs by session into training and held-out sides (the held-out side is the gate's).
2. Join the training side into episodes, attribute rewards, compute Monte Carlo returns, and
   rebuild every logged state with the starting bundle's feature encoder.
3. Train the Action Guard on (state, served action, harmful) and pick its threshold.
4. With the new guard fixed, compute per logged state what the new bundle's decoder works on:
   guardrail weights, the veto, the rule engine's fallback (``policy.decision.DecisionProcedure.inputs``).
5. Advantages: the learned critic's R_ψ(s, a) − V_φ(s) (the default; with ``surrogate = expected``, for every
   action), or returns minus a learned value baseline, or group-relative z-scores.
6. ``updates`` natural-gradient steps on the policy (``trainer.update``): the surrogate
   is the truncated importance ratio (new served probability / logged propensity) times the
   advantage (or, ``expected``, the served mean of every action's advantage); the step is the
   CG solution of F s = g scaled to the KL target and line-searched.
7. Export the networks into a bundle with the training metrics in its manifest.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import torch

from core.domain import N_ACTIONS, FloatArray, PageType, Source
from core.progress import progress
from guard.action_guard import ActionGuard
from policy.decoder import MajorityDecoder
from policy.features import FeatureSpec
from trainer import update
from trainer.advantages import baseline_folds, cross_fitted_baseline, group_advantages
from trainer.config import TrainConfig
from trainer.critic import cross_fitted_critic
from trainer.data import Experience, experience, training_reports, training_rows
from trainer.distributed import LocalReducer, Reducer
from trainer.export import export_bundle
from trainer.guard_spikes import SpikeLog, SpikeRule
from trainer.guard_threshold import VetoCriterion
from trainer.guard_train import assess_guard, train_guard
from trainer.init_arrays import trainable, trainable_product
from trainer.minibatches import fraction, global_count, row_keys, salt_of, sample, union_ratio
from trainer.networks import GuardNet, PolicyNet, guard_from_arrays, policy_from_arrays
from trainer.offline import MAX_WEIGHT
from trainer.replay import decoder_arrays
from trainer.served import TorchDecoder
from trainer.sharded import any_rank, describe_window, newest_time
from trainer.window import NoDecisions, Window
from trainer.window import for_config as window_for
from weights import mlp
from weights.bundle import Bundle
from weights.model_set import LoadOptions, ModelSet

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainResult:
    bundle: bytes
    manifest: dict[str, Any]
    metrics: dict[str, float]
    warnings: list[str] = field(default_factory=list)
    policy: PolicyNet | None = None
    guard: GuardNet | None = None
    behavior_table: np.ndarray | None = None
    spec: FeatureSpec | None = None
    seed: int = 0
    product: dict[str, mlp.Params] | None = None
    """The starting bundle's RecommendProduct networks, carried over untrained (``trainer.export``)."""

    def with_metrics(self, extra: dict[str, float]) -> bytes:
        """The same bundle with ``extra`` added to its training metrics (the gate's offline estimates)."""
        assert self.policy is not None and self.guard is not None and self.behavior_table is not None and self.spec is not None
        self.metrics = {**self.metrics, **{k: float(v) for k, v in extra.items() if math.isfinite(float(v))}}
        self.manifest = {**self.manifest, "training_metrics": self.metrics}
        self.bundle = export_bundle(self.policy, self.guard, self.behavior_table, self.spec, self.manifest, self.seed,
                                    product=self.product)
        return self.bundle


@dataclass(slots=True)
class Targets:
    """Per training row, what the new bundle's decoder works on (fixed during the policy update)."""

    log_weights: torch.Tensor  # (N, A) float64, -inf where banned
    allowed: torch.Tensor  # (N, A) bool
    fallback: torch.Tensor  # (N,) long
    ok: torch.Tensor  # (N,) bool


def pick_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    return torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


def _guard_allow(guard: GuardNet, states: np.ndarray, chunk: int = 65536) -> FloatArray:
    with torch.no_grad():
        parts = [torch.sigmoid(guard(torch.from_numpy(states[i : i + chunk]))).double().numpy() for i in range(0, len(states), chunk)]
    return np.concatenate(parts) if parts else np.zeros((0, N_ACTIONS))


def targets_for(base: ModelSet, exp: Experience, guard: GuardNet, threshold: float, device: torch.device) -> Targets:
    allow = _guard_allow(guard, exp.steps.states)
    zeros = np.zeros((len(exp.steps), N_ACTIONS), dtype=np.float32)
    inputs = base.decision.inputs(exp.steps.contexts, zeros, allow.astype(np.float32), ActionGuard(threshold))
    log_w, allowed, fallback, ok = decoder_arrays(inputs)
    return Targets(*(torch.as_tensor(a, device=device) for a in (log_w, allowed, fallback, ok)))


def rows_of(x: torch.Tensor, rows: npt.NDArray[np.int64]) -> torch.Tensor:
    """``x[rows]``, but ``x`` itself (no copy) when ``rows`` is every row in order, as the fit sample (``max_fit_rows``,
    sorted) is whenever the training side is no larger: states are the run's largest array."""
    if len(rows) == len(x) and np.array_equal(rows, np.arange(len(x))):
        return x
    return x[torch.as_tensor(rows, device=x.device)]


def advantages_for(exp: Experience, config: TrainConfig, states: torch.Tensor, rows: np.ndarray,
                   pi: torch.Tensor | None = None, keys: npt.NDArray[np.uint64] | None = None,
                   reducer: Reducer | None = None, *, sessions: npt.NDArray[Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """Per training row Â (float64), and the fit's metrics. ``pi`` (len(rows), A): what the starting bundle serves
    at the fit rows (``advantage = critic``: V_φ is fitted to E_{a∼π} R_ψ(s, a)); ``keys`` the fit rows' minibatch
    keys; ``reducer``: the ranks' shards are fitted together; ``sessions``: each row's session id (the value baseline's
    halves)."""
    reducer = reducer or LocalReducer()
    returns = torch.as_tensor(exp.returns, dtype=torch.float32, device=states.device)
    if config.advantage == "critic":
        if pi is None:
            raise ValueError("pi: required with advantage=critic")
        acts = torch.as_tensor(exp.steps.actions, device=states.device)
        weights = None if config.critic_weight_cap is None else torch.as_tensor(
            np.minimum(1.0 / exp.steps.propensity, config.critic_weight_cap), dtype=torch.float32, device=states.device)
        return cross_fitted_critic(states, acts, returns, pi, baseline_folds(sessions, config.seed), rows,
                                   expected=config.surrogate == "expected", hidden=config.critic_hidden,
                                   epochs=config.critic_epochs, seed=config.seed, keys=keys, reducer=reducer, weights=weights)
    if config.advantage == "group":
        groups = np.array([int(c.page_type) for c in exp.steps.contexts], dtype=np.int64)
        total = None if reducer.world_size == 1 else lambda x: reducer.total(torch.as_tensor(x, dtype=torch.float64)).numpy()
        advantages = group_advantages(exp.returns, groups, config.group_std_floor, total=total,
                                      width=None if total is None else len(PageType))
        return torch.as_tensor(advantages, device=states.device), {}
    fold = baseline_folds(sessions, config.seed)
    return cross_fitted_baseline(states, returns, fold, rows, config.value_hidden, config.value_epochs, seed=config.seed, keys=keys,
                                 reducer=reducer).double(), {}


def _engagement_metrics(join: dict[str, Any] | None, reducer: Reducer) -> dict[str, float]:
    """What the engagement weights' join used and left out, over every rank (nothing when the weights are off)."""
    if join is None:
        return {}
    counts = {f"engagement_{name}": float(global_count(int(join[name]), reducer))
              for name in ("n_reports", "n_duplicates", "n_unknown_decision", "n_outside_horizon", "n_superseded", "n_steps_weighted")}
    return {**counts, "engagement_mean_weight": union_ratio(join["mean_weight"] * join["n_steps"], float(join["n_steps"]), reducer)}


def _created_at(decisions: pa.Table, reducer: Reducer) -> str:
    """The newest logged decision time (every rank's): the same logs give the same manifest (and bundle bytes)."""
    newest = newest_time(decisions, reducer) or 0.0
    return dt.datetime.fromtimestamp(math.floor(newest), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def train(decisions: pa.Table, outcomes: pa.Table, init: Bundle, config: TrainConfig, *, device: str = "auto",
          reducer: Reducer | None = None, world: int = 1, model_version: str | None = None,
          provenance: dict[str, Any] | None = None, window: Window | None = None) -> TrainResult:
    started = time.monotonic()
    reducer = reducer or LocalReducer()
    dev = pick_device(device)
    torch.manual_seed(config.seed)
    base = ModelSet.load(init, LoadOptions(device="cpu", warmup_batch=1))
    spec = base.encoder.spec
    warnings: list[str] = []

    # 1-2. the window, the training side, as arrays in episode order
    # (under torchrun: this rank's shard of the sessions; every statistic below is of all shards together)
    window = window if window is not None else window_for(decisions, outcomes, config)  # given: read in two passes
    record = describe_window(window, reducer)
    log.info("window: %d decisions of %d sessions (%s in the window before any sample), model versions %s",
             record["decisions"], record["sessions"], record["sessions_in_window"], record["model_versions"])
    rows_train, outcomes_train = training_rows(window.decisions, window.outcomes, config.heldout_fraction, config.seed)
    engagements_train = training_reports(window.engagements, config.heldout_fraction, config.seed)
    exp = experience(window.decisions, outcomes_train, base, config, rows_train, gather=reducer.gather, engagements=engagements_train)
    if exp.engagement is not None and global_count(exp.engagement["n_reports"], reducer) == 0:
        warnings.append("engagement_weights is on but the window holds no engagement report (logs from before the kind, or a "
                        "window built without them): every step weighs 1")
    n = len(exp.steps)
    if any_rank(n == 0, reducer):
        raise NoDecisions("no logged decisions on the training side" + (f" of some rank's shard ({world} ranks)" if world > 1 else ""))
    states_np = exp.steps.states
    states = torch.from_numpy(states_np).to(dev)
    actions = torch.from_numpy(exp.steps.actions).to(dev)
    sessions = np.repeat(exp.episodes.session_ids, exp.episodes.lengths)
    keys = row_keys(sessions)  # a row's own key (session, step): samples and minibatches the same on any sharding
    fit_rows = sample(keys, config.max_fit_rows, salt_of("fit", config.seed), reducer)

    # 3. the guard
    init_policy, init_guard_arrays = trainable(init, base)  # what the servers run, or BundleError
    init_guard = guard_from_arrays(init_guard_arrays, spec.state_dim)
    rows_t = torch.from_numpy(fit_rows)
    criterion = VetoCriterion(config.guard.harm_cost_ratio, config.guard.veto_confidence)
    guard_rows = (rows_of(torch.from_numpy(states_np), fit_rows), actions[rows_t].cpu(),  # on the host: no copy back from a GPU
                  torch.from_numpy(exp.harmful[fit_rows]), sessions[fit_rows])
    guarded = train_guard(*guard_rows, config.guard, init=init_guard, device=dev, criterion=criterion, reducer=reducer)

    # 4. the new bundle's decoder inputs, fixed for the policy update; the guard's change within its budget
    policy = policy_from_arrays(init_policy).to(dev)
    decoder_spec = shipped_decoder(base.manifest["decoder"], config)
    decoder = TorchDecoder(MajorityDecoder(decoder_spec["samples"], decoder_spec["min_votes"], decoder_spec["exploration_epsilon"],
                                           decoder_spec["exploration_temperature"]), torch.float64, dev)
    init_threshold = float(base.manifest["guard"]["threshold"])
    targets = targets_for(base, exp, guarded.net, guarded.threshold, dev)
    old_targets = targets_for(base, exp, init_guard, init_threshold, dev)
    guard_kl = served_kl_between(policy, decoder, states, targets, old_targets, fit_rows, reducer=reducer)
    guard_kept = config.guard_kl_budget is not None and guard_kl > config.guard_kl_budget
    veto_dropped = False
    if guard_kept:
        over = (f"the retrained guard would move the served distribution by KL {guard_kl:.3f} > guard_kl_budget "
                f"{config.guard_kl_budget}: the starting bundle's guard is kept")
        guarded = assess_guard(init_guard, init_threshold, *guard_rows, config.guard, criterion, reducer)  # at its own threshold
        veto_dropped = guarded.threshold != init_threshold
        if veto_dropped:  # the old veto no longer earns its place: it ships only when it does, so it goes, over budget or not
            targets = targets_for(base, exp, init_guard, guarded.threshold, dev)
            guard_kl = served_kl_between(policy, decoder, states, targets, old_targets, fit_rows, reducer=reducer)
            over += (f", but its veto no longer earns its place on the held-out sessions (threshold {init_threshold:g} → "
                     f"{guarded.threshold:g}) and is dropped, which moves the served distribution by KL {guard_kl:.3f}")
        else:
            targets, guard_kl = old_targets, 0.0
        warnings.append(over)
    log.info("guard change: served KL %.4f (budget %s)%s", guard_kl, config.guard_kl_budget,
             (": kept the old guard without its veto" if veto_dropped else ": kept the old guard") if guard_kept else "")

    # 5. advantages
    pi_fit = served_probs_at(policy, decoder, states, targets, fit_rows) if config.advantage == "critic" else None
    advantages, advantage_metrics = advantages_for(exp, config, states, fit_rows, pi_fit, keys[fit_rows], reducer, sessions=sessions)
    advantages = advantages.to(dev)

    # 6. natural-gradient steps
    start_policy = copy.deepcopy(policy)
    propensity = torch.as_tensor(exp.steps.propensity, device=dev)
    behavior = torch.as_tensor(exp.steps.behavior_probs, device=dev)
    stats = update.Stats()
    random_rows = torch.as_tensor(~exp.steps.certain)  # served at random by the behaviour: the rows a ratio can use
    eligible = torch.nonzero(targets.ok.cpu() & random_rows).flatten()  # and decided by the new decoder (others: no gradient)
    n_eligible = global_count(len(eligible), reducer)
    rows = None
    stepping = not any_rank(len(eligible) == 0, reducer)
    if not stepping:
        where = " on some rank's shard" if world > 1 else ""
        warnings.append(f"no logged row served at random is decided by the decoder under the new guard{where} "
                        f"({n_eligible} in all): no policy step")
    spike_log = SpikeLog()
    with progress("train.updates", total=config.updates, unit="step") as bar:
        for step in range(config.updates if stepping else 0):
            # a keyed sample of about `batch` rows of all ranks' eligible rows: this rank's part of it
            pick = eligible.numpy() if n_eligible <= config.batch else \
                eligible.numpy()[fraction(keys[eligible.numpy()], salt_of("batch", config.seed, step)) < config.batch / n_eligible]
            if any_rank(len(pick) == 0, reducer):
                warnings.append(f"update {step}: some rank's part of the batch is empty: no further policy step")
                break
            whole = torch.from_numpy(pick)
            batch = whole.to(dev)
            rows = update.Batch(states[batch], actions[batch], propensity[batch], advantages[batch], targets.log_weights[batch],
                                targets.allowed[batch], targets.fallback[batch], behavior[batch])
            fisher_rows = None  # the Fisher's subsample, keyed: the same rows however the batch is sharded (None: all)
            if config.fisher_fraction < 1.0:
                keyed = np.flatnonzero(fraction(keys[pick], salt_of("fisher", config.seed, step)) < config.fisher_fraction)
                fisher_rows = torch.arange(len(pick)) if any_rank(len(keyed) == 0, reducer) else torch.from_numpy(keyed)  # none: all
            def ess_limit(theta0: torch.Tensor) -> bool:
                return _within_trajectory_ess(policy, decoder, states, targets, exp, theta0, config, reducer)

            outcome = update.natural_step(policy, decoder, rows, config, stats, reducer, None,
                                          shrink=ess_limit if config.min_trajectory_ess is not None else None, fisher_rows=fisher_rows)
            log.info("update %d: %s", step, outcome.to_dict())
            bar.update(1, rows=global_count(len(whole), reducer))
            spike_log.record(outcome.eta, whole.numpy())
            if stats.support_limited:
                log.info("stopping after update %d: a further step would leave what the logs can judge (max_behavior_kl %s, "
                         "min_trajectory_ess %s)", step, config.max_behavior_kl, config.min_trajectory_ess)
                break
    if not stats.kls:  # (steps the line search refused, or the support stops undid, were not taken)
        warnings.append("no natural-gradient step was taken: the bundle's policy is the starting one")
    if rows is not None and len(rows.states):
        stats.ess = update.effective_sample_size(policy, decoder, rows, config.max_ratio, reducer)  # the final policy, last batch
    # 6b. η-spike auto-labels fine-tune the guard, within the same budget on what is served
    logged_adv = advantages if advantages.ndim == 1 else advantages.gather(1, actions[:, None])[:, 0]
    spikes = spike_log.labels(logged_adv.cpu().numpy(), SpikeRule(), gather=reducer.gather)
    extra = spikes.harmful[fit_rows]
    if any_rank(bool(extra.any()), reducer) and not guard_kept:
        tuned = train_guard(*guard_rows, config.guard, init=guarded.net, device=dev, extra_harmful=extra, criterion=criterion,
                            reducer=reducer)
        tuned_targets = targets_for(base, exp, tuned.net, tuned.threshold, dev)
        tuned_kl = served_kl_between(policy, decoder, states, tuned_targets, old_targets, fit_rows,  # against the starting guard
                                     reducer=reducer)
        within = config.guard_kl_budget is None or tuned_kl <= config.guard_kl_budget
        if within and config.min_trajectory_ess is not None:  # and still where the gate can judge the bundle
            within = trajectory_ess_fraction(policy, decoder, states, tuned_targets, exp, config.max_ratio,
                                             reducer) >= config.min_trajectory_ess
        if within:
            guarded, targets, guard_kl = tuned, tuned_targets, tuned_kl
        log.info("guard fine-tuned on %d η-spike labels (this rank's): served KL %.4f, %s", int(extra.sum()), tuned_kl,
                 "kept" if guarded is tuned else "over the budget, dropped")
    kl_behavior = behavior_kl(policy, decoder, states, targets, exp.steps.behavior_probs, ~exp.steps.certain, reducer=reducer)
    random_np = ~exp.steps.certain
    start_decoder = TorchDecoder(base.decision.decoder, torch.float64, dev)
    kl_start = served_kl_between(policy, decoder, states, targets, old_targets, np.flatnonzero(random_np), start_policy,
                                 old_decoder=start_decoder, reducer=reducer)
    kl_steps = served_kl_between(policy, decoder, states, targets, targets, np.flatnonzero(random_np), start_policy, reducer=reducer)
    ess_fraction = trajectory_ess_fraction(policy, decoder, states, targets, exp, config.max_ratio, reducer)
    if kl_behavior > config.behavior_kl_warn:
        warnings.append(f"KL(new ‖ behaviour) = {kl_behavior:.3f} > {config.behavior_kl_warn}: the logs no longer support "
                        "a step this far; collect fresh data under this policy before training further")

    # 7. export, with what the run measured
    metrics = {
        **stats.summary(),
        **guarded.metrics,
        **spikes.metrics(),
        "guard_eta_spike_rows": float(global_count(int(spikes.harmful.sum()), reducer)),  # every rank's labels
        **advantage_metrics,
        "kl_to_behavior": kl_behavior,
        "kl_served_to_start": kl_start,  # what the run applied: KL(new bundle ‖ starting bundle) as served, all random rows
        "kl_served_policy_steps": kl_steps,  # of which the policy's steps alone (the final guard and decoder on both sides)
        "trajectory_ess_fraction": ess_fraction,  # of the training sessions, at the final policy
        "guard_served_kl": guard_kl,
        "guard_kept_from_start": float(guard_kept),
        "guard_veto_dropped": float(veto_dropped),  # kept, but without the veto it no longer earned (guard_served_kl: its cost)
        "return_variance_ratio": _variance_ratio(exp, reducer),
        "train_steps": float(global_count(n, reducer)),
        "train_episodes": float(global_count(exp.episodes.n_episodes, reducer)),
        "train_rows_served_with_certainty": float(global_count(int(exp.steps.certain.sum()), reducer)),  # not in the surrogate, KL
        **_engagement_metrics(exp.engagement, reducer),
    }
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
    policy = policy.cpu()
    log.info("trained in %.1f s (not in the manifest: the same logs and seed give the same bytes)", time.monotonic() - started)
    created_at = _created_at(decisions, reducer)
    # The same inputs give the same bytes and version; other inputs another version (model versions are immutable in the
    # weights store): the starting bundle, the config, and the logs by their newest time (above) and their row counts, so
    # a run on fewer of the same logs is not named as the run on all of them (a review: it was, and its publish refused).
    sizes = [global_count(decisions.num_rows, reducer), global_count(outcomes.num_rows, reducer)]
    digest = hashlib.sha256(json.dumps([base.version, config.to_dict(), sizes], sort_keys=True, default=str).encode()).hexdigest()[:8]
    version = model_version or f"trained-{created_at.replace(':', '').replace('-', '')}-{digest}"
    manifest = {
        **{k: base.manifest[k] for k in ("feature_spec", "actions", "guardrails", "fallback_rules", "golden")},
        "decoder": decoder_spec,
        "model_version": version,
        "created_at": created_at,
        "guard": {"threshold": float(guarded.threshold), "veto": guarded.veto, "veto_reason": guarded.veto_reason},
        "training_metrics": metrics,
        "trainer": {"config": config.to_dict(), "reward_scale": exp.reward_scale, "init_model_version": base.version,
                    "warnings": warnings, "device": str(dev), "beyond_logged_support": kl_behavior > config.behavior_kl_warn,
                    "window": record},
        "provenance": {"kind": "trained", "builder": "trainer.train", **(provenance or {})},
    }
    product = None
    if base.product is not None:  # carried over as they are: cycle trains them apart (trainer.cycle_products)
        product = trainable_product(init, base)  # (what the servers run, or BundleError)
        manifest["product"] = base.manifest["product"]
    data = export_bundle(policy, guarded.net, base.encoder.behavior_table, spec, manifest, config.seed, product=product)
    return TrainResult(data, manifest, metrics, warnings, policy, guarded.net, base.encoder.behavior_table, spec, config.seed,
                       product)


def behavior_kl(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, targets: Targets, behavior: FloatArray,
                rows: npt.NDArray[np.bool_] | None = None, chunk: int = 8192, reducer: Reducer | None = None) -> float:
    """Mean KL(new ‖ behaviour) of the served distributions over the logged states (``rows`` of them).

    The trainer passes the rows the behaviour served at random: against a point mass (a
    rule-engine answer) the KL only measures the floor below, not how far the policy moved.
    """
    from trainer.evaluation import mean_kl

    served = served_probs_at(policy, decoder, states, targets, np.arange(len(states)), chunk).cpu().numpy()
    logged = np.maximum(behavior, 1e-6)  # floored: finite where the old guard vetoed
    if rows is not None:
        served, logged = served[rows], logged[rows]
    return _mean_over_ranks(mean_kl(served, logged) if len(served) else 0.0, len(served), reducer)


def _mean_over_ranks(mean: float, n: int, reducer: Reducer | None) -> float:
    """The mean over every rank's rows of a statistic whose mean over this rank's ``n`` rows is ``mean`` (0: no rows)."""
    if reducer is None or reducer.world_size == 1:
        return mean if n else 0.0
    return union_ratio(mean * n, float(n), reducer)


def shipped_decoder(start: dict[str, Any], config: TrainConfig) -> dict[str, Any]:
    """The decoder settings of the new bundle: the starting bundle's, with the run's exploration where set."""
    out = dict(start)
    if config.exploration_epsilon is not None:
        out["exploration_epsilon"] = config.exploration_epsilon
    if config.exploration_temperature is not None:
        out["exploration_temperature"] = config.exploration_temperature
    return out


def trajectory_ess_fraction(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, targets: Targets,
                            exp: Experience, max_ratio: float, reducer: Reducer | None = None) -> float:
    """ESS / E of the sessions' whole-trajectory weights Π_t min(P_new(a_t|s_t) / μ_t, max_ratio) on the training side.

    The gate's estimators weight an order, observed at a session's last step, by the whole session's
    weight, and the gate refuses below an ESS floor (``trainer.evaluation``): the trainer stops where
    the gate can still judge it. Rows are weighted as the gate weights them: truncated ratios, the whole
    weight capped at ``offline.MAX_WEIGHT``, ratio 1 for degraded and no-model rows (whatever bundle is
    deployed, the server answers those from the rules), the exact target probability for the others.
    """
    rows = np.arange(len(exp.steps), dtype=np.int64)
    p = served_probs_at(policy, decoder, states, targets, rows)
    acts = torch.as_tensor(exp.steps.actions, device=p.device)
    ratio = p.gather(1, acts[:, None])[:, 0].cpu().numpy() / exp.steps.propensity
    source = np.asarray(exp.decisions.column("source").to_numpy(zero_copy_only=False), dtype=np.int64)
    ratio[np.isin(source, (int(Source.FALLBACK_DEGRADED), int(Source.FALLBACK_NO_MODEL)))] = 1.0  # as the gate: any bundle serves those so
    log_w = np.log(np.clip(np.minimum(ratio, max_ratio), 1e-300, None))
    per_session = np.add.reduceat(log_w, exp.episodes.starts) if len(log_w) else np.zeros(0)
    per_session = np.minimum(per_session, math.log(MAX_WEIGHT))  # the gate's cap on a cumulative weight
    reducer = reducer or LocalReducer()
    top = float(reducer.maximum(torch.tensor([per_session.max() if len(per_session) else -math.inf], dtype=torch.float64))[0])
    w = np.exp(per_session - top) if len(per_session) else per_session  # scaled by the largest weight of every rank
    s1, s2, count = reducer.total(torch.tensor([w.sum(), w @ w, float(len(w))], dtype=torch.float64)).tolist()
    return float(s1**2 / s2 / count) if count and s2 > 0 else 0.0


def _within_trajectory_ess(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, targets: Targets,
                           exp: Experience, theta0: torch.Tensor, config: TrainConfig, reducer: Reducer) -> bool:
    """Halve an accepted step (up to 10 times, else undo it) until the trajectory ESS fraction is at least
    ``config.min_trajectory_ess``; True when it had to be shrunk (the run then stops updating)."""
    floor = config.min_trajectory_ess
    assert floor is not None
    shrunk = update.shrink_until(policy, theta0, lambda: trajectory_ess_fraction(policy, decoder, states, targets, exp,
                                                                                  config.max_ratio, reducer) >= floor)
    if shrunk:
        log.info("step shrunk or undone: the trajectory ESS would fall below %.3g of the sessions", floor)
    return shrunk


def served_probs_at(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, targets: Targets,
                    rows: npt.NDArray[np.int64], chunk: int = 8192) -> torch.Tensor:
    """(len(rows), A): what ``policy`` serves at ``rows`` under ``targets``, without gradient."""
    parts = []
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            r = torch.as_tensor(rows[i : i + chunk], device=states.device)
            q = decoder.masked_q(policy(states[r]), targets.log_weights[r], targets.allowed[r])
            parts.append(decoder.served(q, targets.fallback[r], targets.ok[r]))
    return torch.cat(parts) if parts else torch.zeros((0, N_ACTIONS), dtype=torch.float64, device=states.device)


def served_kl_between(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, new: Targets, old: Targets,
                      rows: npt.NDArray[np.int64], old_policy: torch.nn.Module | None = None, chunk: int = 8192,
                      old_decoder: TorchDecoder | None = None, reducer: Reducer | None = None) -> float:
    """Mean over ``rows`` of KL(P_new ‖ P_old): the served distributions of ``policy`` under ``new`` (through
    ``decoder``) and of ``old_policy`` (default: the same policy) under ``old`` (through ``old_decoder``, default
    ``decoder``). 0 for no rows. With a ``reducer``: over every rank's ``rows``."""
    p = served_probs_at(policy, decoder, states, new, rows, chunk)
    q = served_probs_at(old_policy or policy, old_decoder or decoder, states, old, rows, chunk)
    local = float(update.served_kl(p, torch.clamp(q, min=1e-6)).mean()) if len(rows) else 0.0  # floored: finite where vetoed
    return _mean_over_ranks(local, len(rows), reducer)


def _variance_ratio(exp: Experience, reducer: Reducer | None = None) -> float:
    """Var(G)/E[G]² of the raw per-session returns G_0 (the reference design's return-variance monitor), over every
    rank's sessions."""
    from experience.returns import session_returns

    g = session_returns(exp.episodes)
    add = (lambda t: t) if reducer is None else reducer.total
    count, s1 = add(torch.tensor([float(len(g)), float(np.sum(g))], dtype=torch.float64)).tolist()
    mean = s1 / count if count else 0.0
    squares = float(add(torch.tensor([float(np.sum(np.square(g - mean)))], dtype=torch.float64))[0])  # two passes
    return float(squares / count / mean**2) if mean != 0 else math.inf
