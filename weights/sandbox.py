"""Validate a candidate bundle in a child process with an address-space limit and a timeout.

Loading a bundle runs onnxruntime on graphs someone else wrote. ``weights.onnx_check``
refuses what we know to be dangerous, but the last word on "does this fit in the pod" is to
try it where failing costs nothing: a child process (``python -m weights.sandbox``) gets the
bundle's bytes on stdin, sets ``RLIMIT_AS`` to ``memory_bytes``, and does exactly what a
server does (``read_bundle`` → ``ModelSet.load``: schema, signature, graph checks, sessions,
golden self-test, warm-up). Only when it answers ``ok`` within ``timeout_s`` does the caller
load the same bytes itself. A child that runs out of memory, hangs or dies is a
``BundleError`` with reason ``limits``; the server keeps serving what it had.

The parent passes the bytes it already read (not the path), so the file cannot be swapped
between the check and the load.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass

from core.peak_memory import peak_rss_kb
from weights.bundle import MAX_BUNDLE_BYTES, BundleError, read_bundle
from weights.compute_budget import check_compute
from weights.model_set import LoadOptions, ModelSet

_ANSWER_BYTES = 64 * 1024


MAX_MEMORY_MB = 2**20
"""The largest address-space limit a validating child takes (1 TiB): past what ``setrlimit`` takes, every child died
before validating and every bundle was refused, blamed on the bundle (an attack review, 2026-12-07)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of the validating child; ``memory_bytes`` is its whole address space (virtual memory)."""

    memory_bytes: int = 512 * 1024 * 1024  # under the pod's 512Mi: the interpreter and onnxruntime need about 300 MiB of it
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 256 * 2**20 <= self.memory_bytes <= MAX_MEMORY_MB * 2**20:
            raise ValueError(f"validation memory limit: expected 256 MiB to {MAX_MEMORY_MB} MiB, got {self.memory_bytes} bytes")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"validation timeout: expected 0 < seconds <= 3600, got {self.timeout_s}")


def validate_in_child(data: bytes, options: LoadOptions, limits: SandboxLimits) -> dict[str, object]:
    """Run the full load of ``data`` under ``limits`` in a child; its report (``peak_rss_kb`` …), or ``BundleError``.

    The child loads with the caller's ``options``, on CPU with one thread.
    """
    # -P: the working directory is not on the child's path (nothing there can shadow our packages)
    command = [sys.executable, "-P", "-m", "weights.sandbox", str(limits.memory_bytes), json.dumps(child_fields(options))]
    try:
        done = subprocess.run(command, input=data, capture_output=True, timeout=limits.timeout_s, env=child_environment(), check=False)
    except subprocess.TimeoutExpired:
        raise BundleError("limits", f"validating the bundle took longer than {limits.timeout_s:g} s") from None
    answer = _answer(done.stdout)
    if answer is None:
        hint = "out of memory" if done.returncode in (-9, 137) or b"MemoryError" in done.stderr else f"exit {done.returncode}"
        raise BundleError("limits", f"the validating process died ({hint}) under a {limits.memory_bytes // 2**20} MiB "
                                    "address-space limit")
    return verdict(answer)


def verdict(answer: dict[str, object]) -> dict[str, object]:
    """A validating child's answer: returned when it is ok, else raised as the ``BundleError`` it names."""
    if not answer.get("ok"):
        reason, message = str(answer.get("reason", "invalid")), str(answer.get("message", ""))
        raise BundleError(reason if reason != "memory" else "limits", message)
    return answer


def child_fields(options: LoadOptions) -> dict[str, object]:
    """``options`` as JSON data for a child, which always loads on CPU with one thread."""
    fields = {**asdict(options), "public_keys": [k.hex() for k in options.public_keys]}
    fields.update(device="cpu", threads=1)
    return fields


# One thread for every BLAS and OpenMP runtime numpy or onnxruntime may bring. OpenBLAS starts a thread per CPU it sees
# when numpy is imported, each with its own buffer: about 35 MiB of address space a CPU, and a container sees every CPU
# of its node whatever its CPU limit. With them, a 512 MiB child refused every bundle ("MemoryError") on a node of 12 CPUs
# or more, and weights verify/publish's on 8 or more (an SRE review, 2026-12-06, with the CPU count faked). The child
# multiplies nothing large enough for a second thread to matter.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "BLIS_NUM_THREADS": "1"}


def child_environment() -> dict[str, str]:
    """The few variables a validating child needs, and one BLAS/OpenMP thread (``ONE_THREAD``) whatever the server's are;
    nothing else of the server's environment reaches it."""
    passed = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")}
    return {**passed, **ONE_THREAD}


def _answer(stdout: bytes) -> dict[str, object] | None:
    try:
        answer = json.loads(stdout[-_ANSWER_BYTES:].decode().strip().splitlines()[-1])
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    return answer if isinstance(answer, dict) else None


def limit_self(memory_bytes: int) -> None:
    os.nice(10)  # validation must not take CPU from the requests the parent is serving
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def validate_bytes(data: bytes, memory_bytes: int, fields: dict[str, object]) -> dict[str, object]:
    """In the limited process: the server's whole load of ``data``; the answer as plain data."""
    try:
        keys = fields["public_keys"]  # always sent (child_fields): a malformed one fails the check, never turns it off
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"public_keys: expected a list of hex strings, got {keys!r:.80}")
        options = LoadOptions(**{**fields, "public_keys": tuple(bytes.fromhex(k) for k in keys)})  # type: ignore[arg-type]
        model = ModelSet.load(read_bundle(data), options)
        spent = check_compute(model, options.warmup_batch)  # here, alone in its process: its CPU time is the graphs' own
    except BundleError as exc:
        return {"ok": False, "reason": exc.reason, "message": str(exc)}
    except MemoryError:
        return {"ok": False, "reason": "memory", "message": f"validation ran out of its {memory_bytes // 2**20} MiB address space"}
    return {"ok": True, "model_version": model.version, "peak_rss_kb": peak_rss_kb(), "inference_cpu_ms": round(spent * 1000, 3)}


def _child(memory_bytes: int, fields: dict[str, object]) -> dict[str, object]:
    limit_self(memory_bytes)
    return validate_bytes(sys.stdin.buffer.read(MAX_BUNDLE_BYTES + 1), memory_bytes, fields)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        from weights.forkserver import serve_forever

        serve_forever()
    else:
        print(json.dumps(_child(int(sys.argv[1]), json.loads(sys.argv[2]))), flush=True)
