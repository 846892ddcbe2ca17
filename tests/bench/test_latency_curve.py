"""The latency bench's arithmetic: percentiles read back from h2load's per-request log, and the targets it judges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.latency_curve import LOAD_FRACTIONS, combine, grpc_servers_of, hpa_load, judged, parse_args, plot, targets
from bench.loaders import h2load_log_percentiles


def test_percentiles_come_from_every_logged_request(tmp_path: Path) -> None:
    log = tmp_path / "h2.log"
    # h2load's columns: start µs since the epoch, HTTP status, µs to the end of the response
    log.write_text("".join(f"{1_700_000_000_000_000 + i}\t200\t{(i + 1) * 1000}\n" for i in range(100)) + "\n")
    got = h2load_log_percentiles(log)
    assert got["requests"] == 100
    assert (got["p50"], got["p90"], got["p99"], got["max"]) == (50.0, 90.0, 99.0, 100.0)  # nearest rank, in ms


def _server(rps: float, p50: float, p99: list[float], start: float = 0.3, rss: float = 100.0) -> dict[str, Any]:
    point = {"requests_per_s": rps, "p50_ms": p50, "p99_ms": p50 * 2}
    return {"closed": {"64": point, "128": point}, "few": {"1": point, "4": point},
            "open": [{"offered_per_s": 100.0 * f, "p50_ms": 1.0, "p99_ms": v} for f, v in zip(LOAD_FRACTIONS, p99, strict=True)],
            "closed_start_to_serving_s": start, "open_start_to_serving_s": start, "closed_rss_mb": rss, "open_rss_mb": rss}


def test_targets_are_ratios_within_the_run() -> None:
    bare = _server(1000.0, 1.0, [2.0, 2.0, 2.0, 2.0])
    good = targets({"bare": bare, "real": _server(850.0, 1.4, [3.0, 3.9, 3.9, 30.0]), "mlserver": _server(280.0, 9.0, [1.0] * 4)})
    assert all(goal["met"] for goal in good.values()), good
    assert abs(good["throughput_64_in_flight_over_mlserver"]["value"] - 850 / 280) < 1e-12
    bad = targets({"bare": bare, "real": _server(700.0, 2.0, [3.0, 5.0, 4.1, 60.0], start=1.2, rss=160.0),
                   "real_log_dir": _server(600.0, 2.0, [1.0] * 4),
                   "workers": {"workers": 2, "real": _server(1500.0, 1.0, [1.0] * 4), "bare": _server(2000.0, 1.0, [1.0] * 4)},
                   "mlserver": _server(250.0, 9.0, [1.0] * 4)})
    missed = {name for name, goal in bad.items() if not goal["met"]}
    assert missed == set(bad), {name: goal["value"] for name, goal in bad.items()}
    assert abs(bad["log_dir_throughput_cost"]["value"] - (1 - 600 / 700)) < 1e-12
    assert bad["workers_2_64_in_flight_over_2_bare"]["value"] == 0.75
    assert bad["throughput_128_in_flight_over_mlserver"]["value"] == 2.8  # 700 / 250, below 3
    assert "throughput_64_in_flight_over_mlserver" not in targets({"bare": bare, "real": _server(850.0, 1.4, [1.0] * 4)})


def test_the_grpc_servers_context_is_reported_not_judged() -> None:
    """The real server with one gRPC server, and the bare one with as many as the real server: ratios, no verdict."""
    bare = _server(1000.0, 1.0, [2.0] * 4)
    got = targets({"bare": bare, "real": _server(700.0, 1.4, [3.0] * 4), "real_one_server": _server(550.0, 1.0, [1.0] * 4),
                   "bare_same_servers": _server(1400.0, 1.0, [1.0] * 4)})
    assert got["real_one_server_64_in_flight_over_bare"] == {"value": 0.55, "target": "context", "met": None}
    assert got["throughput_128_in_flight_over_bare_same_servers"]["value"] == 0.5
    assert got["throughput_64_in_flight_over_bare"]["value"] == 0.7  # the target stays against the one-server bare process


def test_how_much_of_each_offered_load_was_delivered_is_context() -> None:
    """A load set from the closed loop's capacity can be past the open loop's: the least delivered share says so."""
    bare, real = _server(1000.0, 1.0, [2.0] * 4), _server(850.0, 1.4, [3.0, 3.9, 3.9, 30.0])
    assert "open_loop_least_delivered_over_offered" not in targets({"bare": bare, "real": real})  # no achieved rates: none
    for point, delivered in zip(real["open"], (1.0, 1.0, 0.99, 0.95), strict=True):
        point["requests_per_s"] = point["offered_per_s"] * delivered
    got = targets({"bare": bare, "real": real})["open_loop_least_delivered_over_offered"]
    assert got["target"] == "context" and got["met"] is None and abs(got["value"] - 0.95) < 1e-12


def test_the_plot_is_written_where_no_results_directory_exists_yet(tmp_path: Path) -> None:
    """A fresh checkout has no bench/results: the run's figures must not be lost to a missing directory."""
    pytest.importorskip("matplotlib")  # the bench extra; without it the plot is skipped with a message
    servers = {"bare": _server(1000.0, 1.0, [2.0, 2.0, 2.0, 2.0]), "real": _server(850.0, 1.4, [3.0, 3.9, 3.9, 30.0])}
    servers["real"]["open_one_connection"] = {"offered_per_s": 50.0, "p50_ms": 7.0, "p99_ms": 20.0}  # a marker of its own
    path = tmp_path / "not" / "yet" / "latency-curve.png"
    assert plot(servers, path) == path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bare_servers_count_is_read_as_serve_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOPPING_AGENT_GRPC_SERVERS", raising=False)
    assert grpc_servers_of([]) == 8
    assert grpc_servers_of(["--grpc-servers", "3"]) == grpc_servers_of(["--grpc-servers=3"]) == 3
    monkeypatch.setenv("SHOPPING_AGENT_GRPC_SERVERS", "5")  # the spawned server inherits the environment too
    assert grpc_servers_of([]) == 5 and grpc_servers_of(["--grpc-servers", "2"]) == 2


def test_the_one_connection_point_is_held_to_the_p99_targets() -> None:
    """Half the capacity on one connection: its p99 over bare's, and it counts toward the worst p99 below capacity."""
    bare, real = _server(1000.0, 1.0, [2.0] * 4), _server(850.0, 1.4, [3.0, 3.9, 3.9, 30.0])
    bare["open_one_connection"] = {"offered_per_s": 50.0, "p50_ms": 1.0, "p99_ms": 4.0}
    real["open_one_connection"] = {"offered_per_s": 50.0, "p50_ms": 7.0, "p99_ms": 55.0}
    got = targets({"bare": bare, "real": real})
    assert got["p99_open_50%_one_connection_over_bare"] == {"value": 13.75, "target": "<= 2.0", "met": False}
    assert got["worst_open_loop_p99_ms_below_capacity"]["value"] == 55.0 and not got["worst_open_loop_p99_ms_below_capacity"]["met"]
    real["open_one_connection"]["p99_ms"] = 7.9
    got = targets({"bare": bare, "real": real})
    assert got["p99_open_50%_one_connection_over_bare"]["met"] and got["worst_open_loop_p99_ms_below_capacity"]["value"] == 30.0


def _points(cores: list[float | None]) -> list[dict[str, Any]]:
    return [{"offered_per_s": 100.0 * f, "server_cores": c} for f, c in zip(LOAD_FRACTIONS, cores, strict=True)]


def test_the_autoscalers_load_is_read_off_the_cpu_between_the_points_that_straddle_it() -> None:
    """Offered 25 / 50 / 75 / 90 req/s; the CPU at each; the load at 0.7 of a core, linear between its neighbours."""
    assert hpa_load(_points([0.4, 0.6, 0.8, 0.95])) == pytest.approx(62.5)  # halfway from 0.6 (50) to 0.8 (75)
    assert hpa_load(_points([0.4, 0.7, 0.8, 0.95])) == pytest.approx(50.0)  # a point right at the target
    assert hpa_load(_points([0.875, 0.9, 0.95, 1.0])) == pytest.approx(20.0)  # (0, 0) to the first point: an idle server
    assert hpa_load(list(reversed(_points([0.4, 0.6, 0.8, 0.95])))) == pytest.approx(62.5)  # in any order
    assert hpa_load(_points([0.2, 0.3, 0.5, 0.6])) is None  # never reached: no such load among the measured ones
    assert hpa_load(_points([0.4, None, 0.8, 0.95])) is None  # a point without its CPU (older results)
    assert hpa_load(_points([0.4, 0.6, 0.8, 0.95]), cores=0.95) == pytest.approx(90.0)


def test_the_autoscalers_point_is_context_and_counts_toward_the_worst_p99() -> None:
    bare, real = _server(1000.0, 1.0, [2.0] * 4), _server(850.0, 1.4, [3.0, 3.9, 3.9, 30.0])
    assert not any("hpa" in name for name in targets({"bare": bare, "real": real}))  # not measured: not reported
    bare["open_at_hpa_target"] = {"offered_per_s": 60.0, "p50_ms": 1.0, "p99_ms": 4.0, "server_cores": 0.4}
    real["open_at_hpa_target"] = {"offered_per_s": 60.0, "p50_ms": 5.0, "p99_ms": 70.0, "server_cores": 0.71}
    got = targets({"bare": bare, "real": real})
    assert got["p99_open_at_hpa_target_ms"] == {"value": 70.0, "target": "context", "met": None}
    assert got["p99_open_at_hpa_target_over_bare"]["value"] == 17.5
    assert got["open_loop_at_hpa_target_offered_per_s"]["value"] == 60.0
    assert got["open_loop_at_hpa_target_server_cores"]["value"] == 0.71
    assert got["worst_open_loop_p99_ms_below_capacity"] == {"value": 70.0, "target": "<= 50", "met": False}


def test_rounds_are_judged_on_the_median_of_each_targets_values() -> None:
    bare = _server(1000.0, 1.0, [2.0] * 4)
    fast, slow = _server(900.0, 1.4, [3.0, 3.9, 3.9, 30.0]), _server(700.0, 1.4, [3.0, 3.9, 3.9, 30.0])
    peer = {"mlserver": _server(250.0, 9.0, [1.0] * 4)}
    rounds = [targets({"bare": bare, "real": fast, **peer}), targets({"bare": bare, "real": slow, **peer}),
              targets({"bare": bare, "real": fast})]  # MLServer missing from one round
    got = combine(rounds)
    assert list(got) == list(rounds[0])  # every target, in the order one round reports them
    throughput = got["throughput_64_in_flight_over_bare"]
    assert throughput["values"] == [0.9, 0.7, 0.9] and throughput["value"] == 0.9 and throughput["met"] is True
    assert got["throughput_64_in_flight_over_mlserver"]["values"] == [3.6, 2.8]  # only the rounds that ran it
    assert got["throughput_64_in_flight_over_mlserver"]["value"] == pytest.approx(3.2)
    assert got["throughput_64_in_flight_over_mlserver"]["met"] is True
    assert combine([rounds[1], rounds[1], rounds[0]])["throughput_64_in_flight_over_bare"]["met"] is False  # median 0.7
    assert got["rss_mb"]["met"] is True and got["rss_mb"]["target"] == "<= 150"
    with pytest.raises(ValueError, match="no rounds"):
        combine([])


def test_a_target_is_judged_as_its_text_reads() -> None:
    """One round's verdicts and the medians' go through the same reading of the target's text (``goal``)."""
    assert judged(0.8, ">= 0.8") is True and judged(0.7999, ">= 0.8") is False
    assert judged(50.0, "<= 50") is True and judged(50.1, "<= 50") is False and judged(2.0, "<= 2.0") is True
    assert judged(3.0, "context") is None
    with pytest.raises(ValueError, match="target"):
        judged(1.0, "== 1")


@pytest.mark.parametrize("rounds", ["0", "11"])
def test_rounds_out_of_range_are_refused(rounds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", rounds])
    assert "--rounds in [1, 10]" in capsys.readouterr().err
