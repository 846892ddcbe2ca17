"""A real Prometheus scrapes a real server under load and reads back what the server counted.

Prometheus (Debian's package; .ci/run installs it) runs on 127.0.0.1 with a 1 s scrape
interval and the alert rules loaded. The test drives a few hundred RecommendAction calls
over about five seconds, then asks Prometheus's HTTP API: the target is up, the summed
decision counter equals the calls made, the decision rate during the load matches the
rate the calls were made at, and every alert rule evaluates without error.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import yaml

from tests.harness import ROOT, ServerThread, prometheus_tool, request, running_server, stub

T = TypeVar("T")
JOB = "shopping-agent"
CALLS = 300
LOAD_SECONDS = 5.0
RULES = ROOT / "k8s" / "monitoring" / "alerts.yml"




def _alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """A Prometheus server in a subprocess; ``get`` calls its HTTP API."""

    def __init__(self, binary: str, workdir: Path, metrics_port: int) -> None:
        self.port = _free_port()
        self.log = workdir / "prometheus.log"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }))
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> float | None:
        """An instant query that returns one sample (or none)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        result = self.get("/api/v1/query", **params)["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def logs(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _eventually(check: Callable[[], T | None], timeout: float, what: str, prometheus: Prometheus) -> T:
    """Poll ``check`` until it returns something other than None, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert prometheus.proc.poll() is None, f"prometheus exited: {prometheus.logs()}"
        try:
            result = check()
        except (urllib.error.URLError, ConnectionError):
            result = None  # not listening yet
        if result is not None:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}; prometheus log:\n{prometheus.logs()}"
        time.sleep(0.2)


@pytest.fixture
def live() -> Iterator[ServerThread]:
    with running_server(metrics_port=0, metrics_host="127.0.0.1") as thread:
        yield thread


@pytest.fixture
def binary() -> str:
    return prometheus_tool("prometheus")


@pytest.fixture
def prometheus(binary: str, live: ServerThread, tmp_path: Path) -> Iterator[Prometheus]:
    assert live.server is not None and live.server.metrics_endpoint is not None
    server = Prometheus(binary, tmp_path, live.server.metrics_endpoint.port)
    try:
        yield server
    finally:
        server.stop()


def _load(target: str, errors: list[BaseException]) -> None:
    """CALLS RecommendAction calls spread evenly over LOAD_SECONDS."""
    try:
        with grpc.insecure_channel(target) as ch:
            call = stub(ch).RecommendAction
            start = time.monotonic()
            for i in range(CALLS):
                delay = start + i * LOAD_SECONDS / CALLS - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                call(request(seed=i % 16), timeout=5)
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def test_prometheus_scrapes_the_decisions_the_server_made(prometheus: Prometheus, live: ServerThread) -> None:
    up = f'up{{job="{JOB}"}}'
    decided = f'sum(shopping_agent_decisions_total{{job="{JOB}"}})'

    # The target is scraped (and reads 0 decisions) before the load starts.
    assert _eventually(lambda: prometheus.query(up) == 1 or None, 30, "the first scrape", prometheus)
    assert _eventually(lambda: prometheus.query(decided), 10, "the decision counter", prometheus) == 0

    errors: list[BaseException] = []
    loader = threading.Thread(target=_load, args=(live.target, errors), name="load")
    started = time.time()
    loader.start()
    loader.join(60)
    finished = time.time()
    assert not loader.is_alive() and errors == [], errors

    # Once a scrape after the last call is in, Prometheus's sum is exactly the calls made.
    _eventually(lambda: prometheus.query(decided) == CALLS or None, 30, f"{decided} == {CALLS}", prometheus)
    assert prometheus.query(up) == 1

    # The rate over the last seconds of the load reads the rate the calls were made at. The
    # window ends at the load's end and is shorter than the load, so it is full of load.
    window = 3
    made = CALLS / (finished - started)
    rate = prometheus.query(f'sum(rate(shopping_agent_decisions_total{{job="{JOB}"}}[{window}s]))', at=finished)
    assert rate is not None and made / 3 < rate < made * 3, (rate, made)

    # The alert rules load into a real Prometheus and evaluate without error on live data.
    def rules_evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prometheus.get("/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None

    rules = _eventually(rules_evaluated, 10, "the alert rules to be evaluated", prometheus)
    assert {r["name"]: r["health"] for r in rules} == {name: "ok" for name in _alert_names()}
    # The target up (under the job name the ServiceMonitor gives it): the alerts for a dead service stay inactive.
    state = {r["name"]: r["state"] for r in rules}
    assert (state["ShoppingAgentDown"], state["ShoppingAgentTargetDown"]) == ("inactive", "inactive")
