"""Certificates made in the test run (never committed): CAs, a server certificate for 127.0.0.1 and
localhost, client certificates. EC P-256 keys, so making them takes milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey


@dataclass(frozen=True)
class Issued:
    cert: bytes  # PEM
    key: bytes  # PEM, unencrypted PKCS#8


@dataclass(frozen=True)
class CA:
    name: str
    cert: bytes
    _key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str) -> CA:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(subject, subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(name, cert.public_bytes(serialization.Encoding.PEM), key)

    def issue(self, common_name: str, *, server: bool, key: PrivateKey | None = None, expired: bool = False) -> Issued:
        """A certificate this CA signs, for ``key`` (default: a new EC P-256 key); ``expired``: valid until yesterday."""
        key = key if key is not None else ec.generate_private_key(ec.SECP256R1())
        issuer = x509.load_pem_x509_certificate(self.cert).subject
        builder = _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), issuer, key.public_key(),
                           shift=-datetime.timedelta(days=2) if expired else datetime.timedelta(0))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: CertificatePublicKeyTypes,
             shift: datetime.timedelta = datetime.timedelta(0)) -> x509.CertificateBuilder:
    """Valid from 5 minutes ago for a day, all of it moved by ``shift``."""
    now = datetime.datetime.now(datetime.UTC) + shift
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def replace(path: Path, data: bytes) -> None:
    """Write a temporary file beside ``path``, fsync it, rename it over ``path`` (how a rotation lands)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class ServerFiles:
    """The files a server is started with: --tls-cert, --tls-key, --tls-client-ca."""

    cert: Path
    key: Path
    client_ca: Path

    @classmethod
    def write(cls, directory: Path, ca: CA, client_ca: CA | None = None) -> ServerFiles:
        directory.mkdir(parents=True, exist_ok=True)
        files = cls(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
        files.install(ca, client_ca)
        return files

    def install(self, ca: CA, client_ca: CA | None = None) -> None:
        issued = ca.issue("shopping-agent", server=True)
        replace(self.key, issued.key)
        replace(self.cert, issued.cert)
        replace(self.client_ca, (client_ca or ca).cert)

    def flags(self, mutual: bool = False) -> dict[str, Path]:
        return {"tls_cert": self.cert, "tls_key": self.key, **({"tls_client_ca": self.client_ca} if mutual else {})}
