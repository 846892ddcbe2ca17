"""The default bundle shipped inside the package, so ``serve`` answers out of the box.

Built by ``scripts/build_default_bundle.py`` (fixed seed; see its docstring for provenance).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from weights.bundle import Bundle, read_bundle

DEFAULT_BUNDLE_NAME = "default.bundle"
DEFAULT_MODEL_VERSION = "default-sim-20261207"  # built by scripts/build_default_bundle.py; a new name for each new policy
# (the build's cycles keep their own names, ``CYCLE_PREFIX`` there), so logs and metrics can tell one default from the next


def default_bundle_bytes() -> bytes:
    return resources.files("weights").joinpath("data", DEFAULT_BUNDLE_NAME).read_bytes()


def default_bundle() -> Bundle:
    return read_bundle(default_bundle_bytes())


def default_manifest() -> dict[str, Any]:
    return default_bundle().manifest
