"""Gate calibration: do the gate's 95 % intervals contain the new bundle's true objective, and the true difference?

    .venv/bin/python -m bench.gate_calibration [--seeds 20] [--sessions 4000] [--truth-sessions 8000] [--json]

Per world seed ``k`` (``--first-seed`` … ``+ --seeds``), in ``World(SimConfig(), k)``:

1. the behaviour (``weights.initial.make_bundle``, ``--behaviour-seed``) serves sessions
   ``[0, S)`` through the real recorder (``run_logged``) into a temporary directory;
2. ``trainer.train.train`` (default ``TrainConfig``) trains a new bundle on those logs, read back
   with ``DirectorySource`` as the CronJob reads them;
3. the gate's estimator (``evaluate_bundle``: the objective's episodes, γ = 1) judges the new bundle
   on *independent* logs of the behaviour: sessions ``[S, 2S)`` of the same world; the gate itself
   runs too, the behaviour as the current bundle (``gate``: publish or refuse, and why);
4. the truth: the new bundle itself plays sessions ``[10⁶, 10⁶ + T)`` of the same world, scored by
   ``BusinessObjective`` (``Trace.business()["objective"]``), the very figure the gate estimates.

The behaviour (the current bundle of the gate) plays the same truth sessions, so each seed also has the true paired
difference new − current, per truth session: the quantity the gate decides on (``gate``: DR(new) − DR(current), its
paired bootstrap interval), reported under ``difference`` with whether the gate's interval holds it.

A seed is ``covered`` by an estimator when its 95 % interval contains the truth's mean. The truth
is itself a mean of T sessions, so ``covered_widened`` also reports whether it is inside the
interval with each side widened in quadrature by the truth's own 95 % half-width: the first is
the test that would be exact if the truth were known exactly; the second allows for the truth's
sampling error, which T = 2 S keeps small. Each coverage proportion comes with the lower end of its exact
(Clopper–Pearson) two-sided 95 % interval over the seeds. The gate's checks (ESS as a fraction
of the held-out sessions, mass on unsupported actions) are reported per seed too.

Writes ``bench/results/gate_calibration.json`` with ``--json``. Cost: about 35 s a seed at the
defaults on one core of a shared machine (simulating 24,000 sessions, one training run).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np

from bench.procs import REPO
from bench.report import write_results
from experience.objective import BusinessObjective
from experience.returns import Z_95
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_in_process, run_logged
from simulator.world import World
from trainer.config import TrainConfig
from trainer.evaluation import MAX_PARETO_K, MAX_UNSUPPORTED, MIN_ESS, MIN_ESS_FRACTION, Evaluation, evaluate_bundle, gate
from trainer.guard_threshold import precision_lower_bound
from weights.bundle import Bundle, read_bundle
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet

ESTIMATORS = ("ips", "snips", "dr", "tis")
TRUTH_FIRST_SESSION = 10**6
UTC = ZoneInfo("UTC")
SALT = b"gate-calibration".ljust(32, b".")
OPTIONS = LoadOptions(device="cpu", warmup_batch=8)


@dataclass(frozen=True, slots=True)
class Settings:
    sessions: int
    truth_sessions: int
    behaviour_seed: int
    bootstrap: int
    config: TrainConfig


def behaviour_bundle(seed: int) -> Bundle:
    return read_bundle(make_bundle(seed, f"calibration-behaviour-{seed}", "2026-11-30T00:00:00Z"))


def logged(world: World, model: ModelSet, sessions: range) -> tuple[Any, Any]:
    """The decision and outcome tables of ``sessions`` served by ``model``, written and read back as the server's logs."""
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp:
        run_logged(world, model, sessions, UTC, Path(tmp), SALT)
        source = DirectorySource(Path(tmp))
        return source.table("decisions"), source.table("outcomes")


def one_seed(seed: int, settings: Settings, behaviour: Bundle, *, judge_behaviour: bool = True) -> dict[str, Any]:
    """Train on the behaviour's logs of world ``seed``; the gate's estimate on independent logs, and the truth.

    With ``judge_behaviour`` (the default) the behaviour itself is judged the same way (under ``"behaviour"``: on-policy,
    a sanity check), and the gate's interval on the difference new − behaviour is set against the true paired difference
    on the same truth sessions (under ``"difference"``).
    """
    from trainer.train import train  # torch: imported where it is needed

    started = time.monotonic()
    world, s = World(SimConfig(), seed), settings.sessions
    behaviour_model = ModelSet.load(behaviour, OPTIONS)
    decisions, outcomes = logged(world, behaviour_model, range(s))
    trained = train(decisions, outcomes, behaviour, settings.config, device="cpu", model_version=f"calibration-{seed}")
    new = ModelSet.load(read_bundle(trained.bundle), OPTIONS)
    held = logged(world, behaviour_model, range(s, 2 * s))
    evaluation = evaluate_bundle(new, *held, n_boot=settings.bootstrap, seed=seed)
    current = evaluate_bundle(behaviour_model, *held, n_boot=settings.bootstrap, seed=seed)
    verdict = gate(evaluation, current, settings.config.tolerance, **settings.config.gate_limits())
    truths: list[np.ndarray] = []
    row = {"seed": seed, **judged(world, new, evaluation, settings, truths.append),
           "updates_accepted": trained.metrics.get("updates_accepted"),
           "gate": {"publish": verdict.publish, "reason": verdict.reason, "dr_difference": verdict.difference.to_dict()}}
    if judge_behaviour:
        row["behaviour"] = judged(world, behaviour_model, current, settings, truths.append)
        d = verdict.difference
        row["difference"] = difference_covered(float(d.value), float(d.ci_low), float(d.ci_high), truths[0] - truths[1])
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def truth_sessions(settings: Settings) -> range:
    return range(TRUTH_FIRST_SESSION, TRUTH_FIRST_SESSION + settings.truth_sessions)


def judged(world: World, model: ModelSet, evaluation: Evaluation, settings: Settings,
           per_session: Callable[[np.ndarray], None] | None = None) -> dict[str, Any]:
    """``model``'s estimates (``evaluation``), its truth on the truth sessions, and which intervals hold it;
    ``per_session`` is handed the objective of each truth session, in the sessions' order (for paired differences)."""
    report = evaluation.report
    sessions = truth_sessions(settings)
    truth = run_in_process(world, model, sessions, UTC)
    objective = truth.business()["objective"]
    if per_session is not None:
        per_session(BusinessObjective().per_session([f"sim{world.seed}-s{i}" for i in sessions], truth.tables()[1]).objective)
    row: dict[str, Any] = {
        "truth": {"mean": objective.mean, "ci_low": objective.low, "ci_high": objective.high, "stderr": objective.stderr},
        "behavior_value": report.behavior_value.to_dict(),
        "ess": report.ess,
        "ess_fraction": report.ess / report.n_episodes,
        "ess_steps_fraction": report.ess_steps / report.n_steps,
        "final_weight": report.final_weight.to_dict(),
        "pareto_k": report.pareto_k,
        "unsupported_mass": evaluation.unsupported_mass,
        "gate_checks_pass": bool(report.ess >= max(MIN_ESS_FRACTION * report.n_episodes, MIN_ESS)
                                 and evaluation.unsupported_mass <= MAX_UNSUPPORTED and not report.pareto_k > MAX_PARETO_K),
        "kl_to_behavior": evaluation.behavior_kl,
    }
    for name in ESTIMATORS:
        est = getattr(report, name)
        row[name] = {**est.to_dict(), "covered": bool(est.ci_low <= objective.mean <= est.ci_high),
                     "covered_widened": widened(est.value, est.ci_low, est.ci_high, Z_95 * objective.stderr, objective.mean)}
    return row


def difference_covered(value: float, low: float, high: float, true_difference: np.ndarray) -> dict[str, Any]:
    """The gate's interval on new − current against the true paired difference (per truth session, the same sessions)."""
    n = len(true_difference)
    mean = float(np.mean(true_difference))
    stderr = float(np.std(true_difference, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return {"value": value, "ci_low": low, "ci_high": high, "truth": {"mean": mean, "stderr": stderr},
            "covered": bool(low <= mean <= high), "covered_widened": widened(value, low, high, Z_95 * stderr, mean)}


def clopper_pearson_low(k: int, n: int, level: float = 0.95) -> float:
    """The lower end of the exact (Clopper–Pearson) two-sided ``level`` interval of a proportion ``k`` of ``n`` (0 when
    k = 0): the one-sided bound at 1 − (1 − level)/2, as the guard's precision is bounded (``trainer.guard_threshold``)."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"expected 0 <= k <= n and n >= 1, got k={k}, n={n}")
    return precision_lower_bound(k, n, 1.0 - (1.0 - level) / 2)


def coverage(hits: Sequence[bool]) -> dict[str, Any]:
    """A coverage proportion over seeds: hits of n, the share, and its exact 95 % lower bound (two-sided interval)."""
    k, n = sum(bool(h) for h in hits), len(hits)
    return {"covered": k, "of": n, "share": k / n if n else None, "clopper_pearson_95_low": clopper_pearson_low(k, n) if n else None}


def widened(value: float, low: float, high: float, truth_half_width: float, truth: float) -> bool:
    """Whether ``truth`` is in the interval with each side widened by the truth's own half-width (in quadrature).

    Per side, since a percentile interval of a weighted mean is skewed: ``value − √((value − low)² + h²)`` to
    ``value + √((high − value)² + h²)``.
    """
    return bool(value - math.hypot(value - low, truth_half_width) <= truth <= value + math.hypot(high - value, truth_half_width))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per estimator: coverage (plain, widened, and over the seeds whose estimate the gate would act on), mean error, width."""
    n = len(rows)
    trusted = [r for r in rows if r["gate_checks_pass"]]
    summary: dict[str, Any] = {
        name: {"coverage": sum(r[name]["covered"] for r in rows) / n,
               "coverage_widened": sum(r[name]["covered_widened"] for r in rows) / n,
               "coverage_where_checks_pass": sum(r[name]["covered"] for r in trusted) / len(trusted) if trusted else None,
               "mean_error": sum(r[name]["value"] - r["truth"]["mean"] for r in rows) / n,
               "mean_width": sum(r[name]["ci_high"] - r[name]["ci_low"] for r in rows) / n} for name in ESTIMATORS}
    for name in ESTIMATORS:
        summary[name]["coverage_exact"] = coverage([r[name]["covered"] for r in rows])
        summary[name]["coverage_widened_exact"] = coverage([r[name]["covered_widened"] for r in rows])
    with_difference = [r["difference"] for r in rows if "difference" in r]
    if with_difference:  # the gate's interval on DR(new) − DR(current) against the true paired difference
        summary["difference"] = {"coverage": coverage([d["covered"] for d in with_difference]),
                                 "coverage_widened": coverage([d["covered_widened"] for d in with_difference]),
                                 "mean_error": sum(d["value"] - d["truth"]["mean"] for d in with_difference) / len(with_difference),
                                 "mean_width": sum(d["ci_high"] - d["ci_low"] for d in with_difference) / len(with_difference)}
    summary["seeds_checks_pass"] = len(trusted)
    summary["seeds_published"] = sum(bool(r["gate"]["publish"]) for r in rows)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_calibration", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20, help="world seeds (default 20)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--sessions", type=int, default=4000, help="S: sessions of training logs, and of the gate's logs (default 4000)")
    p.add_argument("--truth-sessions", type=int, help="T: sessions the new bundle plays for the truth (default 2 S)")
    p.add_argument("--behaviour-seed", type=int, default=20261130, help="weights.initial.make_bundle seed of the behaviour")
    p.add_argument("--bootstrap", type=int, default=200)
    p.add_argument("--json", action="store_true", help="write bench/results/gate_calibration.json")
    args = p.parse_args(argv)
    truth_sessions = args.truth_sessions or 2 * args.sessions
    if not (1 <= args.seeds <= 200 and 100 <= args.sessions <= 100_000 and 100 <= truth_sessions <= 200_000):
        p.error("--seeds 1..200, --sessions 100..100,000, --truth-sessions 100..200,000")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    settings = Settings(args.sessions, truth_sessions, args.behaviour_seed, args.bootstrap, TrainConfig())
    behaviour = behaviour_bundle(args.behaviour_seed)
    rows = []
    started = time.monotonic()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = one_seed(seed, settings, behaviour)
        rows.append(row)
        dr, truth = row["dr"], row["truth"]
        print(f"seed {seed:3d}  truth {truth['mean']:7.3f} ± {Z_95 * truth['stderr']:.3f}  DR {dr['value']:7.3f} "
              f"[{dr['ci_low']:7.3f}, {dr['ci_high']:7.3f}] {'in ' if dr['covered'] else 'OUT'}  "
              f"TIS {row['tis']['value']:7.3f} {'in ' if row['tis']['covered'] else 'OUT'}  "
              f"difference: true {row['difference']['truth']['mean']:+7.3f}, gate DR {row['difference']['value']:+7.3f} "
              f"[{row['difference']['ci_low']:+7.3f}, {row['difference']['ci_high']:+7.3f}] "
              f"{'in ' if row['difference']['covered'] else 'OUT'}  "
              f"ESS {row['ess_fraction']:.2f}·E  unsupported {row['unsupported_mass']:.2g}  "
              f"{'published' if row['gate']['publish'] else 'refused'}  {row['seconds']:.0f} s", flush=True)
    summary = summarise(rows)
    for name in ESTIMATORS:
        e = summary[name]
        print(f"{name:6s} value of the new bundle: coverage {e['coverage']:.0%} (exact 95 % lower bound "
              f"{e['coverage_exact']['clopper_pearson_95_low']:.0%}; widened by the truth's error {e['coverage_widened']:.0%})  "
              f"mean error {e['mean_error']:+.3f}  mean width {e['mean_width']:.3f}")
    d = summary["difference"]
    print(f"DR difference new − current (what the gate decides on): coverage {d['coverage']['share']:.0%} "
          f"({d['coverage']['covered']} of {d['coverage']['of']}; exact 95 % lower bound {d['coverage']['clopper_pearson_95_low']:.0%}; "
          f"widened by the truth's error {d['coverage_widened']['share']:.0%})  mean error {d['mean_error']:+.3f}  "
          f"mean width {d['mean_width']:.3f}")
    print(f"the gate's checks (ESS, support) pass on {summary['seeds_checks_pass']} of {len(rows)} seeds; "
          f"it publishes (vs the behaviour as current) on {summary['seeds_published']}")
    result = {"settings": {"seeds": args.seeds, "first_seed": args.first_seed, "sessions": args.sessions,
                           "truth_sessions": truth_sessions, "behaviour_seed": args.behaviour_seed, "bootstrap": args.bootstrap,
                           "min_ess_fraction": MIN_ESS_FRACTION, "min_ess": MIN_ESS, "max_unsupported": MAX_UNSUPPORTED},
              "summary": summary, "seeds": rows, "seconds": round(time.monotonic() - started, 1)}
    if args.json:
        write_results(REPO / "bench" / "results" / "gate_calibration.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
