"""RecommendProduct's throughput beside RecommendAction's and the bare gRPC ceiling, in one run.

    .venv/bin/python -m bench.product_serving [--duration 8] [--warmup 2] [--json]

One shelf of a simulated page (6 categories of 6 SKUs with 768-d embeddings, 3 price bands: about 115 KB a request,
so the server takes ``--max-message-bytes`` 1 MiB) and one ``RecommendAction`` request, the same bytes for every run,
h2load closed loop at 64 in flight (8 connections × 8 streams, one thread), each on a fresh process, all on 127.0.0.1:

- the bare server (parse, constant answer) on the ``RecommendAction`` request: the ceiling;
- ``shopping-agent serve`` on a bundle with product heads (``weights init --product-heads``, as its weights directory's
  active bundle): ``RecommendAction``, and
  ``RecommendProduct`` (three layers scored, sampled, exact propensities);
- the same server on the bundle without heads: ``RecommendProduct`` answered by the per-layer rules.

Before and after each run, a stub call must answer OK, and the raw h2load frame is checked (grpc-status 0).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.load import bare_server_argv, real_server_argv
from bench.loaders import H2Load, check_wire_frame, h2load_binary, run_h2load
from bench.payload import METHOD_PATH, build_request, grpc_frame
from bench.procs import BenchError, ServerProcess, busy_before_run, running
from bench.report import add_json_flag, header, write_results
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from simulator.config import SimConfig
from simulator.products import candidates
from simulator.world import World
from weights.initial import make_bundle
from weights.store import ACTIVE_NAME

PRODUCT_PATH = "/shopping_agent.v1.ShoppingAgent/RecommendProduct"
SHAPE = H2Load(8, 8)
ONE_MIB = str(1 << 20)


def product_request(action: pb.RecommendActionRequest) -> pb.RecommendProductRequest:
    """A simulated page's shelf (world 7, session 0) as a request, the shopper being ``action``."""
    world = World(SimConfig(), 7)
    session = world.session(0)
    categories, bands = candidates(world.catalogue, session.shelf())
    return pb.RecommendProductRequest(
        shopper=action, visit_count=session.visit_count,
        categories=[pb.ProductCategory(category_id=c.category_id, skus=[
            pb.ProductSku(sku_id=s.sku_id, embedding=s.embedding.tolist(), price=s.price, stock=s.stock,
                          **({} if s.competitor_price is None else {"competitor_price": s.competitor_price})) for s in c.skus])
            for c in categories],
        price_bands=[pb.PriceBand(band_id=b.band_id, price_multiplier=b.price_multiplier) for b in bands])


def _check(server: ServerProcess, method: str, message: Any, response: Any) -> None:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(f"/shopping_agent.v1.ShoppingAgent/{method}", request_serializer=type(message).SerializeToString,
                                   response_deserializer=response.FromString)
        call(message, timeout=10)


def measured(name: str, argv: list[str], path: str, body: Path, message: Any, response: Any, args: argparse.Namespace) -> dict[str, Any]:
    method = path.rsplit("/", 1)[1]
    server = ServerProcess(name, argv)
    with running(server):
        server.wait_serving(30.0)
        _check(server, method, message, response)
        check_wire_frame(server, body, path)
        run_h2load(server, body, SHAPE, args.warmup, 0.5, path=path)  # warm-up, discarded
        got = run_h2load(server, body, SHAPE, args.duration, args.warmup, path=path)
        _check(server, method, message, response)
    print(f"  [{name}] {got['requests_per_s']:.0f} req/s, server CPU {got['cpu']['server_cpu_ms_per_request']:.3f} ms a request",
          flush=True)
    return {"requests_per_s": got["requests_per_s"], "server_cpu_ms_per_request": got["cpu"]["server_cpu_ms_per_request"],
            "argv": got["argv"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.product_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    add_json_flag(parser, "product_serving.json")
    args = parser.parse_args(argv)
    try:
        h2load_binary()
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    busy, started = busy_before_run(), time.time()
    action = build_request()
    product = product_request(action)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-product-") as tmp_name:
        tmp = Path(tmp_name)
        action_body, product_body = tmp / "action.grpc", tmp / "product.grpc"
        action_body.write_bytes(grpc_frame(action.SerializeToString()))
        product_body.write_bytes(grpc_frame(product.SerializeToString()))
        heads, flat = tmp / "heads", tmp / "flat"  # weights directories, each with its active bundle
        for directory, data in ((heads, make_bundle(5, "bench-heads", "2026-12-03T00:00:00Z", product_heads=True)),
                                (flat, make_bundle(5, "bench-flat", "2026-12-03T00:00:00Z"))):
            directory.mkdir()
            (directory / ACTIVE_NAME).write_bytes(data)
        served = ["--max-message-bytes", ONE_MIB]
        plan = [
            ("bare RecommendAction", bare_server_argv(), METHOD_PATH, action_body, action, pb.RecommendActionResponse),
            ("RecommendAction (heads bundle)", real_server_argv([*served, "--weights-dir", str(heads)]), METHOD_PATH, action_body, action,
             pb.RecommendActionResponse),
            ("RecommendProduct (heads)", real_server_argv([*served, "--weights-dir", str(heads)]), PRODUCT_PATH, product_body, product,
             pb.RecommendProductResponse),
            ("RecommendProduct (rules: no heads)", real_server_argv([*served, "--weights-dir", str(flat)]), PRODUCT_PATH, product_body,
             product, pb.RecommendProductResponse),
        ]
        try:
            for name, server_argv, path, body, message, response in plan:
                print(f"[{name}]", flush=True)
                runs[name] = measured(name, server_argv, path, body, message, response, args)
        except BenchError as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 1
    bare = runs["bare RecommendAction"]["requests_per_s"]
    ratios = {name: r["requests_per_s"] / bare for name, r in runs.items()}
    print()
    for name, ratio in ratios.items():
        print(f"{name:38} {runs[name]['requests_per_s']:8.0f} req/s  {ratio:.2f} of bare")
    if args.json:
        write_results(args.json, {**header("bench.product_serving", started, argv, cores_busy_before_run=round(busy, 3)),
                                  "request_bytes": {"action": action.ByteSize(), "product": product.ByteSize()},
                                  "runs": runs, "of_bare": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
