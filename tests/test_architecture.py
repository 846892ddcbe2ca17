"""The layering is a contract: import-linter checks it, and a wrong-way import breaks it.

What ``serve`` loads is checked on the real command in a real process (``python -X importtime``
lists every module the interpreter imported).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.harness import ROOT, request, spawn_server, stub

PACKAGES = ("core", "guard", "policy", "weights", "experience", "simulator", "trainer", "server")


def _lint_imports(cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert tool, "lint-imports is not installed next to the interpreter; install the [test] extra"
    env = None if extra_path is None else {**os.environ, "PYTHONPATH": str(extra_path)}
    return subprocess.run([tool, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_the_import_contracts_hold() -> None:
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


def _copy_tree(dest: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.bundle", "*.pyi"))


@pytest.mark.parametrize(("module", "line", "reported"), [
    ("policy/decoder.py", "import torch", "policy.decoder -> torch"),
    ("weights/bundle.py", "import grpc", "weights.bundle -> grpc"),
    ("guard/rules.py", "from policy import decision", "guard.rules -> policy.decision"),
    ("experience/sessions.py", "from trainer import config", "experience.sessions -> trainer.config"),
    ("simulator/world.py", "from trainer import config", "simulator.world -> trainer.config"),
])
def test_a_forbidden_import_breaks_the_contract(tmp_path: Path, module: str, line: str, reported: str) -> None:
    """A copy of the packages with one wrong-way import added: the contract fails and names it."""
    _copy_tree(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # the wrong-way import under test\n")
    out = _lint_imports(tmp_path, extra_path=tmp_path)
    assert out.returncode != 0, out.stdout
    assert "0 broken" not in out.stdout and reported in out.stdout, out.stdout


def test_serve_without_logs_loads_no_trainer_simulator_pyarrow_torch_or_cryptography() -> None:
    """The real ``serve`` in its own process, one call answered, then SIGTERM; every import it made."""
    with spawn_server(interpreter_args=("-X", "importtime")) as server, grpc.insecure_channel(server.target) as ch:
        stub(ch).RecommendAction(request(), timeout=20)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        time.sleep(0.2)  # let the reader thread take the last lines
        imported = {line.split("|")[-1].strip().split(".")[0] for line in server.lines if line.startswith("import time:")}
    assert {"server", "policy", "weights", "onnxruntime", "grpc"} <= imported  # the listing is real
    unwanted = {"torch", "pyarrow", "simulator", "trainer", "onnx", "threadpoolctl",
                "cryptography"}  # (no --bundle-public-key, no TLS here: nothing to verify or handshake)
    assert imported.isdisjoint(unwanted), imported & unwanted


def test_serve_with_logs_loads_the_log_writer_but_no_reader_and_still_no_torch(tmp_path: Path) -> None:
    with spawn_server("--log-dir", str(tmp_path / "logs"), interpreter_args=("-X", "importtime")) as server, \
            grpc.insecure_channel(server.target) as ch:
        stub(ch).RecommendAction(request(), timeout=20)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        time.sleep(0.2)
        modules = {line.split("|")[-1].strip() for line in server.lines if line.startswith("import time:")}
    imported = {m.split(".")[0] for m in modules}
    assert {"pyarrow", "experience"} <= imported and "experience.segment_writer" in modules
    assert imported.isdisjoint({"torch", "simulator", "trainer"})
    # the readers' filesystem layer (S3, GCS, HDFS, Azure, datasets) is the trainer's, not a serving process's memory
    reading = {"pyarrow.fs", "pyarrow._fs", "pyarrow.dataset", "pyarrow.parquet", "experience.segments"}
    assert modules.isdisjoint(reading), modules & reading
