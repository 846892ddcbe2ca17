"""What a first action is worth, as the logs tell it and as the shopper pays it: the continuation decides.

    .venv/bin/python -m bench.continuation [--untrained-logs 0.5,100] [--log-sessions 20000] [--eval-sessions 6000]
        [--seed 7] [--json]

The trainer's returns (and its learned critic's R_ψ(s, a)) are Monte Carlo: a logged page's return is what the
*behaviour* went on to do after it. A prompt whose pay-off needs the right follow-up (a coupon or a share prompt raises
the order probability only once something is in the cart) is then worth what the behaviour's follow-up makes of it.
This bench sets the two side by side, per hidden intent and first action:

* **logged**: the session's undiscounted return (the objective per session) of every logged session, by its first
  action, from logs of ``--log-sessions`` sessions (from 0) served by ``bench.loop``'s untrained bundle with the
  exploration asked for (``bench.offline_learners --untrained-logs``), read back through the trainer's own pipeline;
* **played**: the truth sessions ``[10⁶, 10⁶ + --eval-sessions)`` of the same world, each first action served on the
  first page, then one continuation on every later page: that same behaviour bundle, always add_to_cart, or the intent
  policy (which reads the hidden intent: a reference).

The logged column and the played behaviour column estimate the same thing on disjoint sessions (a check of the logs'
reading); the other two show what the same first action is worth when it is followed up well. Writes
``bench/results/continuation.json`` with ``--json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.loop import SALT, TRUTH_FIRST, UTC, constant, intents, interval, per_session, play
from bench.offline_learners import exploration_of, explored_logs
from bench.report import add_json_flag, header, write_results
from core.domain import Action
from experience.records import SESSION, hash_id
from experience.segments import DirectorySource
from policy.features import context_of
from simulator.config import SimConfig
from simulator.drive import decision_id
from simulator.reference import intent_policy
from simulator.world import PageView, ShopperSession, World
from trainer.config import TrainConfig
from trainer.data import experience
from weights.bundle import read_bundle
from weights.model_set import LoadOptions, ModelSet

FIRST_ACTIONS = (Action.ADD_TO_CART, Action.VIEW_DETAIL, Action.APPLY_COUPON, Action.SHARE_SOCIAL)
Choose = Callable[[ShopperSession, PageView], Action]


def session_index(session: ShopperSession) -> int:
    """``sim<seed>-s<index>`` → index (the simulator's session ids)."""
    return int(session.session_id.rsplit("-s", 1)[1])


def bundle_chooser(model: ModelSet, seed: int) -> Choose:
    """The bundle's served action on one page, with the decision id ``run_in_process`` gives that page."""

    def choose(session: ShopperSession, page: PageView) -> Action:
        request = session.request(page)
        return model.run([request], [context_of(request, UTC)], [decision_id(seed, session_index(session), page.step)])[0].action

    return choose


def first_then(first: Action, then: Choose) -> Choose:
    """``first`` on a session's first page, ``then`` on every later one."""
    return lambda session, page: first if page.step == 0 else then(session, page)


def logged_first_returns(logs: Path, init: Path, world: World, sessions: range) -> dict[str, np.ndarray]:
    """Per logged session (in episode order): its first action's index, its undiscounted return, its hidden intent.

    The logs are read as ``train`` reads them (episodes, the reward configuration, its horizon), with γ = 1 and no
    reward normalisation, so a session's return at its first step is its objective.
    """
    source = DirectorySource(logs)
    model = ModelSet.load(read_bundle(init), LoadOptions(device="cpu", warmup_batch=8))
    exp = experience(source.table("decisions"), source.table("outcomes"), model, TrainConfig(gamma=1.0, normalize_rewards=False))
    starts = exp.episodes.starts
    by_hash = {hash_id(f"sim{world.seed}-s{i}", SALT, SESSION): world.session(i).intent.key for i in sessions}
    return {"first": exp.steps.actions[starts], "value": exp.returns[starts],
            "intent": np.array([by_hash[s] for s in exp.episodes.session_ids])}


def by_intent(first: np.ndarray, value: np.ndarray, intent: np.ndarray) -> dict[str, dict[str, dict[str, float]]]:
    """{intent: {first action: mean, 95 % interval and count of ``value``}}."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for key in sorted(set(intent.tolist())):
        row = {}
        for action in FIRST_ACTIONS:
            chosen = value[(intent == key) & (first == action.index)]
            cell: dict[str, float] = {"n": len(chosen)}
            if len(chosen):
                cell["mean"] = float(chosen.mean())
            if len(chosen) > 1:
                cell |= interval(chosen)
            row[action.key] = cell
        table[key] = row
    return table


def played(world: World, truth: range, choose: Choose) -> dict[str, dict[str, dict[str, float]]]:
    """Each first action, then ``choose``, on every truth session: the objective per session by intent and first action."""
    intent = np.array(list(intents(world, truth).values()))  # in the order of ``truth``, as ``per_session``'s values
    firsts, values = [], []
    for action in FIRST_ACTIONS:
        values.append(per_session(play(world, truth, first_then(action, choose)), world, truth)["objective"])
        firsts.append(np.full(len(truth), action.index))
    return by_intent(np.concatenate(firsts), np.concatenate(values), np.tile(intent, len(FIRST_ACTIONS)))


def best_first(table: dict[str, dict[str, dict[str, float]]]) -> dict[str, str]:
    return {key: max((a for a in row if row[a]["n"]), key=lambda a: row[a]["mean"]) for key, row in table.items()}


def show(name: str, table: dict[str, dict[str, dict[str, float]]]) -> None:
    print(name)
    for key, row in table.items():
        cells = [f"{a[:4]} {c['mean']:6.1f} ±{(c.get('ci_high', np.nan) - c.get('ci_low', np.nan)) / 2:4.1f} ({c['n']})"
                 if c["n"] else f"{a[:4]} –" for a, c in row.items()]
        print(f"  {key:15s} " + " | ".join(cells), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.continuation", description=__doc__.splitlines()[0])
    p.add_argument("--untrained-logs", metavar="EPSILON,TEMPERATURE", default="0.5,100",
                   help="the untrained bundle's exploration while it logs (default 0.5,100: half the pages uniform)")
    p.add_argument("--log-sessions", type=int, default=20_000)
    p.add_argument("--eval-sessions", type=int, default=6000)
    p.add_argument("--seed", type=int, default=7, help="the world")
    add_json_flag(p, "continuation.json")
    args = p.parse_args(argv)
    if not 100 <= args.log_sessions < TRUTH_FIRST:
        p.error(f"--log-sessions: 100..{TRUTH_FIRST - 1:,}")
    if not 100 <= args.eval_sessions <= 200_000:
        p.error("--eval-sessions: 100..200,000")
    try:
        explore = exploration_of(args.untrained_logs)
    except ValueError as exc:
        p.error(f"--untrained-logs: {exc}")
    started = time.time()
    world = World(SimConfig(), args.seed)
    truth = range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions)
    with tempfile.TemporaryDirectory(prefix="bench-continuation-") as tmp:
        init = explored_logs(world, None, *explore, args.log_sessions, Path(tmp))
        logged = logged_first_returns(Path(tmp) / "logs", init, world, range(args.log_sessions))
        behaviour = ModelSet.load(read_bundle(init), LoadOptions(device="cpu", warmup_batch=8))
    tables = {"logged (the behaviour's continuation)": by_intent(**logged)}
    continuations: dict[str, Choose] = {"then the behaviour": bundle_chooser(behaviour, args.seed),
                                        "then always add_to_cart": constant(Action.ADD_TO_CART), "then the intent policy": intent_policy}
    for name, choose in continuations.items():
        tables[f"played, {name}"] = played(world, truth, choose)
    for name, table in tables.items():
        show(name, table)
    if args.json is not None:
        write_results(args.json, {**header("bench.continuation", started, argv), "world_seed": args.seed,
                                  "logs": {"untrained_exploration": explore, "sessions": args.log_sessions},
                                  "truth_sessions": [truth.start, truth.stop], "tables": tables,
                                  "best_first_action": {name: best_first(t) for name, t in tables.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
