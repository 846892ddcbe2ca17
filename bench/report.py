"""What every bench writes: the ``--json`` flag, the results header (when, command, machine), the file."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from bench.procs import REPO


def add_json_flag(parser: argparse.ArgumentParser, default_name: str) -> None:
    """``--json [PATH]``: also write the results, by default to ``bench/results/<default_name>``."""
    parser.add_argument("--json", nargs="?", type=Path, const=REPO / "bench" / "results" / default_name, default=None,
                        metavar="PATH", help=f"also write the results as JSON (default path bench/results/{default_name})")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``AMD EPYC``, ``Intel(R) Xeon(R) ...``): the same command's figures differ by kind of CPU
    (the MLServer peer gained most on an AMD EPYC), so a run must say which it ran on. ``platform.processor()`` where
    there is no ``/proc/cpuinfo``."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def header(module: str, started: float, argv: Sequence[str] | None, **machine: Any) -> dict[str, Any]:
    """When, the command that reproduces the run, its wall time, and the machine (plus ``machine`` extras)."""
    return {
        "when": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "-m", module, *(sys.argv[1:] if argv is None else argv)]),
        "wall_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version(), **machine},
    }


INFO_NAME = "bench-info.json"  # beside generated logs a bench keeps: what generated them


def kept_logs(root: Path, generate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What generated the logs under ``root`` (its ``INFO_NAME``), calling ``generate`` first when they are not there yet;
    the info is written only after ``generate`` returns, so a run cut short generates again."""
    info_path = root / INFO_NAME
    if info_path.exists():
        return dict(json.loads(info_path.read_text()))
    info = generate()
    info_path.write_text(json.dumps(info) + "\n")
    return info


def write_results(path: Path, results: dict[str, Any]) -> None:
    text = json.dumps(results, indent=2, default=float) + "\n"
    written(path, lambda f: f.write(text.encode()))
    print(f"\nresults: {path}")


def written(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``path`` replaced whole or not at all: ``write`` fills a temporary file of its own name beside it, which is renamed
    into place, or removed if writing fails; two processes writing the same path never share one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
