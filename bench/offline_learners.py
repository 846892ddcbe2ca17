"""Learners on the same logs: each trainer configuration from one starting bundle, every result on the same truth sessions.

    .venv/bin/python -m bench.offline_learners --logs DIR --init B.bundle --config A.json --config B.json [--seed 7]
        [--eval-sessions 6000] [--json]
    .venv/bin/python -m bench.offline_learners --untrained-logs 0.5,100 [--behaviour B.bundle] [--log-sessions 20000]
        --config A.json ...
    ... --vw   (Vowpal Wabbit, tuned as ``bench.loop`` tunes it, on the first config's window: the peer on the same rows)

Where ``bench.loop`` asks what the CronJob cycle reaches, this asks what one ``train`` extracts from
a fixed set of logs (for example a ``bench.loop --workdir`` run's directory, logged in world
``--seed``): each ``--config`` (a TrainConfig JSON) trains from ``--init`` on ``--logs``, then plays
the truth sessions ``[10⁶, 10⁶ + --eval-sessions)`` of that world, as ``bench.loop`` scores them: the
objective per session, the action mix per hidden intent, and the paired difference to the best
constant action and to ``--init``; the intent policy is the reference. Writes
``bench/results/offline_learners.json`` with ``--json``.

``--untrained-logs EPSILON,TEMPERATURE`` writes the logs first instead: ``--log-sessions`` sessions of the world
(from session 0, disjoint from the truth sessions) served by ``bench.loop``'s untrained bundle with its decoder's
exploration set to these (``exploration_epsilon``, ``exploration_temperature``: say 0.5,100 for half the pages
drawn uniformly from the allowed actions), which is then ``--init``: what one run extracts from logs as broad as
the behaviour can make them, against the untrained bundle's own (0.05,1.2). ``--behaviour B.bundle`` serves them with
that bundle's policy instead (say a trained one that serves add_to_cart: logs whose follow-up after an explored prompt is
the trained policy's), under the same exploration, and starts every run from it.

``--vw`` adds the loop's peer learner on the very rows the first ``--config`` trained on: the ``trainer.window`` record of
the bundle it wrote (versions, sample) selects them from the logs, VW's setting is chosen on them as ``bench.loop``
chooses it (held-out sessions, never the truth), and its greedy policy plays the same truth sessions, so every run is
paired with it. It needs the bench extra's ``vowpalwabbit``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.loop import (
    SALT,
    TRUTH_FIRST,
    UNTRAINED,
    UTC,
    VWFeatures,
    paired,
    play,
    public,
    references,
    scored,
    trainer_json,
    trainer_window,
    tuned_vw,
    vw_chooser,
    vw_rows,
)
from bench.report import add_json_flag, header, write_results
from experience.segments import DirectorySource
from policy.features import FeatureSpec
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from weights.bundle import read_bundle, write_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet


def trained(logs: Path, init: Path, config: Path, out: Path) -> dict[str, Any]:
    """``shopping-agent train`` in process; its JSON line (the new bundle's training metrics)."""
    code, report = trainer_json(["train", "--logs", str(logs), "--init", str(init), "--config", str(config), "--out", str(out),
                                 "--device", "cpu"])
    if code != 0 or "metrics" not in report:
        raise SystemExit(f"train with {config} exited {code}")
    return report


def exploration_of(text: str) -> tuple[float, float]:
    """``"EPSILON,TEMPERATURE"`` as the decoder's settings (``ValueError`` naming what is wrong)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"expected EPSILON,TEMPERATURE, got {text!r}")
    epsilon, temperature = float(parts[0]), float(parts[1])
    if not (0.0 <= epsilon <= 1.0 and 0.0 < temperature < float("inf")):
        raise ValueError(f"expected EPSILON in [0, 1] and TEMPERATURE > 0, got {text!r}")
    return epsilon, temperature


def explored_logs(world: World, behaviour: Path | None, epsilon: float, temperature: float, sessions: int,
                  out: Path) -> Path:
    """``behaviour`` (``bench.loop``'s untrained bundle when None) with this exploration, written to
    ``out/init.bundle``, after it served ``sessions`` sessions (from 0) into ``out/logs``; returns the bundle's path."""
    bundle = read_bundle(behaviour if behaviour is not None else make_bundle(*UNTRAINED))
    manifest = {k: v for k, v in bundle.manifest.items() if k != "parts"}  # write_bundle fills the checksums in again
    manifest["decoder"] = {**manifest["decoder"], "exploration_epsilon": epsilon, "exploration_temperature": temperature}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "init.bundle"
    write_bundle(path, manifest, bundle.parts)
    model = ModelSet.load(read_bundle(path), LoadOptions(device="cpu", warmup_batch=8))
    run_logged(world, model, range(sessions), UTC, out / "logs", SALT)
    return path


def vw_on_window(world: World, logs: Path, bundle: Path, truth: range) -> dict[str, Any]:
    """VW tuned (``bench.loop.tuned_vw``) on the rows of ``bundle``'s ``trainer.window`` in ``logs``, played greedily on
    ``truth``: its score, the rows it read and the record of its setting's choice."""
    model = read_bundle(bundle)
    window = model.manifest.get("trainer", {}).get("window")
    if window is None:
        raise SystemExit(f"--vw: {bundle} records no trainer window")
    source = DirectorySource(logs)
    decisions, outcomes = trainer_window(source.table("decisions"), source.table("outcomes"), window)
    features = VWFeatures(FeatureSpec.parse(model.manifest["feature_spec"]))  # the spec alone: no graph to load
    vw, choice = tuned_vw(vw_rows(decisions, outcomes, features))
    try:
        result = scored("vw cb_adf", play(world, truth, vw_chooser(vw, features)), world, truth)
    finally:
        vw.finish()
    return result | {"tuning": choice, "trained_on": {"window_of": str(bundle), "decisions": decisions.num_rows,
                                                      "versions": sorted(set(decisions.column("model_version").to_pylist()))}}


def summary(result: dict[str, Any]) -> str:
    mixes = " | ".join(f"{intent} " + " ".join(f"{k[:4]} {v:.2f}" for k, v in mix.items() if v >= 0.01)
                       for intent, mix in result["action_mix_by_intent"].items())
    return f"{result['name']}: {result['objective']['mean']:.2f}  [{mixes}]"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offline_learners", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--logs", type=Path, help="a log directory (serve --log-dir, bench.loop --workdir DIR/logs)")
    source.add_argument("--untrained-logs", metavar="EPSILON,TEMPERATURE",
                        help="write the logs first: the untrained bundle with this exploration serves --log-sessions sessions")
    p.add_argument("--init", type=Path, help="the starting bundle of every run (with --logs)")
    p.add_argument("--behaviour", type=Path, help="with --untrained-logs: this bundle serves the logs (and starts every run)")
    p.add_argument("--log-sessions", type=int, default=20_000, help="sessions logged with --untrained-logs (default 20,000)")
    p.add_argument("--config", type=Path, action="append", required=True, help="a TrainConfig JSON (repeat)")
    p.add_argument("--seed", type=int, default=7, help="the world the logs were written in")
    p.add_argument("--eval-sessions", type=int, default=6000)
    p.add_argument("--vw", action="store_true", help="VW on the first config's window, tuned as bench.loop tunes it (bench extra)")
    add_json_flag(p, "offline_learners.json")
    args = p.parse_args(argv)
    if not 500 <= args.eval_sessions <= 200_000:
        p.error("--eval-sessions: 500..200,000")
    if (args.logs is None) != (args.init is None):
        p.error("--init goes with --logs (--untrained-logs makes its own)")
    if args.behaviour is not None and args.untrained_logs is None:
        p.error("--behaviour goes with --untrained-logs")
    if not 500 <= args.log_sessions < TRUTH_FIRST:
        p.error(f"--log-sessions: 500..{TRUTH_FIRST - 1:,}")
    try:
        explore = exploration_of(args.untrained_logs) if args.untrained_logs is not None else None
    except ValueError as exc:
        p.error(f"--untrained-logs: {exc}")
    if args.vw:
        try:
            import vowpalwabbit  # noqa: F401
        except ImportError:
            p.error("--vw: vowpalwabbit is not installed (pip install -e '.[bench]')")
    started = time.time()
    world = World(SimConfig(), args.seed)
    truth = range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions)
    options = LoadOptions(device="cpu", warmup_batch=8)
    _, best, oracle = references(world, truth)
    print(f"{best['name']} {best['objective']['mean']:.2f}; intent policy {oracle['objective']['mean']:.2f}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-offline-") as tmp_dir:
        tmp = Path(tmp_dir)
        logs, init = args.logs, args.init
        if explore is not None:
            init = explored_logs(world, args.behaviour, *explore, args.log_sessions, tmp / "untrained")
            logs = tmp / "untrained" / "logs"
            print(f"logged sessions [0, {args.log_sessions:,}) with exploration ε {explore[0]}, T {explore[1]}", flush=True)
        start = scored("init", run_in_process(world, ModelSet.load(read_bundle(init), options), truth, UTC), world, truth)
        print(summary(start), flush=True)
        for i, config in enumerate(args.config):
            t0 = time.monotonic()
            out = tmp / f"run-{i}.bundle"
            report = trained(logs, init, config, out)
            model = ModelSet.load(read_bundle(out), options)
            result = scored(config.name, run_in_process(world, model, truth, UTC), world, truth)
            share = result["objective"]["mean"] / oracle["objective"]["mean"]
            result |= {"config": json.loads(config.read_text()), "vs_best_constant": paired(result, best),
                       "vs_init": paired(result, start), "share_of_intent_policy": share,
                       "train_metrics": {k: report["metrics"].get(k) for k in (
                           "updates_accepted", "kl_served_to_start", "kl_to_behavior", "trajectory_ess_fraction", "critic_return_r2",
                           "critic_return_r2_heldout")},
                       "seconds": time.monotonic() - t0}
            d = result["vs_best_constant"]
            print(summary(result) + f"  vs {best['name']} {d['mean']:+.2f} [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]", flush=True)
            runs.append(result)
        vw = vw_on_window(world, logs, tmp / "run-0.bundle", truth) if args.vw else None
        if vw is not None:
            print(summary(vw) + f"  ({vw['tuning']['chosen']}, {vw['trained_on']['decisions']:,} rows)", flush=True)
            for result in runs:
                result["vs_vw"] = d = paired(result, vw)
                print(f"{result['name']} vs VW {d['mean']:+.2f} [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]", flush=True)

    if args.json is not None:
        write_results(args.json, {**header("bench.offline_learners", started, argv), "world_seed": args.seed,
                                  "logs": str(args.logs) if args.logs else {"untrained_exploration": explore,
                                                                            "sessions": args.log_sessions},
                                  "init": str(args.init or args.behaviour or "untrained"), "truth_sessions": [truth.start, truth.stop],
                                  **public({"best_constant": best, "intent_policy": oracle, "init_result": start, "runs": runs,
                                           "vw": vw})})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
