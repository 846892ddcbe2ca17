"""Several worker processes on one port (SO_REUSEPORT) report as one metrics target and drain together."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from server import owned_dirs, supervised, transport, workers
from tests.clock import ManualClock
from tests.harness import Spawned, make_config, request, running, spawn_server, stub, threads_gone


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
    assert set(stopped["exit_codes"].values()) == {0}  # type: ignore[attr-defined]


def _wait_serving(spawned: Spawned, count: int = 2, timeout: float = 20) -> list[int]:
    """The worker pids, once every worker serves."""
    deadline = time.monotonic() + timeout
    while len(_logged(spawned, "serving")) < count:
        assert time.monotonic() < deadline, "".join(spawned.lines)
        time.sleep(0.05)
    pids = _logged(spawned, "workers started")[0]["pids"]
    assert isinstance(pids, list) and len(pids) == count
    return [int(pid) for pid in pids]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_exiting_on_its_own_takes_the_pod_down() -> None:
    with spawn_server("--workers", "2", "--metrics-port", "") as spawned:
        first, second = _wait_serving(spawned)
        os.kill(first, signal.SIGTERM)  # it drains and exits 0, but nobody asked the pod to stop
        assert spawned.proc.wait(timeout=20) == 1
    (own,) = _logged(spawned, "a worker exited on its own; stopping the others")
    assert own["pid"] == first and own["code"] == 0
    stopped = _logged(spawned, "workers stopped")[0]
    assert stopped["exit_codes"] == {str(first): 0, str(second): 0}  # the other one was stopped and drained
    assert stopped["exited_on_their_own"] == [first]
    assert not _alive(second)


def test_a_worker_stuck_in_drain_is_killed_after_the_grace() -> None:
    with spawn_server("--workers", "2", "--metrics-port", "", "--grace-seconds", "0", "--drain-delay-seconds", "0") as spawned:
        stuck, other = _wait_serving(spawned)
        os.kill(stuck, signal.SIGSTOP)  # cannot handle the forwarded SIGTERM: only SIGKILL ends it
        try:
            started = time.monotonic()
            spawned.proc.send_signal(signal.SIGTERM)
            assert spawned.proc.wait(timeout=20) == 1
            assert workers.KILL_MARGIN_SECONDS - 1 <= time.monotonic() - started < workers.KILL_MARGIN_SECONDS + 5
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)
    (killing,) = _logged(spawned, "workers did not stop in time; killing them")
    assert killing["pids"] == [stuck]
    stopped = _logged(spawned, "workers stopped")[0]
    assert stopped["exit_codes"] == {str(stuck): -signal.SIGKILL, str(other): 0}
    assert not _alive(stuck)


def test_a_worker_whose_event_loop_stops_is_killed_and_takes_the_pod_down() -> None:
    """The probes reach one worker of several at random, so a hung one passed liveness (an SRE review): its heartbeat
    stops, and the supervisor kills it after --worker-stall-seconds. Beating workers outlive that time untouched."""
    with spawn_server("--workers", "2", "--metrics-port", "", "--worker-stall-seconds", "3") as spawned:
        hung, other = _wait_serving(spawned)
        time.sleep(4)  # longer than the stall time: beating workers are left alone
        assert spawned.proc.poll() is None and _alive(hung) and _alive(other)
        os.kill(hung, signal.SIGSTOP)  # what a hung event loop looks like from outside: no beat, no answer
        try:
            started = time.monotonic()
            assert spawned.proc.wait(timeout=20) == 1
            assert 2 <= time.monotonic() - started < 12  # the last beat came up to a second before the stop
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
    (killing,) = _logged(spawned, "a worker's event loop has not run for too long (hung or stopped); killing it")
    assert killing["pid"] == hung and killing["silent_s"] >= 3
    stopped = _logged(spawned, "workers stopped")[0]
    assert stopped["exit_codes"] == {str(hung): -signal.SIGKILL, str(other): 0}  # the other one drained
    assert not _alive(hung) and not _alive(other)


def test_heartbeats_report_a_silent_worker_but_not_a_pause_they_shared_with_the_supervisor() -> None:
    """Real pipes, a stepped clock: a worker that stops writing is reported once silent past the stall time; a gap in
    the supervisor's own looks (the whole pod paused, a review killed both workers so) starts every worker afresh."""
    clock = ManualClock()
    beats = supervised.Heartbeats(3.0, clock)
    (r1, w1), (r2, w2) = beats.pipe(), beats.pipe()
    beats.watch(1, r1)
    beats.watch(2, r2)
    try:
        for _ in range(12):  # 6 s of looks every 0.5 s: worker 1 writes throughout, worker 2 never
            clock.now += 0.5
            os.write(w1, b".")
            late = beats.silent([1, 2])
            assert [pid for pid, _ in late] == ([2] if clock.now > 3.0 else [])
        clock.now += 10.0  # the supervisor did not look for 10 s: the pod was paused, workers and all
        assert beats.silent([1, 2]) == []
        clock.now += 3.5  # then worker 1 writes again and worker 2 stays silent past the stall time
        os.write(w1, b".")
        assert beats.silent([1, 2]) == []  # (a look after 3.5 s is a pause too: 3.5 > 3.0 / 2)
        for _ in range(8):
            clock.now += 0.5
            os.write(w1, b".")
            late = beats.silent([1, 2])
        assert [pid for pid, _ in late] == [2] and late[0][1] == pytest.approx(4.0)
        assert beats.silent([1]) == []  # only running workers are judged
    finally:
        beats.close()
        os.close(w1)
        os.close(w2)
    assert _closed(r1) and _closed(r2)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_workers_left_by_a_killed_supervisor_drain_and_free_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGKILL forwards nothing: before server.supervised the workers kept serving on the port, and a new supervisor
    # found it held and refused to start
    # and it cannot remove its metrics directory: the next supervisor does, once no worker of the dead one runs
    with spawn_server("--workers", "2", "--metrics-port", "", "--grace-seconds", "1", "--drain-delay-seconds", "2") as spawned:
        pids = _wait_serving(spawned)
        metrics_dir = Path(str(_logged(spawned, "workers started")[0]["metrics_dir"]))
        try:
            spawned.proc.kill()
            spawned.proc.wait(timeout=10)
            assert metrics_dir not in owned_dirs.sweep_abandoned(workers.METRICS_DIR_PREFIX, metrics_dir.parent)
            assert any(map(running, pids)) and metrics_dir.is_dir()  # the workers, still draining, hold its lock
            deadline = time.monotonic() + supervised.POLL_SECONDS + 15
            while any(map(running, pids)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(map(running, pids)), "".join(spawned.lines)
            transport.check_port_free("127.0.0.1", spawned.port)  # raises while anything listens there
            while not all(map(threads_gone, pids)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(map(threads_gone, pids)), "".join(spawned.lines)
            monkeypatch.setattr("tempfile.tempdir", str(metrics_dir.parent))  # the next supervisor's temp dir
            following = workers.prepare_multiproc_dir(make_config(workers=2))
            assert not metrics_dir.exists() and following.path.is_dir() and following.path != metrics_dir
            following.cleanup()
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        gone = _logged(spawned, "the supervisor is gone; stopping this worker")
    assert len(gone) == 2 and {e["supervisor_pid"] for e in gone} == {spawned.proc.pid}
    assert len(_logged(spawned, "stopped")) == 2  # each drained as on a signal


def _metric_file(path: Path, family: str, name: str, labels: dict[str, str], help_text: str, value: float) -> None:
    """One sample in a metric file of a worker, as prometheus_client's multiprocess mode writes it."""
    db = MmapedDict(str(path))  # type: ignore[no-untyped-call]
    db.write_value(mmap_key(family, name, list(labels), list(labels.values()), help_text), value, 0.0)  # type: ignore[no-untyped-call]
    db.close()  # type: ignore[no-untyped-call]


def _stale_counter(path: Path, value: float) -> None:
    """A previous run's counter file for 'shopping_agent_decisions_total'."""
    _metric_file(path, "shopping_agent_decisions", "shopping_agent_decisions_total", {"action": "none", "source": "policy"},
                 "Decisions served, by action and source.", value)


def test_a_sweep_that_fails_is_logged_and_the_supervisor_still_gets_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Stubbed: the real sweep catches OSError per directory and, run as root here, no permission stops its glob, so
    # nothing on this machine makes it raise; the supervisor's handling of a sweep that does is what is tested.
    def fails(prefix: str) -> list[Path]:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(workers, "sweep_abandoned", fails)
    with caplog.at_level("WARNING", logger="server.workers"):
        mp_dir = workers.prepare_multiproc_dir(make_config(workers=2))
    try:
        assert mp_dir.path.parent == tmp_path and mp_dir.path.is_dir() and mp_dir.inherited()
        assert [r.getMessage() for r in caplog.records] == ["could not sweep abandoned metrics directories"]
    finally:
        mp_dir.cleanup()
    assert not mp_dir.path.exists()


def test_a_configured_metrics_dir_keeps_other_files_and_loses_stale_counters(tmp_path: Path) -> None:
    mp_dir = tmp_path / "metrics"
    mp_dir.mkdir()
    (mp_dir / "keep.txt").write_text("not prometheus_client's\n")
    stale = mp_dir / "counter_999999.db"
    _stale_counter(stale, 1000)
    registry = CollectorRegistry()
    registry.register(MultiProcessCollector(registry=None, path=str(mp_dir)))  # type: ignore[no-untyped-call]
    assert registry.get_sample_value("shopping_agent_decisions_total", {"action": "none", "source": "policy"}) == 1000

    with spawn_server("--workers", "2", "--metrics-multiproc-dir", str(mp_dir)) as spawned:
        metrics_port = int(_logged(spawned, "metrics endpoint")[0]["port"])  # type: ignore[call-overload]
        _wait_serving(spawned)
        assert not stale.exists()
        with grpc.insecure_channel(spawned.target) as ch:
            assert stub(ch).RecommendAction(request(), timeout=5).decision_id
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert sum(v for _, v in _samples(text, "shopping_agent_decisions_total")) == 1
        spawned.proc.send_signal(signal.SIGTERM)
        assert spawned.proc.wait(timeout=20) == 0
    assert mp_dir.is_dir()
    assert sorted(p.name for p in mp_dir.iterdir()) == ["keep.txt"]
    assert (mp_dir / "keep.txt").read_text() == "not prometheus_client's\n"


def test_a_signal_while_workers_start_stops_the_ones_started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(args: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        # Were the handler not installed yet, the SIGTERM below would kill this test run.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        child = real_popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env, pass_fds=pass_fds)
        started.append(child)
        signal.raise_signal(signal.SIGTERM)  # the pod is stopped while its workers start
        return child

    monkeypatch.setattr(subprocess, "Popen", popen)  # as server.workers sees it
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # its metrics directory, and its sweep, away from /tmp
    assert workers.run_workers(make_config(workers=3), os.environ) == 0
    assert len(started) == 1  # no worker started after the signal
    assert started[0].returncode == -signal.SIGTERM  # the forwarded signal reached the one started


def test_a_set_up_that_cannot_be_had_is_one_line_and_exit_2_before_any_worker(tmp_path: Path) -> None:
    """A port a stale server holds with SO_REUSEPORT (every worker binds so, and would have shared it unseen), a taken
    health or metrics port, a metrics directory under a file: refused by the supervisor in one line naming the flag,
    exit 2, no worker started, as a single process refuses them."""
    import socket

    (tmp_path / "afile").write_text("not a directory")
    with socket.socket() as stale, socket.socket() as taken:
        stale.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held, busy = str(stale.getsockname()[1]), str(taken.getsockname()[1])
        cases = {"--port": ["--port", held], "--health-port": ["--health-port", busy], "--metrics-port": ["--metrics-port", busy],
                 "--metrics-multiproc-dir": ["--metrics-multiproc-dir", str(tmp_path / "afile" / "mp")]}
        for flag, args in cases.items():
            out = subprocess.run([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--workers", "2",
                                  "--log-format", "text", *(["--port", "0"] if flag != "--port" else []), *args],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 2, (flag, out.stderr[-2000:])
            assert "Traceback" not in out.stderr and "workers started" not in out.stderr, out.stderr[-2000:]
            assert flag in out.stderr.splitlines()[-1], (flag, out.stderr[-2000:])


def test_the_exit_code_forgives_only_the_signal_the_supervisor_forwarded(tmp_path: Path) -> None:
    """After SIGTERM, a worker ended by that SIGTERM (before its handlers were in) is no failure; one that exited 1 or
    crashed (SIGSEGV) while draining is, and so is any non-zero exit without a signal asked for."""
    def code(requested: list[int], codes: dict[int, int]) -> int:
        sup = workers._Supervisor(make_config(), workers.MultiprocDir(tmp_path, temporary=False))
        sup.requested.extend(requested)
        sup.codes.update(codes)
        return sup.exit_code()

    term = [signal.SIGTERM]
    assert code(term, {1: -signal.SIGTERM, 2: 0}) == 0
    assert code(term, {1: 1, 2: 0}) == 1
    assert code(term, {1: -signal.SIGSEGV, 2: 0}) == 1
    assert code([], {1: -signal.SIGTERM, 2: 0}) == 1


def test_the_pods_model_age_is_its_oldest_workers(tmp_path: Path) -> None:
    """During a swap the workers serve bundles of different ages; the pod's age is the oldest one still served. Two
    workers' gauge files, as prometheus_client writes them, read by the real multiprocess collector."""
    from server.metrics import Metrics, ModelAgeCollector

    mode = Metrics(CollectorRegistry()).model_created._multiprocess_mode  # how the workers' files combine
    name = "shopping_agent_model_created_timestamp_seconds"
    for pid, created in ((1, time.time() - 3600.0), (2, time.time() - 60.0)):
        _metric_file(tmp_path / f"gauge_{mode}_{pid}.db", name, name, {},
                     "The served bundle's created_at (Unix time); its age is time() minus this.", created)
    (age,) = list(ModelAgeCollector(MultiProcessCollector(None, path=str(tmp_path))).collect())
    assert age.samples[0].value == pytest.approx(3600.0, abs=5.0)
