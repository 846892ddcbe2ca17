"""The alerts and the dashboard query metrics the live server really exports, under the names it uses.

A real server with its /metrics endpoint on 127.0.0.1, a few real calls, one scrape over
HTTP; then every metric name in alerts.yml and dashboard.json must be one the scrape
declares, and every exact label matcher must match a series it has.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from tests.harness import ROOT, prometheus_tool, request, running_server, stub

MONITORING = ROOT / "k8s" / "monitoring"

# The series names each metric type puts in the exposition, by suffix.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}

# PromQL, reduced to what names metrics: strings, label matchers, ranges, variables and the
# label lists of by/without/on/ignoring go first; what is left of an identifier is a metric
# name unless a "(" follows it (a function or an aggregation) or it is a keyword.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:]|\s*\()")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left", "group_right",
             "inf", "nan", "start", "end"}
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_EQUAL = re.compile(r'(\w+)\s*=(?![=~])\s*"([^"]*)"')  # label="value"; not !=, =~ or !~


def metric_names(expr: str) -> set[str]:
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}


def exact_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(metric, label, value) for every `label="value"` matcher in a selector with a metric name."""
    return [(metric, label, value) for metric, body in _SELECTOR.findall(expr) for label, value in _EQUAL.findall(body)]




@dataclass(frozen=True)
class Scrape:
    text: str
    names: frozenset[str]  # every series name the exposition declares, suffixes included
    series: dict[str, list[dict[str, str]]]  # series name -> label sets present


@pytest.fixture(scope="module")
def scrape() -> Iterator[Scrape]:
    with running_server(metrics_port=0, metrics_host="127.0.0.1") as live, grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        for seed, page in enumerate((pb.PAGE_TYPE_SEARCH, pb.PAGE_TYPE_CART, pb.PAGE_TYPE_SEARCH)):
            call(request(seed=seed, page_type=page), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            call(request(item_embedding=[0.0] * 10), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert live.server is not None and live.server.metrics_endpoint is not None
        url = f"http://127.0.0.1:{live.server.metrics_endpoint.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    names: set[str] = set()
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample.labels)
    yield Scrape(text, frozenset(names), series)


def _alert_exprs() -> dict[str, str]:
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row keeps its panels inside it


def _dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "dashboard.json").read_text())


def _dashboard_exprs() -> dict[str, str]:
    return {f"{panel['title']} / {target['refId']}": target["expr"]
            for panel in _panels(_dashboard()["panels"]) for target in panel.get("targets", [])}


def test_metric_names_are_read_out_of_promql() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y"}[5m])))') == {"a_bucket"}
    assert metric_names("sum(rate(a_total[5m])) > 3 * sum(rate(a_total[5m] offset 1h))\nand\nsum(b) > 0.1") == {"a_total", "b"}
    assert metric_names('min(c) == 0 or sum(rate(d_total{source="fallback_no_model"}[5m])) > 0') == {"c", "d_total"}
    assert metric_names('sum by (g) (rate(e_total{job=~"$job"}[$__rate_interval])) / count without (h) (f) - time()') == {"e_total", "f"}
    assert metric_names("max(i) unless on (pod) j") == {"i", "j"}
    assert exact_matchers('k_total{a="1", b!="2", c=~"3", d="4"}') == [("k_total", "a", "1"), ("k_total", "d", "4")]


def test_promtool_lints_the_live_metrics(scrape: Scrape) -> None:
    out = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=scrape.text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_scrape_saw_the_calls(scrape: Scrape) -> None:
    handled = {(labels["grpc_method"], labels["grpc_code"]) for labels in scrape.series["grpc_server_handled_total"]}
    assert ("RecommendAction", "INVALID_ARGUMENT") in handled
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    total = sum(s.value for s in families["shopping_agent_decisions"].samples if s.name.endswith("_total"))
    assert total == 3


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_queried_metric_is_exported(scrape: Scrape, source: str) -> None:
    exprs = _alert_exprs() if source == "alerts" else _dashboard_exprs()
    assert exprs
    missing = {where: sorted(metric_names(expr) - scrape.names) for where, expr in exprs.items()}
    assert all(metric_names(expr) for expr in exprs.values()), "an expression with no metric name: the extraction is broken"
    assert {where: names for where, names in missing.items() if names} == {}


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_exact_label_matcher_matches_a_live_series(scrape: Scrape, source: str) -> None:
    exprs = _alert_exprs() if source == "alerts" else _dashboard_exprs()
    unmatched = [(where, metric, label, value) for where, expr in exprs.items() for metric, label, value in exact_matchers(expr)
                 if not any(labels.get(label) == value for labels in scrape.series.get(metric, []))]
    assert unmatched == []


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, as a recording rule: promtool parses and type-checks it."""
    def filled(expr: str) -> str:
        return re.sub(r"\$\{?\w+\}?", ".+", re.sub(r"\$\{?__(?:rate_)?interval\}?", "1m", expr))

    records = [{"record": f"dashboard:query_{i}", "expr": filled(expr)} for i, expr in enumerate(_dashboard_exprs().values())]
    rules = tmp_path / "dashboard_queries.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    out = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(records)} rules found" in out.stdout


def test_every_dashboard_panel_queries_the_datasource_variable() -> None:
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["targets"], panel["title"]
        for datasource in (panel["datasource"], *(t["datasource"] for t in panel["targets"])):
            assert datasource == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
