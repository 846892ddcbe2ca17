"""Lint and types run with the tests, so the README's one test command checks them too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from server.config import describe
from tests.harness import ROOT


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is not installed next to {sys.executable}; install the [test] extra"
    return path


def test_ruff_is_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean() -> None:
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docs_configuration_table_is_current() -> None:
    hint = "regenerate with: python -c 'from server.config import describe; print(describe())'"
    assert describe() in (ROOT / "docs" / "configuration.md").read_text(), hint
