"""Test helpers: a real server on a free loopback port, real stubs, request builders.

No fakes of our own code: ``running_server`` starts the real ``ShoppingAgentServer`` on its
own event loop in a thread, bound to 127.0.0.1 port 0; ``spawn_server`` starts the real
CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc
from server.app import ShoppingAgentServer
from server.config import Config

T = TypeVar("T")
FRESH_ARGS = (20261130, "default-init-20261130", "2026-11-30T00:00:00Z")
FAST_CYCLE: dict[str, Any] = {"updates": 2, "batch": 8192, "value_epochs": 2, "critic_epochs": 2, "guard": {"epochs": 2}, "bootstrap": 100}
"""A ``--config`` for the tests' trainer runs: two updates of one batch, short fits, a small bootstrap."""


def fresh_bundle_bytes() -> bytes:
    """An untrained bundle (what scripts/build_default_bundle.py starts from): what the trainer's tests improve on."""
    from weights.initial import make_bundle

    return make_bundle(*FRESH_ARGS)


def fresh_bundle() -> Any:
    from weights.bundle import read_bundle

    return read_bundle(fresh_bundle_bytes())


def variant_bytes(version: str, *, canary: float | None = None, only: str | None = None, lean: str | None = None) -> bytes:
    """The untrained bundle as another version: asking for ``canary`` of the sessions, and with ``only`` the one action
    its guardrails allow (``add_to_cart`` plays far better than the untrained policy, ``view_detail`` earns nothing);
    with ``lean`` the one they favour, the others weighted 0.05 (much the same play, but a bundle trained from it can
    still serve something else: one trained from ``only`` serves exactly what it does)."""
    import io

    from weights.bundle import PARTS, write_bundle

    base = fresh_bundle()
    manifest = {**base.manifest, "model_version": version}
    if canary is not None:
        manifest["canary"] = {"fraction": canary}
    if only is not None:
        manifest["guardrails"] = {"static": {key: float(key == only) for key in manifest["guardrails"]["static"]}, "rules": []}
    if lean is not None:
        static = manifest["guardrails"]["static"]
        manifest["guardrails"] = {"static": {key: 1.0 if key == lean else min(0.05, static[key]) for key in static}, "rules": []}
    out = io.BytesIO()
    write_bundle(out, manifest, {name: base.parts[name] for name in PARTS})
    return out.getvalue()
ROOT = Path(__file__).resolve().parent.parent


def request(**overrides: Any) -> pb.RecommendActionRequest:
    """A valid request; keyword arguments replace fields."""
    rng = np.random.default_rng(overrides.pop("seed", 0))
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "user_id": "user-1",
        "session_id": "session-1",
        "item_id": "item-1",
        "item_embedding": (rng.standard_normal(768) / np.sqrt(768)).astype(np.float32).tolist(),
        "recent_behavior_ids": ["view:item-9", "search:shoes"],
        "page_type": pb.PAGE_TYPE_SEARCH,
        "cart_item_count": 1,
    }
    fields.update(overrides)
    return pb.RecommendActionRequest(**fields)


class ServerThread:
    """A real ShoppingAgentServer on its own event loop in a background thread."""

    def __init__(self, config: Config, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.server: ShoppingAgentServer | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ShoppingAgentServer:
        self._thread.start()

        async def create() -> ShoppingAgentServer:
            server = ShoppingAgentServer(self.config, self.registry)
            await server.start()
            await server.wait_loaded()
            return server

        self.server = self.call(create())
        return self.server

    def stop(self, grace: float = 0) -> None:
        if self.server is not None:
            self.call(self.server.stop(grace))
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @property
    def target(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"


def make_config(**overrides: Any) -> Config:
    return Config(**{"host": "127.0.0.1", "port": 0, "metrics_port": None, "log_format": "text", "grace_seconds": 1.0,
                     **overrides})


def until(condition: Callable[[], bool], what: str = "the condition", timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds, polling every 10 ms; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _alive(stat: Path) -> bool:
    """A /proc ``stat`` file's task runs (is neither a zombie nor dead; no file: gone)."""
    try:
        text = stat.read_text()
    except FileNotFoundError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def running(pid: int) -> bool:
    """Alive and not a zombie: an orphan that exited waits as one until its new parent (init, a subreaper) reaps it."""
    return _alive(Path(f"/proc/{pid}/stat"))


def threads_gone(pid: int) -> bool:
    """Every thread of ``pid`` has exited. The leader turns zombie (``running`` says no) while its other threads may
    still run and hold the process's descriptors, an inherited lock among them."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return not any(_alive(Path(f"/proc/{pid}/task/{tid}/stat")) for tid in tids)


def promptly(call: Callable[[], T], timeout: float = 10.0, fifo: Path | None = None) -> T:
    """``call()``'s result (or its exception), run in a thread, which must come within ``timeout``; a call still
    running fails the test. With ``fifo`` (a FIFO a hostile volume put where a file was expected, with no writer), a
    call still waiting on it is then released by opening the FIFO's writing end, so no thread stays blocked."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)  # daemon: a hung call still lets the suite end
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the waiting open returns; the read then sees EOF
            thread.join(timeout)
        raise AssertionError(f"{call} still running after {timeout} s" + (f", waiting on the FIFO {fifo}" if fifo else ""))
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def running_server(**overrides: Any) -> Iterator[ServerThread]:
    thread = ServerThread(make_config(**overrides))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def stub(channel: grpc.Channel) -> pb_grpc.ShoppingAgentStub:
    return pb_grpc.ShoppingAgentStub(channel)


class Spawned:
    """The real CLI in a subprocess; the bound port is read from its JSON 'listening' log line."""

    def __init__(self, proc: subprocess.Popen[str], port: int, lines: list[str]) -> None:
        self.proc, self.port, self.lines = proc, port, lines

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


_SCRATCH = tempfile.TemporaryDirectory(prefix="shopping-agent-tests-")
"""The spawned servers' TMPDIR: the tests end them with SIGKILL, which leaves whatever they made in the temp dir behind
(onnxruntime's ``.ses`` file, for one); this process removes the lot when it exits."""


def spawn_server(*args: str, env: dict[str, str] | None = None, timeout: float = 20,
                 interpreter_args: tuple[str, ...] = ()) -> Spawned:
    cmd = [sys.executable, *interpreter_args, "-m", "server", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
           "--metrics-port", "0", "--log-format", "json", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TMPDIR": _SCRATCH.name, **(env or {})}, cwd=ROOT)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # not ours (a library printing to stderr)
            continue
        if entry.get("msg") == "listening":
            spawned = Spawned(proc, int(entry["port"]), lines)
            threading.Thread(target=_drain, args=(proc, lines), daemon=True).start()
            return spawned
    proc.kill()
    proc.wait(10)
    proc.stderr.close()
    raise AssertionError(f"server did not start: {''.join(lines)}")


def prometheus_tool(name: str) -> str:
    """Path of a tool from Debian's prometheus package: skip without it, but fail under CI."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: apt-get install prometheus"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _drain(proc: subprocess.Popen[str], lines: list[str]) -> None:
    try:
        for line in proc.stderr or ():
            lines.append(line)
    except ValueError:  # closed by __exit__
        pass


def trainer_in_process(*argv: str) -> tuple[int, str, str]:
    """``shopping-agent`` trainer commands in this process (no interpreter or torch start per call): exit code, stdout,
    stderr. The console script itself is run by tests/trainer/test_train_loop.py."""
    import contextlib
    import io

    from trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def strict_json(line: str) -> Any:
    """A command's ``--json`` line parsed as strict JSON: Python's ``json.loads`` takes a bare ``NaN`` or ``Infinity``,
    which ``JSON.parse``, jq and other strict parsers (the CronJob's log tooling) reject."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)
