"""Which model set the server serves: one reference, read once per request, swapped whole.

``ModelHolder.current`` is either a loaded ``ModelSet`` or ``NoModel``; swapping is one
attribute assignment, so a request in flight keeps the object it read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from server.config import Config
from server.watcher import Signature, signature
from weights.bundle import BundleError, read_bundle
from weights.embedded import default_bundle, default_manifest
from weights.model_set import LoadOptions, ModelSet, NoModel
from weights.store import ACTIVE_NAME

log = logging.getLogger(__name__)


def load_options(config: Config) -> LoadOptions:
    return LoadOptions(
        device=config.device,
        threads=config.intra_op_threads,
        warmup_batch=config.max_batch,
        samples=config.samples,
        min_votes=config.min_votes,
        exploration_epsilon=config.exploration_epsilon,
        guard_threshold=config.guard_threshold,
    )


class ModelHolder:
    """``on_swap(version, manifest or None, loaded_at)`` hears of every change (metrics follow the model)."""

    def __init__(self, on_swap: Callable[[str, Mapping[str, Any] | None, float], None] | None = None) -> None:
        self.current: ModelSet | NoModel = NoModel(default_manifest())
        self._on_swap = on_swap
        self._notify(self.current)

    def swap(self, model: ModelSet | NoModel) -> None:
        self.current = model
        self._notify(model)

    def _notify(self, model: ModelSet | NoModel) -> None:
        if self._on_swap is not None:
            if isinstance(model, ModelSet):
                self._on_swap(model.version, model.manifest, model.loaded_at)
            else:
                self._on_swap("", None, 0.0)


def active_path(config: Config) -> Path | None:
    return None if config.weights_dir is None else Path(config.weights_dir) / ACTIVE_NAME


def load_file(path: Path, options: LoadOptions) -> ModelSet:
    """Read, validate, self-test and warm up the bundle at ``path`` (raises BundleError)."""
    return ModelSet.load(read_bundle(path), options)


def load_initial(config: Config) -> tuple[ModelSet | NoModel, Signature | None]:
    """The model set to serve at start, and the signature of the active file it judged.

    The weights directory's active bundle, else the embedded default (or no model). The
    signature is taken before reading, so a file replaced meanwhile looks changed to the
    watcher and is loaded again.
    """
    options = load_options(config)
    path = active_path(config)
    seen = None
    if path is not None:
        seen = signature(path)
        try:
            model = load_file(path, options)
            log.info("loaded bundle", extra={"fields": {"path": str(path), "model_version": model.version,
                                                        "providers": list(model.policy.providers)}})
            return model, seen
        except BundleError as exc:
            log.warning("cannot serve the active bundle", extra={"fields": {"path": str(path), "reason": exc.reason, "error": str(exc)}})
    if not config.use_embedded_default:
        log.warning("no model loaded: answering from the rule engine (source FALLBACK_NO_MODEL)")
        return NoModel(default_manifest()), seen
    model = ModelSet.load(default_bundle(), options)
    log.info("loaded the embedded default bundle", extra={"fields": {"model_version": model.version,
                                                                     "providers": list(model.policy.providers)}})
    return model, seen
