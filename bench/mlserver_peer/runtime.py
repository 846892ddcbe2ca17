"""A Seldon MLServer runtime serving the shopping-agent's two MLPs: the serving peer of ``bench.peer_mlserver``.

Runs inside MLServer's own virtual environment (``.venv-mlserver``), never in the project's. The request is the item
embedding (FP32, 1 × 768, as raw contents); the state is that embedding, zeros for the behaviour part and a one-hot
hour, as ``policy.features`` lays it out (920 floats); the policy and the guard graphs of the embedded default bundle
run on it, and the answer is the policy's softmax masked by the guard's veto (5 floats). That is less work than the
project's server does per request (no guardrails, no ten-sample vote, no exact propensity): the comparison flatters
the peer.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

ITEM_DIM, STATE_DIM, HOUR = 768, 920, 12
HOUR_COLUMN = STATE_DIM - 24 + HOUR


class PolicyRuntime(MLModel):  # type: ignore[misc]
    async def load(self) -> bool:
        folder = self.settings.parameters.uri
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # as the project's server runs its sessions
        self._policy = ort.InferenceSession(f"{folder}/policy.onnx", options, providers=["CPUExecutionProvider"])
        self._guard = ort.InferenceSession(f"{folder}/guard.onnx", options, providers=["CPUExecutionProvider"])
        self._threshold = float(self.settings.parameters.extra.get("guard_threshold", 0.5))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        embedding = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32).reshape(-1, ITEM_DIM)
        state = np.zeros((len(embedding), STATE_DIM), dtype=np.float32)
        state[:, :ITEM_DIM] = embedding
        state[:, HOUR_COLUMN] = 1.0
        logits = self._policy.run(None, {"state": state})[0]
        allow = self._guard.run(None, {"state": state})[0]
        p = np.exp(logits - logits.max(axis=1, keepdims=True)) * (allow >= self._threshold)
        p /= np.maximum(p.sum(axis=1, keepdims=True), 1e-12)
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("action_probs", p.astype(np.float32))])
