"""The alert rules: promtool accepts them, their unit tests pass, and every alert is tested both ways.

``promtool`` comes with Debian's prometheus package (.ci/run installs it). Without it these
tests skip on a developer's machine and fail in CI, where a skip would hide a broken rule.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import ROOT, prometheus_tool

MONITORING = ROOT / "k8s" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = (MONITORING / "alerts_test.yml", MONITORING / "alerts_drift_test.yml")
"""The drift alerts' week-long cases have a file of their own, evaluated every 5 minutes, not every minute."""

PROMTOOL_TIMEOUT_S = 300
"""The rule tests take 9-11 s a file alone on two cores (2026-12-06); the limit is there for a hung promtool, not to
time it."""


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([prometheus_tool("promtool"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT_S)


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules() -> None:
    out = _promtool("check", "rules", str(RULES.relative_to(ROOT)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


@pytest.mark.parametrize("rule_tests", RULE_TESTS, ids=lambda path: path.name)
def test_the_rule_unit_tests_pass(rule_tests: Path) -> None:
    out = _promtool("test", "rules", str(rule_tests.relative_to(ROOT)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        tests = yaml.safe_load(path.read_text())
        assert tests["rule_files"] == [RULES.name], path.name
        for case in tests["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert names - fired == set(), "alerts with no test case that fires them"
    assert names - quiet == set(), "alerts with no test case where they stay quiet"
    assert (fired | quiet) - names == set(), "test cases for alerts that alerts.yml does not define"


def test_every_alert_says_how_bad_it_is_and_what_to_do() -> None:
    alerts = _alerts()
    names = [rule["alert"] for rule in alerts]
    assert len(names) == len(set(names)), f"an alert name is used twice: {names}"
    for rule in alerts:
        assert rule.get("for"), f"{rule['alert']}: no 'for', it would fire on one bad evaluation"
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), rule["alert"]
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{rule['alert']}: no {key} annotation"
        assert f"### {rule['alert']}" in (MONITORING / "README.md").read_text(), f"{rule['alert']}: not in the README"
