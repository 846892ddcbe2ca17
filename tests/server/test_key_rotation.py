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
        assert len(set(key_ids.values())) == 3
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
