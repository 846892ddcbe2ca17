"""The PrometheusRule carries exactly the plain rules file's groups, so the two never drift.

k8s/monitoring/alerts.yml is the source (promtool-tested by tests/monitoring); the manifest
k8s/base/prometheusrule.yaml is generated from it by k8s/gen_prometheusrule.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.k8s_render import render
from tests.harness import ROOT, prometheus_tool

RULES = ROOT / "k8s" / "monitoring" / "alerts.yml"
MANIFEST = ROOT / "k8s" / "base" / "prometheusrule.yaml"
GENERATOR = ROOT / "k8s" / "gen_prometheusrule.py"


def _rule(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule


def test_the_prometheus_rule_groups_equal_the_plain_rules_file() -> None:
    plain = yaml.safe_load(RULES.read_text())["groups"]
    [manifest] = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert manifest["spec"] == {"groups": plain}, "regenerate: python k8s/gen_prometheusrule.py"
    names = [rule["alert"] for group in plain for rule in group["rules"] if "alert" in rule]
    assert len(names) >= 8 and len(names) == len(set(names))


def test_every_overlay_keeps_the_rules_unchanged() -> None:
    plain = yaml.safe_load(RULES.read_text())["groups"]
    for overlay in ("base", "overlays/prod", "overlays/gpu"):
        assert _rule(render(ROOT / "k8s" / overlay))["spec"] == {"groups": plain}, overlay


def test_the_generator_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_generator_check_notices_drift(tmp_path: Path) -> None:
    """Run a copy of the generator next to an edited rules file: --check fails until it is regenerated."""
    (tmp_path / "monitoring").mkdir()
    (tmp_path / "base").mkdir()
    (tmp_path / "gen_prometheusrule.py").write_text(GENERATOR.read_text())
    (tmp_path / "base" / "prometheusrule.yaml").write_text(MANIFEST.read_text())
    (tmp_path / "monitoring" / "alerts.yml").write_text(RULES.read_text().replace("for: 10m", "for: 11m", 1))

    def gen(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(tmp_path / "gen_prometheusrule.py"), *args], capture_output=True, text=True, timeout=60)

    assert gen("--check").returncode == 1
    assert gen().returncode == 0
    assert gen("--check").returncode == 0


def test_promtool_accepts_the_rules_inside_the_manifest(tmp_path: Path) -> None:
    """What the Prometheus Operator hands Prometheus (spec as a rules file) passes promtool."""
    [manifest] = list(yaml.safe_load_all(MANIFEST.read_text()))
    rules_file = tmp_path / "from-prometheusrule.yml"
    rules_file.write_text(yaml.safe_dump(manifest["spec"], sort_keys=False, allow_unicode=True))
    out = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    count = sum(len(group["rules"]) for group in manifest["spec"]["groups"])
    assert f"SUCCESS: {count} rules found" in out.stdout
