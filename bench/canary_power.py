"""How often the canary would have certified a candidate of known true gain: its power, look by look, from a loop run.

    .venv/bin/python -m bench.canary_power --loop bench/results/loop.json [--max-looks 3] [--json]

``bench.loop`` meets each refused candidate once: its canary's looks either certify it or wait, and one run cannot say
how often they would. The run's JSON holds what that takes: the candidate's true gain over the served policy (paired,
on the truth sessions: ``refused_candidate.vs_served``), and each canary look's interval at its level on the sessions
it had (``cycles[k].canary``). A look's estimate is a difference of two means of independent sessions, so it is normal
to a close approximation at these sizes (10,000 sessions a side), with the standard error its own interval gives:
(high − low) / (2 z). Looks are cumulative (look k reads every canary session so far), so their estimates are nested
means: the bench draws them as sums of independent increments (``--draws`` times, a fixed seed) and applies the judge's
rule in order (``trainer.canary``: promote when the lower bound ≥ 0, drop when the upper bound < 0, else wait; the
tolerance is 0 as in the loop). Looks the run did not reach take the last one's error shrunk by the square root of
the sessions, one cycle's canary share a look. Next to it, the gate's own chance, one look at 95 % with the standard
error its paired interval's width implies (a normal approximation: the gate's interval is a bootstrap percentile and
skewed). Power is given at the true gain and at the ends of its interval, since the truth is itself an estimate.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from bench.report import add_json_flag, header, write_results
from trainer.canary import CanarySettings

GATE_LEVEL = 0.95


def standard_error(low: float, high: float, level: float) -> float:
    """The standard error a normal interval of ``level`` from ``low`` to ``high`` implies."""
    return (high - low) / (2.0 * NormalDist().inv_cdf(0.5 + level / 2.0))


def promoted_by_look(gain: float, errors: Sequence[float | None], level: float, draws: int = 400_000,
                     seed: int = 0) -> list[dict[str, float | None]]:
    """Per look k, the probability that the canary was promoted, and that it was dropped, at look k or before, for a
    true ``gain`` and cumulative looks of standard errors ``errors`` (decreasing: each look has more sessions; None: a
    look with too few sessions for an interval, which decides nothing). A canary still undecided at the last look is
    dropped there, as the judge drops it at ``max_looks``."""
    given = [i for i, e in enumerate(errors) if e is not None]
    info = 1.0 / np.square(np.asarray([errors[i] for i in given], dtype=np.float64))
    if np.any(np.diff(info) <= 0):
        raise ValueError(f"errors: expected decreasing standard errors (cumulative looks), got {list(errors)}")
    step_info = np.diff(info, prepend=0.0)
    rng = np.random.default_rng(seed)
    increments = gain + rng.standard_normal((draws, len(info))) / np.sqrt(step_info)
    estimates = np.cumsum(increments * step_info, axis=1) / info  # each look's mean over every session so far
    half = NormalDist().inv_cdf(0.5 + level / 2.0) / np.sqrt(info)
    undecided = np.ones(draws, dtype=bool)
    promoted = dropped = 0
    out: list[dict[str, float | None]] = []
    for k, error in enumerate(errors):
        if error is not None:
            j = given.index(k)
            promote = undecided & (estimates[:, j] - half[j] >= 0.0)
            drop = undecided & ~promote & (estimates[:, j] + half[j] < 0.0)
            promoted += int(promote.sum())
            undecided &= ~promote
        else:
            drop = np.zeros(draws, dtype=bool)
        if k == len(errors) - 1:
            drop = undecided.copy()  # undecided after max_looks: dropped
        dropped += int((drop & undecided).sum())
        undecided &= ~drop
        out.append({"look": k + 1, "standard_error": error, "promoted_by": promoted / draws, "dropped_by": dropped / draws})
    return out


def look_errors(looks: Sequence[dict[str, Any]], max_looks: int) -> tuple[list[float | None], bool]:
    """Per look number 1..``max_looks``, its standard error: a look's own interval's, None for one that had no interval
    (too few sessions), and for looks the run did not reach the last interval's shrunk by the square root of the sessions
    (one cycle's canary share a look). A look whose error did not shrink (its sample's variance jumped) is taken as
    just below the one before, so the looks stay nested; the second value says whether any was."""
    by_number = {look["look"]: look for look in looks}
    errors: list[float | None] = []
    last: tuple[int, float] | None = None
    clamped = False
    for k in range(1, max_looks + 1):
        look = by_number.get(k)
        if look is not None and look.get("ci_low") is not None:
            error = standard_error(look["ci_low"], look["ci_high"], look["level"])
            if last is not None and error >= last[1]:
                error, clamped = last[1] * 0.999, True
            errors.append(error)
            last = (k, error)
        elif look is not None or last is None:
            errors.append(None)
        else:
            errors.append(last[1] * (last[0] / k) ** 0.5)
    return errors, clamped


def canaries(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each refused candidate of a loop run whose canary was looked at: its true gain and its looks, in order."""
    found = []
    for cycle in run["cycles"]:
        candidate = cycle.get("refused_candidate")
        if not candidate:
            continue
        looks = [{**c["canary"], "cycle": c["cycle"]} for c in run["cycles"]
                 if c.get("canary") and c["canary"].get("model_version") == candidate["name"] and c["canary"].get("look")]
        gate = cycle["gate"]["difference"]
        found.append({"cycle": cycle["cycle"], "candidate": candidate["name"], "gain": candidate["vs_served"],
                      "gate": gate, "looks": sorted(looks, key=lambda look: look["look"]),
                      "last_cycle": max(c["cycle"] for c in run["cycles"])})
    return found


def power(found: dict[str, Any], max_looks: int, draws: int) -> dict[str, Any]:
    looks = found["looks"]
    errors, clamped = look_errors(looks, max_looks)
    if all(e is None for e in errors):
        errors = []  # no look had an interval: nothing to draw
    level = next((look["level"] for look in looks if look.get("level") is not None), CanarySettings().level)
    gain = found["gain"]
    gate_error = standard_error(found["gate"]["ci_low"], found["gate"]["ci_high"], GATE_LEVEL) if found["gate"] else None
    at = {"true gain": gain["mean"], "its interval's low end": gain["ci_low"], "its interval's high end": gain["ci_high"]}
    return {
        "cycle": found["cycle"], "candidate": found["candidate"], "true_gain": gain, "level": level,
        "looks_observed": [{k: look.get(k) for k in ("cycle", "look", "estimate", "ci_low", "ci_high", "action",
                                                      "canary_sessions", "control_sessions")} for look in looks],
        "errors_clamped": clamped,
        "looks_the_run_had_room_for": found["last_cycle"] - looks[0]["cycle"] + 1 if looks else 0,
        "gate_standard_error": gate_error,
        "at": {name: {"gain": g,
                      "gate_certifies": None if gate_error is None else
                      1.0 - NormalDist().cdf(NormalDist().inv_cdf(0.5 + GATE_LEVEL / 2.0) - g / gate_error),
                      "canary": promoted_by_look(g, errors, level, draws) if errors else []}
               for name, g in at.items()},
    }


def calibration(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per look k, over the canaries whose run had cycles for k looks after their first, whatever they decided (a run
    that ends earlier would leave out only canaries still waiting: a bias towards promotions): how many the model expects
    promoted by look k at their true gains (the sum of their chances), and how many were."""
    out = []
    for k in range(1, max((len(r["at"]["true gain"]["canary"]) for r in results), default=0) + 1):
        expected = observed = followed = 0.0
        for r in results:
            looks = r["looks_observed"]
            if r["looks_the_run_had_room_for"] < k:
                continue
            followed += 1
            cells = r["at"]["true gain"]["canary"]  # empty when no look had an interval: it could promote nothing
            expected += cells[k - 1]["promoted_by"] if cells else 0.0
            observed += any(look["look"] <= k and look["action"] == "promote" for look in looks)
        if followed:
            out.append({"look": k, "canaries": int(followed), "expected_promoted": expected, "promoted": int(observed)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.canary_power", description=__doc__.splitlines()[0])
    p.add_argument("--loop", type=Path, nargs="+", required=True, help="bench.loop JSON results (--json)")
    p.add_argument("--max-looks", type=int, default=CanarySettings().max_looks, help="looks before a canary is dropped")
    p.add_argument("--draws", type=int, default=400_000, help="Monte Carlo draws of the looks")
    add_json_flag(p, "canary_power.json")
    args = p.parse_args(argv)
    if not (1 <= args.max_looks <= 20 and 1_000 <= args.draws <= 10_000_000):
        p.error("--max-looks 1..20, --draws 1,000..10,000,000")
    started = time.time()
    results = []
    for path in args.loop:
        run = json.loads(path.read_text())
        if not isinstance(run, dict) or "cycles" not in run:
            p.error(f"--loop {path}: not a bench.loop result (no cycles)")
        for found in canaries(run):
            result = power(found, args.max_looks, args.draws)
            results.append({"loop": str(path), **result})
            print(f"{path} cycle {result['cycle']}: {result['candidate']}, {len(result['looks_observed'])} look(s) observed")
            for name, cell in result["at"].items():
                gate = "" if cell["gate_certifies"] is None else f"gate {cell['gate_certifies']:.2f}; "
                canary = ", ".join(f"look {c['look']} {c['promoted_by']:.2f}" for c in cell["canary"])
                print(f"  at {name} {cell['gain']:+.2f}: {gate}canary promoted by {canary}")
    if not results:
        print("no refused candidate in these runs")
    checked = calibration(results)
    for c in checked:
        print(f"by look {c['look']}: {c['canaries']} canaries followed, {c['expected_promoted']:.1f} expected promoted, "
              f"{c['promoted']} were")
    if args.json:
        write_results(args.json, {**header("bench.canary_power", started, argv), "max_looks": args.max_looks,
                                  "draws": args.draws, "candidates": results, "calibration": checked})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
