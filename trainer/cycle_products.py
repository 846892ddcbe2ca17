"""``cycle``'s product step: train the ``RecommendProduct`` heads on the window's product decisions, gated on their own.

The heads are a second decision with its own logs (``products/``), its own trust regions and its own gate
(``trainer.product_train``), so ``cycle`` judges them apart from the flat decision:

- the step runs when the bundle trained from carries product heads and the logs hold product decisions of the
  window's model versions from the window's start on (``trainer.product_window``: the gate's held-out sessions and
  a bounded sample, read in two passes);
- heads the product gate passes go into the flat candidate, whatever becomes of it (published, kept for a second
  look, started as a canary), and its version says so (``<candidate>-p<digest>``);
- when the flat candidate is not published, passed heads are also published alone: the active bundle's flat decision
  byte for byte with the new heads, as ``products-<time>-<digest>`` (the digest of the heads' bytes, so a version
  names its bytes). Its manifest's ``same_flat_as`` names the versions whose flat decision it serves, so a candidate
  kept for a second look, trained from the bundle before, is still judged (``trainer.second_look``), and a canary
  started in the same run is compared with sessions that see the same heads;
- refused heads are left out; a product step that fails is reported (``error``) and leaves the flat decision's
  outcome alone; one that has nothing to train on says why (``skipped``).

What happened is reported under ``products`` in ``cycle``'s report, and the trained heads' metrics (each layer's KL
and steps, the gate's verdict) under ``product_training`` in the manifest of the bundles that carry them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from experience.segments import DirectorySource
from experience.sessions import split_by_session
from trainer.product_train import GATE_SALT, ProductTrainConfig, ProductTrainResult, train_products
from trainer.product_window import read_products
from weights import mlp
from weights.bundle import PRODUCT_GUARD_PARTS, PRODUCT_PARTS, Bundle, read_bundle, rewritten
from weights.product_heads import PART

log = logging.getLogger(__name__)

MAX_ROWS = 12_000
"""Product decisions ``cycle`` trains the heads on at most. A product decision's rows are wide (every candidate's
features: 6 categories and 6 SKUs of 768 floats here), and ``train-products`` at its 40,000 peaked at 6.8 GB, too
close to the CronJob pod's 8 Gi after the flat decision's run; see docs/performance.md for the figure at this size."""
MAX_GATE_ROWS = 8_000
"""Held-out product decisions the product gate judges on at most (about 1,800 sessions of 4.4 pages)."""


@dataclass
class ProductStep:
    report: dict[str, Any]
    trained: ProductTrainResult | None = None
    """The heads-only bundle (the starting bundle's flat decision with the new heads), under its final version."""
    params: dict[str, mlp.Params] | None = field(default=None, repr=False)
    digest: str = ""
    """The first 8 hex digits of the SHA-256 of the new heads' parts."""

    @property
    def passed(self) -> bool:
        return self.trained is not None and self.trained.publish


def same_flat_as(manifest: dict[str, Any]) -> list[str]:
    """The versions whose flat decision a bundle serves byte for byte (besides its own): a heads-only bundle's."""
    versions = manifest.get("same_flat_as")
    return [v for v in versions if isinstance(v, str)] if isinstance(versions, list) else []


def product_step(source: DirectorySource, base: Bundle, versions: list[str], created_at: str,
                 config: ProductTrainConfig | None = None, max_gate_rows: int = MAX_GATE_ROWS,
                 since: float | None = None) -> ProductStep:
    """Train and gate ``base``'s product heads on the product decisions of ``versions`` from ``since`` (module doc)."""
    config = config or ProductTrainConfig(max_rows=MAX_ROWS)
    if "product" not in base.manifest:
        return ProductStep({"skipped": "the bundle has no product heads (format version 1)"})
    if not source.has("products"):
        return ProductStep({"skipped": "the logs hold no product decisions (products/)"})
    window = read_products(source, versions, gate_share=config.gate_share, seed=config.seed, gate_salt=GATE_SALT,
                           max_rows=config.max_rows, max_gate_rows=max_gate_rows, since=since)
    if window.products.num_rows == 0:
        return ProductStep({"skipped": f"no product decisions of the window's versions {versions}", **window.describe()})
    held = split_by_session(np.asarray(window.products.column("session_id").to_pylist(), dtype=object), config.gate_share,
                            config.seed, GATE_SALT)
    if held.all() or not held.any():
        return ProductStep({"skipped": f"too few sessions to hold {config.gate_share:g} of them out for the product gate "
                                       "and train on the rest", **window.describe()})
    trained = train_products(window.products, window.outcomes, base, "products-pending", created_at, config)
    gate = trained.metrics["gate"]
    report = {"window": window.describe(), "publish": trained.publish, "reason": gate["reason"], "gate": gate,
              "layers": trained.metrics["layers"]}
    if not trained.publish:
        return ProductStep(report, trained)
    new = read_bundle(trained.bundle)
    digest = hashlib.sha256(b"".join(new.parts[name] for name in (*PRODUCT_PARTS, *PRODUCT_GUARD_PARTS)
                                     if name in new.parts)).hexdigest()[:8]  # the heads' and their guards' bytes
    version = f"products-{created_at.replace('-', '').replace(':', '')}-{digest}"
    params = {name: mlp.policy_params_from_onnx(new.parts[part]) for name, part in PART.items()}
    return ProductStep(report, ProductTrainResult(rewritten(new, {"model_version": version}), trained.metrics), params, digest)
