"""Ed25519 signatures on bundles: who may publish weights, not only whether the file is intact.

The manifest's sha256 values catch corruption, not tampering: whoever can write the weights
volume can write a matching manifest. A signed bundle carries ``signature.ed25519``, the
Ed25519 signature (RFC 8032, via ``cryptography``) of the manifest's stored bytes; the
manifest lists every part's sha256 and size, so the signature covers the whole bundle.

A server configured with public keys (``--bundle-public-key``) loads only bundles whose
signature verifies under one of them: unsigned and mis-signed bundles are rejected like any
invalid bundle (counted, logged, the current model keeps serving). Without a key, signatures
are neither required nor checked.

Keys are PEM files: the private key (PKCS#8) stays with whoever publishes (the CronJob's
Secret, or an operator's machine); servers get only public keys (SubjectPublicKeyInfo).
``shopping-agent weights keygen`` makes a pair. A public key file may hold several keys, one
PEM block each (at most ``MAX_TRUSTED_KEYS``), as a CA bundle holds several certificates: during
a rotation the servers trust the old key and the new one, so a bundle signed by either loads
whichever the publisher has switched to (SECURITY.md, *Keys*).
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from core.files import UnreadableFile, read_bounded
from weights.bundle import MANIFEST, SIGNATURE, Bundle, BundleError, read_bundle, write_members


class KeyFileError(ValueError):
    """A key file that is not an Ed25519 key of the expected kind."""


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    """The Ed25519 private key of the PEM file ``path``: a regular file of at most ``MAX_KEY_FILE_BYTES``, read without
    blocking (``--key /dev/zero`` took 1.7 GB before a ``MemoryError``, a FIFO hung ``sign``: an attack review,
    2026-12-07)."""
    try:
        text = read_bounded(path, MAX_KEY_FILE_BYTES)
    except UnreadableFile as exc:
        raise KeyFileError(f"{path}: {exc}") from None
    try:
        key = serialization.load_pem_private_key(text, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # an algorithm it has no code for: not a traceback
        raise KeyFileError(f"{path}: not a readable unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 private key")
    return key


MAX_TRUSTED_KEYS = 8  # a rotation needs two; a file of thousands would cost every load a verify per key
MAX_KEY_FILE_BYTES = 64 * 1024  # a PEM Ed25519 public key is 113 bytes
_PEM_BLOCK = re.compile(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.DOTALL)


def load_public_keys(path: Path | str) -> tuple[bytes, ...]:
    """The raw Ed25519 public keys of the PEM file ``path``, one per ``BEGIN PUBLIC KEY`` block, in file order, repeats
    dropped; text between blocks is ignored (a comment naming each key), a block that does not parse is an error."""
    try:
        text = read_bounded(path, MAX_KEY_FILE_BYTES)  # a regular file: a FIFO in a Secret's place must not hang the start
    except UnreadableFile as exc:
        raise KeyFileError(f"{path}: not a readable PEM public key ({exc})") from None
    blocks = _PEM_BLOCK.findall(text)
    if not blocks or len(blocks) != text.count(b"-----BEGIN"):
        raise KeyFileError(f"{path}: not a readable PEM public key (expected only -----BEGIN PUBLIC KEY----- blocks, "
                           f"found {len(blocks)} whole of {text.count(b'-----BEGIN')})")
    keys: list[bytes] = []
    for n, block in enumerate(blocks, 1):
        try:
            key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(f"{path}: key {n}: not a readable PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFileError(f"{path}: key {n}: not an Ed25519 public key")
        raw = public_key_bytes(key)
        if raw not in keys:
            keys.append(raw)
    if len(keys) > MAX_TRUSTED_KEYS:
        raise KeyFileError(f"{path}: {len(keys)} public keys, more than {MAX_TRUSTED_KEYS}")
    return tuple(keys)


def key_id(raw: bytes) -> str:
    """A short name for a raw public key in logs and reports: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_bytes(key: Ed25519PublicKey) -> bytes:
    """The raw 32-byte key: what load options carry (plain data, comparable, picklable-free)."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keypair_pem() -> tuple[bytes, bytes]:
    """A new (private PKCS#8 PEM, public SubjectPublicKeyInfo PEM) pair."""
    private = Ed25519PrivateKey.generate()
    return (
        private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
    )


def sign(data: bytes, key: Ed25519PrivateKey) -> bytes:
    """The bundle ``data`` with its signature member set (replacing any earlier one); checked first."""
    bundle = read_bundle(data)
    members = {MANIFEST: bundle.manifest_bytes, **bundle.parts}  # every part of its format version, as read
    members[SIGNATURE] = key.sign(bundle.manifest_bytes)
    out = io.BytesIO()
    write_members(out, members)
    return out.getvalue()


def signed_by(bundle: Bundle, public_keys: tuple[bytes, ...]) -> bytes | None:
    """The first of ``public_keys`` (raw bytes) under which ``bundle``'s signature verifies; None if none does."""
    if bundle.signature is None:
        return None
    for raw in public_keys:
        try:
            Ed25519PublicKey.from_public_bytes(raw).verify(bundle.signature, bundle.manifest_bytes)
        except InvalidSignature:
            continue
        return raw
    return None


def check_signature(bundle: Bundle, public_keys: tuple[bytes, ...]) -> None:
    """Raise ``BundleError("signature", …)`` unless ``bundle`` is signed by one of ``public_keys`` (raw bytes); no keys,
    no check."""
    if not public_keys:
        return
    if bundle.signature is None:
        raise BundleError("signature", f"the bundle is not signed, and this server accepts only bundles signed by its key "
                                       f"({SIGNATURE} is missing)")
    if signed_by(bundle, public_keys) is None:
        which = "this server's public key" if len(public_keys) == 1 else f"any of this server's {len(public_keys)} public keys"
        raise BundleError("signature", f"the bundle's signature does not verify under {which}")

