"""Which model set the server serves: one reference, read once per request, swapped whole.

``ModelHolder.current`` is either a loaded ``ModelSet`` or ``NoModel``; swapping is one
attribute assignment, so a request in flight keeps the object it read. ``canary``, when a
canary is loaded, is a ``weights.canary.CanaryRoute``: it answers its share of the sessions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from server.config import Config
from server.watcher import Signature, signature
from weights.bundle import BundleError, read_bundle, read_file
from weights.canary import CanaryRoute, requested_fraction
from weights.embedded import default_bundle, default_manifest
from weights.forkserver import Validator
from weights.held import refuse_held
from weights.model_set import LoadOptions, ModelSet, NoModel
from weights.sandbox import SandboxLimits
from weights.store import ACTIVE_NAME, CANARY_DIR, CANARY_NAME

log = logging.getLogger(__name__)


def load_options(config: Config) -> LoadOptions:
    """How this server loads bundles (reads the public key file: ``KeyFileError`` when it is not one)."""
    keys: tuple[bytes, ...] = ()
    if config.bundle_public_key is not None:  # cryptography (about 7 MB) only in a server that verifies signatures
        from weights.signing import load_public_keys

        keys = load_public_keys(config.bundle_public_key)
    return LoadOptions(
        device=config.device,
        threads=config.intra_op_threads,
        warmup_batch=config.max_batch,
        samples=config.samples,
        min_votes=config.min_votes,
        exploration_epsilon=config.exploration_epsilon,
        guard_threshold=config.guard_threshold,
        public_keys=keys,
    )


def make_validator(config: Config) -> Validator | None:
    """The server's validating process (started on first use); None when bundles are validated in-process only."""
    if config.validate_memory_mb == 0:
        return None
    return Validator(SandboxLimits(memory_bytes=config.validate_memory_mb * 1024 * 1024, timeout_s=config.validate_timeout_seconds))


class ModelHolder:
    """``on_swap(version, manifest or None, loaded_at)`` hears of every change of the active model set, ``on_canary(route
    or None)`` of every change of the canary (metrics follow both)."""

    def __init__(self, on_swap: Callable[[str, Mapping[str, Any] | None, float], None] | None = None,
                 on_canary: Callable[[CanaryRoute | None], None] | None = None) -> None:
        self.current: ModelSet | NoModel = NoModel(default_manifest())
        self.canary: CanaryRoute | None = None
        self._on_swap = on_swap
        self._on_canary = on_canary
        self._notify(self.current)

    def set_canary(self, route: CanaryRoute | None) -> None:
        self.canary = route
        self._notify_canary()

    def swap(self, model: ModelSet | NoModel) -> None:
        self.current = model
        self._notify(model)
        if self.canary is not None:  # whether it serves anyone depends on the active one too
            self._notify_canary()

    def _notify_canary(self) -> None:
        """``on_canary`` hears the canary that answers some sessions, or None: none, or one that serves nobody beside the
        active set (its own version: a promotion whose drop did not happen; another item dimension)."""
        if self._on_canary is not None:
            route = self.canary
            self._on_canary(route if route is not None and route.serves_beside(self.current) else None)

    def _notify(self, model: ModelSet | NoModel) -> None:
        if self._on_swap is not None:
            if isinstance(model, ModelSet):
                self._on_swap(model.version, model.manifest, model.loaded_at)
            else:
                self._on_swap("", None, 0.0)


def active_path(config: Config) -> Path | None:
    return None if config.weights_dir is None else Path(config.weights_dir) / ACTIVE_NAME


def canary_path(config: Config) -> Path | None:
    """Where the canary is published; None when this server serves none (no weights directory, or a cap of 0)."""
    if config.weights_dir is None or config.max_canary_fraction <= 0:
        return None
    return Path(config.weights_dir) / CANARY_DIR / CANARY_NAME


def load_canary(path: Path, options: LoadOptions, cap: float, validator: Validator | None = None) -> CanaryRoute:
    """The canary at ``path``, loaded as the active bundle is, with its share capped at ``cap`` (raises BundleError).

    A bundle there that asks for no share (``canary.fraction``) is refused: it is not a canary.
    """
    model = load_file(path, options, validator)
    try:
        fraction = requested_fraction(model.manifest)
    except ValueError as exc:
        raise BundleError("schema", f"manifest.json: {exc}") from None
    return CanaryRoute(model, min(fraction, cap))


def load_file(path: Path, options: LoadOptions, validator: Validator | None = None) -> ModelSet:
    """Read, validate, self-test and warm up the bundle at ``path`` (raises BundleError).

    With a ``validator``, a child process loads the same bytes first under a memory limit and
    a timeout; this process loads them only once the child succeeded. A candidate the trainer holds for a second look
    (``weights.held``) is refused, whoever signed it: it is not a release.
    """
    data = read_file(path)
    if validator is not None:
        validator.validate(data, options)
    bundle = read_bundle(data)
    refuse_held(bundle.manifest, str(path))
    return ModelSet.load(bundle, options)


def load_initial(config: Config, options: LoadOptions,
                 validator: Validator | None = None) -> tuple[ModelSet | NoModel, Signature | None, BundleError | None]:
    """The model set to serve at start, the signature of the active file it judged, and why that file was refused.

    The weights directory's active bundle, else the embedded default (or no model). The
    signature is taken before reading, so a file replaced meanwhile looks changed to the
    watcher and is loaded again.
    """
    path = active_path(config)
    seen, rejected = None, None
    if path is not None:
        seen = signature(path)
        try:
            model = load_file(path, options, validator)
            log.info("loaded bundle", extra={"fields": {"path": str(path), "model_version": model.version,
                                                        "providers": list(model.policy.providers)}})
            return model, seen, None
        except BundleError as exc:
            if exc.reason == "io" and signature(path) is None:  # no bundle published yet: nothing was refused
                log.info("no active bundle published yet", extra={"fields": {"path": str(path)}})
            else:  # as the watcher logs a refusal later on: the publisher's error, and this pod serves something else
                rejected = exc
                log.error("cannot serve the active bundle", extra={"fields": {"path": str(path), "reason": exc.reason, "error": str(exc)}})
    if not config.use_embedded_default:
        log.warning("no model loaded: answering from the rule engine (source FALLBACK_NO_MODEL)")
        return NoModel(default_manifest()), seen, rejected
    # the embedded default is ours (in the package, not on the volume): no signature or child needed
    model = ModelSet.load(default_bundle(), dataclasses.replace(options, public_keys=()))
    log.info("loaded the embedded default bundle", extra={"fields": {"model_version": model.version,
                                                                     "providers": list(model.policy.providers)}})
    return model, seen, rejected
