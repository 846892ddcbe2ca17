"""A validating process that starts once and forks a limited child per bundle, so a swap does not pay for a new interpreter.

``weights.sandbox.validate_in_child`` starts a fresh ``python -m weights.sandbox`` for every
bundle: safe, but about 280 ms of interpreter, numpy and onnxruntime start-up on every swap,
competing with serving for the pod's cores. ``Validator`` keeps one such process
(``python -m weights.sandbox --serve``) that has imported them once and, for each bundle,
forks a child that sets its own address-space limit and nice level and does the server's whole
load (``weights.sandbox.validate_bytes``). The forked child starts with nothing but imports: the
validating process never creates an onnxruntime session itself, so no thread pool is forked.

Protocol on the validating process's stdin/stdout: a JSON header line (``size``, ``memory``,
``timeout``, ``fields``), then ``size`` bytes of bundle; one JSON answer line back. A child
that overruns its timeout is killed; one that dies without answering (the memory limit, a
crash in onnxruntime) is reported; either is reason ``limits``. If the validating process
itself dies, the next bundle starts a new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

from core.peak_memory import address_space_kb
from weights.bundle import BundleError
from weights.model_set import LoadOptions
from weights.sandbox import SandboxLimits, child_environment, child_fields, limit_self, validate_bytes, verdict

log = logging.getLogger(__name__)

_SLACK_S = 5.0  # the validating process's own timeout is the child's; the caller waits a little longer
_EXIT_WAIT_S = 2.0  # how long a closed validating process has to leave on its own before it is killed


class Validator:
    """One long-lived validating process for this server (thread-safe; one bundle at a time)."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._ensure()

    def validate(self, data: bytes, options: LoadOptions) -> dict[str, object]:
        """The child's report for ``data`` (``peak_rss_kb`` …), or ``BundleError``; as ``validate_in_child``."""
        header = {"size": len(data), "memory": self.limits.memory_bytes, "timeout": self.limits.timeout_s,
                  "fields": child_fields(options)}
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(header).encode() + b"\n" + data)
                proc.stdin.flush()
                line = _read_line(proc.stdout.fileno(), self.limits.timeout_s + _SLACK_S)
            except (OSError, EOFError, TimeoutError) as exc:
                self._discard()
                raise BundleError("limits", f"the validating process failed ({type(exc).__name__}); it is restarted") from None
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise BundleError("limits", "the validating process gave no answer")
        return verdict(answer)

    def close(self) -> None:
        with self._lock:
            self._discard()

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is not None:
            log.warning("the validating process ended (exit %s); starting a new one", self._proc.returncode)
            self._discard()
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, "-P", "-m", "weights.sandbox", "--serve"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=child_environment())
        return self._proc

    def _discard(self) -> None:
        """End the validating process: stdin closed, it returns and cleans up (its temp directory); killed if it
        is still there after ``_EXIT_WAIT_S`` (stuck in a request)."""
        if self._proc is not None:
            if self._proc.poll() is None and self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(_EXIT_WAIT_S)
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(10)
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None


def _read_line(fd: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError("the validating process ended")
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


# --- the validating process ---------------------------------------------------------------------


def serve_forever() -> None:
    """``python -m weights.sandbox --serve``: import once, then fork one limited child per request."""
    import onnxruntime  # noqa: F401  (imported once here, inherited by every child: the point of this process)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops it (stdin closes, or kill), not a terminal's ^C
    started_kb = address_space_kb()  # what a child of a fresh process inherits: its limit counts this much
    stdin = sys.stdin.buffer
    while True:
        header = stdin.readline()
        if not header:
            return
        request = json.loads(header)
        data = stdin.read(int(request["size"]))
        answer = _fork_one(data, int(request["memory"]), float(request["timeout"]), request["fields"], started_kb)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def grown_limit(memory_bytes: int, started_kb: int, now_kb: int, held_bytes: int = 0) -> int:
    """The address-space limit of a child forked now: ``memory_bytes`` (``--validate-memory-mb``, which counts what a
    freshly started validating process holds, ``started_kb``) plus what this process has grown by since. The limit is
    absolute and a forked child inherits every mapping, so this process's growth (161 MB to 448-473 MB of VmSize over a
    day's swaps, a review found, 2026-12-07) came off the child's room: honest bundles that validated at a server's start
    were refused on hot swap (``std::bad_alloc``), as ``onnx`` or ``invalid``, never retried. ``held_bytes``: what this
    process holds for the child to validate (the bundle's bytes, read since), which a fresh process holds too and which
    is not growth."""
    if started_kb < 0 or now_kb < 0:  # no /proc: as before
        return memory_bytes
    return memory_bytes + max(0, (now_kb - started_kb) * 1024 - held_bytes)


def _fork_one(data: bytes, memory_bytes: int, timeout_s: float, fields: dict[str, object], started_kb: int) -> dict[str, object]:
    limit = grown_limit(memory_bytes, started_kb, address_space_kb(), len(data))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: limit itself, validate, answer, and leave without running any cleanup of the parent's
        os.close(read_end)
        try:
            limit_self(limit)
            answer = validate_bytes(data, memory_bytes, fields)
        except BaseException as exc:
            answer = {"ok": False, "reason": "invalid", "message": f"{type(exc).__name__}: {str(exc)[:200]}"}
        try:
            os.write(write_end, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        return _collect(pid, read_end, timeout_s, memory_bytes)
    finally:
        os.close(read_end)


def _collect(pid: int, fd: int, timeout_s: float, memory_bytes: int) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"ok": False, "reason": "limits", "message": f"validating the bundle took longer than {timeout_s:g} s"}
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        return answer
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    return {"ok": False, "reason": "limits",
            "message": f"the validating process died ({how}) under a {memory_bytes // 2**20} MiB address-space limit"}
