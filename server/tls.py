"""TLS from certificate files that are rotated under a running server (cert-manager, a Secret volume).

``CertificateFiles`` names a certificate chain, its key and, for mutual TLS, the CA
certificates that client certificates must chain to. ``ReloadingCertificates`` reads them at
start (any problem is a ``TlsError`` naming the flag and the file, and the server does not
start) and again whenever their signature changes: (device, inode, size, mtime) of each
file, through symlinks. A Secret volume swaps its ``..data`` symlink, cert-manager and
operators rename files into place: both change it. New files are checked whole before they
are used (PEM that parses, a key that matches the certificate, a CA file that holds
certificates, no file changed while it was read); otherwise the certificates in use stay in
use and the reason is logged, once per signature. A rotation that renames the files one by
one passes through such a state and is taken up as soon as the last file is in place.

The gRPC port gets ``grpc.dynamic_ssl_server_credentials``, whose fetcher grpc calls before
the handshake of every new connection: a few ``stat`` calls, and a new configuration only
when the files changed. /metrics asks ``ssl_context()`` for each connection the same way.
Connections already open keep the certificates they started with. The private key is never
logged and never leaves this process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from core.files import UnreadableFile, read_bounded
from server.config import Config

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int, int, int], ...]


class TlsError(ValueError):
    """Certificate files that cannot be used."""


@dataclass(frozen=True)
class CertificateFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None
    flag: str = "--tls-cert"
    """The flag the messages name."""
    grpc: bool = True
    """Served by grpc's TLS, which takes fewer key types than Python's ssl (``_check_key_type``); /metrics is served by
    Python's ssl."""

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


def grpc_files(config: Config) -> CertificateFiles | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    return CertificateFiles(config.tls_cert, config.tls_key, config.tls_client_ca, "--tls-cert")


def metrics_files(config: Config) -> CertificateFiles | None:
    if config.metrics_tls_cert is None or config.metrics_tls_key is None:
        return None
    return CertificateFiles(config.metrics_tls_cert, config.metrics_tls_key, config.metrics_tls_client_ca, "--metrics-tls-cert",
                            grpc=False)


def check_files(config: Config) -> None:
    """Raise ``TlsError`` unless every configured set of certificate files is usable (at start, before serving)."""
    for files in (grpc_files(config), metrics_files(config)):
        if files is not None:
            load(files)


def signature(files: CertificateFiles) -> Signature:
    """What the files are now; the ctime moves on a ``chmod`` too, so a file refused as unreadable is read again once
    its mode is mended (as the weights watcher does)."""
    stats = [os.stat(path) for path in files.paths]
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in stats)


@dataclass(frozen=True)
class Certificates:
    """One consistent read of the files, and a server ``SSLContext`` built from the same read."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None
    signature: Signature
    context: ssl.SSLContext


MAX_FILE_BYTES = 1 << 20
"""The largest certificate, key or CA file read (a Kubernetes Secret holds at most 1 MiB in all): a 256 MB file was
read, held (+265 MB) and parsed on every handshake after it (a review, 2026-12-05)."""


def read_file(path: Path, flag: str) -> bytes:
    """A regular file's bytes, opened without blocking (``core.files.read_bounded``): a FIFO (or a device) put where a
    certificate belongs blocked the read with no writer, inside grpc's handshake and under the reload lock, so no new
    connection got through even after the file was put back, and nothing was logged (a review, 2026-12-05). Now it is
    refused like any unusable file."""
    try:
        return read_bounded(path, MAX_FILE_BYTES)
    except UnreadableFile as exc:
        raise TlsError(f"{flag}: cannot read {path}: {exc}") from None


def load(files: CertificateFiles) -> Certificates:
    try:
        before = signature(files)
    except OSError as exc:
        raise TlsError(f"{files.flag}: cannot read {exc.filename}: {exc.strerror}") from None
    cert, key = read_file(files.cert, files.flag), read_file(files.key, files.flag)
    client_ca = read_file(files.client_ca, files.flag) if files.client_ca is not None else None
    context = server_context(files, cert, key, client_ca)
    _check_dates(files, cert)
    try:
        after = signature(files)
    except OSError as exc:
        raise TlsError(f"{files.flag}: {exc.filename} went away while it was read") from None
    if after != before:
        raise TlsError(f"{files.flag}: the files changed while they were read")
    return Certificates(cert, key, client_ca, before, context)


CLOCK_SKEW = timedelta(minutes=5)
"""How far before its ``not_valid_before`` a certificate is taken: an issuer's clock may run a little ahead of the node's."""


def _check_dates(files: CertificateFiles, cert_chain: bytes) -> None:
    """``TlsError`` unless the leaf certificate is valid now: an expired one renamed in was reloaded, the valid one
    dropped, and every new handshake failed (an attack review, 2026-12-07); one not yet valid fails the same way."""
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificate(cert_chain)
    except ValueError:  # server_context took it: leave the parse to it
        return
    now = datetime.now(UTC)
    if not leaf.not_valid_before_utc - CLOCK_SKEW <= now <= leaf.not_valid_after_utc:
        raise TlsError(f"{files.flag}: {files.cert}: the certificate is not valid now (valid from "
                       f"{leaf.not_valid_before_utc.isoformat()} to {leaf.not_valid_after_utc.isoformat()})")


def server_context(files: CertificateFiles, cert: bytes, key: bytes, client_ca: bytes | None) -> ssl.SSLContext:
    """TLS 1.2 or later, from the bytes read (``read_file``), so the context and grpc's configuration are one read;
    with a client CA, a client certificate it signed is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # ssl loads a chain from paths only: these are the bytes read, in memory files no one else can open. An empty
        # password: an encrypted key fails here instead of OpenSSL prompting on a terminal.
        with _in_memory(cert) as cert_path, _in_memory(key) as key_path:
            context.load_cert_chain(cert_path, key_path, password=b"")
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TlsError(f"{files.flag}: {files.cert} and {files.key} are not a PEM certificate chain and its "
                       f"unencrypted private key ({_reason(exc)})") from None
    if files.grpc:
        _check_key_type(files, key)
    if client_ca is not None:
        try:
            with _in_memory(client_ca) as ca_path:
                context.load_verify_locations(cafile=ca_path)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise TlsError(f"{files.flag}: {files.client_ca} holds no usable PEM CA certificate ({_reason(exc)})") from None
        if not context.get_ca_certs():
            raise TlsError(f"{files.flag}: {files.client_ca} holds no CA certificate")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path to ``data`` in an anonymous memory file (``memfd_create``, Linux): never on a disk, gone when closed."""
    fd = os.memfd_create("tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _check_key_type(files: CertificateFiles, key: bytes) -> None:
    """The keys grpc's TLS serves with to grpc's own clients: RSA (of 2048 bits or more: fewer are weak) and ECDSA on
    P-256 or P-384. Python's ssl (OpenSSL) also takes secp256k1 or Ed448 keys, which grpc cannot load: it went on
    serving the old certificate while "certificates reloaded" was logged, and a server started with one exited with a
    traceback (a review, 2026-12-05). With P-521 or Ed25519 keys grpc's handshakes fail (no common signature
    algorithm: measured, ``tests/server/test_tls.py``)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        private = load_pem_private_key(key, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise TlsError(f"{files.flag}: {files.key}: the key cannot be read ({_reason(exc)})") from None
    if isinstance(private, rsa.RSAPrivateKey) and private.key_size >= 2048:
        return
    if isinstance(private, ec.EllipticCurvePrivateKey) and isinstance(private.curve, (ec.SECP256R1, ec.SECP384R1)):
        return
    if isinstance(private, rsa.RSAPrivateKey):
        kind = f"{private.key_size}-bit RSA"
    elif isinstance(private, ec.EllipticCurvePrivateKey):
        kind = f"EC ({private.curve.name})"
    else:
        kind = type(private).__name__.removesuffix("PrivateKey")
    article = "an" if kind[0] in "AEIOU8" else "a"
    raise TlsError(f"{files.flag}: {files.key} holds {article} {kind} key; grpc serves with RSA of 2048 bits or more, or ECDSA "
                   "on P-256 or P-384")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


class ReloadingCertificates:
    """The certificates in use, re-read when the files' signature changes. Safe from any thread."""

    def __init__(self, files: CertificateFiles) -> None:
        self.files = files
        self.current = load(files)
        self.reloads = 0
        self.refusals = 0
        self._examined: Signature | str = self.current.signature
        self._lock = threading.Lock()
        log.info("certificates loaded", extra={"fields": self._fields()})

    def refresh(self) -> Certificates | None:
        """The new certificates if the files changed and are usable; None if unchanged or unusable (the old stay)."""
        try:
            probe: Signature | str = signature(self.files)
        except OSError as exc:
            probe = f"cannot stat {exc.filename}: {exc.strerror}"
        with self._lock:
            if probe == self._examined:
                return None
            self._examined = probe
            try:
                if isinstance(probe, str):
                    raise TlsError(f"{self.files.flag}: {probe}")
                loaded = load(self.files)
            except TlsError as exc:
                self.refusals += 1
                log.warning("new certificate files refused; the current ones stay in use",
                            extra={"fields": {**self._fields(), "reason": str(exc)}})
                return None
            self._examined = loaded.signature  # the files may have changed again since the probe: this is what is held
            self.current = loaded
            self.reloads += 1
        log.info("certificates reloaded", extra={"fields": self._fields()})
        return loaded

    def ssl_context(self) -> ssl.SSLContext:
        """The context for a new connection (after picking up changed files)."""
        self.refresh()
        return self.current.context

    def _fields(self) -> dict[str, object]:
        fields: dict[str, object] = {"flag": self.files.flag, "cert": str(self.files.cert), "mutual_tls": self.files.mutual}
        fields.update(_describe(self.current.cert_chain))
        return fields


def _describe(cert_chain: bytes) -> dict[str, object]:
    """Subject and expiry of the leaf certificate, for the logs."""
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificate(cert_chain)
    except ValueError:
        return {}
    return {"subject": leaf.subject.rfc4514_string(), "not_after": leaf.not_valid_after_utc.isoformat()}


def _grpc_configuration(certificates: Certificates) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(certificates.private_key, certificates.cert_chain)],
                                                     root_certificates=certificates.client_ca)


def server_credentials(source: ReloadingCertificates) -> grpc.ServerCredentials:
    """Credentials whose certificates follow the files; with a client CA, a client certificate is required.

    Several servers share one ``source`` (``--grpc-servers``): ``refresh`` reports new files once, to
    whichever server's handshake looked first, so each credentials object compares what it serves
    with the source's current certificates and takes them up at its own next handshake."""
    served = source.current

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        nonlocal served
        try:
            source.refresh()
        except Exception:  # never into grpc's handshake: keep what is in use
            log.exception("reading the certificate files failed; the current ones stay in use")
            return None
        current = source.current
        if current is served:
            return None
        served = current
        return _grpc_configuration(current)

    return grpc.dynamic_ssl_server_credentials(_grpc_configuration(served), fetch,
                                               require_client_authentication=source.files.mutual)
