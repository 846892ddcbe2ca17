"""The bundle: one file that carries a whole model set, so one rename publishes it.

A bundle is a zip archive (stored, fixed timestamps, sorted members, so the same content
gives the same bytes) holding:

- ``manifest.json``: format and model version, created-at, feature spec, action set,
  guardrails, fallback rules, guard threshold, decoder settings, training metrics,
  provenance, golden-test tolerance, and the sha256 and size of every other part;
- ``policy.onnx``, ``guard.onnx``: the two networks (ONNX protobuf);
- ``behavior_table.npy``: the hashing-trick behaviour embeddings (float32);
- ``golden_states.npy``, ``golden_outputs.npy``: inputs and expected outputs (policy logits
  ⊕ guard allow-probabilities) for the load-time self-test;
- from format version 2, ``RecommendProduct``'s networks (``weights.product_heads``): ``product_encoder.onnx``,
  ``product_category.onnx``, ``product_sku.onnx``, ``product_band.onnx`` and ``golden_product_outputs.npy``.
  A bundle without them is version 1 (every bundle before them), and still serves ``RecommendAction``.

and, when signed (``weights.signing``), ``signature.ed25519``: an Ed25519 signature of the
manifest's bytes (which carry every part's sha256).

Parsing is safe by construction: JSON, ONNX protobuf and ``.npy`` read with
``allow_pickle=False``; nothing is ever unpickled. A file on the weights volume is hostile
until proved otherwise, so ``read_bundle`` reads only a regular file of at most
``MAX_BUNDLE_BYTES`` (a FIFO, a device or ``/dev/zero`` is refused before a byte is read),
accepts only *stored* members (nothing to inflate: a small zip cannot expand in memory),
exactly the expected member names once each, and turns any failure at all into a
``BundleError`` with a reason. It checks the container (members, sizes, checksums, format
version, model version, created-at); ``weights.model_set.ModelSet.load`` checks the contents
(``weights.onnx_check`` before onnxruntime sees a graph).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from core.conditions import MAX_NAME
from core.files import UnreadableFile, read_bounded

FORMAT = "shopping-agent-bundle"
FORMAT_VERSION = 3
"""The newest format this code writes and reads; it reads every version in ``VERSION_PARTS``."""
MANIFEST = "manifest.json"
PARTS = ("policy.onnx", "guard.onnx", "behavior_table.npy", "golden_states.npy", "golden_outputs.npy")
PRODUCT_PARTS = ("product_encoder.onnx", "product_category.onnx", "product_sku.onnx", "product_band.onnx",
                 "golden_product_outputs.npy")
PRODUCT_GUARD_PARTS = ("product_guard_category.onnx", "product_guard_sku.onnx", "product_guard_band.onnx",
                       "golden_product_guard_outputs.npy")
VERSION_PARTS = {1: PARTS, 2: PARTS + PRODUCT_PARTS, 3: PARTS + PRODUCT_PARTS + PRODUCT_GUARD_PARTS}
"""The parts of each format version: 1 has the flat decision's networks; 2 adds ``RecommendProduct``'s heads
(``weights.product_heads``); 3 adds a learned guard per product layer (``weights.product_guard``). Each bundle is
written at the lowest version that holds its parts, so one without heads is version 1, byte for byte as before."""

SIGNATURE = "signature.ed25519"
MAX_BUNDLE_BYTES = 128 * 1024 * 1024  # the default bundle is 1.9 MB; two MLPs of this kind stay far below
MAX_PART_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_TRAINING_METRICS = 512  # a trained bundle has about 60 (a metric series each on every server)
MODEL_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@=-]{0,199}")  # also a history file's name (weights.store)
MODEL_VERSION_RULE = "1-200 letters, digits and . _ : + @ = -, starting with a letter or digit"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


REASONS = ("io", "size", "format", "format_version", "checksum", "schema", "signature", "shape", "nonfinite", "range", "onnx",
           "golden", "limits", "invalid", "held")
"""Every reason a server refuses a bundle for: the ``reason`` label of ``shopping_agent_model_swaps_total{result="rejected"}``,
whose series exist from the start (a series that first appears at 1 shows no increase on a dashboard). The trainer adds
``graph`` for an ``--init`` bundle whose networks it cannot continue from."""


class BundleError(ValueError):
    """A bundle that must not be served. ``reason`` is a short label (for metrics), one of ``REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Bundle:
    manifest: dict[str, Any]
    parts: dict[str, bytes]
    manifest_bytes: bytes = b""  # as stored: what a signature covers
    signature: bytes | None = None

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


def version_of(names: Iterable[str]) -> int:
    """The format version whose parts a bundle holding ``names`` must have: the lowest that names them all."""
    held = set(names)
    return 3 if held & set(PRODUCT_GUARD_PARTS) else 2 if held & set(PRODUCT_PARTS) else 1


def rewritten(bundle: Bundle, manifest: Mapping[str, Any] | None = None, parts: Mapping[str, bytes] | None = None,
              drop: Iterable[str] = ()) -> bytes:
    """``bundle``'s bytes with ``manifest``'s keys set over its own and ``parts`` added or replacing its own, after
    removing the parts named in ``drop``; the format version and checksums are recomputed (``write_bundle``). Unsigned:
    a signature covers the old manifest."""
    gone = set(drop)
    buf = io.BytesIO()
    write_bundle(buf, {**bundle.manifest, **(manifest or {})},
                 {**{n: d for n, d in bundle.parts.items() if n not in gone}, **(parts or {})})
    return buf.getvalue()


def write_bundle(path: Path | io.BytesIO, manifest: dict[str, Any], parts: dict[str, bytes]) -> dict[str, Any]:
    """Write a bundle; fills in ``format``, ``format_version`` and ``parts`` checksums.

    Returns the manifest as written. The same input gives the same bytes.
    """
    version = version_of(parts)
    names = VERSION_PARTS[version]
    missing, extra = sorted(set(names) - set(parts)), sorted(set(parts) - set(names))
    if missing or extra:
        raise ValueError(f"missing parts {missing}, unknown parts {extra}")
    manifest = {
        **manifest,
        "format": FORMAT,
        "format_version": version,
        "parts": {name: {"sha256": sha256(parts[name]), "size": len(parts[name])} for name in names},
    }
    members = {MANIFEST: json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"}
    members.update({name: parts[name] for name in names})
    write_members(path, members)
    return manifest


def write_members(path: Path | io.BytesIO, members: dict[str, bytes]) -> None:
    """The zip container: stored members in name order, fixed timestamps (the same members, the same bytes)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, members[name])


def read_file(path: Path | str, limit: int = MAX_BUNDLE_BYTES, what: str = "bundle") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (``core.files.read_bounded``); raises
    ``BundleError("io" | "size")``, naming ``what`` it is."""
    try:
        return read_bounded(path, limit)
    except UnreadableFile as exc:
        raise BundleError(exc.reason, f"cannot read {what} {path}: {exc}") from None


def read_bundle(source: Path | str | bytes) -> Bundle:
    """Open and check a bundle's container: members, sizes, format version, checksums.

    Every failure, whatever raised it (a damaged zip, a manifest nested past the parser's
    recursion limit, memory), is a ``BundleError``: the caller keeps serving what it has.
    """
    try:
        return _read_bundle(source if isinstance(source, bytes) else read_file(source))
    except BundleError:
        raise
    except Exception as exc:  # a hostile file must never escape as another type (no fallback, no count)
        raise BundleError("invalid", f"cannot parse bundle: {type(exc).__name__}: {str(exc)[:200]}") from None


def _read_bundle(data: bytes) -> Bundle:
    if len(data) > MAX_BUNDLE_BYTES:
        raise BundleError("size", f"the bundle is {len(data)} bytes, more than the {MAX_BUNDLE_BYTES}-byte limit")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise BundleError("format", f"not a bundle (bad zip container: {exc})") from None
    with zf:
        listed_infos = zf.infolist()
        infos = {i.filename: i for i in listed_infos}
        if len(infos) != len(listed_infos):
            names = [i.filename for i in listed_infos]
            raise BundleError("format", f"duplicate members {sorted({n for n in names if names.count(n) > 1})}")
        expected = {MANIFEST, *VERSION_PARTS[version_of(infos)]}
        if not expected <= set(infos) <= expected | {SIGNATURE}:
            raise BundleError(
                "format",
                f"unexpected members: missing {sorted(expected - set(infos))}, extra {sorted(set(infos) - expected - {SIGNATURE})}",
            )
        odd = sorted(n for n, i in infos.items() if i.flag_bits & 0x1 or i.compress_type != zipfile.ZIP_STORED
                     or i.compress_size != i.file_size)
        if odd:
            raise BundleError("format", f"members {odd} are compressed or encrypted: a bundle stores its members as they are")
        limits = {MANIFEST: MAX_MANIFEST_BYTES, SIGNATURE: 64}
        too_big = sorted(n for n, i in infos.items() if i.file_size > limits.get(n, MAX_PART_BYTES))
        if too_big or sum(i.file_size for i in listed_infos) > len(data):
            raise BundleError("size", f"members {too_big or sorted(infos)} are larger than the size limits")
        try:
            raw = {name: zf.read(name) for name in infos}
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as exc:
            raise BundleError("format", f"damaged bundle: {exc}") from None
    try:
        manifest = json.loads(raw[MANIFEST])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BundleError("format", f"manifest.json: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError("format", f"manifest.json: format is not {FORMAT!r}")
    version = manifest.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in VERSION_PARTS:
        raise BundleError(
            "format_version",
            f"manifest.json: format_version {version!r} is not supported (this server reads {sorted(VERSION_PARTS)})",
        )
    part_names = VERSION_PARTS[version]
    if set(part_names) != set(infos) - {MANIFEST, SIGNATURE}:
        held = sorted(set(infos) - {MANIFEST, SIGNATURE})
        raise BundleError("format", f"format_version {version} has the parts {sorted(part_names)}, the bundle {held}")
    model_version = manifest.get("model_version")
    if not isinstance(model_version, str) or not MODEL_VERSION.fullmatch(model_version):
        # every answer, log record and metric carries it, and a history file is named by it: a lone surrogate could not
        # be encoded (every answer would fail), a long one would ride on each answer
        raise BundleError("schema", f"manifest.json: model_version must be {MODEL_VERSION_RULE}; got {ascii(model_version)[:60]}")
    created_at = manifest.get("created_at")
    if created_at is not None and parse_time(created_at) is None:
        raise BundleError("schema", f"manifest.json: created_at must be an ISO 8601 time with a zone, got {str(created_at)[:40]!r}")
    _check_training_metrics(manifest.get("training_metrics"))
    listed = manifest.get("parts")
    if not isinstance(listed, dict):
        raise BundleError("schema", "manifest.json: parts must be an object")
    for name in part_names:
        entry = listed.get(name)
        if not isinstance(entry, dict) or entry.get("sha256") != sha256(raw[name]) or entry.get("size") != len(raw[name]):
            raise BundleError("checksum", f"{name}: sha256 or size does not match the manifest")
    return Bundle(manifest=manifest, parts={name: raw[name] for name in part_names}, manifest_bytes=raw[MANIFEST],
                  signature=raw.get(SIGNATURE))


def _check_training_metrics(metrics: Any) -> None:
    """Each of a manifest's ``training_metrics`` becomes a series of ``shopping_agent_model_training_metric`` named by a
    label (``server.metrics``): a name that could not be encoded (a lone surrogate) would fail every scrape, and ten
    thousand names would make each scrape ten times the size. So: at most ``MAX_TRAINING_METRICS`` names, each of 1-100
    printable characters, as rule names are (their values may be anything: only finite numbers are exported)."""
    if metrics is None:
        return
    if not isinstance(metrics, dict) or len(metrics) > MAX_TRAINING_METRICS:
        raise BundleError("schema", f"manifest.json: training_metrics must be an object of at most {MAX_TRAINING_METRICS} "
                                    f"entries, got {type(metrics).__name__} of {len(metrics) if isinstance(metrics, dict) else '-'}")
    for name in metrics:
        if not (0 < len(name) <= MAX_NAME and name.isprintable()):
            raise BundleError("schema", f"manifest.json: training_metrics names must be 1-{MAX_NAME} printable characters, got "
                                        f"{ascii(name)[:60]}")


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 time with a zone (``2026-11-30T00:00:00Z``), or None when ``value`` is not one."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None
