"""bench.suite_time: the plugin records each test's span (setup, call and teardown) and the collector's time in every
process that runs tests, named by the run; the summary adds up the last run's records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.suite_time import latest_run, main, summary
from tests.harness import ROOT

SUITE = '''
import gc, time
import pytest

@pytest.fixture
def slow_teardown():
    yield
    time.sleep(0.3)

def test_sleeps():
    time.sleep(0.4)

def test_collects():
    gc.collect()

def test_tears_down_slowly(slow_teardown):
    pass

def test_quick():
    pass
'''


def _run(tmp_path: Path, *extra: str, workers: str = "2", inherited_worker: str | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "suite").mkdir(exist_ok=True)
    (tmp_path / "suite" / "test_tiny.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # this suite's own worker name, if any
    if inherited_worker:
        env["PYTEST_XDIST_WORKER"] = inherited_worker
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "bench.suite_time", "-p", "no:cacheprovider", "-q", "-n", workers,
                           *extra, str(tmp_path / "suite")], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env=env)


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*.json")]


def _span(result: dict, name: str) -> float:
    return next(t["s"] for t in result["slowest"] if t["test"].endswith(f"test_tiny.py::{name}"))


def test_each_worker_writes_its_tests_spans_and_the_summary_adds_them_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "times"
    run = _run(tmp_path, "--suite-time-dir", str(out))  # after a space: allowed while DIR does not exist (pytest ignores it)
    assert run.returncode == 0, run.stdout + run.stderr
    records = _records(out)
    assert records and {r["worker"] for r in records} <= {"gw0", "gw1"}  # the workers' files; the controller ran none
    assert len({r["run"] for r in records}) == 1
    result = summary(records)
    assert result["tests"] == 4 and result["slowest"][0]["test"].endswith("test_tiny.py::test_sleeps")
    assert 0.4 <= _span(result, "test_sleeps") < 5 and 0.3 <= _span(result, "test_tears_down_slowly") < 5  # teardown counts
    assert result["work_s"] >= 0.7 and result["wall_s"] >= 0.4
    assert sum(r["gc_runs"][2] for r in records) >= 1  # test_collects ran a full collection, and it was timed
    assert 0 < sum(sum(r["gc_s"]) for r in records) < result["wall_s"] + 60  # a duration, not a clock reading
    assert [k for k, _ in result["by_module"]] == [result["slowest"][0]["test"].split("::")[0]]
    assert main([str(out)]) == 0 and "4 tests" in capsys.readouterr().out


def test_one_process_writes_main_and_the_summary_reads_the_last_run_of_a_directory(tmp_path: Path,
                                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "times"
    first = _run(tmp_path, f"--suite-time-dir={out}")
    assert first.returncode == 0, first.stdout + first.stderr
    second = _run(tmp_path, f"--suite-time-dir={out}", workers="0", inherited_worker="gw7")  # as from inside a worker
    assert second.returncode == 0, second.stdout + second.stderr
    found = _records(out)
    last = latest_run(found)
    assert [r["worker"] for r in last] == ["main"] and len(found) > len(last)  # the earlier run's files stay, unread
    assert summary(last)["tests"] == 4 and summary(last)["workers"][0]["idle_at_end_s"] == 0
    assert main([str(out)]) == 0 and "of earlier runs" in capsys.readouterr().out


def test_without_a_directory_nothing_is_written_and_an_empty_one_is_an_error(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not list(tmp_path.glob("**/*.json"))
    assert main([str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="suite-time-dir"):
        summary([])


@pytest.mark.parametrize("given", ["under-tmp", "beside-the-project", "in-PYTEST_ADDOPTS"])
def test_an_existing_directory_after_a_space_is_refused_naming_the_form_that_works(tmp_path: Path, given: str) -> None:
    """pytest read an existing DIR after a space as a test path when it looked for its configuration: with no test path
    besides, the run was rooted at DIR (under /tmp) or at a parent it shares with the project (beside it), without the
    project's pyproject (one process, not -n auto). Refused in each case, before anything is collected."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-n 2"\n')
    out = tmp_path / "times"
    out.mkdir()
    value, cwd = ("../times", project) if given == "beside-the-project" else (str(out), ROOT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    words = ["--suite-time-dir", value]
    if given == "in-PYTEST_ADDOPTS":
        env["PYTEST_ADDOPTS"], words = f"--suite-time-dir {value}", []
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "bench.suite_time", "-p", "no:cacheprovider", "--co", "-q", *words],
                         cwd=cwd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert run.returncode == 4 and f"write --suite-time-dir={value}" in run.stdout + run.stderr, run.stdout + run.stderr
