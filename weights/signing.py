"""Ed25519 signatures on bundles: who may publish weights, not only whether the file is intact.

The manifest's sha256 values catch corruption, not tampering: whoever can write the weights
volume can write a matching manifest. A signed bundle carries ``signature.ed25519``, the
Ed25519 signature (RFC 8032, via ``cryptography``) of the manifest's stored bytes; the
manifest lists every part's sha256 and size, so the signature covers the whole bundle.

A server configured with a public key (``--bundle-public-key``) loads only bundles whose
signature verifies under it: unsigned and mis-signed bundles are rejected like any invalid
bundle (counted, logged, the current model keeps serving). Without a key, signatures are
neither required nor checked.

Keys are PEM files: the private key (PKCS#8) stays with whoever publishes (the CronJob's
Secret, or an operator's machine); servers get only the public key (SubjectPublicKeyInfo).
``shopping-agent weights keygen`` makes a pair.
"""

from __future__ import annotations

import io
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from weights.bundle import MANIFEST, SIGNATURE, Bundle, BundleError, read_bundle, write_members


class KeyFileError(ValueError):
    """A key file that is not an Ed25519 key of the expected kind."""


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not a readable unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 private key")
    return key


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{path}: not a readable PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path}: not an Ed25519 public key")
    return key


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


def check_signature(bundle: Bundle, public_key: bytes | None) -> None:
    """Raise ``BundleError("signature", …)`` unless ``bundle`` is signed by ``public_key`` (raw bytes); no key, no check."""
    if public_key is None:
        return
    if bundle.signature is None:
        raise BundleError("signature", f"the bundle is not signed, and this server accepts only bundles signed by its key "
                                       f"({SIGNATURE} is missing)")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(bundle.signature, bundle.manifest_bytes)
    except InvalidSignature:
        raise BundleError("signature", "the bundle's signature does not verify under this server's public key") from None

