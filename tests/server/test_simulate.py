"""``shopping-agent simulate``: in-process and over gRPC, scored from the real logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from experience.records import OUTCOME, hash_id
from experience.returns import mean_return, session_returns
from experience.salt import read_salt, resolve_salt
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from tests.harness import ROOT, running_server, spawn_server, until
from tests.small_disk import SmallDisk
from weights.embedded import DEFAULT_MODEL_VERSION

CLI = [sys.executable, "-m", "server", "simulate"]


def simulate(*args: str, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    run = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert run.stdout, run.stderr
    return run.returncode, json.loads(run.stdout)


def logged_value(root: Path) -> tuple[float, int]:
    source = DirectorySource(root)
    value = mean_return(session_returns(build_episodes(source.table("decisions"), source.table("outcomes"))))
    return value.mean, value.n


def trace_ids(path: Path, kind: str) -> set[str]:
    return {entry["id"] for entry in map(json.loads, path.read_text().splitlines()) if entry["kind"] == kind}


def test_in_process_is_reproducible_and_batch_independent() -> None:
    code, first = simulate("--sessions", "300", "--seed", "11")
    assert code == 0
    _, again = simulate("--sessions", "300", "--seed", "11", "--batch", "7")
    _, other = simulate("--sessions", "300", "--seed", "12")
    keys = ("sessions", "decisions", "outcomes", "mean_return", "ci_low", "ci_high", "sources")
    assert {k: first[k] for k in keys} == {k: again[k] for k in keys}
    assert first["mean_return"] != other["mean_return"]
    assert first["sessions"] == 300 and first["ci_low"] <= first["mean_return"] <= first["ci_high"]
    assert first["model_versions"] == [DEFAULT_MODEL_VERSION]


def test_in_process_logs_score_the_same(tmp_path: Path) -> None:
    code, result = simulate("--sessions", "200", "--seed", "5", "--log-dir", str(tmp_path), "--trace", str(tmp_path / "t.jsonl"))
    assert code == 0
    assert result["logs_written"] == {"decisions": result["decisions"], "outcomes": result["outcomes"],
                                      "engagements": result["engagements"], "products": 0}  # the driver offers no products
    assert result["engagements"] == result["decisions"]  # one report per page view
    value, n = logged_value(tmp_path)
    assert n == 200 and value == pytest.approx(result["mean_return"], rel=1e-12)
    logged = set(DirectorySource(tmp_path).table("decisions").column("decision_id").to_pylist())
    assert trace_ids(tmp_path / "t.jsonl", "decision") == logged


def test_in_process_products_are_offered_reported_and_logged(tmp_path: Path) -> None:
    """--products: every page offers one product (the rules here: the embedded default has no heads); the shopper's
    reactions are reported against the product decision, which is logged, and the run is reproducible."""
    code, result = simulate("--sessions", "150", "--seed", "5", "--products", "--log-dir", str(tmp_path))
    assert code == 0 and result["products"] == result["decisions"] == result["logs_written"]["products"]
    assert set(result["product_sources"]) == {"fallback_no_model"} and sum(result["product_sources"].values()) == 3 * result["products"]
    _, again = simulate("--sessions", "150", "--seed", "5", "--products")
    _, plain = simulate("--sessions", "150", "--seed", "5")
    assert again["objective_per_session"] == result["objective_per_session"] != plain["objective_per_session"]
    source = DirectorySource(tmp_path)
    offered = set(source.table("products").column("decision_id").to_pylist())
    outcomes = source.table("outcomes").to_pylist()
    taken = [o for o in outcomes if o["decision_id"] in offered]
    assert taken and {o["outcome"] for o in taken} <= {1, 6}  # ADD_TO_CART, COMPLAINT: the offer's reactions
    assert not offered & set(source.table("decisions").column("decision_id").to_pylist())  # ids of their own


def test_over_grpc_the_server_logs_what_was_served(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with running_server(log_dir=logs) as live:
        code, result = simulate("--target", live.target, "--sessions", "40", "--seed", "3", "--concurrency", "4",
                                "--trace", str(tmp_path / "t.jsonl"))
    assert code == 0 and not result["interrupted"] and result["error"] is None
    assert result["sessions"] == 40 and result["outcomes_logged"] == result["outcomes_acknowledged"] == result["outcomes"]
    # every page view's engagement went over the wire too, and into the logs, joined to the decision it names
    assert result["engagements_logged"] == result["engagements_acknowledged"] == result["engagements"] == result["decisions"]
    engaged = DirectorySource(logs).table("engagements")
    assert set(engaged.column("decision_id").to_pylist()) == set(DirectorySource(logs).table("decisions").column("decision_id").to_pylist())
    value, n = logged_value(logs)
    assert n == 40 and value == pytest.approx(result["mean_return"], rel=1e-12)  # the trainer's view of the same sessions
    table = DirectorySource(logs).table("decisions")
    assert trace_ids(tmp_path / "t.jsonl", "decision") == set(table.column("decision_id").to_pylist())


def test_sigterm_mid_simulation_every_answer_is_logged(tmp_path: Path) -> None:
    logs, trace = tmp_path / "logs", tmp_path / "trace.jsonl"
    with spawn_server("--log-dir", str(logs), "--grace-seconds", "5") as server:
        sim = subprocess.Popen([*CLI, "--target", server.target, "--sessions", "100000", "--seed", "9", "--json",
                                "--trace", str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (not trace.exists() or len(trace.read_text().splitlines()) < 300):
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(20) == 0
            out, err = sim.communicate(timeout=60)
        finally:
            if sim.poll() is None:
                sim.kill()
                sim.communicate()
    assert sim.returncode == 1, err
    result = json.loads(out)
    assert result["interrupted"] and result["error"]
    source = DirectorySource(logs)
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    answered, acknowledged = trace_ids(trace, "decision"), trace_ids(trace, "outcome")
    assert len(answered) == result["decisions_answered"] >= 100
    assert answered <= set(decisions.column("decision_id").to_pylist())
    key = read_salt(logs)  # the server's, kept next to its logs (no salt configured); outcome ids are logged hashed
    assert key is not None and {hash_id(o, key, OUTCOME) for o in acknowledged} <= set(outcomes.column("outcome_id").to_pylist())


def test_sigterm_in_process_closes_the_logs_it_wrote(tmp_path: Path) -> None:
    """SIGTERM (a deleted pod, ``timeout``) ends an in-process run as Ctrl-C does: the recorder closes its segments on
    the way out, so everything written is readable at once; the default action left them open and hidden."""
    logs = tmp_path / "logs"
    sim = subprocess.Popen([*CLI, "--sessions", "1000000", "--log-dir", str(logs), "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        until(lambda: any((logs / "decisions").glob("*.arrows")), "the run's first decision segment", timeout=60)
        time.sleep(1.0)
        sim.send_signal(signal.SIGTERM)
        _, err = sim.communicate(timeout=60)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.communicate()
    assert sim.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "shopping-agent simulate: stopped by SIGTERM" in err and "Traceback" not in err
    assert not list(logs.rglob(".open-*")), "segments left open"
    source = DirectorySource(logs)
    assert source.table("decisions").num_rows > 0 and source.table("outcomes").num_rows > 0


def test_one_session_has_no_interval_and_says_so_in_json() -> None:
    """The interval of one session is undefined: null in the JSON, where NaN made the run exit 1 with no output."""
    code, result = simulate("--sessions", "1", "--trace", "/dev/null")  # an existing file it may write: taken
    assert code == 0 and result["sessions"] == 1 and isinstance(result["mean_return"], float)
    assert result["ci_low"] is None and result["ci_high"] is None and result["stderr"] is None


def test_a_log_dir_that_cannot_be_made_is_bad_usage(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    run = subprocess.run([*CLI, "--sessions", "5", "--log-dir", str(tmp_path / "afile" / "logs")], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--log-dir" in run.stderr and "cannot be created or written: Not a directory" in run.stderr


def test_records_dropped_on_a_full_volume_fail_the_run(small_disk: SmallDisk) -> None:
    """The run's purpose is its logs: a full volume (the salt already there) drops records, which the run counts and
    fails on (exit 1), where it exited 0 with every record lost."""
    logs = small_disk.path / "logs"
    resolve_salt(logs, "")
    small_disk.fill()
    code, result = simulate("--sessions", "300", "--log-dir", str(logs))
    assert code == 1 and result["logs_incomplete"] is True
    assert result["logs_dropped"]["decisions"] > 0 and result["logs_written"]["decisions"] < result["decisions_answered"]


@pytest.mark.parametrize(("args", "message"), [
    (["--sessions", "0"], "--sessions must be >= 1"),
    (["--target", "127.0.0.1:1", "--log-dir", "/tmp/x"], "--log-dir is for in-process runs"),
    (["--timezone", "Mars/Olympus"], "unknown IANA timezone"),
    (["--target", "127.0.0.1:1", "--products"], "--products is for in-process runs"),
    (["--trace", "/proc/nosuch/trace.jsonl"], "--trace /proc/nosuch/trace.jsonl: cannot be written"),
    (["--trace", "/tmp"], "--trace /tmp: cannot be written"),
    # an attack review (2026-12-07): 8192 dropped a batch's log records, a million took 4 GB to warm up for two sessions,
    # and a deadline of inf or nan was taken and every call failed (exit 1, as if the server had gone)
    (["--batch", "8192"], "--batch 1..4096"),
    (["--target", "127.0.0.1:1", "--deadline-ms", "inf"], "--deadline-ms a number of milliseconds in (0, 3600000]"),
    (["--target", "127.0.0.1:1", "--deadline-ms", "nan"], "--deadline-ms a number of milliseconds in (0, 3600000]"),
])
def test_bad_usage_exits_2(args: list[str], message: str) -> None:
    run = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and message in run.stderr
