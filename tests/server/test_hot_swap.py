"""Hot swap under load: real files, real renames, a real server answering throughout.

Every case keeps concurrent clients calling RecommendAction while bundles are published
onto the active name (write a temp file in the same directory, fsync, os.replace) and
asserts: no failed call, every response carries a version that was valid, the final
version is the expected one.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from server.models import ACTIVE_NAME
from tests.harness import ServerThread, request, running_server, stub, until
from weights.bundle import PARTS, npy_bytes, write_bundle
from weights.embedded import DEFAULT_MODEL_VERSION, default_bundle

BASE = default_bundle()


def bundle_bytes(version: str, **manifest_changes: object) -> bytes:
    manifest = {k: v for k, v in BASE.manifest.items() if k not in ("format", "format_version", "parts")}
    manifest.update(model_version=version, **manifest_changes)
    buf = io.BytesIO()
    write_bundle(buf, manifest, {p: BASE.parts[p] for p in PARTS})
    return buf.getvalue()


def nan_bundle(version: str) -> bytes:
    table = BASE.array("behavior_table.npy").copy()
    table[0, 0] = np.nan
    manifest = {k: v for k, v in BASE.manifest.items() if k not in ("format", "format_version", "parts")}
    buf = io.BytesIO()
    write_bundle(buf, {**manifest, "model_version": version}, {**BASE.parts, "behavior_table.npy": npy_bytes(table)})
    return buf.getvalue()


def publish(directory: Path, data: bytes, name: str = ACTIVE_NAME) -> None:
    """Atomic publish: a temp file in the same directory, fsync, rename onto the active name."""
    tmp = directory / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)


@dataclass
class Load:
    """Clients calling RecommendAction until stopped; every outcome recorded."""

    target: str
    versions: list[str] = field(default_factory=list)
    per_client: list[list[str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        mine: list[str] = []
        self.per_client.append(mine)
        with grpc.insecure_channel(self.target) as ch:
            call = stub(ch).RecommendAction
            deadline = time.monotonic() + 60
            while not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    version = call(request(), timeout=5).model_version
                    mine.append(version)
                    self.versions.append(version)
                except grpc.RpcError as exc:
                    self.errors.append(f"{exc.code()}: {exc.details()}")

    def last_version(self) -> str:
        return self.versions[-1] if self.versions else ""


@pytest.fixture
def weights_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "weights"
    directory.mkdir()
    publish(directory, bundle_bytes("v1"))
    return directory


def _serve(weights_dir: Path, inotify: bool = True) -> Iterator[tuple[ServerThread, Load]]:
    with running_server(weights_dir=weights_dir, weights_poll_seconds=0.2, weights_inotify=inotify,
                        weights_debounce_ms=20) as live:
        load = Load(live.target)
        threads = [threading.Thread(target=load.run) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            yield live, load
        finally:
            load.stop.set()
            for t in threads:
                t.join(10)


def wait_for(load: Load, version: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while load.last_version() != version:
        assert time.monotonic() < deadline, f"still serving {load.last_version()!r}, expected {version!r}"
        time.sleep(0.02)


def _swaps(live: ServerThread, result: str, reason: str = "") -> float:
    return live.registry.get_sample_value("shopping_agent_model_swaps_total", {"result": result, "reason": reason}) or 0.0


def _refused(live: ServerThread, file: str = "active") -> float | None:
    return live.registry.get_sample_value("shopping_agent_weights_refused", {"file": file})


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "poll-only"])
def test_a_good_bundle_is_picked_up_without_a_failed_call(weights_dir: Path, inotify: bool) -> None:
    for live, load in _serve(weights_dir, inotify):
        wait_for(load, "v1")
        publish(weights_dir, bundle_bytes("v2"))
        wait_for(load, "v2", timeout=5)
        time.sleep(0.2)
        assert _swaps(live, "ok") == 1
        assert live.registry.get_sample_value("shopping_agent_model_info", {"model_version": "v2", "format_version": "1"}) == 1
    assert load.errors == []
    assert set(load.versions) == {"v1", "v2"}
    for versions in load.per_client:  # a client never goes back to the old model once it saw the new one
        if "v2" in versions:
            assert all(v == "v2" for v in versions[versions.index("v2"):])


def test_a_burst_of_twenty_publishes_ends_on_the_last(weights_dir: Path) -> None:
    for live, load in _serve(weights_dir):
        wait_for(load, "v1")
        bundles = [bundle_bytes(f"burst-{i}") for i in range(20)]
        for data in bundles:  # twenty within about a second
            publish(weights_dir, data)
            time.sleep(0.03)
        wait_for(load, "burst-19", timeout=10)
        time.sleep(0.5)
        assert load.last_version() == "burst-19"
        assert 1 <= _swaps(live, "ok") <= 20
    assert load.errors == []
    assert set(load.versions) <= {"v1", *(f"burst-{i}" for i in range(20))}
    for versions in load.per_client:  # each client's calls are sequential, so each sees versions only move forward
        order = [-1 if v == "v1" else int(v.split("-")[1]) for v in versions]
        assert order == sorted(order)


def _truncated(v: str) -> bytes:
    return bundle_bytes(v)[:5000]


def _flipped(v: str) -> bytes:
    data = bytearray(bundle_bytes(v))
    data[len(data) // 2] ^= 0x40
    return bytes(data)


BAD = {
    "truncated": (_truncated, "format"),
    "flipped-byte": (_flipped, "format"),  # the zip's CRC catches it before the manifest's sha256 does
    "nan": (nan_bundle, "nonfinite"),
    # a candidate the trainer holds for a second look (weights.held): a valid bundle, but not a release
    "held-for-a-second-look": (lambda v: bundle_bytes(v, held=True), "held"),
    "unknown-format-version": (lambda v: _with_format_version(v), "format_version"),
    "wrong-shape": (lambda v: bundle_bytes(v, feature_spec={**BASE.manifest["feature_spec"], "item_dim": 512,
                                                              "state_dim": 664}), "shape"),
}


def _with_format_version(version: str) -> bytes:
    import json
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(bundle_bytes(version)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                manifest["format_version"] = 99
                data = json.dumps(manifest).encode()
            dst.writestr(info, data)
    return out.getvalue()


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_bundle_is_refused_and_the_old_model_keeps_serving(weights_dir: Path, case: str) -> None:
    make, reason = BAD[case]
    for live, load in _serve(weights_dir):
        wait_for(load, "v1")
        publish(weights_dir, make("bad"))
        deadline = time.monotonic() + 5
        while _swaps(live, "rejected", reason) < 1:
            assert time.monotonic() < deadline, f"not rejected with reason {reason}"
            time.sleep(0.02)
        time.sleep(0.6)  # several polls: the rejected file is not retried
        assert _swaps(live, "rejected", reason) == 1
        assert load.last_version() == "v1"
        assert _refused(live) == 1  # while it lies there: the rejection count alone ages out of an alert's window
        publish(weights_dir, bundle_bytes("v3"))  # and a good one afterwards still lands
        wait_for(load, "v3")
        assert _refused(live) == 0
    assert load.errors == []
    assert "bad" not in load.versions


def test_a_bundle_of_another_item_dimension_swaps_in_and_requests_are_checked_against_it(weights_dir: Path) -> None:
    """A catalogue re-embedded at 512 dimensions ships as a valid bundle of item_dim 512: once it serves, requests of
    512 floats are answered and 768 refused naming the field (the servicer's limits follow the served bundle)."""
    from policy.features import FeatureSpec
    from weights.initial import make_bundle

    narrow = make_bundle(3, "v512", "2026-12-06T00:00:00Z", spec=FeatureSpec(item_dim=512))
    with running_server(weights_dir=weights_dir, weights_poll_seconds=0.1, weights_debounce_ms=20) as live, \
            grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        assert call(request(), timeout=5).model_version == "v1"
        publish(weights_dir, narrow)

        def serves_512() -> bool:
            try:
                return bool(call(request(item_embedding=[0.01] * 512), timeout=5).model_version == "v512")
            except grpc.RpcError as exc:  # the 768-d bundle still serves: 512 floats are refused until the swap
                assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
                return False

        until(serves_512, "the 512-d bundle to serve")
        with pytest.raises(grpc.RpcError) as info:
            call(request(), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("item_embedding: expected exactly 512 values, got 768")


def test_a_deleted_active_file_keeps_the_model_serving(weights_dir: Path) -> None:
    for live, load in _serve(weights_dir):
        wait_for(load, "v1")
        publish(weights_dir, b"not a bundle")
        until(lambda live=live: _refused(live) == 1, "the refusal")
        (weights_dir / ACTIVE_NAME).unlink()
        until(lambda live=live: _refused(live) == 0, "a missing file to clear the refusal")
        time.sleep(0.8)
        assert load.last_version() == "v1"
        publish(weights_dir, bundle_bytes("v2"))
        wait_for(load, "v2")
    assert load.errors == []


def test_a_configmap_style_symlink_swap_is_seen(tmp_path: Path) -> None:
    """Kubernetes ConfigMap volumes: name -> ..data/name, and ..data is a symlink swapped by rename."""
    root = tmp_path / "cm"
    root.mkdir()

    def swap_to(version: str) -> None:
        target = root / f"..{version}"
        target.mkdir()
        publish(target, bundle_bytes(version))
        link = root / "..data_tmp"
        link.symlink_to(target.name)
        os.replace(link, root / "..data")

    swap_to("c1")
    (root / ACTIVE_NAME).symlink_to(f"..data/{ACTIVE_NAME}")
    for _, load in _serve(root):
        wait_for(load, "c1")
        swap_to("c2")
        wait_for(load, "c2", timeout=5)
    assert load.errors == []


def test_a_missing_directory_at_start_serves_the_default_then_picks_up_the_bundle(tmp_path: Path) -> None:
    directory = tmp_path / "not-yet"
    for _, load in _serve(directory):
        wait_for(load, DEFAULT_MODEL_VERSION)
        directory.mkdir()
        publish(directory, bundle_bytes("late"))
        wait_for(load, "late", timeout=5)
    assert load.errors == []


def test_the_cli_publishes_and_rolls_back_under_load_poll_only(tmp_path: Path) -> None:
    """The operator's path end to end: `weights publish` and `weights rollback` while clients call, inotify off."""
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.harness import ROOT

    directory = tmp_path / "volume"
    directory.mkdir()
    cli = [sys.executable, "-m", "server", "weights"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)

    for version in ("p1", "p2"):
        (tmp_path / f"{version}.bundle").write_bytes(bundle_bytes(version))
    (tmp_path / "bad.bundle").write_bytes(_flipped("bad"))
    assert run("publish", str(tmp_path / "p1.bundle"), "--dir", str(directory)).returncode == 0
    for live, load in _serve(directory, inotify=False):
        wait_for(load, "p1")
        out = run("publish", str(tmp_path / "p2.bundle"), "--dir", str(directory))
        assert out.returncode == 0 and out.stdout.startswith("published p2")
        wait_for(load, "p2")
        bad = run("publish", str(tmp_path / "bad.bundle"), "--dir", str(directory))
        assert bad.returncode == 1 and bad.stderr.startswith("refused")
        out = run("rollback", "--dir", str(directory))
        assert out.returncode == 0 and out.stdout.startswith("rolled back to p1")
        wait_for(load, "p1")
        with grpc.insecure_channel(live.target) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING  # health stays SERVING through swaps
    assert load.errors == []
    assert set(load.versions) == {"p1", "p2"}


def test_an_active_file_refused_at_start_for_a_passing_cause_is_read_again(weights_dir: Path) -> None:
    """The validating child given no time at all: the start's read is refused with ``limits`` (a cause that can pass
    on a busy node), and the watcher tries the unchanged file again after its first back-off (5 s), counting it."""
    with running_server(weights_dir=weights_dir, weights_poll_seconds=0.2, validate_timeout_seconds=0.001) as live:
        deadline = time.monotonic() + 5
        while _swaps(live, "rejected", "limits") < 1:
            assert time.monotonic() < deadline, "the start's read was not refused"
            time.sleep(0.05)
        assert _refused(live) == 1  # refused at start: the embedded default serves, and the gauge says why
        deadline = time.monotonic() + 15
        while _swaps(live, "rejected", "limits") < 2:
            assert time.monotonic() < deadline, "the file refused at start was not read again"
            time.sleep(0.1)


def test_the_start_logs_a_refused_active_file_as_an_error_and_a_missing_one_as_news(tmp_path: Path,
                                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A refusal at start is the publisher's error, logged as the watcher logs one later; an empty volume (day one) is not."""
    caplog.set_level(logging.INFO, logger="server.models")
    empty, bad = tmp_path / "empty", tmp_path / "bad"
    empty.mkdir()
    bad.mkdir()
    publish(bad, b"not a bundle")
    for directory, message, level in ((empty, "no active bundle published yet", logging.INFO),
                                      (bad, "cannot serve the active bundle", logging.ERROR)):
        caplog.clear()
        with running_server(weights_dir=directory, validate_memory_mb=0) as live:
            assert _refused(live) == (1 if directory is bad else 0)
        starts = [r for r in caplog.records if r.name == "server.models" and "active bundle" in r.getMessage()]
        assert [(r.getMessage(), r.levelno) for r in starts] == [(message, level)]
