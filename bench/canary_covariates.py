"""How much a regression-adjusted (CUPED-like) canary judge could gain: the share of a session's objective that
what is known before the first decision explains.

    .venv/bin/python -m bench.canary_covariates [--sessions 30000] [--seed 7] [--json]

The canary judge (``trainer.canary``) compares the mean objective per session of two randomised sides with a Welch
interval. Adjusting each session's objective by a regression on pre-treatment covariates (the first request's state,
which no policy has yet acted on) narrows that interval by a factor √(1 − R²), R² the share of the objective's variance
the covariates explain out of sample. This bench measures that R² on the simulator, for two policies (always
add_to_cart and the intent policy), with the covariates the trainer itself sees: the first page's state from the
embedded bundle's feature encoder (item embedding, behaviour buckets, hour), its page type and cart count. Ridge
regression, two-fold cross-fitted (each half predicted by a fit on the other). For scale, the same R² with the
hidden intent instead (its mean per intent): no feature-based adjustment can explain the part within an intent.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np

from bench.loop import constant, per_session, play
from bench.report import add_json_flag, header, write_results
from core.domain import Action
from policy.features import local_hour
from simulator.config import SimConfig
from simulator.reference import intent_policy
from simulator.world import PageView, ShopperSession, World
from weights.embedded import default_bundle
from weights.model_set import ModelSet

FIRST = 3_000_000  # a session range no other bench plays
UTC = ZoneInfo("UTC")


def cross_fitted_r2(x: np.ndarray, y: np.ndarray, ridge: float = 10.0, seed: int = 0) -> float:
    """Out-of-sample R² of a ridge regression of ``y`` on ``x``, two folds, each predicted by the other's fit."""
    fold = np.random.default_rng(seed).integers(0, 2, len(y))
    predicted = np.empty(len(y))
    for k in (0, 1):
        fit, out = fold != k, fold == k
        mu, sd = x[fit].mean(axis=0), x[fit].std(axis=0) + 1e-9
        z = (x[fit] - mu) / sd
        beta = np.linalg.solve(z.T @ z + ridge * np.eye(z.shape[1]), z.T @ (y[fit] - y[fit].mean()))
        predicted[out] = ((x[out] - mu) / sd) @ beta + y[fit].mean()
    return float(1.0 - np.var(y - predicted) / np.var(y))


def measured(world: World, sessions: range, name: str, choose: Any, model: ModelSet) -> dict[str, Any]:
    """Play ``choose`` on ``sessions``; the R² of the first request's covariates and of the hidden intent."""
    first: dict[str, tuple[ShopperSession, PageView]] = {}

    def remembering(session: ShopperSession, page: PageView) -> Action:
        first.setdefault(session.session_id, (session, page))
        return choose(session, page)

    y = per_session(play(world, sessions, remembering), world, sessions)["objective"]
    pairs = [first[f"sim{world.seed}-s{i}"] for i in sessions]
    requests = [s.request(p) for s, p in pairs]
    states = model.encoder.encode_batch(requests, [local_hour(r.event_time_s, UTC) for r in requests])
    page_type = np.eye(8)[[int(r.page_type) for r in requests]]
    extra = np.array([[r.cart_item_count, len(r.recent_behavior_ids)] for r in requests], dtype=np.float64)
    x = np.hstack([states.astype(np.float64), page_type, extra])
    intent = np.array([s.intent.key for s, _ in pairs])
    means = {k: y[intent == k].mean() for k in set(intent)}
    within = y - np.array([means[k] for k in intent])
    r2 = cross_fitted_r2(x, y)
    return {"policy": name, "sessions": len(y), "objective_mean": float(y.mean()), "objective_sd": float(y.std(ddof=1)),
            "r2_first_request": r2, "interval_width_factor": float(np.sqrt(max(1.0 - r2, 0.0))),
            "r2_hidden_intent": float(1.0 - np.var(within) / np.var(y))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_covariates", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=30_000)
    parser.add_argument("--seed", type=int, default=7, help="the world")
    add_json_flag(parser, "canary_covariates.json")
    args = parser.parse_args(argv)
    started = time.time()
    world, model = World(SimConfig(), args.seed), ModelSet.load(default_bundle())
    sessions = range(FIRST, FIRST + args.sessions)
    rows = [measured(world, sessions, "always add_to_cart", constant(Action.ADD_TO_CART), model),
            measured(world, sessions, "intent policy", intent_policy, model)]
    for r in rows:
        print(f"{r['policy']:>20}: objective {r['objective_mean']:.2f} ± sd {r['objective_sd']:.1f}; R² first request "
              f"{r['r2_first_request']:.3f} (interval × {r['interval_width_factor']:.3f}); R² hidden intent {r['r2_hidden_intent']:.3f}")
    if args.json:
        write_results(args.json, {**header("bench.canary_covariates", started, argv), "seed": args.seed, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
