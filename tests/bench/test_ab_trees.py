"""bench.ab_trees starts the server from the tree it is given, and refuses a directory that is not one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.ab_trees import main, tree_argv
from tests.harness import ROOT


def test_the_server_runs_from_the_tree_given() -> None:
    run = subprocess.run([*tree_argv(ROOT, ["--grpc-servers", "1"]), "--help"], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--grpc-servers" in run.stdout


def test_a_directory_without_the_server_does_not_fall_back_to_the_installed_one(tmp_path: Path) -> None:
    run = subprocess.run([*tree_argv(tmp_path, []), "--help"], capture_output=True, text=True, timeout=60, cwd="/")
    assert run.returncode != 0 and "is not under" in run.stderr


def test_a_tree_that_is_not_this_repository_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--a", str(tmp_path), "--b", str(ROOT)])
    assert ended.value.code == 2 and "--a" in capsys.readouterr().err
