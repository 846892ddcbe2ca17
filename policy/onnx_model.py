"""One onnxruntime session per model, created once and reused for every batch.

The CUDA provider is used when onnxruntime-gpu is installed and CUDA is usable; otherwise
the CPU provider. Which provider a session really got is read back from
``session.get_providers()`` (onnxruntime-gpu silently falls back to CPU without CUDA).

The server never imports torch, so nothing else has loaded CUDA's libraries when the first
CUDA session is made: ``preload_cuda_libraries`` has onnxruntime load them from the NVIDIA
wheels (``onnxruntime-gpu[cuda,cudnn]``, the [gpu] extra) or the system's loader path first.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "onnxruntime is not installed: install the serving runtime with .venv/bin/pip install -e '.[cpu]' in a checkout, "
    "or pip install 'shopping-agent[cpu]' from a package index ([gpu] instead on CUDA nodes; never both)"
)


class RuntimeMissing(RuntimeError):
    """Neither onnxruntime nor onnxruntime-gpu is importable."""


def onnxruntime() -> Any:
    """Import onnxruntime or raise ``RuntimeMissing`` with the install command."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise RuntimeMissing(INSTALL_HINT) from exc
    return ort


def choose_providers(device: str, available: list[str]) -> list[str]:
    """Execution providers for ``device`` (auto|cpu|cuda), best first."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}")
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeMissing("device=cuda but onnxruntime has no CUDAExecutionProvider (install the [gpu] extra)")
    if device != "cpu" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


# TF32 off: with it, onnxruntime's CUDA provider rounds float32 matrix inputs to a 10-bit mantissa
# (its default on Ampere and later), and the embedded default's golden self-test then missed its
# 1e-4 tolerance on an H200 (1.02e-4): every CUDA server answered FALLBACK_NO_MODEL. These MLPs
# are far too small for TF32's speed to matter; the self-test's meaning does.
CUDA_OPTIONS = {"use_tf32": "0"}


def session_providers(names: list[str]) -> list[str | tuple[str, dict[str, str]]]:
    """``choose_providers``'s names as ``InferenceSession`` takes them, the CUDA provider with ``CUDA_OPTIONS``."""
    return [(n, dict(CUDA_OPTIONS)) if n == "CUDAExecutionProvider" else n for n in names]


@functools.cache
def preload_cuda_libraries() -> None:
    """Load CUDA, cuBLAS and cuDNN once per process, before the first CUDA session (see the module doc).

    ``onnxruntime.preload_dlls`` (1.21 and later) prints what it could not load; that goes to the log.
    """
    ort = onnxruntime()
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # process-wide while it runs: at load, where nothing else prints
            preload()
    except Exception as exc:  # a missing library shows as the CPU fallback's warning; the model still loads
        log.warning("onnxruntime.preload_dlls failed: %s: %s", type(exc).__name__, str(exc)[:300])
    text = re.sub(r"\x1b\[[0-9;]*m", "", said.getvalue())  # its warnings come in terminal colours
    if text.strip():
        log.warning("onnxruntime.preload_dlls: %s", " ".join(text.split())[:500])


# Where onnxruntime is told external data lives: below a character device, so no process, root included, can ever
# create it. A graph is loaded from bytes, so onnxruntime would otherwise resolve an external-data path against the
# working directory. ``weights.onnx_check`` refuses such graphs first; this makes the runtime itself find nothing even if
# one got past. A constant, not a private temp directory: a process killed with SIGKILL (an OOM kill, a worker past its
# grace period) left one of those behind on every start, 84 in a day on a development machine.
NO_EXTERNAL_DATA = "/dev/null/shopping-agent-has-no-external-data"


class OnnxModel:
    """A single-input, single-output ONNX graph on an onnxruntime session."""

    def __init__(self, name: str, model: bytes, device: str = "auto", threads: int = 1) -> None:
        ort = onnxruntime()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", NO_EXTERNAL_DATA)
        providers = choose_providers(device, ort.get_available_providers())
        if "CUDAExecutionProvider" in providers:
            preload_cuda_libraries()
        self.name = name
        self.session = ort.InferenceSession(model, sess_options=options, providers=session_providers(providers))
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(f"{name}: expected one input and one output, got {len(inputs)} and {len(outputs)}")
        self.input_name = inputs[0].name
        self.input_shape = tuple(inputs[0].shape)
        self.output_name = outputs[0].name
        self.providers = tuple(self.session.get_providers())
        if device != "cpu" and "CUDAExecutionProvider" in providers and self.providers[0] != "CUDAExecutionProvider":
            log.warning("%s: CUDA provider requested but the session runs on %s", name, self.providers[0])

    def run(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        out = self.session.run([self.output_name], {self.input_name: x})[0]
        return np.asarray(out)
