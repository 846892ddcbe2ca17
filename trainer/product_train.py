"""Train a bundle's ``RecommendProduct`` heads on its logged product decisions: read, step each layer, export.

``train_products`` reads the ``products`` records and outcomes (``trainer.product_data``), holds out ``gate_share`` of
the sessions (a keyed hash), takes each layer's trust-region natural-gradient steps on the rest
(``trainer.product_update``) and writes a bundle whose flat-decision parts are the starting bundle's byte for byte and
whose product heads are the new ones (``weights.product_heads.with_heads``), loaded back as the server loads it. The
held-out offers then judge the new heads against the starting ones (``trainer.product_gate``); the verdict is in the
metrics (``gate``) and the manifest. Training rows beyond ``max_rows`` are sampled by a keyed hash of their session,
so a rerun on the same logs trains on the same rows and gives the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import torch

from experience.sessions import first_copies, session_codes, session_hashes, split_by_session
from trainer.config import ProductStepConfig
from trainer.init_arrays import trainable_product, trainable_product_guards
from trainer.product_checks import usable_products
from trainer.product_data import LAYERS, layer_widths, parse_layers, product_rows
from trainer.product_gate import judge
from trainer.product_guard import GuardConfig, PreviousGuard, train_guards
from trainer.product_update import DELTAS, ENCODER_DELTA, update_heads
from trainer.window import SAMPLE_SALT
from weights import mlp
from weights.bundle import Bundle, read_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.product_guard import golden_h
from weights.product_guard import manifest_section as guard_section
from weights.product_guard import parts as guard_parts
from weights.product_heads import feature_widths, with_heads

GATE_SALT = b"product-gate"
"""The product gate's held-out split (``experience.sessions.split_by_session``), independent of the flat gate's."""
SAME_FLAT_KEPT = 20
"""Versions a heads-only bundle names as serving its flat decision byte for byte (``same_flat_as``), newest first."""
MAX_ROWS = 40_000
"""Product decisions one run trains on: a whole run peaked at 6.8 GB at this size on a shelf of 6 categories × 6 SKUs
of 768 floats (``cycle`` takes fewer: ``trainer.cycle_products.MAX_ROWS``)."""


@dataclass(frozen=True)
class ProductTrainConfig:
    deltas: Mapping[str, float] = field(default_factory=lambda: dict(DELTAS))
    layers: tuple[str, ...] = LAYERS
    max_rows: int = MAX_ROWS
    seed: int = 0
    gate_share: float = 0.2
    """Sessions held out of training for the gate (a keyed hash of the session)."""
    tolerance: float = 0.0
    encoder_delta: float = ENCODER_DELTA
    """The shared encoder's region on the sum of the layers' KL (``trainer.product_update``); 0 holds it fixed."""
    encoder_layers: tuple[str, ...] | None = None
    """The layers whose data teach the encoder (``update_heads``), some of ``layers``; None: all of them. The others'
    data cannot reach the other layers through it (``bench.product_stability``)."""
    guard: GuardConfig | None = field(default_factory=GuardConfig)
    """The per-layer guards' training (``trainer.product_guard``); None: the bundle is written without guards."""

    def __post_init__(self) -> None:
        if self.encoder_layers is not None and (not self.encoder_layers or not set(self.encoder_layers) <= set(self.layers)):
            raise ValueError(f"encoder_layers: expected some of the layers trained {self.layers}, got {self.encoder_layers}")

    @classmethod
    def of(cls, step: ProductStepConfig, seed: int = 0, tolerance: float = 0.0, max_rows: int = MAX_ROWS) -> ProductTrainConfig:
        """The config ``step`` asks for (``train-products``' flags, ``cycle``'s ``products``); ``max_rows`` where it
        names none."""
        deltas = {**DELTAS, **{layer: value for layer, value in (("category", step.delta_category), ("sku", step.delta_sku),
                                                                  ("price_band", step.delta_price_band)) if value is not None}}
        guard = None
        if step.guard:
            guard = GuardConfig()
            if step.guard_max_complaint is not None:
                guard = dataclasses.replace(guard, max_complaint=step.guard_max_complaint)
            if step.guard_steps is not None:
                guard = dataclasses.replace(guard, steps=step.guard_steps)
        return cls(deltas=deltas, max_rows=step.max_rows or max_rows, seed=seed, tolerance=tolerance,
                   encoder_delta=ENCODER_DELTA if step.delta_encoder is None else step.delta_encoder,
                   encoder_layers=None if step.encoder_layers is None else parse_layers(step.encoder_layers), guard=guard)

    def to_dict(self) -> dict[str, Any]:
        return {"deltas": dict(self.deltas), "layers": list(self.layers), "max_rows": self.max_rows, "seed": self.seed,
                "gate_share": self.gate_share, "tolerance": self.tolerance,
                "encoder_delta": self.encoder_delta, "encoder_layers": list(self.encoder_layers or self.layers),
                "guard": None if self.guard is None else self.guard.to_dict()}


@dataclass(frozen=True)
class ProductTrainResult:
    bundle: bytes
    metrics: dict[str, Any]

    @property
    def publish(self) -> bool:
        return bool(self.metrics["gate"]["publish"])


def fill_sessions(distinct: list[Any], sizes: npt.NDArray[np.int64], max_rows: int, seed: int,
                  among: npt.NDArray[np.bool_] | None = None) -> npt.NDArray[np.bool_]:
    """Which of the ``distinct`` sessions (``sizes``: their rows; ``among``: the ones eligible, default all) to keep: whole
    sessions in the order of the window sample's keyed session hash (``experience.sessions.session_hashes``) up to
    ``max_rows`` rows, skipping a session that no longer fits. The same on a rerun; ``trainer.product_window`` fills
    its read with it, so training on what it read samples nothing more."""
    keep = np.zeros(len(distinct), dtype=np.bool_)
    room = max_rows
    for code in np.argsort(session_hashes(distinct, SAMPLE_SALT + int(seed).to_bytes(8, "little", signed=True)), kind="stable"):
        if (among is None or among[code]) and sizes[code] <= room:  # a smaller session further on may still fit
            keep[code], room = True, room - int(sizes[code])
    return keep


def sample_rows(table: pa.Table, max_rows: int, seed: int) -> pa.Table:
    """At most ``max_rows`` rows of whole sessions (``fill_sessions``)."""
    if table.num_rows <= max_rows:
        return table
    distinct, which = session_codes(table.column("session_id").to_numpy(zero_copy_only=False))
    keep = fill_sessions(distinct, np.bincount(which, minlength=len(distinct)), max_rows, seed)
    return table.filter(pa.array(keep[which]))


def _ordered(products: pa.Table) -> pa.Table:
    """``products`` in one order whatever the files' (the cross-fitting folds and the guards' validation split go by
    position: ``logs compact`` sorts each hour by session, and the same rows had trained other heads and moved the gate,
    a review). Sorted once sampled and split, which are by session hash: the sort copies only what is trained on."""
    return products.sort_by([("session_id", "ascending"), ("time_s", "ascending"), ("decision_id", "ascending")])


def train_products(products: pa.Table, outcomes: pa.Table, bundle: Bundle, model_version: str, created_at: str,
                   config: ProductTrainConfig | None = None) -> ProductTrainResult:
    """New product heads for ``bundle`` from its logged product decisions (module doc)."""
    config = config or ProductTrainConfig()
    if config.max_rows < 1:
        raise ValueError(f"max_rows: expected >= 1, got {config.max_rows}")
    if not 0.0 < config.gate_share < 1.0:
        raise ValueError(f"gate_share: expected in (0, 1), got {config.gate_share}")
    if products.num_rows == 0:
        raise ValueError("the logs hold no product decisions (products/): nothing to train the heads on")
    logged = products.num_rows
    distinct = first_copies(products, np.arange(logged, dtype=np.int64))  # a copied segment's rows once (the oldest copy)
    if len(distinct) < logged:
        products = products.take(pa.array(distinct))
    outcomes = outcomes.sort_by([("session_id", "ascending"), ("event_time_s", "ascending"), ("outcome_id", "ascending"),
                                 ("received_s", "ascending")])
    torch.manual_seed(config.seed)
    model = ModelSet.load(bundle, LoadOptions(device="cpu", warmup_batch=1))
    products, outcomes, dropped = usable_products(products, outcomes, model.encoder.spec, layer_widths(model))  # rows no server
    if products.num_rows == 0:  # writes, or that this bundle cannot rebuild: their sessions left out
        raise ValueError(f"every one of the {logged} product decisions is in a session with rows no server writes or this "
                         f"bundle cannot rebuild ({dropped.reasons})")
    gate_rows = split_by_session(products.column("session_id").to_numpy(zero_copy_only=False), config.gate_share, config.seed,
                                 GATE_SALT)
    if gate_rows.all() or not gate_rows.any():
        raise ValueError(f"too few sessions to hold {config.gate_share:g} of them out for the gate and train on the rest")
    held = product_rows(_ordered(products.filter(pa.array(gate_rows))), outcomes, model)
    rows = product_rows(_ordered(sample_rows(products.filter(pa.array(~gate_rows)), config.max_rows, config.seed)), outcomes,
                        model)
    if len(rows) == 0:
        raise ValueError(f"max_rows {config.max_rows}: no whole session fits; raise it")
    params = trainable_product(bundle, model)  # the encoder and heads the servers run (or BundleError)
    new, steps = update_heads(params, rows, config.deltas, config.layers, config.encoder_delta,
                              encoder_layers=config.encoder_layers, seed=config.seed)
    metrics: dict[str, Any] = {"product_rows": len(rows), "product_rows_logged": logged, "gate_rows": len(held),
                               "duplicate_rows": logged - len(distinct), "left_out": dropped.to_dict(),
                               "mean_reward": float(rows.rewards.mean()),
               "taken": float(rows.taken.mean()), "complaints": float(rows.complaints.mean()),
               "layers": {s.layer: s.to_dict() for s in steps}, "behaviour_versions": list(rows.model_versions),
               "config": config.to_dict()}
    earlier = bundle.manifest.get("same_flat_as")
    manifest = {"model_version": model_version, "created_at": created_at,
                "provenance": {"kind": "product-trained", "from": bundle.model_version,
                               "builder": "trainer.product_train.train_products"},
                "same_flat_as": [bundle.model_version, *(earlier if isinstance(earlier, list) else [])][:SAME_FLAT_KEPT],
                "product_training": metrics}
    guard = None
    if config.guard is not None:  # on the new encoder's h, the one the exported heads and guards read
        widths = feature_widths(model.encoder.spec)
        previous = None
        if model.product is not None and model.product.guard is not None:  # carry its vetoes forward (``carried``)
            previous = PreviousGuard(trainable_product_guards(bundle, model),  # what the servers run, or BundleError
                                     mlp.policy_forward(params["encoder"], rows.states), model.product.guard.max_complaint)
        guards, metrics["guard"] = train_guards(rows, mlp.policy_forward(new["encoder"], rows.states), held,
                                                mlp.policy_forward(new["encoder"], held.states), widths, config.guard,
                                                config.seed, previous)
        guard = (guard_parts(guards, golden_h(new["encoder"], bundle.array("golden_states.npy")), widths),
                 guard_section(config.guard.max_complaint))
    candidate = ModelSet.load(read_bundle(with_heads(bundle, new, model.encoder.spec, manifest, guard)),
                              LoadOptions(device="cpu", warmup_batch=1))
    assert candidate.product is not None and model.product is not None
    verdict = judge(candidate.product, model.product, held, config.tolerance, config.seed, current_version=bundle.model_version)
    metrics["gate"] = verdict.to_dict()
    data = with_heads(bundle, new, model.encoder.spec, manifest, guard)  # the same bytes, with the verdict in the manifest
    ModelSet.load(read_bundle(data), LoadOptions(device="cpu", warmup_batch=1))  # as the server will: golden self-test
    return ProductTrainResult(data, metrics)
