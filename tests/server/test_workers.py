"""Several worker processes on one port (SO_REUSEPORT) report as one metrics target and drain together."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Spawned, request, spawn_server, stub


def _logged(spawned: Spawned, msg: str, timeout: float = 20) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = []
        for line in list(spawned.lines):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        found = [e for e in entries if e.get("msg") == msg]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"never logged {msg!r}: {''.join(spawned.lines)}")


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_two_workers_share_the_port_and_report_as_one_target() -> None:
    with spawn_server("--workers", "2") as spawned:
        metrics_port = int(_logged(spawned, "metrics endpoint")[0]["port"])  # type: ignore[call-overload]
        deadline = time.monotonic() + 20
        while len(_logged(spawned, "serving")) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        calls = 0
        for _ in range(12):  # a connection per channel: the kernel spreads them over the workers
            with grpc.insecure_channel(spawned.target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                for _ in range(5):
                    assert stub(ch).RecommendAction(request(), timeout=5).decision_id
                    calls += 1
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        decided = sum(v for _, v in _samples(text, "shopping_agent_decisions_total"))
        started = sum(v for labels, v in _samples(text, "grpc_server_started_total") if labels["grpc_method"] == "RecommendAction")
        assert decided == calls and started == calls
        pids = {labels["pid"] for labels, _ in _samples(text, "shopping_agent_model_info")}
        assert len(pids) == 2  # both workers loaded a model and report through the parent
        assert [v for _, v in _samples(text, "shopping_agent_model_loaded")] == [1.0]
        (age,) = [v for _, v in _samples(text, "shopping_agent_model_age_seconds")]
        (created,) = [v for _, v in _samples(text, "shopping_agent_model_created_timestamp_seconds")]
        assert age == pytest.approx(time.time() - created, abs=30)
        spawned.proc.send_signal(signal.SIGTERM)
        assert spawned.proc.wait(timeout=20) == 0
    stopped = _logged(spawned, "workers stopped")[0]
    assert set(stopped["exit_codes"].values()) == {0}  # type: ignore[union-attr]
