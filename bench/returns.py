"""Trainer-input benchmark: vectorised returns against a plain Python loop, and the whole log → returns path.

    .venv/bin/python -m bench.returns                  # about 5 s on 2 cores
    .venv/bin/python -m bench.returns --quick          # smoke run, a few seconds
    .venv/bin/python -m bench.returns --json           # also write bench/results/returns.json

In one run, on one core (numpy, no threads):

1. **Returns**: random episodes of 5–15 steps with sparse rewards (10 % non-zero).
   ``discounted_returns`` and ``n_step_returns`` (n = 3) over ``--steps`` steps (best of
   ``--repeats``), and a plain Python loop (``G = r + γ G`` backwards over lists, the fastest
   pure-Python form, also best of ``--repeats``) over the first ``--loop-steps`` steps of the
   same episodes; the loop's returns must equal the vectorised ones. Steps/s for each and
   the ratio.
2. **Join + attribute + returns**: synthetic decision and outcome logs built **in memory as
   Arrow tables** (no log reader yet; no disk I/O is timed): ``--decisions`` decisions in
   sessions of 5–15 steps, ~0.4 outcomes per decision (add_to_cart, orders, coupon use,
   shares, exits), 2 % duplicated outcomes, 1 % orphans, rows shuffled (out-of-order
   arrival), a few sessions running past the 72 h horizon. Timed: ``build_episodes`` (sort,
   de-duplicate, join, attribute), then ``discounted_returns``, then ``session_returns`` +
   ``mean_return`` (best of ``--repeats``).

Every loop is bounded by the flags' limits.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``policy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.report import add_json_flag, header, write_results
from core.domain import Action, Outcome
from experience.returns import GAMMA, discounted_returns, mean_return, n_step_returns, session_returns
from experience.sessions import HORIZON_S, build_episodes

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """What one run measures; built once from the flags."""

    steps: int
    """Steps of random episodes for the vectorised returns."""
    loop_steps: int
    """The first this many of them (whole episodes) for the Python loop."""
    decisions: int
    """Decisions in the synthetic logs for the join."""
    repeats: int
    """Each vectorised timing is the best of this many runs."""
    seed: int


def best_of(repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    """The fastest of ``repeats`` runs of ``fn`` (seconds) and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    assert result is not None
    return best, result


def random_episodes(rng: np.random.Generator, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Episodes of 5–15 steps laid end to end, ``steps`` in all; 10 % of the rewards non-zero."""
    lengths = rng.integers(5, 16, size=steps // 5 + 1)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), steps)) + 1]
    lengths[-1] -= int(lengths.sum()) - steps
    lengths = lengths[lengths > 0]
    starts = np.cumsum(lengths) - lengths
    rewards = np.where(rng.random(steps) < 0.1, rng.lognormal(3.0, 1.0, steps), 0.0)
    return rewards, starts, lengths


def python_returns(rewards: list[float], starts: list[int], lengths: list[int], gamma: float) -> list[float]:
    """The plain loop the vectorised kernel replaces."""
    out = [0.0] * len(rewards)
    for start, length in zip(starts, lengths, strict=True):
        g = 0.0
        for t in range(start + length - 1, start - 1, -1):
            g = rewards[t] + gamma * g
            out[t] = g
    return out


def bench_returns(settings: Settings) -> dict[str, Any]:
    rng = np.random.default_rng(settings.seed)
    rewards, starts, lengths = random_episodes(rng, settings.steps)
    vec_s, returns = best_of(settings.repeats, lambda: discounted_returns(rewards, starts, lengths, GAMMA))
    nstep_s, _ = best_of(settings.repeats, lambda: n_step_returns(rewards, starts, lengths, 3, GAMMA))
    n_loop = int(np.searchsorted(np.cumsum(lengths), settings.loop_steps, side="right"))  # whole episodes only
    loop_steps = int(lengths[:n_loop].sum())
    r_list, s_list, l_list = rewards[:loop_steps].tolist(), starts[:n_loop].tolist(), lengths[:n_loop].tolist()
    loop_s, loop = best_of(settings.repeats, lambda: python_returns(r_list, s_list, l_list, GAMMA))
    if not np.allclose(loop, returns[:loop_steps], rtol=1e-12, atol=1e-9):
        raise AssertionError("the Python loop and the vectorised returns disagree")
    return {
        "steps": settings.steps,
        "episodes": len(lengths),
        "max_length": int(lengths.max()),
        "vectorised_s": vec_s,
        "vectorised_steps_per_s": settings.steps / vec_s,
        "n_step_3_s": nstep_s,
        "n_step_3_steps_per_s": settings.steps / nstep_s,
        "loop_steps": loop_steps,
        "loop_s": loop_s,
        "loop_steps_per_s": loop_steps / loop_s,
        "speedup": (settings.steps / vec_s) / (loop_steps / loop_s),
    }


def _ids(prefix: str, values: np.ndarray) -> pa.Array:
    return pc.binary_join_element_wise(prefix, pc.cast(pa.array(values), pa.string()), "-")


def synthetic_logs(rng: np.random.Generator, n_decisions: int) -> tuple[pa.Table, pa.Table]:
    """Decision and outcome tables with the join's columns (see the module doc), rows shuffled."""
    lengths = rng.integers(5, 16, size=n_decisions // 5 + 1)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), n_decisions)) + 1]
    lengths[-1] -= int(lengths.sum()) - n_decisions
    lengths = lengths[lengths > 0]
    n_sessions = len(lengths)
    session = np.repeat(np.arange(n_sessions), lengths)
    session_key = rng.permutation(10 * n_sessions)[:n_sessions]  # ids unrelated to time order
    t0 = 1.7e9 + rng.random(n_sessions) * 7 * 86_400
    gaps = rng.exponential(90.0, n_decisions)
    gaps[np.cumsum(lengths) - lengths] = 0.0
    late = rng.random(n_decisions) < 0.0005  # a few long pauses: those sessions outlive the horizon
    gaps[late] += HORIZON_S
    offsets = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[np.cumsum(lengths) - lengths], lengths)
    times = t0[session] + offsets
    action = rng.choice([int(a) for a in Action], size=n_decisions, p=[0.25, 0.4, 0.1, 0.1, 0.15])
    decisions = pa.table(
        {
            "decision_id": _ids("d", rng.permutation(n_decisions)),
            "session_id": _ids("s", session_key[session]),
            "event_time_s": times,
            "action": pa.array(action.astype(np.int8)),
        }
    )

    parts: list[tuple[np.ndarray, np.ndarray, int, np.ndarray]] = []  # (decision index, delay, kind, value)

    def emit(mask: np.ndarray, kind: Outcome, delay: np.ndarray, value: np.ndarray) -> None:
        idx = np.flatnonzero(mask)
        parts.append((idx, delay[: len(idx)], int(kind), value[: len(idx)]))

    noise = rng.random(n_decisions)
    cart, coupon, share = action == int(Action.ADD_TO_CART), action == int(Action.APPLY_COUPON), action == int(Action.SHARE_SOCIAL)
    emit(cart & (noise < 0.7), Outcome.ADD_TO_CART, rng.exponential(5.0, n_decisions), np.zeros(n_decisions))
    emit(cart & (noise < 0.25), Outcome.ORDER, rng.exponential(4 * 3600.0, n_decisions), rng.lognormal(4.0, 1.0, n_decisions))
    emit(coupon & (noise < 0.3), Outcome.ORDER, rng.exponential(1800.0, n_decisions), rng.lognormal(4.0, 1.0, n_decisions))
    emit(coupon & (noise < 0.3), Outcome.COUPON_USED, rng.exponential(60.0, n_decisions), np.zeros(n_decisions))
    emit(share & (noise < 0.5), Outcome.SHARE, rng.exponential(30.0, n_decisions), np.zeros(n_decisions))
    last = np.zeros(n_decisions, dtype=np.bool_)
    last[np.cumsum(lengths) - 1] = True
    emit(last & (noise < 0.7), Outcome.EXIT, rng.exponential(60.0, n_decisions), np.zeros(n_decisions))

    idx = np.concatenate([p[0] for p in parts])
    kind = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int8) for p in parts])
    event = times[idx] + np.concatenate([p[1] for p in parts])
    value = np.concatenate([p[3] for p in parts])
    discount = np.where((kind == int(Outcome.ORDER)) & (rng.random(len(idx)) < 0.3), 0.1 * value, 0.0)
    sessions = session_key[session[idx]]
    orphan = rng.random(len(idx)) < 0.01
    sessions = np.where(orphan, -1 - np.arange(len(idx)), sessions)  # keys no decision has
    outcome_id = np.arange(len(idx))
    dup = np.flatnonzero(rng.random(len(idx)) < 0.02)  # re-sent copies, received later
    rows = np.concatenate([np.arange(len(idx)), dup])
    received = event[rows] + rng.exponential(2.0, len(rows)) + np.concatenate([np.zeros(len(idx)), 1 + rng.random(len(dup))])
    shuffled = rng.permutation(len(rows))
    rows, received = rows[shuffled], received[shuffled]
    outcomes = pa.table(
        {
            "outcome_id": _ids("o", outcome_id[rows]),
            "decision_id": _ids("d", idx[rows]),
            "session_id": _ids("s", sessions[rows]),
            "outcome": pa.array(kind[rows]),
            "value": value[rows],
            "coupon_discount": discount[rows],
            "event_time_s": event[rows],
            "received_s": received,
        }
    )
    return decisions, outcomes


def bench_join(settings: Settings) -> dict[str, Any]:
    rng = np.random.default_rng(settings.seed + 1)
    start = time.perf_counter()
    decisions, outcomes = synthetic_logs(rng, settings.decisions)
    build_s = time.perf_counter() - start
    join_s, episodes = best_of(settings.repeats, lambda: build_episodes(decisions, outcomes))
    returns_s, _ = best_of(settings.repeats, lambda: discounted_returns(episodes.rewards, episodes.starts, episodes.lengths))
    summary_s, summary = best_of(settings.repeats, lambda: mean_return(session_returns(episodes)))
    total = join_s + returns_s + summary_s
    return {
        "decisions": decisions.num_rows,
        "outcomes": outcomes.num_rows,
        "synthetic_build_s": build_s,
        "episodes": episodes.n_episodes,
        "steps": episodes.n_steps,
        "closed": int(episodes.closed.sum()),
        "truncated": int(episodes.truncated.sum()),
        "nonzero_rewards": int((episodes.rewards != 0).sum()),
        "report": episodes.report.to_dict(),
        "mean_return": summary.to_dict(),
        "join_attribute_s": join_s,
        "returns_s": returns_s,
        "session_returns_s": summary_s,
        "total_s": total,
        "decisions_per_s": decisions.num_rows / total,
    }


def print_report(returns: dict[str, Any], join: dict[str, Any]) -> None:
    print(f"\nreturns, {returns['steps']:,} steps in {returns['episodes']:,} episodes (5-15 steps), γ = {GAMMA}, one core")
    print(f"  {'':26} {'steps':>12} {'seconds':>9} {'steps/s':>14}")
    print(f"  {'vectorised (full)':26} {returns['steps']:>12,} {returns['vectorised_s']:>9.4f} {returns['vectorised_steps_per_s']:>14,.0f}")
    print(
        f"  {'vectorised (n-step, n=3)':26} {returns['steps']:>12,} {returns['n_step_3_s']:>9.4f} {returns['n_step_3_steps_per_s']:>14,.0f}"
    )
    print(f"  {'python loop':26} {returns['loop_steps']:>12,} {returns['loop_s']:>9.4f} {returns['loop_steps_per_s']:>14,.0f}")
    print(f"  vectorised / loop: {returns['speedup']:.1f}x")
    print(f"\njoin + attribute + returns, synthetic in-memory Arrow tables: {join['decisions']:,} decisions, {join['outcomes']:,} outcomes")
    for label, key in (
        ("build_episodes (join, attribute)", "join_attribute_s"),
        ("discounted_returns", "returns_s"),
        ("session_returns + mean_return", "session_returns_s"),
        ("total", "total_s"),
    ):
        print(f"  {label:34} {join[key]:>8.3f} s")
    r, m = join["report"], join["mean_return"]
    print(
        f"  {join['episodes']:,} episodes, {join['steps']:,} steps, {join['closed']:,} closed, {join['truncated']:,} truncated,"
        f" {join['nonzero_rewards']:,} rewarded steps"
    )
    print(
        f"  dropped: {r['n_duplicate_outcomes']:,} duplicate, {r['n_orphan_outcomes']:,} orphan,"
        f" {r['n_outcomes_outside_horizon']:,} outside-horizon outcomes; {r['n_truncated_steps']:,} truncated steps"
    )
    print(f"  mean_return {m['mean']:.3f}  95% CI [{m['low']:.3f}, {m['high']:.3f}]")


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path | None]:
    p = argparse.ArgumentParser(prog="python -m bench.returns", description="Vectorised returns and the log join, timed.")
    p.add_argument("--steps", type=int, default=2_000_000, help="steps for the vectorised returns (default 2M)")
    p.add_argument("--loop-steps", type=int, default=200_000, help="steps for the Python loop (default 200k)")
    p.add_argument("--decisions", type=int, default=1_000_000, help="decisions in the synthetic logs (default 1M)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per vectorised timing (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 200k steps, 20k loop steps, 100k decisions")
    add_json_flag(p, "returns.json")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.loop_steps, args.decisions = 200_000, 20_000, 100_000
    if not (1_000 <= args.steps <= 50_000_000 and 100 <= args.loop_steps <= min(args.steps, 5_000_000)):
        p.error("--steps must be in [1e3, 5e7]; --loop-steps in [100, min(--steps, 5e6)]")
    if not (1_000 <= args.decisions <= 20_000_000 and 1 <= args.repeats <= 20):
        p.error("--decisions must be in [1e3, 2e7]; --repeats in [1, 20]")
    return Settings(args.steps, args.loop_steps, args.decisions, args.repeats, args.seed), args.json


def main(argv: Sequence[str] | None = None) -> int:
    settings, json_path = parse_args(argv)
    started = time.time()
    returns = bench_returns(settings)
    join = bench_join(settings)
    print_report(returns, join)
    if json_path is not None:
        write_results(json_path, {
            **header("bench.returns", started, argv, numpy=np.__version__, pyarrow=pa.__version__),
            "settings": asdict(settings),
            "returns": returns,
            "join": join,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
