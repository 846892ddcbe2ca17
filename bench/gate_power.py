"""How many held-out sessions the gate needs to certify a step: its paired DR interval at several sizes, and with a Q̂
that knows what no learner can.

    .venv/bin/python -m bench.gate_power --current A.bundle --candidate B.bundle     # world 7, 20,000 fresh sessions
    .venv/bin/python -m bench.gate_power ... --sizes 4000,10000,20000 --json

``--current`` serves ``--sessions`` fresh sessions of world ``--seed`` (from ``--first-session``, which
must be disjoint from the sessions the two bundles were trained on) through the server's decision
code and recorder (its trace is its truth), and the candidate plays the same sessions in process,
so the true difference is paired per chunk. The fresh logs are cut into disjoint chunks of each ``--sizes`` (the gate's
held-out side: 6,000 sessions at the default sample), and on each chunk the gate's own
``evaluate_bundle`` and ``gate`` (tolerance 0) judge candidate − current twice:

- with the gate's Q̂ (``trainer.evaluation.q_features``: a projection of the state, page type,
  position);
- with an **oracle Q̂**: the same features plus the simulator's hidden intent of the session and
  its product with the page type, fitted as always on the other folds of episodes. No learner can
  have these; they say how much of the interval any better Q̂ could remove.

Next to both, the **on-policy canary** a shop could run instead: on each chunk, the candidate's
real objective on a ``--canary`` share of its sessions (5 %, a seeded draw per session as a keyed
session hash would make) against the current's on the rest, their difference of means with a
normal 95 % interval (unpaired: no session is seen by both bundles). No weights: it holds the truth
as an A/B test does, and its width is what a canary of that share would have to live with.

Per size and judge: the mean interval width, the root-mean-square error against the paired truth,
how often the interval held it, and how often the gate published. A bundle pair from
``bench.loop --workdir W``: ``W/weights/history/<version before cycle k>.bundle`` and
``W/candidate-<k>.bundle`` of a refused cycle ``k``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.loop import SALT, UTC, intents, per_session
from bench.report import add_json_flag, header, write_results
from experience.objective import BusinessObjective
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from trainer import evaluation, offline
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

QFeatures = Callable[..., np.ndarray]


def with_intent(intent_rows: Callable[[], np.ndarray]) -> QFeatures:
    """The gate's Q̂ features plus the hidden intent one-hot and intent × page type (``intent_rows``: per step, in the
    episodes' step order, of the chunk being judged)."""
    gate_features = evaluation.q_features

    def features(steps: Any, positions: np.ndarray, projection: np.ndarray) -> np.ndarray:
        base = gate_features(steps, positions, projection)
        intent = intent_rows()
        page = base[:, evaluation.PROJECTION_DIM : evaluation.PROJECTION_DIM + 5]
        return np.concatenate([base, intent, (intent[:, :, None] * page[:, None, :]).reshape(len(base), -1)], axis=1)

    return features


def judged(candidate: ModelSet, current: ModelSet, d: pa.Table, o: pa.Table) -> dict[str, Any]:
    whole = d.num_rows + 1  # one chunk: the oracle's intent rows are those of the whole chunk of sessions
    new, old = evaluation.evaluate_bundle(candidate, d, o, chunk=whole), evaluation.evaluate_bundle(current, d, o, chunk=whole)
    diff = offline.difference(new.report, old.report, "dr")
    return {"estimate": diff.value, "ci_low": diff.ci_low, "ci_high": diff.ci_high, "publish": evaluation.gate(new, old, 0.0).publish}


def canary(candidate: np.ndarray, current: np.ndarray, in_canary: np.ndarray) -> dict[str, Any]:
    """The on-policy comparison a canary would make on these sessions: the candidate's objective on the canary's share,
    the current's on the rest (each the bundle's real play of that session), their difference of means with a normal
    95 % interval (unpaired: no session is seen by both)."""
    a, b = candidate[in_canary], current[~in_canary]
    if len(a) < 2 or len(b) < 2:
        raise ValueError("canary: each side needs at least 2 sessions")
    value = float(a.mean() - b.mean())
    half = 1.96 * math.sqrt(float(a.var(ddof=1)) / len(a) + float(b.var(ddof=1)) / len(b))
    return {"estimate": value, "ci_low": value - half, "ci_high": value + half, "publish": value - half >= 0.0, "canary_sessions": len(a)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    err = np.array([r["estimate"] - r["truth"] for r in rows])
    return {"chunks": len(rows), "mean_width": float(np.mean([r["ci_high"] - r["ci_low"] for r in rows])),
            "rmse_vs_truth": float(math.sqrt(np.mean(err**2))),
            "held_truth": sum(r["ci_low"] <= r["truth"] <= r["ci_high"] for r in rows), "published": sum(r["publish"] for r in rows)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_power", description=__doc__.splitlines()[0])
    p.add_argument("--current", type=Path, required=True)
    p.add_argument("--candidate", type=Path, required=True)
    p.add_argument("--seed", type=int, default=7, help="the world")
    p.add_argument("--sessions", type=int, default=20_000)
    p.add_argument("--first-session", type=int, default=500_000)
    p.add_argument("--sizes", default="4000,10000,20000", help="held-out sizes, comma-separated")
    p.add_argument("--canary", type=float, default=0.05, help="the share of sessions an on-policy canary would serve")
    add_json_flag(p, "gate_power.json")
    args = p.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if not (500 <= args.sessions <= 200_000 and all(200 <= s <= args.sessions for s in sizes)):
        p.error("--sessions 500..200,000; every size 200..--sessions")
    if not 0.0 < args.canary < 1.0 or min(sizes) * min(args.canary, 1 - args.canary) < 20:
        p.error("--canary: a share in (0, 1) that leaves at least 20 sessions on each side of the smallest size")
    started, started_wall = time.monotonic(), time.time()
    options = LoadOptions(device="cpu", warmup_batch=8)
    world = World(SimConfig(), args.seed)
    current, candidate = (ModelSet.load(read_bundle(b), options) for b in (args.current, args.candidate))
    sessions = range(args.first_session, args.first_session + args.sessions)
    with tempfile.TemporaryDirectory(prefix="gate-power-") as tmp:
        trace, _ = run_logged(world, current, sessions, UTC, Path(tmp), SALT)
        source = DirectorySource(tmp)
        decisions, outcomes = source.table("decisions"), source.table("outcomes")
    candidate_value = per_session(run_in_process(world, candidate, sessions, UTC), world, sessions)["objective"]
    current_value = per_session(trace, world, sessions)["objective"]
    truth = candidate_value - current_value
    in_canary = np.random.default_rng([args.seed, 2]).random(len(sessions)) < args.canary  # as a keyed session hash would
    session_of = dict(zip(trace.decision_ids, (int(s.rsplit("-s", 1)[1]) for s in trace.decision_sessions), strict=True))
    row_session = np.array([session_of[d] for d in decisions.column("decision_id").to_pylist()])
    intent_of = intents(world, sessions)
    keys = sorted(set(intent_of.values()))
    chunk_intents: list[np.ndarray] = []
    oracle = with_intent(lambda: chunk_intents[-1])
    results: dict[str, Any] = {"sizes": {}}
    for size in sizes:
        rows: dict[str, list[dict[str, Any]]] = {"gate_q": [], "oracle_q": [], "canary": []}
        for lo in range(args.first_session, args.first_session + args.sessions - size + 1, size):
            mask = (row_session >= lo) & (row_session < lo + size)
            d = decisions.filter(pa.array(mask))
            o = outcomes.filter(pc.is_in(outcomes.column("session_id"), pc.unique(d.column("session_id"))))
            steps = row_session[mask][np.asarray(build_episodes(d, o, BusinessObjective().episode_config()).rows)]
            chunk_intents.append(np.eye(len(keys), dtype=np.float32)[[keys.index(intent_of[f"sim{args.seed}-s{s}"]) for s in steps]])
            true = float(truth[lo - args.first_session : lo - args.first_session + size].mean())
            rows["gate_q"].append({"truth": true, **judged(candidate, current, d, o)})
            with mock.patch.object(evaluation, "q_features", oracle):
                rows["oracle_q"].append({"truth": true, **judged(candidate, current, d, o)})
            part = slice(lo - args.first_session, lo - args.first_session + size)
            rows["canary"].append({"truth": true, **canary(candidate_value[part], current_value[part], in_canary[part])})
            print(f"size {size:,} from {lo:,}: truth {true:+.2f}; "
                  + "; ".join(f"{k} {r[-1]['estimate']:+.2f} [{r[-1]['ci_low']:+.2f}, {r[-1]['ci_high']:+.2f}]" for k, r in rows.items()),
                  file=sys.stderr, flush=True)
        results["sizes"][str(size)] = {k: {**summary(r), "per_chunk": r} for k, r in rows.items()}
    results.update({"world_seed": args.seed, "sessions": [sessions.start, sessions.stop], "current": current.version,
                    "candidate": candidate.version, "true_difference": float(truth.mean()),
                    "true_difference_ci95": 1.96 * float(truth.std(ddof=1)) / math.sqrt(len(truth)),
                    "seconds": time.monotonic() - started})
    print(f"candidate − current by the truth on all {len(truth):,} sessions: {results['true_difference']:+.2f} "
          f"± {results['true_difference_ci95']:.2f}")
    print("held-out sessions | judge | chunks | mean width | RMSE vs truth | held the truth | published")
    for size, by_q in results["sizes"].items():
        for q, s in by_q.items():
            print(f"{int(size):>9,} | {q} | {s['chunks']} | {s['mean_width']:.2f} | {s['rmse_vs_truth']:.2f} | "
                  f"{s['held_truth']}/{s['chunks']} | {s['published']}/{s['chunks']}")
    if args.json:
        write_results(args.json, {**header("bench.gate_power", started_wall, argv), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
