"""A/B of two source trees: the real server from each (say the commit before a change and the change), the same load.

Each tree is a checkout of this repository (``git worktree add /tmp/before HEAD~1``); its server runs with the tree's
own packages first on ``sys.path`` and the interpreter and installed dependencies of this one. Same loader (h2load,
one thread), payload and flags for both; the trees alternate (a, b, a, b, ...) with a fresh server each round, so drift
on a shared machine hits both alike. Reported: each tree's req/s and server CPU per request, their medians, and the
ratio b/a of the medians. Checks before and after each load, as ``bench.load`` does.

Run: ``.venv/bin/python -m bench.ab_trees --a /tmp/before --b . [--rounds 5] [--duration 10] [--server-arg=--log-dir=/tmp/l]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.ab_cost import alternated
from bench.load import Settings, real_server_argv
from bench.loaders import H2Load, h2load_binary
from bench.procs import REPO, BenchError

# The tree's directory goes first on sys.path; the assertion makes sure its `server` package is the one that runs.
BOOT = ("import sys, runpy; tree = sys.argv.pop(1); sys.path.insert(0, tree); import server; "
        "assert server.__file__.startswith(tree), f'{server.__file__} is not under {tree}'; "
        "runpy.run_module('server', run_name='__main__', alter_sys=True)")


def tree_argv(tree: Path, extra: Sequence[str]) -> list[str]:
    """``shopping-agent serve`` (as ``bench.load`` starts it) from the source tree ``tree``."""
    serve = real_server_argv(extra)
    return [sys.executable, "-c", BOOT, str(tree.resolve()), *serve[serve.index("serve"):]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab_trees", description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, required=True, help="the first source tree (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="the second source tree")
    p.add_argument("--rounds", type=int, default=5, help="a/b pairs (default 5)")
    p.add_argument("--duration", type=float, default=10.0, help="h2load measured seconds per run (default 10)")
    p.add_argument("--clients", type=int, default=8, help="h2load connections (default 8)")
    p.add_argument("--streams", type=int, default=8, help="h2load streams a connection (default 8: 64 in flight)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra flag for both servers")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "ab_trees.json")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= 9 or not 0 < args.duration <= 60:
        p.error("--rounds 1..9, --duration 0..60 s")
    for name in ("a", "b"):
        if not (getattr(args, name) / "server" / "__main__.py").is_file():
            p.error(f"--{name} {getattr(args, name)}: not a source tree of this repository (no server/__main__.py)")
    try:
        h2load_binary()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    settings = Settings(duration_s=args.duration, h2_warmup_s=2.0, h2=H2Load(args.clients, args.streams),
                        latency_duration_s=1.0, concurrency=16, single_latency_duration_s=0.0, warmup_s=1.0,
                        start_timeout_s=30.0, server_args=(), profile_s=0.0)
    argvs = {name: tree_argv(getattr(args, name), args.server_arg) for name in ("a", "b")}
    try:
        rps, cpu = alternated(args.rounds, settings, lambda _tmp, _round: argvs, prefix="tree-")
    except (BenchError, TimeoutError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    med = {name: statistics.median(values) for name, values in rps.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    for name in ("a", "b"):
        print(f"{name} {getattr(args, name)}: {', '.join(f'{v:.0f}' for v in rps[name])} req/s, median {med[name]:.0f}; "
              f"server CPU {med_cpu[name]:.3f} ms a request (median)")
    print(f"b/a throughput {med['b'] / med['a']:.3f}, CPU a request {med_cpu['b'] / med_cpu['a']:.3f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"when": time.time(), "a": str(args.a), "b": str(args.b), "server_args": args.server_arg,
                                       "rps": rps, "cpu_ms_per_request": cpu, "median": med, "median_cpu": med_cpu,
                                       "ratio": med["b"] / med["a"]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
