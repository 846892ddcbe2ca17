"""The ``shopping-agent`` command line. Only this module installs signal handlers and blocks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from policy.experience import cli as logs_cli
from policy.onnx_model import RuntimeMissing, choose_providers, onnxruntime
from policy.trainer import cli as trainer_cli
from server import logs, simulate
from server.config import Config, add_arguments, build_config
from weights import cli as weights_cli

log = logging.getLogger(__name__)


async def serve(config: Config) -> int:
    from server.app import ShoppingAgentServer

    server = ShoppingAgentServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        if stopping:
            return
        log.info("signal received, shutting down", extra={"fields": {"signal": signal.Signals(signum).name}})
        stopping.append(loop.create_task(server.stop()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.stopped.wait()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shopping-agent", description="Shopping-agent decision service.")
    sub = p.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run the gRPC server", description="Run the gRPC decision server.")
    add_arguments(serve_p)
    weights_cli.register(sub)
    logs_cli.register(sub)
    simulate.register(sub)
    trainer_cli.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[1] == "--":
        # `torchrun ... shopping-agent train -- --logs DIR`: torchrun's own parser would take
        # --logs for its --logs-specs, so the options travel after a "--"; drop it here.
        del argv[1]
    args = parser().parse_args(argv)
    if args.command == "weights":
        logs.configure("INFO", "text")
        return weights_cli.run(args)
    if args.command in ("train", "evaluate", "cycle"):
        logs.configure("INFO", "text")
        return trainer_cli.run(args)
    if args.command == "simulate":
        logs.configure("WARNING", "text")
        return simulate.run(args)
    if args.command == "logs":
        logs.configure("INFO", "text")
        return logs_cli.run(args)
    if args.command == "serve":
        try:
            config = build_config(args, os.environ)
        except ValueError as exc:
            print(f"shopping-agent: configuration error: {exc}", file=sys.stderr)
            return 2
        logs.configure(config.log_level, config.log_format)
        try:
            choose_providers(config.device, onnxruntime().get_available_providers())
        except (RuntimeMissing, ValueError) as exc:
            print(f"shopping-agent: {exc}", file=sys.stderr)
            return 2
        if config.workers > 1:
            from server.workers import run_workers

            return run_workers(config, os.environ)
        return asyncio.run(serve(config))
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":
    sys.exit(main())
