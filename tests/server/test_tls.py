"""TLS and mutual TLS on the gRPC port, against real servers and real handshakes.

Every certificate is made here (tests/tls_certs.py): a CA, a server certificate for
127.0.0.1 and localhost, client certificates, and a second CA that the server does not trust.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.cli import parser
from server.config import Config, build_config, to_args
from server.tls import CertificateFiles, ReloadingCertificates, TlsError, signature
from tests.harness import ROOT, Spawned, make_config, request, running_server, spawn_server, stub
from tests.tls_certs import CA, Issued, ServerFiles, replace

FRESH = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own for each channel


@pytest.fixture(scope="module")
def ca() -> CA:
    return CA.create("test CA")


@pytest.fixture(scope="module")
def other_ca() -> CA:
    return CA.create("a CA the server does not trust")


def credentials(trust: CA, client: Issued | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=trust.cert)
    return grpc.ssl_channel_credentials(root_certificates=trust.cert, private_key=client.key, certificate_chain=client.cert)


def status_of_a_call(target: str, creds: grpc.ChannelCredentials | None, timeout: float = 5) -> grpc.StatusCode:
    """RecommendAction over a new connection: OK, or the code it failed with."""
    channel = grpc.secure_channel(target, creds, options=FRESH) if creds is not None else \
        grpc.insecure_channel(target, options=FRESH)
    with channel:
        try:
            assert stub(channel).RecommendAction(request(), timeout=timeout).decision_id
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def logged(spawned: Spawned, msg: str) -> list[dict[str, Any]]:
    entries = []
    for line in list(spawned.lines):
        with contextlib.suppress(json.JSONDecodeError):
            entries.append(json.loads(line))
    return [e for e in entries if isinstance(e, dict) and e.get("msg") == msg]


def test_tls_handshake_and_a_call(tmp_path: Path, ca: CA, other_ca: CA) -> None:
    files = ServerFiles.write(tmp_path, ca)
    with running_server(**files.flags()) as live:
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        with grpc.secure_channel(live.target, credentials(ca), options=FRESH) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert status_of_a_call(live.target, None) == grpc.StatusCode.UNAVAILABLE, "a plaintext client on a TLS port"
        assert status_of_a_call(live.target, credentials(other_ca)) == grpc.StatusCode.UNAVAILABLE, "a server it cannot verify"


def test_mutual_tls_refuses_clients_without_a_certificate_or_with_a_foreign_one(tmp_path: Path, ca: CA, other_ca: CA) -> None:
    files = ServerFiles.write(tmp_path, ca)
    with running_server(**files.flags(mutual=True)) as live:
        assert status_of_a_call(live.target, credentials(ca, ca.issue("frontend", server=False))) == grpc.StatusCode.OK
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.UNAVAILABLE, "no client certificate"
        foreign = other_ca.issue("frontend", server=False)
        assert status_of_a_call(live.target, credentials(ca, foreign)) == grpc.StatusCode.UNAVAILABLE, "signed by another CA"


def test_rotated_files_are_served_to_new_connections_without_a_restart(tmp_path: Path, ca: CA) -> None:
    """cert-manager renews with a new CA: the server's certificate, key and client CA are renamed into
    place; new connections that trust only the new CA get in, old-CA clients no longer do, and a
    connection opened before the rotation keeps working."""
    new_ca = CA.create("the next CA")
    files = ServerFiles.write(tmp_path, ca)
    old_client, new_client = ca.issue("frontend", server=False), new_ca.issue("frontend", server=False)
    with running_server(**files.flags(mutual=True)) as live, \
            grpc.secure_channel(live.target, credentials(ca, old_client), options=FRESH) as before:
        assert live.server is not None and live.server.certificates is not None
        assert stub(before).RecommendAction(request(), timeout=5).decision_id
        assert status_of_a_call(live.target, credentials(new_ca, new_client)) == grpc.StatusCode.UNAVAILABLE
        files.install(new_ca)
        for _ in range(12):  # fresh connections land on any of the port's --grpc-servers (8): every one rotated
            assert status_of_a_call(live.target, credentials(new_ca, new_client)) == grpc.StatusCode.OK
            assert status_of_a_call(live.target, credentials(ca, old_client)) == grpc.StatusCode.UNAVAILABLE
        assert stub(before).RecommendAction(request(), timeout=5).decision_id, "an open connection keeps its session"
        assert live.server.certificates.reloads == 1


def test_unusable_new_files_keep_the_current_certificates(tmp_path: Path, ca: CA, caplog: pytest.LogCaptureFixture) -> None:
    files = ServerFiles.write(tmp_path, ca)
    with running_server(**files.flags()) as live, caplog.at_level(logging.WARNING, logger="server.tls"):
        assert live.server is not None and live.server.certificates is not None
        replace(files.key, ca.issue("someone else", server=True).key)  # a key that does not match the certificate
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        replace(files.cert, b"not a certificate\n")
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        files.cert.unlink()
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.refusals == 3 and live.server.certificates.reloads == 0
        reasons = [getattr(r, "fields", {}).get("reason", "") for r in caplog.records
                   if r.name == "server.tls" and r.levelno == logging.WARNING]  # whatever an earlier test left the root level at
        assert len(reasons) == 3 and all("--tls-cert" in r for r in reasons), reasons
        files.install(ca)  # a good pair again: taken up
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.reloads == 1


def test_an_expired_certificate_is_refused_at_start_and_on_rotation(tmp_path: Path, ca: CA) -> None:
    """An attack review (2026-12-07): a rotation to an expired certificate was reloaded (INFO, its not_after in the
    past), the valid one dropped, and every new handshake then failed; one expired at start was taken silently."""
    files = ServerFiles.write(tmp_path, ca)
    source = ReloadingCertificates(CertificateFiles(files.cert, files.key, None))
    stale = ca.issue("localhost", server=True, expired=True)
    replace(files.key, stale.key)
    replace(files.cert, stale.cert)
    assert source.refresh() is None and source.refusals == 1 and source.reloads == 0  # the valid pair stays in use
    with pytest.raises(TlsError, match=r"the certificate is not valid now \(valid from .* to "):
        ReloadingCertificates(CertificateFiles(files.cert, files.key, None))


def test_a_fifo_or_an_oversized_file_is_refused_without_blocking_a_handshake(tmp_path: Path, ca: CA) -> None:
    """A FIFO renamed over the certificate blocked the read with no writer, inside grpc's handshake and under the
    reload lock: no new connection got through even after the file was put back, and nothing was logged (a review,
    2026-12-05). A 256 MB certificate was read and held. Both are refused now, the certificates in use stay, and good
    files are taken up after them."""
    files = ServerFiles.write(tmp_path, ca)
    with running_server(**files.flags()) as live:
        assert live.server is not None and live.server.certificates is not None
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, files.cert)
        started = time.monotonic()
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert time.monotonic() - started < 3
        good = ca.issue("shopping-agent", server=True)
        replace(files.key, good.key)
        replace(files.cert, good.cert + b"# padding\n" * 120_000)  # 1.2 MB: past the 1 MiB a Secret holds
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.refusals == 2 and live.server.certificates.reloads == 0
        replace(files.cert, good.cert)
        assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.reloads == 1


def test_keys_grpc_cannot_serve_with_are_refused_and_those_it_can_are_served(tmp_path: Path, ca: CA) -> None:
    """Python's ssl takes a secp256k1 or an Ed448 key; grpc's TLS cannot serve with either: a rotation to one was
    logged as reloaded while the old certificate went on being served, and a start with one exited with a traceback
    (a review, 2026-12-05); with P-521 or Ed25519 keys grpc's own clients find no common signature algorithm. They are
    refused like any unusable file (so is RSA under 2048 bits); RSA and P-384 are served (P-256: every other test)."""
    files = ServerFiles.write(tmp_path / "served", ca)
    with running_server(**files.flags()) as live:
        assert live.server is not None and live.server.certificates is not None
        for key in (ec.generate_private_key(ec.SECP256K1()), ed448.Ed448PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate(),
                    ec.generate_private_key(ec.SECP521R1()), rsa.generate_private_key(public_exponent=65537, key_size=1024)):
            issued = ca.issue("shopping-agent", server=True, key=key)
            replace(files.key, issued.key)
            replace(files.cert, issued.cert)
            assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.refusals == 5 and live.server.certificates.reloads == 0
        for key in (rsa.generate_private_key(public_exponent=65537, key_size=2048), ec.generate_private_key(ec.SECP384R1())):
            issued = ca.issue(f"served-{type(key).__name__}", server=True, key=key)
            replace(files.key, issued.key)
            replace(files.cert, issued.cert)
            assert status_of_a_call(live.target, credentials(ca)) == grpc.StatusCode.OK
        assert live.server.certificates.reloads == 2

    start = ServerFiles.write(tmp_path / "start", ca)
    issued = ca.issue("shopping-agent", server=True, key=ec.generate_private_key(ec.SECP256K1()))
    replace(start.key, issued.key)
    replace(start.cert, issued.cert)
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "0", "--metrics-port", "", "--tls-cert",
                          str(start.cert), "--tls-key", str(start.key)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--tls-cert" in out.stderr and "grpc serves with" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_health_port_answers_plaintext_probes_and_nothing_else(tmp_path: Path, ca: CA) -> None:
    files = ServerFiles.write(tmp_path, ca)
    with running_server(**files.flags(mutual=True), health_port=0) as live:
        assert live.server is not None and live.server.health_port is not None
        with grpc.insecure_channel(f"127.0.0.1:{live.server.health_port}", options=FRESH) as ch:
            for service in ("", "shopping_agent.v1.ShoppingAgent"):
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                stub(ch).RecommendAction(request(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(("fields", "flag"), [
    ({"tls_cert": Path("c.pem")}, "--tls-key"),
    ({"tls_key": Path("k.pem")}, "--tls-cert"),
    ({"tls_client_ca": Path("ca.pem")}, "--tls-client-ca"),
    ({"metrics_tls_cert": Path("c.pem")}, "--metrics-tls-key"),
    ({"metrics_tls_client_ca": Path("ca.pem")}, "--metrics-tls-client-ca"),
    ({"health_port": 50051}, "--health-port"),
])
def test_half_configured_tls_is_a_configuration_error_naming_the_flag(fields: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        Config(**fields)  # type: ignore[arg-type]


def test_unreadable_certificate_files_stop_the_cli_before_it_serves(tmp_path: Path, ca: CA) -> None:
    files = ServerFiles.write(tmp_path, ca)
    replace(files.key, ca.issue("another key", server=True).key)
    cases = [("--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", str(files.key)),
             ("--tls-cert", str(files.cert), "--tls-key", str(files.key)),
             ("--metrics-tls-cert", str(files.cert), "--metrics-tls-key", str(files.cert))]
    for args in cases:
        out = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "0", "--metrics-port", "", *args],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2, out.stderr
        assert args[0] in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_tls_settings_reach_every_worker_unchanged(tmp_path: Path) -> None:
    config = make_config(**ServerFiles(tmp_path / "c", tmp_path / "k", tmp_path / "ca").flags(mutual=True),
                         metrics_tls_cert=tmp_path / "mc", metrics_tls_key=tmp_path / "mk", health_port=0,
                         max_concurrent_rpcs=None, max_connection_idle_seconds=12.5, keepalive_max_ping_strikes=0,
                         log_dir=Path("-logs"))  # a value that starts with "-" took the next flag's place (a review)
    rebuilt = build_config(parser().parse_args(["serve", *to_args(config)]), {})
    assert rebuilt == config


def test_two_workers_serve_tls_and_the_plaintext_health_port(tmp_path: Path, ca: CA) -> None:
    files = ServerFiles.write(tmp_path, ca)
    client = ca.issue("frontend", server=False)
    with spawn_server("--workers", "2", "--tls-cert", str(files.cert), "--tls-key", str(files.key),
                      "--tls-client-ca", str(files.client_ca), "--health-port", "0", timeout=60) as spawned:
        deadline = time.monotonic() + 30
        while len(logged(spawned, "serving")) < 2:
            assert time.monotonic() < deadline, "".join(spawned.lines)
            time.sleep(0.05)
        for _ in range(6):  # a connection per channel: the kernel spreads them over both workers
            assert status_of_a_call(spawned.target, credentials(ca, client)) == grpc.StatusCode.OK
        assert status_of_a_call(spawned.target, credentials(ca)) == grpc.StatusCode.UNAVAILABLE
        health_ports = {entry["port"] for entry in logged(spawned, "health port")}
        assert len(health_ports) == 1, "both workers share one health port"
        with grpc.insecure_channel(f"127.0.0.1:{health_ports.pop()}", options=FRESH) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        spawned.proc.send_signal(signal.SIGTERM)  # the workers drain and exit with the parent (a kill would orphan them)
        assert spawned.proc.wait(30) == 0


def test_a_secret_volume_update_is_taken_up(tmp_path: Path, ca: CA) -> None:
    """The kubelet updates a mounted Secret by writing a new directory and swapping the ``..data`` symlink
    the file names point through: the signature (through the symlinks) changes, the new files are read."""
    renewed = CA.create("the renewed CA")

    def version(name: str, authority: CA) -> None:
        directory = tmp_path / name
        directory.mkdir()
        issued = authority.issue("shopping-agent", server=True)
        (directory / "tls.crt").write_bytes(issued.cert)
        (directory / "tls.key").write_bytes(issued.key)
        (directory / "ca.crt").write_bytes(authority.cert)

    version("..2026_12_01_10_00_00.1", ca)
    (tmp_path / "..data").symlink_to("..2026_12_01_10_00_00.1")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    source = ReloadingCertificates(CertificateFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"))
    assert source.refresh() is None, "nothing changed"
    version("..2026_12_31_10_00_00.2", renewed)
    (tmp_path / "..data_tmp").symlink_to("..2026_12_31_10_00_00.2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    taken = source.refresh()
    assert taken is not None and taken.client_ca == renewed.cert and source.current is taken
    assert source.refresh() is None and source.reloads == 1


def test_a_chmod_of_a_certificate_file_is_a_change(tmp_path: Path, ca: CA) -> None:
    """A file refused as unreadable and then mended with ``chmod`` is read again (its ctime moves; content and mtime
    do not)."""
    files = CertificateFiles(tmp_path / "tls.crt", tmp_path / "tls.key")
    issued = ca.issue("localhost", server=True)
    files.cert.write_bytes(issued.cert)
    files.key.write_bytes(issued.key)
    source = ReloadingCertificates(files)
    before = signature(files)
    for mode in (0o600, 0o640):  # a second chmod a second later, for file systems whose ctime ticks in seconds
        os.chmod(files.key, mode)
        if signature(files) != before:
            break
        time.sleep(1.1)
    assert signature(files) != before
    assert source.refresh() is not None and source.reloads == 1  # examined and taken again
