"""The bundle: one file that carries a whole model set, so one rename publishes it.

A bundle is a zip archive (stored, fixed timestamps, sorted members, so the same content
gives the same bytes) holding:

- ``manifest.json``: format and model version, created-at, feature spec, action set,
  guardrails, fallback rules, guard threshold, decoder settings, training metrics,
  provenance, golden-test tolerance, and the sha256 and size of every other part;
- ``policy.onnx``, ``guard.onnx``: the two networks (ONNX protobuf);
- ``behavior_table.npy``: the hashing-trick behaviour embeddings (float32);
- ``golden_states.npy``, ``golden_outputs.npy``: inputs and expected outputs (policy logits
  ⊕ guard allow-probabilities) for the load-time self-test.

Parsing is safe by construction: JSON, ONNX protobuf and ``.npy`` read with
``allow_pickle=False``; member sizes are checked before anything is decompressed. Nothing
is ever unpickled. ``read_bundle`` checks the container (members, sizes, checksums, format
version); ``weights.model_set.ModelSet.load`` checks the contents.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

FORMAT = "shopping-agent-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTS = ("policy.onnx", "guard.onnx", "behavior_table.npy", "golden_states.npy", "golden_outputs.npy")
MAX_PART_BYTES = 256 * 1024 * 1024
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


class BundleError(ValueError):
    """A bundle that must not be served. ``reason`` is a short label (for metrics)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Bundle:
    manifest: dict[str, Any]
    parts: dict[str, bytes]

    @property
    def model_version(self) -> str:
        return str(self.manifest["model_version"])

    def array(self, name: str) -> npt.NDArray[Any]:
        """A ``.npy`` part as an array (never unpickles)."""
        try:  # read_array accepts .npy only (np.load would also open .npz archives)
            array = np.lib.format.read_array(io.BytesIO(self.parts[name]), allow_pickle=False)
        except (ValueError, EOFError, OSError) as exc:
            raise BundleError("format", f"{name}: not a plain numeric .npy array ({exc})") from None
        if array.dtype.kind not in "fiub":
            raise BundleError("format", f"{name}: dtype {array.dtype} is not numeric")
        return array


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def npy_bytes(array: npt.NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def write_bundle(path: Path | io.BytesIO, manifest: dict[str, Any], parts: dict[str, bytes]) -> dict[str, Any]:
    """Write a bundle; fills in ``format``, ``format_version`` and ``parts`` checksums.

    Returns the manifest as written. The same input gives the same bytes.
    """
    missing = sorted(set(PARTS) - set(parts))
    if missing:
        raise ValueError(f"missing parts {missing}")
    manifest = {
        **manifest,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "parts": {name: {"sha256": sha256(parts[name]), "size": len(parts[name])} for name in PARTS},
    }
    members = {MANIFEST: json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"}
    members.update({name: parts[name] for name in PARTS})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, members[name])
    return manifest


def read_bundle(source: Path | bytes) -> Bundle:
    """Open and check a bundle's container: members, sizes, format version, checksums."""
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except OSError as exc:
        raise BundleError("io", f"cannot read bundle: {exc.strerror or exc}") from None
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise BundleError("format", f"not a bundle (bad zip container: {exc})") from None
    with zf:
        infos = {i.filename: i for i in zf.infolist()}
        expected = {MANIFEST, *PARTS}
        if set(infos) != expected:
            raise BundleError(
                "format",
                f"unexpected members: missing {sorted(expected - set(infos))}, extra {sorted(set(infos) - expected)}",
            )
        if infos[MANIFEST].file_size > MAX_MANIFEST_BYTES or any(infos[p].file_size > MAX_PART_BYTES for p in PARTS):
            raise BundleError("format", "a member is larger than the size limit")
        odd = sorted(n for n, i in infos.items() if i.flag_bits & 0x1 or i.compress_type not in _COMPRESSIONS)
        if odd:
            raise BundleError("format", f"members {odd} are encrypted or use an unsupported compression")
        try:
            raw = {name: zf.read(name) for name in expected}
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as exc:
            raise BundleError("format", f"damaged bundle: {exc}") from None
    try:
        manifest = json.loads(raw[MANIFEST])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError("format", f"manifest.json: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError("format", f"manifest.json: format is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            "format_version",
            f"manifest.json: format_version {manifest.get('format_version')!r} is not supported (this server reads {FORMAT_VERSION})",
        )
    if not isinstance(manifest.get("model_version"), str) or not manifest["model_version"]:
        raise BundleError("schema", "manifest.json: model_version must be a non-empty string")
    listed = manifest.get("parts")
    if not isinstance(listed, dict):
        raise BundleError("schema", "manifest.json: parts must be an object")
    for name in PARTS:
        entry = listed.get(name)
        if not isinstance(entry, dict) or entry.get("sha256") != sha256(raw[name]) or entry.get("size") != len(raw[name]):
            raise BundleError("checksum", f"{name}: sha256 or size does not match the manifest")
    return Bundle(manifest=manifest, parts={name: raw[name] for name in PARTS})
