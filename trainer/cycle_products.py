"""``cycle``'s product step: train the ``RecommendProduct`` heads on the window's product decisions, gated on their own.

The heads are a second decision with its own logs (``products/``), its own trust regions and its own gate
(``trainer.product_train``), so ``cycle`` judges them apart from the flat decision:

- the step runs when the bundle trained from carries product heads and the logs hold product decisions of the
  window's model versions (``trainer.product_window``: the gate's held-out sessions and a bounded sample);
- heads the product gate passes go into the flat candidate, whatever becomes of it (published, kept for a second
  look, started as a canary); heads it refuses are left out, and the candidate keeps the heads it was trained from;
- when the flat candidate is not published and nothing is kept or started, passed heads are published on their own:
  the active bundle's flat decision byte for byte with the new heads, under a new model version.

What happened is reported under ``products`` in ``cycle``'s report, and the trained heads' metrics (each layer's KL
and steps, the gate's verdict) under ``product_training`` in the manifest of the bundle that carries them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from experience.segments import DirectorySource
from trainer.product_train import GATE_SALT, MAX_ROWS, ProductTrainConfig, ProductTrainResult, train_products
from trainer.product_window import read_products
from weights import mlp
from weights.bundle import Bundle, read_bundle
from weights.product_heads import PART

log = logging.getLogger(__name__)

MAX_GATE_ROWS = 20_000
"""Held-out product decisions the product gate judges on at most (about 2,500 sessions of 8 pages)."""


@dataclass
class ProductStep:
    report: dict[str, Any]
    trained: ProductTrainResult | None = None
    params: dict[str, mlp.Params] | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.trained is not None and self.trained.publish


def product_step(source: DirectorySource, base: Bundle, versions: list[str], model_version: str, created_at: str,
                 config: ProductTrainConfig | None = None, max_gate_rows: int = MAX_GATE_ROWS) -> ProductStep:
    """Train and gate ``base``'s product heads on the product decisions of ``versions`` (module doc)."""
    config = config or ProductTrainConfig(max_rows=MAX_ROWS)
    if "product" not in base.manifest:
        return ProductStep({"skipped": "the bundle has no product heads (format version 1)"})
    if not source.has("products"):
        return ProductStep({"skipped": "the logs hold no product decisions (products/)"})
    window = read_products(source, versions, gate_share=config.gate_share, seed=config.seed, gate_salt=GATE_SALT,
                           max_rows=config.max_rows, max_gate_rows=max_gate_rows)
    if window.products.num_rows == 0:
        return ProductStep({"skipped": f"no product decisions of the window's versions {versions}", **window.describe()})
    try:
        trained = train_products(window.products, window.outcomes, base, model_version, created_at, config)
    except ValueError as exc:  # too few sessions to hold out, none that fits: the heads stay as they are
        log.warning("the product heads were not trained: %s", exc)
        return ProductStep({"skipped": str(exc), **window.describe()})
    gate = trained.metrics["gate"]
    report = {"window": window.describe(), "publish": trained.publish, "reason": gate["reason"], "gate": gate,
              "layers": trained.metrics["layers"]}
    params = None
    if trained.publish:
        new = read_bundle(trained.bundle)
        params = {name: mlp.policy_params_from_onnx(new.parts[part]) for name, part in PART.items()}
    return ProductStep(report, trained, params)
