"""Signed bundles: a server with a public key loads only bundles signed by its private key."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness import ROOT, promptly
from tests.small_disk import SmallDisk
from tests.weights import hostile
from weights.bundle import MANIFEST, SIGNATURE, BundleError, read_bundle
from weights.cli import EXIT_ERROR
from weights.embedded import DEFAULT_MODEL_VERSION
from weights.model_set import LoadOptions, ModelSet
from weights.signing import MAX_TRUSTED_KEYS, KeyFileError, key_id, keypair_pem, load_private_key, load_public_keys, sign


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    out = {}
    for who in ("ours", "theirs"):
        private, public = keypair_pem()
        (root / f"{who}.key").write_bytes(private)
        (root / f"{who}.pub").write_bytes(public)
        out[who], out[f"{who}_pub"] = root / f"{who}.key", root / f"{who}.pub"
    return out


def options(keys: dict[str, Path], who: str = "ours") -> LoadOptions:
    return LoadOptions(device="cpu", warmup_batch=1, public_keys=load_public_keys(keys[f"{who}_pub"]))


def test_a_signed_bundle_loads_and_keeps_its_parts(keys: dict[str, Path]) -> None:
    data = hostile.rebuilt()
    signed = sign(data, load_private_key(keys["ours"]))
    bundle = read_bundle(signed)
    assert bundle.signature is not None and len(bundle.signature) == 64
    assert bundle.parts == read_bundle(data).parts and bundle.manifest == read_bundle(data).manifest
    assert ModelSet.load(bundle, options(keys)).version == DEFAULT_MODEL_VERSION
    assert sign(signed, load_private_key(keys["ours"])) == signed  # Ed25519 is deterministic; re-signing replaces


def test_unsigned_and_mis_signed_bundles_are_refused(keys: dict[str, Path]) -> None:
    data = hostile.rebuilt()
    with pytest.raises(BundleError, match="not signed") as caught:
        ModelSet.load(read_bundle(data), options(keys))
    assert caught.value.reason == "signature"
    theirs = sign(data, load_private_key(keys["theirs"]))
    with pytest.raises(BundleError, match="does not verify"):
        ModelSet.load(read_bundle(theirs), options(keys))
    ModelSet.load(read_bundle(theirs), LoadOptions(device="cpu", warmup_batch=1))  # without a key: not checked


def test_a_tampered_manifest_breaks_the_signature(keys: dict[str, Path]) -> None:
    signed = sign(hostile.rebuilt(), load_private_key(keys["ours"]))
    with zipfile.ZipFile(io.BytesIO(signed)) as zf:
        entries = [(n, zf.read(n)) for n in sorted(zf.namelist())]
    manifest = json.loads(dict(entries)[MANIFEST])
    manifest["guard"]["threshold"] = 0.0  # veto nothing
    tampered = hostile.members([(n, json.dumps(manifest).encode() if n == MANIFEST else d) for n, d in entries])
    assert SIGNATURE in zipfile.ZipFile(io.BytesIO(tampered)).namelist()
    with pytest.raises(BundleError, match="does not verify"):
        ModelSet.load(read_bundle(tampered), options(keys))


def test_key_files_of_the_wrong_kind_are_clear_errors(keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="not a readable PEM public key"):
        load_public_keys(keys["ours"])
    (tmp_path / "junk.pem").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(KeyFileError, match="key 1: not a readable"):
        load_public_keys(tmp_path / "junk.pem")


def _rsa_public_pem() -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _unknown_algorithm_pem(ed25519_pem: bytes) -> bytes:
    """The same key under an algorithm OID cryptography has no code for (1.3.101.127, next to Ed25519's 1.3.101.112): it
    raised UnsupportedAlgorithm, which is not a ValueError, so a start with it ended in a traceback (a re-read)."""
    import base64

    body = b"".join(line for line in ed25519_pem.splitlines() if not line.startswith(b"-----"))
    der = base64.b64decode(body).replace(b"\x06\x03\x2b\x65\x70", b"\x06\x03\x2b\x65\x7f")
    return b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(der) + b"-----END PUBLIC KEY-----\n"


def test_the_validating_childs_fields_carry_every_key_and_a_malformed_one_fails(keys: dict[str, Path], tmp_path: Path) -> None:
    """The child (weights.sandbox) gets the keys as JSON; a field it cannot read must fail the check, not turn it off."""
    from weights.sandbox import child_fields, validate_bytes

    both = tmp_path / "both.pub"
    both.write_bytes(keys["ours_pub"].read_bytes() + keys["theirs_pub"].read_bytes())
    fields = json.loads(json.dumps(child_fields(LoadOptions(warmup_batch=1, public_keys=load_public_keys(both)))))
    signed = sign(hostile.rebuilt(), load_private_key(keys["theirs"]))
    assert validate_bytes(signed, 2**31, fields)["ok"] is True  # the second key reached the child
    assert validate_bytes(hostile.rebuilt(), 2**31, fields)["reason"] == "signature"
    for malformed in ("", None, [1]):
        with pytest.raises(TypeError, match="public_keys"):
            validate_bytes(hostile.rebuilt(), 2**31, {**fields, "public_keys": malformed})


def test_a_key_file_may_hold_several_keys_and_every_one_must_be_whole(keys: dict[str, Path], tmp_path: Path) -> None:
    """During a rotation the servers trust the old key and the new one: one file, one PEM block each (comments between
    blocks allowed). A file with anything else in a BEGIN block is refused whole, naming the block: trusting the keys
    that did parse would quietly drop the one the operator meant to add."""
    ours, theirs = keys["ours_pub"].read_bytes(), keys["theirs_pub"].read_bytes()
    both = tmp_path / "both.pub"
    both.write_bytes(b"# the old key\n" + ours + b"# the new key, from 2026-12-06\n" + theirs + ours)  # a repeat is dropped
    assert load_public_keys(both) == (*load_public_keys(keys["ours_pub"]), *load_public_keys(keys["theirs_pub"]))
    assert len({key_id(k) for k in load_public_keys(both)}) == 2 and all(len(key_id(k)) == 16 for k in load_public_keys(both))
    cases = {
        b"": "found 0 whole of 0",
        ours + b"-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n": "found 1 whole of 2",  # a second block cut short
        ours + _rsa_public_pem(): "key 2: not an Ed25519 public key",
        ours + _unknown_algorithm_pem(ours): "key 2: not a readable PEM public key",  # cryptography: UnsupportedAlgorithm
        ours + keys["ours"].read_bytes(): "found 1 whole of 2",  # a private key pasted in by mistake
        b"x" * (64 * 1024 + 1): "more than the 65536-byte limit",
    }
    for text, message in cases.items():
        (tmp_path / "bad.pub").write_bytes(text)
        with pytest.raises(KeyFileError, match=message):
            load_public_keys(tmp_path / "bad.pub")
    os.mkfifo(tmp_path / "fifo.pub")  # no writer: a blocking open would wait for ever
    with pytest.raises(KeyFileError, match="not a regular file"):
        promptly(lambda: load_public_keys(tmp_path / "fifo.pub"), fifo=tmp_path / "fifo.pub")
    many = [keypair_pem()[1] for _ in range(MAX_TRUSTED_KEYS + 1)]
    (tmp_path / "many.pub").write_bytes(b"".join(many))
    with pytest.raises(KeyFileError, match=f"{MAX_TRUSTED_KEYS + 1} public keys, more than {MAX_TRUSTED_KEYS}"):
        load_public_keys(tmp_path / "many.pub")
    (tmp_path / "many.pub").write_bytes(b"".join(many[:MAX_TRUSTED_KEYS]))
    assert len(load_public_keys(tmp_path / "many.pub")) == MAX_TRUSTED_KEYS


def test_with_two_trusted_keys_a_bundle_signed_by_either_loads_and_no_other(keys: dict[str, Path], tmp_path: Path) -> None:
    both = tmp_path / "both.pub"
    both.write_bytes(keys["ours_pub"].read_bytes() + keys["theirs_pub"].read_bytes())
    trusting = LoadOptions(device="cpu", warmup_batch=1, public_keys=load_public_keys(both))
    data = hostile.rebuilt()
    for who in ("ours", "theirs"):
        assert ModelSet.load(read_bundle(sign(data, load_private_key(keys[who]))), trusting).version == DEFAULT_MODEL_VERSION
    private, _ = keypair_pem()
    (tmp_path / "third.key").write_bytes(private)
    with pytest.raises(BundleError, match="does not verify under any of this server's 2 public keys"):
        ModelSet.load(read_bundle(sign(data, load_private_key(tmp_path / "third.key"))), trusting)
    with pytest.raises(BundleError, match="not signed"):
        ModelSet.load(read_bundle(data), trusting)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", "weights", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_keygen_writes_the_pair_or_nothing(tmp_path: Path, small_disk: SmallDisk) -> None:
    """A full disk, or a public path that cannot be written, left a private key behind (empty, on the full disk), and
    every rerun then failed on it ("File exists") until someone removed it by hand."""
    (tmp_path / "afile").write_text("not a directory")
    out = cli("keygen", "--private", str(tmp_path / "k"), "--public", str(tmp_path / "afile" / "k.pub"))
    assert out.returncode == EXIT_ERROR and "Not a directory" in out.stderr and not (tmp_path / "k").exists()
    small_disk.fill()
    out = cli("keygen", "--private", str(small_disk.path / "k"), "--public", str(small_disk.path / "k.pub"))
    assert out.returncode == EXIT_ERROR and "No space left" in out.stderr, out.stderr
    assert sorted(p.name for p in small_disk.path.iterdir()) == ["filler"]  # no key, no temp file
    small_disk.free()
    assert cli("keygen", "--private", str(small_disk.path / "k"), "--public", str(small_disk.path / "k.pub")).returncode == 0
    assert (load_private_key(small_disk.path / "k").public_key().public_bytes_raw(),) == load_public_keys(small_disk.path / "k.pub")


def test_keygen_never_writes_over_a_key_and_sign_reads_a_key_file_bounded(tmp_path: Path) -> None:
    """An attack review (2026-12-07): ``keygen --public signing.key`` replaced the publisher's private key with a public
    one, exit 0; ``sign --key /dev/zero`` took 1.7 GB before a ``MemoryError`` (killed without a cap); a FIFO hung."""
    assert cli("keygen", "--private", str(tmp_path / "k"), "--public", str(tmp_path / "k.pub")).returncode == 0
    before = (tmp_path / "k").read_bytes()
    out = cli("keygen", "--private", str(tmp_path / "new"), "--public", str(tmp_path / "k"))
    assert out.returncode == EXIT_ERROR and f"--public {tmp_path / 'k'}: exists" in out.stderr, out.stderr
    assert (tmp_path / "k").read_bytes() == before and not (tmp_path / "new").exists()
    out = cli("keygen", "--private", str(tmp_path / "same"), "--public", str(tmp_path / "same"))
    assert out.returncode == EXIT_ERROR and "name one file" in out.stderr and not (tmp_path / "same").exists()
    bundle = tmp_path / "b.bundle"
    bundle.write_bytes(hostile.rebuilt())
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"-" * (64 * 1024 + 1))
    for key, says in (("/dev/zero", "not a regular file"), (str(tmp_path / "fifo"), "not a regular file"),
                      (str(tmp_path / "big"), "more than the 65536-byte limit")):
        out = cli("sign", str(bundle), "--key", key)
        assert out.returncode == EXIT_ERROR and says in out.stderr, (key, out.stderr)


def test_keygen_sign_verify_and_publish_on_the_command_line(tmp_path: Path) -> None:
    assert cli("keygen", "--private", str(tmp_path / "k"), "--public", str(tmp_path / "k.pub")).returncode == 0
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert cli("keygen", "--private", str(tmp_path / "k"), "--public", str(tmp_path / "k.pub")).returncode != 0  # never overwrites
    bundle = tmp_path / "b.bundle"
    bundle.write_bytes(hostile.rebuilt())
    out = cli("verify", str(bundle), "--public-key", str(tmp_path / "k.pub"))
    assert out.returncode == 1 and "invalid (signature)" in out.stderr
    assert cli("sign", str(bundle), "--key", str(tmp_path / "k")).returncode == 0
    out = cli("verify", str(bundle), "--public-key", str(tmp_path / "k.pub"))
    assert out.returncode == 0 and "(signed by key " in out.stdout
    unsigned = tmp_path / "u.bundle"
    unsigned.write_bytes(hostile.rebuilt(model_version="v2"))
    pv = tmp_path / "pv"
    out = cli("publish", str(unsigned), "--dir", str(pv), "--public-key", str(tmp_path / "k.pub"))
    assert out.returncode == 1 and "refused (signature)" in out.stderr
    out = cli("publish", str(unsigned), "--dir", str(pv), "--public-key", str(tmp_path / "k.pub"), "--sign-key", str(tmp_path / "k"))
    assert out.returncode == 0, out.stderr
    assert read_bundle(pv / "weights_active.bundle").signature is not None


def test_where_the_servers_key_is_set_publish_and_rollback_check_against_it(tmp_path: Path) -> None:
    """The rollback Job runs ``weights rollback --dir`` with no ``--public-key``: where the servers load only signed
    bundles it reported "rolled back" to an unsigned version they refused, so nothing changed while ``show`` named it
    active (a review). ``--public-key`` now defaults to the servers' own variable."""
    from server.config import ENV_PREFIX
    from weights.cli import PUBLIC_KEY_ENV

    assert PUBLIC_KEY_ENV == ENV_PREFIX + "BUNDLE_PUBLIC_KEY"  # the variable the servers read (server.config)
    assert cli("keygen", "--private", str(tmp_path / "k"), "--public", str(tmp_path / "k.pub")).returncode == 0
    pv, unsigned, later = tmp_path / "pv", tmp_path / "u.bundle", tmp_path / "u3.bundle"
    unsigned.write_bytes(hostile.rebuilt(model_version="v1"))
    later.write_bytes(hostile.rebuilt(model_version="v3"))
    assert cli("publish", str(unsigned), "--dir", str(pv)).returncode == 0  # before signing was turned on
    signed = tmp_path / "s.bundle"
    signed.write_bytes(hostile.rebuilt(model_version="v2"))
    assert cli("publish", str(signed), "--dir", str(pv), "--sign-key", str(tmp_path / "k")).returncode == 0
    env = {PUBLIC_KEY_ENV: str(tmp_path / "k.pub")}
    out = cli("rollback", "--dir", str(pv), env=env)
    assert out.returncode == 1 and "refused (signature)" in out.stderr, out.stderr
    assert read_bundle(pv / "weights_active.bundle").model_version == "v2"  # the servers' bundle stays active
    out = cli("publish", str(later), "--dir", str(pv), env=env)
    assert out.returncode == 1 and "refused (signature)" in out.stderr
    assert cli("rollback", "--dir", str(pv), env={PUBLIC_KEY_ENV: ""}).returncode == 0  # unset: as before
