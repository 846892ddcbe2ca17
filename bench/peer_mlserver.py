"""Seldon MLServer as the serving peer: the same two MLPs behind MLServer's V2 gRPC protocol, tuned, in its own venv.

MLServer 1.7.1 cannot share the project's environment (its pins differ, and its default worker needs
``uvloop==0.21.0`` to load a model at all), so it lives in ``.venv-mlserver``, an optional bench dependency::

    python3 -m venv .venv-mlserver && .venv-mlserver/bin/pip install mlserver==1.7.1 uvloop==0.21.0 onnxruntime

Without it the bench that asks for the peer says so and goes on without it. The peer serves the embedded default
bundle's policy and guard graphs with ``bench/mlserver_peer/runtime.py``, tuned as its documentation advises for one
process (``parallel_workers`` 0: inference in the server's own process; debug off; its metrics server off). The
request is the same item embedding the project's server gets (768 floats), as one ModelInfer call; the checks before
and after each load run a real MLServer stub (``bench/mlserver_peer/client.py``, under MLServer's interpreter), since
h2load counts a gRPC error as a success.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.procs import HOST, REPO, BenchError, ServerProcess
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb

VENV = REPO / ".venv-mlserver"
PEER = REPO / "bench" / "mlserver_peer"
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
INSTALL = "python3 -m venv .venv-mlserver && .venv-mlserver/bin/pip install mlserver==1.7.1 uvloop==0.21.0 onnxruntime"


def missing(venv: Path = VENV) -> str | None:
    """Why the peer cannot run here (None: it can)."""
    if not (venv / "bin" / "mlserver").exists():
        return f"MLServer skipped: no {venv.name} with mlserver in it. To include it: {INSTALL}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Peer:
    """A prepared model repository, the ModelInfer frame h2load posts, and the interpreter that speaks V2."""

    root: Path
    body: Path
    embedding: Path
    python: Path

    def client(self, *args: str, timeout_s: float = 60.0) -> int:
        return subprocess.run([str(self.python), str(PEER / "client.py"), *args], cwd=REPO, timeout=timeout_s,
                              capture_output=True, check=False).returncode

    def process(self) -> PeerProcess:
        grpc_port = _free_port()
        settings = {"debug": False, "parallel_workers": 0, "host": HOST, "grpc_port": grpc_port, "http_port": _free_port(),
                    "metrics_endpoint": None, "metrics_port": _free_port()}
        (self.root / "settings.json").write_text(json.dumps(settings))
        argv = [str(self.python.parent / "mlserver"), "start", str(self.root)]
        return PeerProcess("mlserver", argv, peer=self, fixed_port=grpc_port)

    def check(self, server: ServerProcess, calls: int) -> None:
        if self.client("check", server.target, str(self.embedding), str(calls)) != 0:
            raise BenchError(f"mlserver: ModelInfer did not answer OK {calls} times; log:\n" + "\n".join(server.log_tail))


def prepare(tmp: Path, request: pb.RecommendActionRequest, venv: Path = VENV) -> Peer:
    """The peer's model repository under ``tmp``: the embedded bundle's two graphs, the runtime, its settings."""
    from weights.embedded import default_bundle

    bundle = default_bundle()
    root = tmp / "mlserver"
    model = root / "policy"
    model.mkdir(parents=True)
    for part in ("policy.onnx", "guard.onnx"):
        (model / part).write_bytes(bundle.parts[part])
    shutil.copy(PEER / "runtime.py", model / "runtime.py")
    threshold = float(bundle.manifest["guard"]["threshold"])
    (model / "model-settings.json").write_text(json.dumps({
        "name": "policy", "implementation": "runtime.PolicyRuntime",
        "parameters": {"uri": str(model), "extra": {"guard_threshold": threshold}}}))
    embedding = tmp / "embedding.f32"
    np.asarray(request.item_embedding, dtype="<f4").tofile(embedding)
    peer = Peer(root, tmp / "mlserver-request.grpc", embedding, venv / "bin" / "python")
    if peer.client("frame", str(embedding), str(peer.body)) != 0 or not peer.body.exists():
        raise BenchError("mlserver: could not build the ModelInfer frame with MLServer's stubs")
    return peer


@dataclass
class PeerProcess(ServerProcess):
    """MLServer on a port chosen beforehand; ready when the model answers ModelReady (it has no gRPC health service)."""

    peer: Peer | None = None
    fixed_port: int | None = None

    def spawn(self) -> None:
        super().spawn()
        self.port = self.fixed_port

    def wait_serving(self, timeout_s: float, interval_s: float = 0.010) -> float:
        assert self.peer is not None
        if self.peer.client("ready", self.target, str(timeout_s), timeout_s=timeout_s + 30) != 0:
            self.check_alive()
            raise BenchError(f"mlserver: model not ready {timeout_s:.0f} s after spawn; log:\n" + "\n".join(self.log_tail))
        return time.perf_counter() - self.spawned_at
