"""Where the test suite's time goes: a pytest plugin that records each test's span and the garbage collector's time in
every process that runs tests, and a summary of what it wrote.

    .venv/bin/python -m pytest -p bench.suite_time --suite-time-dir=/tmp/suite-time
    .venv/bin/python -m bench.suite_time /tmp/suite-time [--top 20] [--json]

Under pytest-xdist each worker writes its own file (the controller runs no test and writes none). The summary gives the
work (the sum of the tests' spans: setup, call and teardown), the wall time from the first test's start to the last
one's end, how long each worker sat idle at the end while another still ran (what ordering could win back), the
collector's share, and the work by directory, by module and by test. Write the option with ``=``: pytest looks for its
configuration before it loads this plugin, so it takes an existing directory after a space for a test path, and with no
other test path the run is rooted at that directory or a parent of it, without the repository's settings (one process,
not ``-n auto``). The plugin refuses the spaced form whenever the directory exists, whatever it led to. The suite's own
wall time (pytest's last line) adds start-up and collection, which no test's span holds. A directory may keep earlier
runs' files: the summary reads the run that ended last. Two caveats: a span is wall time on a shared machine, and a
test's subprocesses (a server, a rebuild) run inside it on other cores, so the work is not one core's time; and the
collector's time is the test processes' own (their subprocesses' is not counted), over the whole process, start-up
included, so its share is rough.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import pytest


class Recorder:
    """One test process's record: each test's start and end (``time.time()``, comparable across the processes of one
    machine) and the time spent in collections, by generation. ``run`` names the pytest run (xdist's controller makes
    it and hands it to its workers), so records of earlier runs left in the directory are told apart."""

    def __init__(self, out: Path, worker: str, run: str) -> None:
        self.out, self.worker, self.run = out, worker, run
        self.tests: list[list[Any]] = []
        self.gc_s, self.gc_runs, self._gc_start = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        generation = info["generation"]
        self.gc_s[generation] += time.perf_counter() - self._gc_start
        self.gc_runs[generation] += 1

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:  # xdist's controller, once per worker it starts
        node.workerinput[RUN_KEY] = self.run

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        start = time.time()  # the process that runs the test: xdist's controller only relays its reports
        try:
            return (yield)
        finally:
            self.tests.append([item.nodeid, start, time.time()])

    @pytest.hookimpl
    def pytest_sessionfinish(self) -> None:
        if not self.tests:  # xdist's controller: its workers ran the tests
            return
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"run": self.run, "worker": self.worker, "pid": os.getpid(), "tests": self.tests, "gc_s": self.gc_s,
                  "gc_runs": self.gc_runs}
        (self.out / f"{self.run}-{self.worker}-{os.getpid()}.json").write_text(json.dumps(record))

    @pytest.hookimpl
    def pytest_unconfigure(self) -> None:
        gc.callbacks.remove(self._gc)


RUN_KEY = "suite_time_run"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-time-dir", default=None,
                     help="bench.suite_time: write each test process's spans here (write --suite-time-dir=DIR)")


def dir_after_a_space(config: pytest.Config) -> str | None:
    """The value of ``--suite-time-dir`` given as a word of its own (in ``PYTEST_ADDOPTS`` or on the command line) when it
    names an existing path, else None."""
    words = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *config.invocation_params.args]
    for flag, value in itertools.pairwise(words):
        if flag == "--suite-time-dir" and (config.invocation_params.dir / value).exists():
            return value
    return None


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--suite-time-dir")
    if not out:
        return
    workerinput = getattr(config, "workerinput", None)  # set in xdist's workers only
    if workerinput is not None:  # (not checked again here: a worker replaced late may find DIR made by then)
        worker, run = workerinput["workerid"], workerinput.get(RUN_KEY, "unnamed")
    else:
        spaced = dir_after_a_space(config)
        if spaced is not None:
            # pytest looks for its configuration before it loads this plugin, so it took the existing DIR for a test path:
            # with no other path the run is rooted at DIR or a parent of it, without the repository's pyproject (one process
            # instead of -n auto, warnings not errors), and timing such a run misleads. Refused, whatever it led to.
            raise pytest.UsageError(f"--suite-time-dir {spaced}: an existing directory after a space is a test path to "
                                    f"pytest when it looks for its configuration, so the run may go without the repository's "
                                    f"settings (pyproject's -n auto); write --suite-time-dir={spaced}")
        worker, run = "main", f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    config.pluginmanager.register(Recorder(Path(out).resolve(), worker, run), "suite-time-recorder")


def latest_run(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run that ended last (a directory may hold earlier runs' too)."""
    if not records:
        return []
    last = max(records, key=lambda r: max(e for _, _, e in r["tests"]))["run"]  # the run of the last test to end
    return [r for r in records if r["run"] == last]


def summary(records: Sequence[dict[str, Any]], top: int = 20) -> dict[str, Any]:
    """What the records of one run say (see the module doc); times in seconds."""
    if not records:
        raise ValueError("no records: was the suite run with -p bench.suite_time --suite-time-dir=DIR?")
    spans = [(r["worker"], name, start, end) for r in records for name, start, end in r["tests"]]
    first, last = min(s for _, _, s, _ in spans), max(e for _, _, _, e in spans)
    by_dir: collections.Counter[str] = collections.Counter()
    by_module: collections.Counter[str] = collections.Counter()
    for _, name, start, end in spans:
        module = name.split("::")[0]
        by_module[module] += end - start
        by_dir["/".join(module.split("/")[:2])] += end - start
    workers = []
    for r in sorted(records, key=lambda r: (len(r["worker"]), r["worker"], r["pid"])):
        ends = [e for _, _, e in r["tests"]]
        workers.append({"worker": r["worker"], "pid": r["pid"], "tests": len(r["tests"]),
                        "busy_s": round(sum(e - s for _, s, e in r["tests"]), 1), "idle_at_end_s": round(last - max(ends), 1),
                        "gc_s": round(sum(r["gc_s"]), 1), "gc_runs": r["gc_runs"]})
    work = sum(e - s for _, _, s, e in spans)
    gc_s = sum(sum(r["gc_s"]) for r in records)
    slowest = sorted(spans, key=lambda t: t[3] - t[2], reverse=True)[:top]
    return {"tests": len(spans), "work_s": round(work, 1), "wall_s": round(last - first, 1),
            "parallelism": round(work / (last - first), 2) if last > first else None,
            "gc_s": round(gc_s, 1), "gc_share": round(gc_s / work, 3) if work else None, "workers": workers,
            "by_directory": [[k, round(v, 1)] for k, v in by_dir.most_common()],
            "by_module": [[k, round(v, 1)] for k, v in by_module.most_common(top)],
            "slowest": [{"test": name, "worker": worker, "s": round(end - start, 1), "started_at_s": round(start - first, 1)}
                        for worker, name, start, end in slowest]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the --suite-time-dir of one run")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    found = [json.loads(p.read_text()) for p in sorted(args.directory.glob("*.json"))]
    records = latest_run(found)
    try:
        result = summary(records, args.top)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    result["records_of_earlier_runs_ignored"] = len(found) - len(records)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['tests']} tests: {result['work_s']} s of work in {result['wall_s']} s ({result['parallelism']} at once); "
          f"garbage collection {result['gc_s']} s ({result['gc_share']:.1%})")
    if result["records_of_earlier_runs_ignored"]:
        print(f"  ({result['records_of_earlier_runs_ignored']} records of earlier runs in {args.directory} ignored)")
    for w in result["workers"]:
        print(f"  {w['worker']}: {w['tests']} tests, busy {w['busy_s']} s, idle at the end {w['idle_at_end_s']} s, gc {w['gc_s']} s")
    print("by directory:", ", ".join(f"{k} {v}" for k, v in result["by_directory"][:8]))
    for t in result["slowest"]:
        print(f"  {t['s']:7.1f} s  at {t['started_at_s']:6.1f} s on {t['worker']}  {t['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
