"""``shopping-agent weights …`` as a CronJob runs it: the real CLI in a subprocess, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.harness import variant_bytes
from weights.bundle import Bundle, npy_bytes, read_bundle, write_bundle
from weights.initial import make_bundle
from weights.store import ACTIVE_NAME, HISTORY_DIR, INDEX_NAME, WeightsStore
from weights.validate import verify

ROOT = Path(__file__).resolve().parents[2]
CREATED = "2026-01-01T00:00:00Z"


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", "weights", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def said(out: subprocess.CompletedProcess[str]) -> str:
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """v1 and v2 as files, a truncated copy, and v1's version with other weights."""
    d = tmp_path_factory.mktemp("bundles")
    data = {"v1": make_bundle(1, "v1", CREATED), "v2": make_bundle(2, "v2", CREATED), "other-v1": make_bundle(9, "v1", CREATED)}
    data["truncated"] = data["v2"][: len(data["v2"]) - 5000]
    paths = {}
    for name, content in data.items():
        paths[name] = d / f"{name}.bundle"
        paths[name].write_bytes(content)
    return paths


@pytest.fixture
def nan_file(tmp_path: Path, rebuild: Callable[..., bytes], default_bundle: Bundle) -> Path:
    table = default_bundle.array("behavior_table.npy").copy()
    table[0, 0] = np.inf
    path = tmp_path / "nan.bundle"
    path.write_bytes(rebuild(**{"behavior_table.npy": npy_bytes(table)}))
    return path


def no_temp_files(directory: Path) -> bool:
    return not list(directory.rglob(".tmp-*"))


# --- init, verify, show ------------------------------------------------------------------------


def test_init_writes_a_valid_bundle_reproducibly(tmp_path: Path) -> None:
    out = cli("init", "--out", tmp_path / "b.bundle", "--seed", "3", "--version", "boot-3", "--created-at", CREATED)
    assert out.returncode == 0, said(out)
    assert out.stdout.startswith("created boot-3 ")
    assert (tmp_path / "b.bundle").read_bytes() == make_bundle(3, "boot-3", CREATED)
    assert no_temp_files(tmp_path)

    assert cli("init", "--out", tmp_path / "d.bundle").returncode == 0
    out = cli("verify", tmp_path / "d.bundle")
    assert (out.returncode, out.stdout) == (0, "ok init-0\n")


@pytest.mark.parametrize("package", ["onnx", "threadpoolctl"])
def test_init_without_a_package_of_its_extra_says_what_to_install(tmp_path: Path, package: str) -> None:
    fake = tmp_path / "site" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n")
    out = cli("init", "--out", tmp_path / "b.bundle", env={"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"})
    assert out.returncode == 2
    assert f"shopping-agent weights: needs {package}, which the train extra installs: .venv/bin/pip install -e '.[cpu,train]'" \
        in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "b.bundle").exists()


def test_verify_gives_the_reason_and_exit_1(files: dict[str, Path], nan_file: Path, tmp_path: Path) -> None:
    out = cli("verify", files["v1"])
    assert (out.returncode, out.stdout) == (0, "ok v1\n")
    out = cli("verify", files["truncated"])
    assert out.returncode == 1 and out.stderr.startswith("invalid (format): "), said(out)
    out = cli("verify", nan_file)
    assert out.returncode == 1 and out.stderr.startswith(f"invalid (nonfinite): {nan_file}: behavior_table.npy"), said(out)
    out = cli("verify", tmp_path / "missing.bundle")
    assert out.returncode == 2 and "No such file" in out.stderr
    held = tmp_path / "held.bundle"  # a candidate the gate refused (weights.held): valid, but every server refuses it
    bundle = read_bundle(files["v1"].read_bytes())
    with held.open("wb") as f:
        write_bundle(f, {**bundle.manifest, "held": True}, dict(bundle.parts))
    out = cli("verify", held)
    assert out.returncode == 1 and out.stderr.startswith(f"invalid (held): {held}: refused as a release: a candidate"), said(out)


def test_show_prints_the_manifest_for_people_and_as_json(files: dict[str, Path]) -> None:
    out = cli("show", files["v1"])
    assert out.returncode == 0, said(out)
    for text in ("model_version     v1", "created_at        2026-01-01T00:00:00Z", "shopping-agent-bundle version 1",
                 "item_dim=768", "add_to_cart, view_detail", "full_cart_damp_add", "cart_page_coupon",
                 "guard_threshold   0.2", "min_votes=4", "policy.onnx", "sha256"):
        assert text in out.stdout, text
    out = cli("show", files["v1"], "--json")
    manifest = json.loads(out.stdout)
    assert manifest["model_version"] == "v1" and set(manifest["parts"]) >= {"policy.onnx", "guard.onnx"}
    out = cli("show", files["truncated"])
    assert out.returncode == 1 and out.stderr.startswith("invalid (format)")
    assert cli("show").returncode == 2  # a file or --dir is required


def test_show_writes_a_manifests_control_characters_as_escapes(tmp_path: Path) -> None:
    """An ESC sequence in a manifest reached the terminal (retitled it, moved its cursor), and a lone surrogate stopped
    `show` with a traceback (an attack review, 2026-12-06)."""
    from tests.weights.hostile import rebuilt

    path = tmp_path / "odd.bundle"
    path.write_bytes(rebuilt(provenance={"logs": "\x1b]0;pwned\x07\x1b[2J", "by": "\ud800", "as": "a\\x1b"}))
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "weights_active.bundle").write_bytes(path.read_bytes())
    for out in (cli("show", path), cli("show", "--dir", weights)):
        assert out.returncode == 0, said(out)
        assert "\x1b" not in out.stdout and "\\x1b]0;pwned\\x07\\x1b[2J" in out.stdout and "\\ud800" in out.stdout
        assert "a\\\\x1b" in out.stdout  # a backslash typed in the text is doubled: it never passes for an escape


# --- publish, rollback, show --dir ---------------------------------------------------------------


def test_publish_rollback_and_show_a_weights_directory(files: dict[str, Path], tmp_path: Path) -> None:
    pv = tmp_path / "pv"
    out = cli("publish", files["v1"], "--dir", pv)
    assert (out.returncode, out.stdout) == (0, "published v1\n"), said(out)
    assert (pv / ACTIVE_NAME).read_bytes() == files["v1"].read_bytes()
    out = cli("publish", files["v1"], "--dir", pv)
    assert (out.returncode, out.stdout) == (0, "unchanged v1\n")
    out = cli("publish", files["v2"], "--dir", pv)
    assert (out.returncode, out.stdout) == (0, "published v2 (was v1)\n")

    out = cli("show", "--dir", pv, "--json")
    shown = json.loads(out.stdout)
    assert shown["active"]["model_version"] == "v2"
    assert [(h["model_version"], h["active"]) for h in shown["history"]] == [("v1", False), ("v2", True)]
    out = cli("show", "--dir", pv)
    assert out.returncode == 0 and "model_version     v2" in out.stdout and "* v2" in out.stdout
    assert shown["canary"] is None and "canary            (none)" in out.stdout
    assert shown["pending"] is None and "pending           (none)" in out.stdout
    store = WeightsStore(pv, partial(verify, limits=None))
    store.hold(variant_bytes("k3"))  # a candidate kept for a second look: operators are told to rm it, so show it
    shown = json.loads(cli("show", "--dir", pv, "--json").stdout)["pending"]
    assert shown["model_version"] == "k3" and f"k3, kept for a second look (sha256 {shown['sha256']}; rm {store.pending_path}" in \
        cli("show", "--dir", pv).stdout
    store.drop_pending()
    store.start_canary(variant_bytes("c1", canary=0.05))
    store.count_canary_look("c1")
    shown = json.loads(cli("show", "--dir", pv, "--json").stdout)["canary"]
    assert {k: shown[k] for k in ("model_version", "fraction", "looks")} == {"model_version": "c1", "fraction": 0.05, "looks": 1}
    assert "c1 asks for 0.05 of the sessions (each server caps it at its --max-canary-fraction), judged 1 times" in \
        cli("show", "--dir", pv).stdout
    store.canary_path.write_bytes(b"not a bundle")
    assert "canary            unreadable:" in cli("show", "--dir", pv).stdout
    store.drop_canary()

    out = cli("rollback", "--dir", pv)
    assert (out.returncode, out.stdout) == (0, "rolled back to v1 (was v2)\n"), said(out)
    assert (pv / ACTIVE_NAME).read_bytes() == files["v1"].read_bytes()
    shown = json.loads(cli("show", "--dir", pv, "--json").stdout)["history"]
    assert [h["rolled_back_at"] is not None for h in shown] == [False, True]  # v2, left for an older one: a plain rollback skips it
    assert f"v2  published {shown[1]['published_at']}  sha256 {shown[1]['sha256']}  rolled back from {shown[1]['rolled_back_at']}" in \
        cli("show", "--dir", pv).stdout
    out = cli("rollback", "--dir", pv)
    assert out.returncode == 1 and "nothing to roll back to: v1 is the oldest" in out.stderr
    out = cli("rollback", "--dir", pv, "--to", "v2")
    assert (out.returncode, out.stdout) == (0, "rolled back to v2 (was v1)\n")
    out = cli("rollback", "--dir", pv, "--to", "v7")
    assert out.returncode == 1 and out.stderr.startswith("refused (unknown_version)")
    assert no_temp_files(pv)
    out = cli("rollback", "--dir", tmp_path / "not-mounted")  # exit 1 is a refusal to the Job: this is no refusal
    assert (out.returncode, out.stderr) == (2, f"error (io): --dir {tmp_path / 'not-mounted'} is not a directory\n")
    out = cli("verify", files["truncated"])  # the file named, as in a script's log of many
    assert out.returncode == 1 and out.stderr.startswith(f"invalid (format): {files['truncated']}: "), out.stderr


@pytest.mark.parametrize("bad", ["truncated", "nan", "other-v1"])
def test_publish_refuses_and_the_active_file_stays(bad: str, files: dict[str, Path], nan_file: Path, tmp_path: Path) -> None:
    pv = tmp_path / "pv"
    assert cli("publish", files["v1"], "--dir", pv).returncode == 0
    active = pv / ACTIVE_NAME
    before = (active.read_bytes(), active.stat().st_ino, (pv / HISTORY_DIR / INDEX_NAME).read_bytes())
    out = cli("publish", nan_file if bad == "nan" else files[bad], "--dir", pv)
    assert out.returncode == 1 and out.stdout == "", said(out)
    expected = {"truncated": "refused (format)", "nan": "refused (nonfinite)", "other-v1": "refused (immutable)"}[bad]
    assert out.stderr.startswith(expected) and out.stderr.count("\n") == 1, out.stderr
    assert (active.read_bytes(), active.stat().st_ino, (pv / HISTORY_DIR / INDEX_NAME).read_bytes()) == before
    assert no_temp_files(pv)


def test_rollback_of_an_empty_directory_fails_clearly(tmp_path: Path) -> None:
    out = cli("rollback", "--dir", tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith("refused (nothing_to_roll_back): nothing to roll back to")


def test_usage_and_io_problems_exit_2(files: dict[str, Path], tmp_path: Path) -> None:
    assert cli("publish", files["v1"]).returncode == 2  # --dir is required
    assert cli("publish", files["v1"], "--dir", tmp_path, "--keep", "0").returncode == 2
    out = cli("publish", tmp_path / "missing.bundle", "--dir", tmp_path / "pv")
    assert out.returncode == 2 and out.stderr.startswith("error (io): cannot read bundle")
    out = cli("show", "--dir", tmp_path / "nowhere")
    assert out.returncode == 2 and "no such weights directory" in out.stderr
    # An attack review (2026-12-07): each of these was a traceback (exit 1), a verdict on the bundle for a bad flag, a
    # bundle every server refuses written with exit 0, or a whole mistyped tree made and a publish reported done.
    for args, says in ((("init", "--out", tmp_path / "x.bundle", "--seed", "-1"), "--seed: expected an integer from 0"),
                       (("init", "--out", tmp_path / "x.bundle", "--created-at", "garbage"), "--created-at: expected an ISO 8601"),
                       (("verify", files["v1"], "--validate-memory-mb", "100"), "--validate-memory-mb: expected 0"),
                       (("verify", files["v1"], "--validate-memory-mb", "99999999999999999999"), "--validate-memory-mb: expected 0"),
                       (("publish", files["v1"], "--dir", tmp_path / "typo" / "weights"), "No such file or directory")):
        out = cli(*args)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    assert not (tmp_path / "x.bundle").exists() and not (tmp_path / "typo").exists()
    assert cli("publish", files["v1"], "--dir", tmp_path / "weights").returncode == 0  # the directory itself is made


def test_two_publisher_processes_at_once(files: dict[str, Path], tmp_path: Path) -> None:
    pv = tmp_path / "pv"
    procs = [subprocess.Popen([sys.executable, "-m", "server", "weights", "publish", str(files[v]), "--dir", str(pv)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in ("v1", "v2")]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    active = (pv / ACTIVE_NAME).read_bytes()
    assert active in (files["v1"].read_bytes(), files["v2"].read_bytes())
    out = cli("verify", pv / ACTIVE_NAME)
    assert out.returncode == 0
    index = json.loads((pv / HISTORY_DIR / INDEX_NAME).read_text())
    assert sorted(e["model_version"] for e in index) == ["v1", "v2"]
    assert out.stdout == f"ok {index[-1]['model_version']}\n"
    assert no_temp_files(pv)
