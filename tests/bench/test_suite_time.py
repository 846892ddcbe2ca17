"""bench.suite_time: the plugin records each test's span and the collector's time in every xdist worker; the summary
adds them up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.suite_time import main, summary
from tests.harness import ROOT

SUITE = '''
import gc, time

def test_sleeps():
    time.sleep(0.4)

def test_collects():
    gc.collect()

def test_quick_a():
    pass

def test_quick_b():
    pass
'''


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "suite").mkdir(exist_ok=True)
    (tmp_path / "suite" / "test_tiny.py").write_text(SUITE)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "bench.suite_time", "-p", "no:cacheprovider", "-q", "-n", "2",
                           *extra, str(tmp_path / "suite")], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_each_worker_writes_its_tests_spans_and_the_summary_adds_them_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "times"
    run = _run(tmp_path, "--suite-time-dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert {r["worker"] for r in records} <= {"gw0", "gw1"} and records  # the workers' files; the controller ran none
    result = summary(records)
    assert result["tests"] == 4 and result["slowest"][0]["test"].endswith("test_tiny.py::test_sleeps")
    assert 0.4 <= result["slowest"][0]["s"] < 5 and result["work_s"] >= 0.4 and result["wall_s"] >= 0.4
    assert sum(r["gc_runs"][2] for r in records) >= 1  # test_collects ran a full collection, and it was timed
    assert [k for k, _ in result["by_module"]] == [result["slowest"][0]["test"].split("::")[0]]
    assert main([str(out)]) == 0 and "4 tests" in capsys.readouterr().out


def test_without_a_directory_nothing_is_written_and_an_empty_one_is_an_error(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not list(tmp_path.glob("**/*.json"))
    assert main([str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="suite-time-dir"):
        summary([])
