"""The baseline: the ShoppingAgent service with no decision behind it.

A single-process ``grpc.aio`` server built like the real one (same generated code, same
channel options from ``server.config.Config``'s defaults, a health service; one server on the
port unless ``--grpc-servers N``, the real server's admission lever, asks for more) whose
``RecommendAction`` only reads the parsed request and answers one constant, realistically
sized ``RecommendActionResponse``. What the bench measures against it is the cost of gRPC,
HTTP/2 and protobuf in this Python on this machine: the ceiling the real server cannot beat.

    python bench/bare_server.py --host 127.0.0.1 --port 0

On stderr it logs JSON lines like the real server: ``{"msg": "listening", "port": N}`` once
bound and ``{"msg": "serving"}`` when health is SERVING. SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Sequence

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc
from server.config import Config

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ShoppingAgent"].full_name


def constant_response() -> pb.RecommendActionResponse:
    """A response shaped like a real decision (five scores), so serialization costs the same."""
    actions = [a for a in pb.Action.values() if a != pb.ACTION_UNSPECIFIED]
    scores = [
        pb.ActionScore(action=a, policy_probability=0.2, guard_allow_probability=0.9, blocked=False, served_probability=0.2)
        for a in actions
    ]
    return pb.RecommendActionResponse(
        decision_id="0" * 32,
        action=pb.ACTION_VIEW_DETAIL,
        source=pb.DECISION_SOURCE_POLICY,
        propensity=0.2,
        votes=5,
        samples=8,
        action_scores=scores,
        model_version="bare",
    )


class BareServicer(pb_grpc.ShoppingAgentServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self._response = constant_response()

    async def RecommendAction(  # noqa: N802 - the gRPC method name
        self, request: pb.RecommendActionRequest, context: aio.ServicerContext  # type: ignore[type-arg]
    ) -> pb.RecommendActionResponse:
        # gRPC has already deserialized the request; touch it so nothing is lazily skipped.
        if not request.item_id or len(request.item_embedding) == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "item_id and item_embedding are required")
        return self._response


def _log(msg: str, **fields: object) -> None:
    print(json.dumps({"ts": time.time(), "level": "INFO", "logger": "bench.bare_server", "msg": msg, **fields}),
          file=sys.stderr, flush=True)


async def serve(host: str, port: int, reuse_port: bool = False, grpc_servers: int = 1) -> int:
    defaults = Config()
    options = [  # as in server/app.py (reuse_port: as each of its --workers binds, or its --grpc-servers)
        ("grpc.max_receive_message_length", defaults.max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port or grpc_servers > 1)),
    ]
    health_servicer = health.aio.HealthServicer()
    servers, bound = [], port
    for _ in range(grpc_servers):  # the first binds (port 0 picks one), the others join it
        server = aio.server(options=options)
        pb_grpc.add_ShoppingAgentServicer_to_server(BareServicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        bound = server.add_insecure_port(f"{host}:{bound}")
        if bound == 0:
            raise OSError(f"cannot bind {host}:{port}")
        servers.append(server)
    for server in servers:
        await server.start()
    _log("listening", host=host, port=bound)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _log("serving", port=bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await asyncio.gather(*(server.stop(2.0) for server in servers))
    _log("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (logged)")
    p.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT: several processes on one port")
    p.add_argument("--grpc-servers", type=int, default=1,
                   help="grpc.aio servers on the port, as the real server's --grpc-servers (default 1: the issue's baseline)")
    args = p.parse_args(argv)
    if not 1 <= args.grpc_servers <= 64:
        p.error("--grpc-servers must be in 1..64")
    return asyncio.run(serve(args.host, args.port, args.reuse_port, args.grpc_servers))


if __name__ == "__main__":
    sys.exit(main())
