"""A candidate the gate refused, kept for a second look, carries a mark in its manifest that no server serves.

``cycle`` keeps such a candidate on the weights volume (``pending/candidate.bundle``), signed, so that the second look,
which may publish it, knows the trainer made it. But a signature says who made a bundle, not that the gate passed it:
whoever could write the volume could move the kept file to the active name, and every server requiring signatures
took it (a security review, 2026-12-06). The mark (``"held": true``) is in the manifest, which the signature covers, so
it cannot be removed without the key. Servers refuse a marked bundle as the active one or the canary; the store will not
publish it or start it as a canary; a second look that passes publishes the candidate without it, signed again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weights.bundle import BundleError

KEY = "held"


def marked(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` of a candidate kept for a second look."""
    return {**manifest, KEY: True}


def released(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` without the mark: what a second look that passed publishes."""
    return {k: v for k, v in manifest.items() if k != KEY}


def refuse_held(manifest: Mapping[str, Any], where: str) -> None:
    """``BundleError`` (reason ``held``) when ``manifest`` carries the mark, whatever its value: ``where`` names the file."""
    if KEY in manifest:
        raise BundleError("held", f"{where}: a candidate the gate refused, held for a second look, not a release "
                                    f"(manifest key {KEY!r}); a second look publishes it once it passes")
