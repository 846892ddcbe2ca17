"""The MLServer peer's client side, run with MLServer's own interpreter (it has MLServer's protobuf stubs).

    client.py frame EMBEDDING.f32 OUT.grpc     the gRPC frame of one ModelInfer call (what h2load posts)
    client.py ready HOST:PORT SECONDS          exit 0 once the model answers ModelReady, 1 at the deadline
    client.py check HOST:PORT EMBEDDING.f32 N  N ModelInfer calls through a real stub; exit 1 unless every one is OK
"""

from __future__ import annotations

import struct
import sys
import time

import grpc
import numpy as np
from mlserver.grpc import dataplane_pb2 as pb
from mlserver.grpc import dataplane_pb2_grpc as rpc

MODEL = "policy"


def request(embedding: np.ndarray) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="item_embedding", datatype="FP32", shape=[1, len(embedding)])
    return pb.ModelInferRequest(model_name=MODEL, inputs=[tensor], raw_input_contents=[embedding.astype("<f4").tobytes()])


def main(argv: list[str]) -> int:
    command = argv[0]
    if command == "frame":
        message = request(np.fromfile(argv[1], dtype="<f4")).SerializeToString()
        with open(argv[2], "wb") as out:
            out.write(struct.pack(">BI", 0, len(message)) + message)
        return 0
    with grpc.insecure_channel(argv[1]) as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        if command == "ready":
            deadline = time.monotonic() + float(argv[2])
            while time.monotonic() < deadline:
                try:
                    if stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=0.5).ready:
                        return 0
                except grpc.RpcError:
                    pass
                time.sleep(0.02)
            return 1
        if command == "check":
            call = request(np.fromfile(argv[2], dtype="<f4"))
            for _ in range(int(argv[3])):
                reply = stub.ModelInfer(call, timeout=5.0)
                if list(reply.outputs[0].shape) != [1, 5]:
                    print(f"unexpected answer: {reply}", file=sys.stderr)
                    return 1
            return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
