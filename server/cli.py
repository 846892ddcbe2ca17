"""The ``shopping-agent`` command line. Only the command lines (this module, and ``trainer/cli.py``'s ``process_main``
for ``python -m trainer``) install signal handlers and block.

Each subcommand's module is imported only when that subcommand runs, so ``serve`` loads no
trainer, simulator or log reader (and ``train`` no gRPC server).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from core.stopping import sigterm_interrupts, stopped
from server import logs
from server.config import Config, add_arguments, build_config

log = logging.getLogger(__name__)

# command → (module with register(subparsers) and run(args), help, log level while it runs)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "weights": ("weights.cli", "create, verify, show, publish and roll back bundles", "INFO"),
    "logs": ("experience.cli", "read the decision, outcome, engagement and product logs", "INFO"),
    "simulate": ("server.simulate", "run simulated shoppers and report the served policy's true value", "WARNING"),
    "train": ("trainer.cli", "train a new bundle from decision and outcome logs (needs the train extra)", "INFO"),
    "train-products": ("trainer.cli", "train a bundle's RecommendProduct heads on its logged product decisions", "INFO"),
    "evaluate": ("trainer.cli", "offline estimates of a bundle's value on logs (IPS, SNIPS, DR, TIS)", "INFO"),
    "cycle": ("trainer.cli", "train → evaluate → gate → publish (the CronJob's command)", "INFO"),
}


async def serve(config: Config) -> int:
    from server.app import ShoppingAgentServer
    from server.memory import arrow_on_system_allocator, freeze_startup_objects, raise_young_threshold

    if config.log_dir is not None:  # before the recorder imports pyarrow (server/memory.py)
        pool, in_time = arrow_on_system_allocator()
        log.debug("arrow memory pool", extra={"fields": {"pool": pool, "before_pyarrow_import": in_time}})
    try:
        server = ShoppingAgentServer(config)
    except ValueError as exc:  # the log salt (experience.salt.SaltError): a setup problem to report, not a crash
        print(f"shopping-agent: {exc}", file=sys.stderr)
        return 2
    frozen = freeze_startup_objects()  # everything imported and built so far; the bundle loads after this (module doc)
    thresholds = raise_young_threshold()
    log.debug("objects exempted from garbage collection", extra={"fields": {"frozen": frozen, "gc_thresholds": list(thresholds)}})
    loop = asyncio.get_running_loop()
    requested = asyncio.Event()

    def on_signal(signum: int) -> None:
        if not requested.is_set():
            log.info("signal received, shutting down", extra={"fields": {"signal": signal.Signals(signum).name}})
            requested.set()

    # Before start(): a SIGTERM that arrives while the server binds or right after it logs
    # "listening" is a shutdown like any other, not the default action (killed, logs unflushed).
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    orphan_watch = beat = None
    if config.supervisor_pid is not None:  # a --workers worker: stop as if signalled once the supervisor is gone
        from server.supervised import stop_when_orphaned

        orphan_watch = asyncio.create_task(stop_when_orphaned(config.supervisor_pid, requested.set), name="orphan-watch")
    if config.heartbeat_fd is not None:  # and show the supervisor that this event loop runs, until the drain is over
        from server.supervised import heartbeat

        beat = asyncio.create_task(heartbeat(config.heartbeat_fd), name="heartbeat")
    try:
        await server.start()
    except OSError as exc:  # the port is taken (transport.check_port_free) or cannot be bound: say so, release what started
        print(f"shopping-agent: {exc}", file=sys.stderr)
        for task in (orphan_watch, beat):
            if task is not None:
                task.cancel()
        await server.stop(0, 0)
        return 2
    await requested.wait()
    if orphan_watch is not None:
        orphan_watch.cancel()
    await server.stop()
    if beat is not None:
        beat.cancel()
    return 0


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``command``) that command's options in full and the others by name only."""
    p = argparse.ArgumentParser(prog="shopping-agent", description="Shopping-agent decision service.")
    sub = p.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run the gRPC server", description="Run the gRPC decision server.")
    add_arguments(serve_p)
    registered: set[str] = set()
    for name, (module, help_text, _) in COMMANDS.items():
        if command is None or COMMANDS.get(command, ("",))[0] == module:
            if module not in registered:
                _module(module).register(sub)
                registered.add(module)
        else:
            sub.add_parser(name, help=help_text, add_help=False)  # listed in --help; parsed only when chosen
    return p


# packages the commands import that only an extra installs (the serving runtime: policy.onnx_model's RuntimeMissing)
EXTRAS = {"torch": "train", "onnx": "train", "threadpoolctl": "train"}


def missing_package(exc: ModuleNotFoundError | RuntimeError) -> str | None:
    """What to install for a command that stopped at a missing package; None when no extra provides it."""
    if not isinstance(exc, ModuleNotFoundError):
        return str(exc)  # RuntimeMissing: its message is the install command
    package = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(package)
    if extra is None:
        return None
    return (f"needs {package}, which the {extra} extra installs: .venv/bin/pip install -e '.[cpu,{extra}]' in a "
            f"checkout (shopping-agent[cpu,{extra}] from a package index)")


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[1] == "--":
        # `shopping-agent train -- --logs DIR` (as torchrun once needed): torchrun's own parser would take
        # --logs for its --logs-specs, so the options travel after a "--"; drop it here.
        del argv[1]
    args = parser(_command(argv)).parse_args(argv)
    if args.command in COMMANDS:
        module, _, level = COMMANDS[args.command]
        logs.configure(level, "text")
        from policy.onnx_model import RuntimeMissing

        with sigterm_interrupts():
            try:
                return int(_module(module).run(args))
            except (ModuleNotFoundError, RuntimeMissing) as exc:
                hint = missing_package(exc)
                if hint is None:
                    raise  # not a package an extra provides: a broken install, with its traceback
                print(f"shopping-agent {args.command}: {hint}", file=sys.stderr)
                return 2  # a set-up problem, as bad usage is: the CronJob does not retry it
            except KeyboardInterrupt as exc:
                return stopped(args.command, exc)
    if args.command == "serve":
        try:
            config = build_config(args, os.environ)
        except ValueError as exc:
            print(f"shopping-agent: configuration error: {exc}", file=sys.stderr)
            return 2
        logs.configure(config.log_level, config.log_format)
        from policy.onnx_model import RuntimeMissing, choose_providers, onnxruntime
        from server.models import load_options
        from server.tls import check_files

        try:
            choose_providers(config.device, onnxruntime().get_available_providers())
            load_options(config)  # the bundle public key, if one is configured, must be a readable Ed25519 key
            check_files(config)  # TLS certificates and keys: readable, PEM, a key that matches (TlsError is a ValueError)
        except (RuntimeMissing, ValueError) as exc:
            print(f"shopping-agent: {exc}", file=sys.stderr)
            return 2
        from server.memory import cap_malloc_arenas

        cap_malloc_arenas()  # before any thread but the main one allocates (every --workers worker runs this too)
        if config.workers > 1:
            from server.workers import run_workers

            return run_workers(config, os.environ)
        return asyncio.run(serve(config))
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":
    sys.exit(main())
