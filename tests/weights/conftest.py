"""Bundles for the weights tests: the embedded default, and ways to write altered copies of it."""

from __future__ import annotations

import copy
import io
import zipfile
from collections.abc import Callable
from typing import Any

import pytest

from weights.bundle import Bundle, read_bundle, write_bundle
from weights.embedded import default_bundle_bytes

Rebuild = Callable[..., bytes]
RawZip = Callable[[dict[str, bytes]], bytes]


@pytest.fixture(autouse=True)
def _no_servers_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights`` checks against ``$SHOPPING_AGENT_BUNDLE_PUBLIC_KEY`` by default (``weights.cli``): a shell or image that
    sets it must not change what these tests' commands, which inherit the environment, accept."""
    monkeypatch.delenv("SHOPPING_AGENT_BUNDLE_PUBLIC_KEY", raising=False)


@pytest.fixture(scope="session")
def default_bytes() -> bytes:
    return default_bundle_bytes()


@pytest.fixture(scope="session")
def default_bundle(default_bytes: bytes) -> Bundle:
    return read_bundle(default_bytes)


@pytest.fixture
def manifest(default_bundle: Bundle) -> dict[str, Any]:
    """A deep copy of the default manifest, free to change."""
    return copy.deepcopy(default_bundle.manifest)


@pytest.fixture
def rebuild(default_bundle: Bundle) -> Rebuild:
    """Write a consistent bundle (valid container, right checksums) from the default with changes.

    ``rebuild(manifest=..., **{"policy.onnx": b"..."})``: a replacement manifest and/or parts.
    """

    def build(manifest: dict[str, Any] | None = None, **parts: bytes) -> bytes:
        buf = io.BytesIO()
        write_bundle(buf, copy.deepcopy(manifest or default_bundle.manifest), {**default_bundle.parts, **parts})
        return buf.getvalue()

    return build


@pytest.fixture
def raw_zip() -> RawZip:
    """Write members as a zip exactly as given: no checksums filled in, nothing added."""

    def build(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
            for name, data in members.items():
                zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        return buf.getvalue()

    return build


@pytest.fixture
def members(default_bytes: bytes) -> dict[str, bytes]:
    """The default bundle's members (manifest included), as raw bytes."""
    with zipfile.ZipFile(io.BytesIO(default_bytes)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}
