"""The alerts and the dashboard query metrics the live server really exports, under the names it uses.

A real server with its /metrics endpoint on 127.0.0.1, a few real calls, one scrape over
HTTP; then every metric name in alerts.yml and dashboard.json must be one the scrape
declares, and every exact label matcher must match a series it has.

The server watches a weights directory and sees two publishes before the scrape: a good
bundle (swapped in) and a broken one (rejected). The swap counter's label children appear
only when the watcher judges a bundle, so this is what makes `result="rejected"` a series
the scrape really has, with the labels the server really writes.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import time
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
from server.models import ACTIVE_NAME
from tests.harness import ROOT, ServerThread, prometheus_tool, request, running_server, stub
from weights.bundle import REASONS, read_bundle, write_bundle
from weights.embedded import default_bundle_bytes

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


def _publish(directory: Path, data: bytes) -> None:
    """Write a temp file in the directory and rename it onto the active name, as the publisher does."""
    tmp = directory / f".tmp-{time.monotonic_ns()}"
    tmp.write_bytes(data)
    os.replace(tmp, directory / ACTIVE_NAME)


def _good_bundle(version: str) -> bytes:
    base = read_bundle(default_bundle_bytes())
    manifest = {k: v for k, v in base.manifest.items() if k not in ("format", "format_version", "parts")}
    buf = io.BytesIO()
    write_bundle(buf, {**manifest, "model_version": version}, base.parts)
    return buf.getvalue()


def _judged(live: ServerThread, directory: Path, data: bytes, result: str, reason: str) -> None:
    """Publish ``data`` and wait until the server's watcher has counted it as ``result``/``reason``."""
    labels = {"result": result, "reason": reason}
    before = live.registry.get_sample_value("shopping_agent_model_swaps_total", labels) or 0.0
    _publish(directory, data)
    deadline = time.monotonic() + 20
    while (live.registry.get_sample_value("shopping_agent_model_swaps_total", labels) or 0.0) <= before:
        assert time.monotonic() < deadline, f"the watcher never counted a swap {labels}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    weights_dir = tmp_path_factory.mktemp("weights")  # empty: the server starts on the embedded default
    with running_server(metrics_port=0, metrics_host="127.0.0.1", weights_dir=weights_dir, weights_poll_seconds=0.1,
                        weights_inotify=False, weights_debounce_ms=20) as live, grpc.insecure_channel(live.target) as ch:
        _judged(live, weights_dir, _good_bundle("monitoring-swap"), "ok", "")
        _judged(live, weights_dir, b"not a bundle", "rejected", "format")
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


def test_the_scrape_saw_the_swap_and_the_rejection(scrape: Scrape) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    counted = {(s.labels["result"], s.labels["reason"]): s.value for s in families["shopping_agent_model_swaps"].samples
               if s.name == "shopping_agent_model_swaps_total"}
    assert {key for key, value in counted.items() if value} == {("ok", ""), ("rejected", "format")}
    assert counted[("ok", "")] == 1 and counted[("rejected", "format")] == 1
    assert [labels["model_version"] for labels in scrape.series["shopping_agent_model_info"]] == ["monitoring-swap"]
    assert families["shopping_agent_model_last_swap_timestamp_seconds"].samples[0].value > 0


def test_the_process_is_described_as_prometheus_expects(scrape: Scrape) -> None:
    """The standard process metrics an SRE's dashboards read (the registry is the server's own, not the default)."""
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
            "process_start_time_seconds"} <= scrape.names


def test_every_refusal_reason_has_its_series_from_the_start(scrape: Scrape) -> None:
    """A series that first appears at 1 shows no rate on the dashboard's swaps panel: one for each reason, at 0 until then."""
    rejected = {labels["reason"] for labels in scrape.series["shopping_agent_model_swaps_total"] if labels["result"] == "rejected"}
    assert rejected == set(REASONS)
    assert {labels["file"] for labels in scrape.series["shopping_agent_weights_refused"]} == {"active", "canary"}


def test_every_reason_a_server_refuses_a_bundle_for_is_one_of_the_reasons() -> None:
    """What a server loads a bundle through (the trainer adds its own for an --init it cannot continue from)."""
    given = {match for package in ("core", "guard", "policy", "server", "weights") for path in (ROOT / package).glob("**/*.py")
             for match in re.findall(r'BundleError\(\s*"([a-z_]+)"', path.read_text())}
    assert len(given) >= 10 and given <= set(REASONS), given - set(REASONS)


PROMETHEUS_OWN = frozenset({"up"})
"""Series Prometheus writes for each target itself, not read from any exposition (ShoppingAgentDown and TargetDown)."""


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_queried_metric_is_exported(scrape: Scrape, source: str) -> None:
    exprs = _alert_exprs() if source == "alerts" else _dashboard_exprs()
    assert exprs
    missing = {where: sorted(metric_names(expr) - scrape.names - PROMETHEUS_OWN) for where, expr in exprs.items()}
    assert all(metric_names(expr) for expr in exprs.values()), "an expression with no metric name: the extraction is broken"
    assert {where: names for where, names in missing.items() if names} == {}


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_exact_label_matcher_matches_a_live_series(scrape: Scrape, source: str) -> None:
    exprs = _alert_exprs() if source == "alerts" else _dashboard_exprs()
    unmatched = [(where, metric, label, value) for where, expr in exprs.items() for metric, label, value in exact_matchers(expr)
                 if metric not in PROMETHEUS_OWN and not any(labels.get(label) == value for labels in scrape.series.get(metric, []))]
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
