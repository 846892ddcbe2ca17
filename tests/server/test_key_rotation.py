"""A signing-key rotation on a running server, as SECURITY.md (*Keys*) walks it: the servers trust the old key and the
new one from one file, the publisher switches keys, and every bundle either signed stays loadable throughout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from tests.harness import ROOT, request, running_server, stub, until
from tests.weights import hostile
from weights.cli import PUBLIC_KEY_ENV
from weights.store import ACTIVE_NAME


def weights_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", "weights", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def test_a_server_trusting_the_old_and_the_new_key_takes_bundles_signed_by_either_and_no_other(tmp_path: Path) -> None:
    key_ids = {}
    for who in ("old", "new", "stranger"):
        made = weights_cli("keygen", "--private", str(tmp_path / f"{who}.key"), "--public", str(tmp_path / f"{who}.pub"))
        assert made.returncode == 0, made.stderr
        key_ids[who] = made.stdout.split("(public, key ")[1].split(")")[0]  # keygen names the key it made
    assert len(set(key_ids.values())) == 3
    trusted = tmp_path / "trusted.pub"  # the servers' Secret during the rotation: both public keys, one file
    trusted.write_bytes((tmp_path / "old.pub").read_bytes() + (tmp_path / "new.pub").read_bytes())
    env = {PUBLIC_KEY_ENV: str(trusted)}
    pv = tmp_path / "pv"
    for version in ("v1-old", "v2-new"):
        (tmp_path / f"{version}.bundle").write_bytes(hostile.rebuilt(model_version=version))
    published = weights_cli("publish", str(tmp_path / "v1-old.bundle"), "--dir", str(pv), "--sign-key", str(tmp_path / "old.key"),
                            env=env)
    assert published.returncode == 0, published.stderr

    with running_server(weights_dir=pv, weights_inotify=False, weights_poll_seconds=0.1, bundle_public_key=trusted) as live, \
            grpc.insecure_channel(live.target) as channel:
        def serving() -> str:
            return stub(channel).RecommendAction(request(), timeout=10).model_version

        assert serving() == "v1-old"  # signed by the old key, which the servers still trust
        # The publisher switches to the new key: its bundles load on the servers already rolled to both keys.
        out = weights_cli("publish", str(tmp_path / "v2-new.bundle"), "--dir", str(pv), "--sign-key", str(tmp_path / "new.key"),
                          env=env)
        assert out.returncode == 0, out.stderr
        until(lambda: serving() == "v2-new", "the bundle signed by the new key to serve")
        # Which key signed the active bundle: once no bundle that may still be needed is signed by the old key, drop it.
        shown = weights_cli("verify", str(pv / ACTIVE_NAME), env=env)
        assert shown.returncode == 0 and shown.stdout.strip() == f"ok v2-new (signed by key {key_ids['new']})", shown.stdout
        # A bundle signed by neither key, put in place by hand (past publish's own check): refused, counted, not served.
        (tmp_path / "v3.bundle").write_bytes(hostile.rebuilt(model_version="v3-stranger"))
        assert weights_cli("sign", str(tmp_path / "v3.bundle"), "--key", str(tmp_path / "stranger.key")).returncode == 0
        refused = weights_cli("verify", str(tmp_path / "v3.bundle"), env=env)
        assert refused.returncode == 1 and "any of this server's 2 public keys" in refused.stderr
        os.replace(tmp_path / "v3.bundle", pv / ACTIVE_NAME)
        until(lambda: live.registry.get_sample_value("shopping_agent_model_swaps_total",
                                                     {"result": "rejected", "reason": "signature"}) == 1.0,
              "the stranger's bundle to be refused")
        assert serving() == "v2-new"


def test_a_key_file_the_server_cannot_use_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """Exit 2 naming the file, no traceback: a key of an algorithm cryptography has no code for (it raised an exception
    that is not a ValueError, and the start ended in a traceback, exit 1), a private key where the public one belongs."""
    from tests.weights.test_signing import _unknown_algorithm_pem
    from weights.signing import keypair_pem

    private, public = keypair_pem()
    cases = {"unknown.pub": public + _unknown_algorithm_pem(public), "private.pub": private}
    for name, text in cases.items():
        (tmp_path / name).write_bytes(text)
        out = subprocess.run([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "",
                              "--bundle-public-key", str(tmp_path / name)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"{tmp_path / name}" in out.stderr and "not a readable PEM public key" in out.stderr, out.stderr
