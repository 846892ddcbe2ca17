"""``train``: logged decisions and outcomes → a new bundle. Reads top to bottom.

1. Split the logs by session into training and held-out sides (the held-out side is the gate's).
2. Join the training side into episodes, attribute rewards, compute Monte Carlo returns, and
   rebuild every logged state with the starting bundle's feature encoder.
3. Train the Action Guard on (state, served action, harmful) and pick its threshold.
4. With the new guard fixed, compute per logged state what the new bundle's decoder works on:
   guardrail weights, the veto, the rule engine's fallback (``policy.decision.DecisionProcedure.inputs``).
5. Advantages: returns minus a learned value baseline (or group-relative z-scores).
6. ``updates`` natural-gradient steps on the policy (``trainer.update``): the surrogate
   is the truncated importance ratio (new served probability / logged propensity) times the
   advantage; the step is the CG solution of F s = g scaled to the KL target and line-searched.
7. Export the networks into a bundle with the training metrics in its manifest.
"""

from __future__ import annotations

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

from core.domain import N_ACTIONS, FloatArray
from guard.action_guard import ActionGuard
from policy.features import FeatureSpec
from trainer import update
from trainer.advantages import baseline_advantages, fit_value, group_advantages
from trainer.config import TrainConfig
from trainer.data import Experience, experience, split
from trainer.distributed import LocalReducer, Reducer
from trainer.export import export_bundle
from trainer.guard_train import train_guard
from trainer.networks import GuardNet, PolicyNet, guard_from_arrays, policy_from_arrays
from trainer.replay import decoder_arrays
from trainer.served import TorchDecoder
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

    def with_metrics(self, extra: dict[str, float]) -> bytes:
        """The same bundle with ``extra`` added to its training metrics (the gate's offline estimates)."""
        assert self.policy is not None and self.guard is not None and self.behavior_table is not None and self.spec is not None
        self.metrics = {**self.metrics, **{k: float(v) for k, v in extra.items() if math.isfinite(float(v))}}
        self.manifest = {**self.manifest, "training_metrics": self.metrics}
        self.bundle = export_bundle(self.policy, self.guard, self.behavior_table, self.spec, self.manifest, self.seed)
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


def advantages_for(exp: Experience, config: TrainConfig, states: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    returns = torch.as_tensor(exp.returns, dtype=torch.float32, device=states.device)
    if config.advantage == "group":
        groups = np.array([int(c.page_type) for c in exp.steps.contexts], dtype=np.int64)
        return torch.as_tensor(group_advantages(exp.returns, groups, config.group_std_floor), device=states.device)
    value = fit_value(states[rows], returns[rows], config.value_hidden, config.value_epochs, seed=config.seed)
    return baseline_advantages(states, returns, value).double()


def _created_at(decisions: pa.Table) -> str:
    """The newest logged decision time: the same logs give the same manifest (and bundle bytes)."""
    newest = float(np.max(decisions.column("time_s").to_numpy())) if decisions.num_rows else 0.0
    return dt.datetime.fromtimestamp(math.floor(newest), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def train(decisions: pa.Table, outcomes: pa.Table, init: Bundle, config: TrainConfig, *, device: str = "auto",
          reducer: Reducer | None = None, rank: int = 0, world: int = 1, model_version: str | None = None,
          provenance: dict[str, Any] | None = None) -> TrainResult:
    started = time.monotonic()
    reducer = reducer or LocalReducer()
    dev = pick_device(device)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    base = ModelSet.load(init, LoadOptions(device="cpu", warmup_batch=1))
    spec = base.encoder.spec
    warnings: list[str] = []

    # 1-2. the training side, as arrays in episode order
    (train_d, train_o), _ = split(decisions, outcomes, config.heldout_fraction, config.seed)
    exp = experience(train_d, train_o, base, config)
    n = len(exp.steps)
    if n == 0:
        raise ValueError("no logged decisions on the training side")
    states_np = exp.steps.states
    states = torch.from_numpy(states_np).to(dev)
    actions = torch.from_numpy(exp.steps.actions).to(dev)
    sessions = np.repeat(exp.episodes.session_ids, exp.episodes.lengths)
    fit_rows = np.sort(rng.choice(n, size=min(n, config.max_fit_rows), replace=False))

    # 3. the guard
    init_guard = guard_from_arrays(mlp.guard_params_from_onnx(init.parts["guard.onnx"]), spec.state_dim)
    rows_t = torch.from_numpy(fit_rows)
    guarded = train_guard(states[rows_t].cpu(), actions[rows_t].cpu(), torch.from_numpy(exp.harmful[fit_rows]), sessions[fit_rows],
                          config.guard, init=init_guard, device=dev)

    # 4. the new bundle's decoder inputs, fixed for the policy update
    targets = targets_for(base, exp, guarded.net, guarded.threshold, dev)

    # 5. advantages
    advantages = advantages_for(exp, config, states, fit_rows).to(dev)

    # 6. natural-gradient steps
    policy = policy_from_arrays(mlp.policy_params_from_onnx(init.parts["policy.onnx"])).to(dev)
    decoder = TorchDecoder(base.decision.decoder, torch.float64, dev)
    propensity = torch.as_tensor(exp.steps.propensity, device=dev)
    behavior = torch.as_tensor(exp.steps.behavior_probs, device=dev)
    stats = update.Stats()
    batch_gen = torch.Generator().manual_seed(config.seed)  # the same on every rank: the same batch
    random_rows = torch.as_tensor(~exp.steps.certain)  # served at random by the behaviour: the rows a ratio can use
    eligible = torch.nonzero(targets.ok.cpu() & random_rows).flatten()  # and decided by the new decoder (others: no gradient)
    n_batch = min(len(eligible), config.batch)
    rows = None
    if n_batch < world:
        warnings.append(f"a batch of {n_batch} rows for {world} ranks ({len(eligible)} logged rows are decided by the decoder "
                        "under the new guard): no policy step")
    for step in range(config.updates if n_batch >= world else 0):
        # every rank draws the same batch, then takes its shard of it
        batch = torch.sort(eligible[torch.randperm(len(eligible), generator=batch_gen)[:n_batch]]).values[rank::world].to(dev)
        rows = update.Batch(states[batch], actions[batch], propensity[batch], advantages[batch], targets.log_weights[batch],
                            targets.allowed[batch], targets.fallback[batch], behavior[batch])
        fisher_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 7919 + rank)  # per rank: its shard's subsample
        outcome = update.natural_step(policy, decoder, rows, config, stats, reducer, fisher_gen)
        log.info("update %d: %s", step, outcome.to_dict())
        if stats.support_limited:
            log.info("stopping after update %d: the next step would leave the logs' support (max_behavior_kl %s)", step,
                     config.max_behavior_kl)
            break
    if stats.tracker.steps == 0:
        warnings.append("no natural-gradient step was taken: the bundle's policy is the starting one")
    if rows is not None and len(rows.states):
        stats.ess = update.effective_sample_size(policy, decoder, rows, config.max_ratio)  # the final policy, on the last batch
    kl_behavior = behavior_kl(policy, decoder, states, targets, exp.steps.behavior_probs, ~exp.steps.certain)
    if kl_behavior > config.behavior_kl_warn:
        warnings.append(f"KL(new ‖ behaviour) = {kl_behavior:.3f} > {config.behavior_kl_warn}: the logs no longer support "
                        "a step this far; collect fresh data under this policy before training further")

    # 7. export, with what the run measured
    metrics = {
        **stats.summary(),
        **guarded.metrics,
        "kl_to_behavior": kl_behavior,
        "return_variance_ratio": _variance_ratio(exp),
        "train_steps": float(n),
        "train_episodes": float(exp.episodes.n_episodes),
        "train_rows_served_with_certainty": float(exp.steps.certain.sum()),  # left out of the surrogate and the KL
    }
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
    policy = policy.cpu()
    log.info("trained in %.1f s (not in the manifest: the same logs and seed give the same bytes)", time.monotonic() - started)
    created_at = _created_at(decisions)
    # Unique for (logs, starting bundle, config): the same inputs give the same bytes, other inputs another version
    # (model versions are immutable in the weights store).
    digest = hashlib.sha256(json.dumps([base.version, config.to_dict()], sort_keys=True, default=str).encode()).hexdigest()[:8]
    version = model_version or f"trained-{created_at.replace(':', '').replace('-', '')}-{digest}"
    manifest = {
        **{k: base.manifest[k] for k in ("feature_spec", "actions", "guardrails", "fallback_rules", "decoder", "golden")},
        "model_version": version,
        "created_at": created_at,
        "guard": {"threshold": float(guarded.threshold)},
        "training_metrics": metrics,
        "trainer": {"config": config.to_dict(), "reward_scale": exp.reward_scale, "init_model_version": base.version,
                    "warnings": warnings, "device": str(dev), "beyond_logged_support": kl_behavior > config.behavior_kl_warn},
        "provenance": {"kind": "trained", "builder": "trainer.train", **(provenance or {})},
    }
    data = export_bundle(policy, guarded.net, base.encoder.behavior_table, spec, manifest, config.seed)
    return TrainResult(data, manifest, metrics, warnings, policy, guarded.net, base.encoder.behavior_table, spec, config.seed)


def behavior_kl(policy: torch.nn.Module, decoder: TorchDecoder, states: torch.Tensor, targets: Targets, behavior: FloatArray,
                rows: npt.NDArray[np.bool_] | None = None, chunk: int = 8192) -> float:
    """Mean KL(new ‖ behaviour) of the served distributions over the logged states (``rows`` of them).

    The trainer passes the rows the behaviour served at random: against a point mass (a
    rule-engine answer) the KL only measures the floor below, not how far the policy moved.
    """
    from trainer.evaluation import mean_kl

    parts = []
    with torch.no_grad():
        for i in range(0, len(states), chunk):
            sl = slice(i, i + chunk)
            q = decoder.masked_q(policy(states[sl]), targets.log_weights[sl], targets.allowed[sl])
            parts.append(decoder.served(q, targets.fallback[sl], targets.ok[sl]).cpu().numpy())
    if not parts:
        return 0.0
    served, logged = np.concatenate(parts), np.maximum(behavior, 1e-6)  # floored: finite where the old guard vetoed
    if rows is not None:
        if not rows.any():
            return 0.0
        served, logged = served[rows], logged[rows]
    return mean_kl(served, logged)


def _variance_ratio(exp: Experience) -> float:
    """Var(G)/E[G]² of the raw per-session returns G_0 (the reference design's return-variance monitor)."""
    from experience.returns import session_returns

    g = session_returns(exp.episodes)
    mean = float(np.mean(g)) if len(g) else 0.0
    return float(np.var(g) / mean**2) if mean != 0 else math.inf
