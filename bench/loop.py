"""The learning loop on the simulator: from the untrained bundle, CronJob cycles, against strong baselines.

    .venv/bin/python -m bench.loop [--cycles 5] [--sessions 20000] [--eval-sessions 20000] [--seed 7] [--no-vw]
        [--canary F [--canary-level L]]

One world (``--seed``: catalogue, prices, shoppers), disjoint session ranges. Each cycle:

1. the active bundle serves the next ``--sessions`` sessions through the real recorder, appended
   to one log directory (as the servers' PV holds them), at a fixed server time two hours after the
   cycle before (``cycle_clock``: so the versions' names, and the canary's sessions, are the same in every run);
2. ``shopping-agent cycle`` runs on that directory, in process, with its default config (or
   ``--config``): train from the active bundle on its window of the logs → evaluate → gate →
   publish into a weights directory;
3. the active bundle after the cycle plays the truth sessions ``[10⁶, 10⁶ + --eval-sessions)``,
   the same shoppers and dice every cycle: the business objective per session (net GMV − 10 per
   complaint), net GMV, and the action mix, overall and per hidden intent; a candidate the gate
   refused plays them too (kept by ``cycle --candidate-out``), so the bench shows whether the gate
   turned down a gain or a loss.

With ``--canary F`` the servers' canary is simulated too: a candidate the gate refused but could
not rule out serves F of the next cycle's sessions (``weights.canary.Routed``: the servers' own
keyed session hash), and the next cycle judges it on-policy (``trainer.canary``); each look's
interval is set against the paired truth of the same two bundles (``canary_vs_truth``).

Baselines on the same truth sessions: every constant action (the best one named), the intent
policy that reads each shopper's hidden intent (a reference, not a bound), and Vowpal Wabbit's
contextual-bandit learner (``--cb_adf``, one pass; an optional bench dependency: ``pip install -e '.[bench]'``)
trained on the rows of the cycle's trainer window (the sessions the window of the bundle trained that cycle selected,
by its manifest's ``trainer.window`` record: its versions, the versions served, its sample; the gate's held-out
sessions included; a cycle that trained nothing: the same window settings over the versions served), with the
return-to-go of the objective as its cost, played greedily. Its setting is chosen each cycle from ``VW_GRID``
(cb_type dr / ips / mtr × VW's default learning rate / ``-l 0.01 --power_t 0``) by the self-normalised IPS of each
setting's greedy policy on 20 % of the window's sessions held out (a keyed hash of the session id), fit on the other
80 %; the chosen setting is then retrained on every row of the window. The truth sessions never enter the choice. Intervals on differences
are paired over the shared sessions. Writes ``bench/results/loop.json``, ``loop.png`` and the served policy's per-session
truth of every cycle (``loop.per-session.npz``, for paired comparisons between runs: ``bench.engagement_ab``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa

from bench.procs import REPO
from bench.report import write_results, written
from core.domain import Action, Outcome, Source
from experience.objective import BusinessObjective
from experience.returns import Z_95, discounted_returns
from experience.segments import DirectorySource
from experience.sessions import build_episodes
from policy.features import FeatureSpec, behavior_buckets, local_hour
from simulator.config import SERVABLE, SimConfig
from simulator.drive import CRON_INTERVAL_S, Trace, cycle_time, decision_id, reports_for, run_in_process, run_logged
from simulator.reference import intent_policy
from simulator.world import PageView, ShopperSession, World
from trainer.canary import CanarySettings
from weights.bundle import read_bundle
from weights.canary import CanaryRoute, Routed, fraction_of
from weights.initial import make_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.store import WeightsStore
from weights.validate import verify

TRUTH_FIRST = 1_000_000
UNTRAINED = (20261130, "default-init-20261130", "2026-11-30T00:00:00Z")
"""``weights.initial.make_bundle``'s arguments for the untrained bundle the learning benches start from (the seed and
version ``scripts/build_default_bundle.py`` starts from too)."""
SALT = b"bench-loop".ljust(32, b".")
LOG_CLOCK_S = datetime.fromisoformat(UNTRAINED[2]).timestamp()  # 2026-11-30T00:00:00Z, as scripts/build_default_bundle.py
UTC = ZoneInfo("UTC")
Choose = Callable[[ShopperSession, PageView], Action]


# --- the deciders that are not bundles ---------------------------------------------------------


def cycle_clock(cycle: int) -> float:
    """The server time of every record cycle ``cycle`` (from 1) logs (``simulator.drive.cycle_time``): with the wall
    clock each run of the bench drew other canary sessions (docs/performance.md)."""
    return cycle_time(LOG_CLOCK_S, cycle - 1)


def play(world: World, sessions: range, choose: Choose) -> Trace:
    """Each session against ``choose(session, page)``, traced as ``run_in_process`` traces a bundle."""
    trace = Trace()
    for index in sessions:
        session = world.session(index)
        step = 0
        while (page := session.page()) is not None:
            did = decision_id(world.seed, index, step)
            action = choose(session, page)
            trace.decided(session.session_id, did, page.event_time_s, action, Source.POLICY)
            for report in reports_for(session, did, session.respond(action)):
                trace.reported(report)
            step += 1
        trace.sessions_finished += 1
    return trace


def constant(action: Action) -> Choose:
    return lambda session, page: action



# --- Vowpal Wabbit on the same logs --------------------------------------------------------------


class VWFeatures:
    """What the policy sees, as VW features: the behaviour buckets, the hour, a fixed projection of the embedding."""

    def __init__(self, spec: FeatureSpec, dim: int = 32) -> None:
        self.spec = spec
        self.projection = (np.random.default_rng(0).standard_normal((spec.item_dim, dim)) / math.sqrt(dim)).astype(np.float32)

    def shared(self, buckets: Sequence[int], hour: int, embedding: np.ndarray) -> str:
        e = np.asarray(embedding, dtype=np.float32) @ self.projection
        return "shared |s " + " ".join(f"b{b}" for b in buckets) + f" h{hour} " + " ".join(f"e{j}:{v:.4f}" for j, v in enumerate(e))


def _actions_lines(label_at: int | None = None, cost: float = 0.0, prob: float = 1.0) -> list[str]:
    return [(f"0:{cost:.6f}:{prob:.6f} " if i == label_at else "") + f"|a a{int(a)}" for i, a in enumerate(SERVABLE)]


VW_BASE = "--cb_adf -q sa --quiet --random_seed 1"
VW_GRID = {
    "dr, VW default rate": "--cb_type dr",
    "ips, VW default rate": "--cb_type ips",
    "mtr, VW default rate": "--cb_type mtr",
    "dr, -l 0.01 --power_t 0": "--cb_type dr --power_t 0 -l 0.01",  # the bench's single setting before the grid
    "ips, -l 0.01 --power_t 0": "--cb_type ips --power_t 0 -l 0.01",
    "mtr, -l 0.01 --power_t 0": "--cb_type mtr --power_t 0 -l 0.01",
}
"""The settings VW is tuned over each cycle: ``VW_BASE`` plus one of these, one pass each."""
VW_HELDOUT_SHARE = 0.2
VW_SPLIT_KEY = b"bench-loop-vw-split"


@dataclasses.dataclass(frozen=True)
class VWRows:
    """The logged rows VW learns from, as its examples: the rows that served a servable action, in episode order, with
    the action's slot, the logged propensity and the return-to-go of the objective (γ = 1) from that row."""

    shared: list[str]
    slot: np.ndarray
    propensity: np.ndarray
    togo: np.ndarray
    session: np.ndarray

    def __len__(self) -> int:
        return len(self.shared)

    def labelled(self, i: int) -> list[str]:
        return [self.shared[i], *_actions_lines(int(self.slot[i]), -float(self.togo[i]) / 100.0, float(self.propensity[i]))]


def vw_rows(decisions: pa.Table, outcomes: pa.Table, features: VWFeatures) -> VWRows:
    episodes = build_episodes(decisions, outcomes)
    ordered = decisions.take(pa.array(episodes.rows))
    togo = discounted_returns(episodes.rewards, episodes.starts, episodes.lengths, 1.0)
    slot_of = {int(a): i for i, a in enumerate(SERVABLE)}
    slots = np.array([slot_of.get(int(a), -1) for a in ordered.column("action").to_numpy()], dtype=np.int64)
    keep = np.flatnonzero(slots >= 0)
    hours = ordered.column("hour").to_numpy()
    buckets = ordered.column("behavior_bucket_indices").to_pylist()
    emb = np.asarray(ordered.column("item_embedding").combine_chunks().values.to_numpy(zero_copy_only=False),
                     dtype=np.float32).reshape(len(ordered), -1)
    projected = emb[keep] @ features.projection  # the projection of VWFeatures.shared, for every row at once
    shared = ["shared |s " + " ".join(f"b{b}" for b in buckets[i]) + f" h{hours[i]} " + " ".join(f"e{j}:{v:.4f}" for j, v in enumerate(e))
              for i, e in zip(keep, projected, strict=True)]
    return VWRows(shared, slots[keep], ordered.column("propensity").to_numpy()[keep].astype(np.float64),
                  np.asarray(togo, dtype=np.float64)[keep], np.asarray(ordered.column("session_id").to_pylist(), dtype=object)[keep])


def heldout_sessions(session_ids: np.ndarray, share: float = VW_HELDOUT_SHARE, key: bytes = VW_SPLIT_KEY) -> np.ndarray:
    """True for the rows of the sessions held out from VW's tuning fits: a keyed hash of the session id, so a session
    is held out whole and the split does not depend on the rows' order."""
    cut = int(share * 2**64)
    memo: dict[str, bool] = {}
    out = np.empty(len(session_ids), dtype=bool)
    for i, s in enumerate(session_ids):
        if (h := memo.get(s)) is None:
            h = memo[s] = int.from_bytes(hashlib.blake2b(str(s).encode(), digest_size=8, key=key).digest(), "little") < cut
        out[i] = h
    return out


def fit_vw(rows: VWRows, setting: str, which: np.ndarray | None = None, passes: int = 1) -> Any:
    """A VW workspace (``VW_BASE`` + ``setting``) trained on ``rows`` (only those at the indices ``which``, if given)."""
    import vowpalwabbit

    vw = vowpalwabbit.Workspace(f"{VW_BASE} {setting}")
    indices = range(len(rows)) if which is None else which
    for _ in range(passes):
        for i in indices:
            vw.learn(rows.labelled(int(i)))
    return vw


def greedy_slots(vw: Any, rows: VWRows, which: np.ndarray) -> np.ndarray:
    """VW's greedy action slot (the least predicted cost) on the rows at ``which``."""
    unlabelled = _actions_lines()
    return np.array([int(np.argmin(vw.predict([rows.shared[int(i)], *unlabelled]))) for i in which], dtype=np.int64)


def offpolicy_value(rows: VWRows, which: np.ndarray, chosen: np.ndarray) -> dict[str, float]:
    """Per-row IPS and self-normalised IPS, on the rows at ``which``, of choosing ``chosen`` at a row and following the
    logged behaviour after it: the return-to-go weighted by 1[chosen = logged] / logged propensity. The value VW's
    cost regression targets; the rows' logged mean return-to-go is the behaviour's own."""
    w = (chosen == rows.slot[which]) / rows.propensity[which]
    r = rows.togo[which]
    wr = w * r
    n = len(which)
    snips = float(wr.sum() / w.sum()) if w.sum() > 0 else math.nan
    return {"ips": float(wr.mean()), "ips_se": float(wr.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan, "snips": snips,
            "match_rate": float((w > 0).mean()), "rows": n, "behaviour": float(r.mean())}


def tuned_vw(rows: VWRows, grid: dict[str, str] | None = None, passes: int = 1) -> tuple[Any, dict[str, Any]]:
    """VW's setting chosen on the logs alone: each setting of ``grid`` is fit on the rows of the sessions not held out
    (``heldout_sessions``), its greedy policy valued off-policy on the held-out rows (``offpolicy_value``), and the one
    with the highest self-normalised IPS is retrained on every row. Returns it and the record of the choice."""
    grid = VW_GRID if grid is None else grid
    held = heldout_sessions(rows.session)
    fit_on, judge_on = np.flatnonzero(~held), np.flatnonzero(held)
    estimates: dict[str, dict[str, float]] = {}
    for name, setting in grid.items():
        vw = fit_vw(rows, setting, fit_on, passes)
        estimates[name] = offpolicy_value(rows, judge_on, greedy_slots(vw, rows, judge_on))
        vw.finish()
    scored_by = {k: v["snips"] for k, v in estimates.items() if math.isfinite(v["snips"])}
    chosen = max(scored_by, key=lambda k: scored_by[k]) if scored_by else next(iter(grid))
    record = {"chosen": chosen, "setting": f"{VW_BASE} {grid[chosen]}", "passes": passes, "chosen_by": "snips on held-out sessions",
              "rows": len(rows), "heldout_rows": len(judge_on), "heldout_share": VW_HELDOUT_SHARE, "heldout_estimates": estimates}
    return fit_vw(rows, grid[chosen], None, passes), record


def trainer_window(decisions: pa.Table, outcomes: pa.Table, settings: dict[str, Any]) -> tuple[pa.Table, pa.Table]:
    """The decisions and outcomes of the sessions a trainer window with these settings (a bundle manifest's
    ``trainer.window`` record, or the same keys) selects from these logs: its versions, serving versions and sample."""
    from trainer.session_index import SessionIndex
    from trainer.window import choose, sessions_of

    versions = settings.get("versions")
    ids, _ = choose(SessionIndex.of([decisions]), settings.get("hours"), versions, settings.get("max_sessions"),
                    int(settings.get("sample_key") or 0), settings.get("serving") or ())
    return sessions_of(decisions, outcomes, ids)


def resolved_config(path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``--config`` file's fields (read once) and ``resolved_fields`` of them (``trainer.cli.UsageError`` naming the
    field for a bad one)."""
    from trainer.cli import config_file

    fields = config_file(path)
    return fields, resolved_fields(fields)


def resolved_fields(fields: Any) -> dict[str, Any]:
    """Every TrainConfig field ``fields`` gives, the trainer's defaults for the rest, as a JSON holds them."""
    from trainer.cli import config_fields

    return dict(json.loads(json.dumps(config_fields(fields).to_dict(), default=float)))


def code_version() -> str:
    """The commit the bench ran from, ``+dirty`` when the tree had uncommitted changes ("unknown" outside a checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def window_settings(resolved: dict[str, Any], serving_versions: Sequence[str]) -> dict[str, Any]:
    """The window settings of the run's resolved config (``resolved_fields``) with the versions served now: what
    ``cycle`` would read on a run that trained nothing to record."""
    return {"hours": resolved["window_hours"], "versions": resolved["window_versions"], "max_sessions": resolved["max_sessions"],
            "sample_key": resolved["sample_key"], "serving": list(serving_versions)}


def vw_chooser(vw: Any, features: VWFeatures) -> Choose:
    def choose(session: ShopperSession, page: PageView) -> Action:
        lines = [features.shared(behavior_buckets(page.recent_behavior_ids, features.spec), local_hour(page.event_time_s, UTC),
                                 page.item_embedding), *_actions_lines()]
        scores = vw.predict(lines)  # cb_adf: the predicted cost of each action line
        return SERVABLE[int(np.argmin(scores))]

    return choose


# --- scoring -------------------------------------------------------------------------------------


def per_session(trace: Trace, world: World, sessions: range) -> dict[str, np.ndarray]:
    """Per session: the objective, net GMV, complaints, and add-to-cart conversion (1 when any item went into the cart)."""
    ids = [f"sim{world.seed}-s{i}" for i in sessions]
    b = BusinessObjective().per_session(ids, trace.tables()[1])
    index = {s: i for i, s in enumerate(ids)}
    carted = [index[s] for s, o in zip(trace.outcome_sessions, trace.outcomes, strict=True) if o == Outcome.ADD_TO_CART]
    conversion = np.zeros(len(ids))
    conversion[carted] = 1.0
    return {"objective": b.objective, "net_gmv": b.net_gmv, "complaints": b.complaints, "add_to_cart_conversion": conversion}


def interval(x: np.ndarray) -> dict[str, float]:
    m, se = float(np.mean(x)), float(np.std(x, ddof=1) / math.sqrt(len(x)))
    return {"mean": m, "ci_low": m - Z_95 * se, "ci_high": m + Z_95 * se}


@functools.cache
def intents(world: World, sessions: range) -> dict[str, str]:
    """Each session's hidden intent, by session id (the simulator's truth, never shown to a learner)."""
    return {s.session_id: s.intent.key for s in map(world.session, sessions)}


def action_mix(actions: np.ndarray) -> dict[str, float]:
    mix = np.bincount(actions - 1, minlength=5) / max(len(actions), 1)  # Action 1..5
    return dict(zip([a.key for a in Action], mix.tolist(), strict=True))


def scored(name: str, trace: Trace, world: World, sessions: range) -> dict[str, Any]:
    """The truth per session, and the action mix overall and per hidden intent: whether a policy tells the
    shoppers apart (the intent policy coupons bargain hunters, prompts sharers to share …) or serves all alike."""
    values = per_session(trace, world, sessions)
    actions = np.asarray(trace.actions, dtype=np.int64)
    of_session = intents(world, sessions)
    intent = np.array([of_session[s] for s in trace.decision_sessions])
    by_intent = {i: action_mix(actions[intent == i]) for i in sorted(set(of_session.values()))}
    return {"name": name, **{k: interval(v) for k, v in values.items()}, "action_mix": action_mix(actions),
            "action_mix_by_intent": by_intent, "_per_session": values}


def references(world: World, truth: range) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Every constant action, the best of them, and the intent policy, scored on the truth sessions."""
    constants = [scored(f"always {a.key}", play(world, truth, constant(a)), world, truth) for a in SERVABLE]
    best = max(constants, key=lambda r: r["objective"]["mean"])
    return constants, best, scored("intent policy", play(world, truth, intent_policy), world, truth)


def paired_runs(a: dict[str, np.ndarray], b: dict[str, np.ndarray], cycles: int, metrics: Sequence[str],
                names: tuple[str, str] = ("a", "b")) -> list[dict[str, Any]]:
    """Two runs' per-session files (``per_session_path``) over the same truth sessions, per cycle and metric: each run's
    mean with its interval (keyed by ``names``), and the paired difference second − first (``"{b}_minus_{a}"``)."""
    first, second = names
    rows = []
    for c in range(cycles + 1):
        row: dict[str, Any] = {"cycle": c}
        for m in metrics:
            x, y = a[f"cycle{c}.{m}"], b[f"cycle{c}.{m}"]
            if x.shape != y.shape:
                raise ValueError(f"cycle {c} {m}: the runs scored different truth sessions ({x.shape} vs {y.shape})")
            row[m] = {first: interval(x), second: interval(y), f"{second}_minus_{first}": interval(y - x)}
        rows.append(row)
    return rows


def paired(a: dict[str, Any], b: dict[str, Any], key: str = "objective") -> dict[str, float]:
    return interval(a["_per_session"][key] - b["_per_session"][key])


def exploration(decisions: pa.Table) -> dict[str, float]:
    """How broad the logged behaviour was: mean entropy of the served distribution, share of near-certain rows."""
    p = np.asarray(decisions.column("served_probs").combine_chunks().values.to_numpy(), dtype=np.float64).reshape(-1, 5)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return {"mean_entropy_nats": float(entropy.mean()), "share_max_prob_over_0.99": float((p.max(axis=1) > 0.99).mean()),
            "min_served_prob_of_served_action": float(decisions.column("propensity").to_numpy().min())}


# --- the loop ------------------------------------------------------------------------------------


def trainer_json(argv: list[str]) -> tuple[int, dict[str, Any]]:
    """The trainer's CLI in process: its exit code and the JSON object of its last stdout line ({} if none)."""
    from trainer.cli import main as trainer_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = trainer_main(argv)
    text = out.getvalue().strip().splitlines()
    return code, json.loads(text[-1]) if text and text[-1].startswith("{") else {}


def run_cycle(logs: Path, weights: Path, config: Path | None, candidate: Path, canary: float = 0.0,
              canary_level: float | None = None) -> tuple[int, dict[str, Any]]:
    argv = ["cycle", "--logs", str(logs), "--weights-dir", str(weights), "--device", "cpu", "--json", "--candidate-out", str(candidate)]
    if canary:
        argv += ["--canary", str(canary)] + (["--canary-level", str(canary_level)] if canary_level is not None else [])
    return trainer_json(argv + (["--config", str(config)] if config is not None else []))


def canary_settings(fraction: float, level: float | None) -> CanarySettings | None:
    """What the cycles' canaries run with (``None``: no canary): the trainer's own settings, so its rules refuse a
    bad fraction or level here (``ValueError``) and the report names the level the looks really used."""
    if not fraction:
        if level is not None:
            raise ValueError("a canary level is only used with a canary fraction")
        return None
    return CanarySettings(fraction=fraction) if level is None else CanarySettings(fraction=fraction, level=level)


def serving(store: WeightsStore, active: ModelSet, options: LoadOptions) -> Routed:
    """What the servers serve from ``store``: the active bundle, and the canary on its share of the sessions."""
    data = store.canary()
    if data is None:
        return Routed(active, None)
    model = ModelSet.load(read_bundle(data), options)
    return Routed(active, CanaryRoute(model, fraction_of(model.manifest)))


def canary_against_truth(entry: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any] | None:
    """A canary look's interval (canary − active, on-policy) next to the paired truth of the same two bundles; None
    when the cycle compared nothing."""
    look = entry.get("canary") or {}
    estimate = look.get("estimate")  # null in the cycle's JSON (NaN before 2026-12-06) when too few sessions to compare
    if not look.get("look") or estimate is None or not math.isfinite(float(estimate)):  # no look, or too few to compare
        return None
    if "canary_bundle" in previous:  # the canary that served this cycle's sessions next to the active bundle it was judged
        truth = previous["canary_bundle"]["vs_served"]  # against, promoted or not (a successor may be active after a promote)
    elif look.get("action") == "promote" and not (entry.get("gate") or {}).get("published"):
        truth = paired(entry["truth"], previous["truth"])  # the promoted canary is the active bundle after this cycle
    else:
        return None
    low, high = float(look["ci_low"]), float(look["ci_high"])
    return {"action": look["action"], "estimate": float(look["estimate"]), "ci_low": low, "ci_high": high,
            "truth": truth["mean"], "held": bool(low <= truth["mean"] <= high)}


def per_session_path(out: Path) -> Path:
    """Where a run's per-session truth goes, next to its JSON: ``cycle{c}.{objective,net_gmv,…}`` arrays over the truth
    sessions, in their order, so that two runs on the same world and truth sessions can be compared paired."""
    return out.with_suffix(".per-session.npz")


def public(x: Any) -> Any:
    """``x`` without the keys that start with ``_`` (per-session arrays), at any depth: what the JSON holds."""
    if isinstance(x, dict):
        return {k: public(v) for k, v in x.items() if not k.startswith("_")}
    if isinstance(x, list):
        return [public(v) for v in x]
    return x


def _gate_summary(report: dict[str, Any]) -> dict[str, Any]:
    keep = {k: report.get(k) for k in ("publish", "reason", "published", "model_version", "current_version", "checks")}
    for side in ("new", "current"):
        ev = report.get(side) or {}
        keep[side] = {k: ev.get(k) for k in ("ips", "snips", "dr", "tis", "behavior_value") if k in ev}
    keep["difference"] = report.get("dr_difference") or report.get("difference")
    look = report.get("second_look")
    if look is True:  # this run published the kept candidate on its second look
        keep["second_look"] = {"published": True, "sessions": report.get("sessions"), "level": report.get("level")}
    elif isinstance(look, dict):  # a look before this run trained: refused, waiting, stale or unreadable
        keep["second_look"] = {k: look.get(k) for k in ("model_version", "publish", "reason", "sessions", "level", "dr_difference")}
    if "kept_for_second_look" in report:
        keep["kept_for_second_look"] = report["kept_for_second_look"]
    return keep


def gate_against_truth(entry: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any] | None:
    """What the gate estimated for the bundle it judged (new − current, DR, its interval) next to that bundle's paired
    true difference on the truth sessions: a published bundle against the one it replaced, a refused candidate
    against the bundle it was compared with. With it, the new bundle's weights' tail k̂ and ESS as the gate measured
    them (None where the report has no checks). None when the cycle judged nothing (no difference in its report)."""
    difference = (entry.get("gate") or {}).get("difference")
    if not difference:
        return None
    if entry["gate"].get("published"):  # against the bundle it replaced: a canary this run promoted first, if one was
        promoted = (entry.get("canary") or {}).get("action") == "promote"
        truth = paired(entry["truth"], previous["canary_bundle"] if promoted else previous["truth"])
    elif "refused_candidate" in entry:
        truth = entry["refused_candidate"]["vs_served"]
    else:
        return None
    low, high = float(difference["ci_low"]), float(difference["ci_high"])
    checks = entry["gate"].get("checks") or {}
    return {"dr": float(difference["value"]), "ci_low": low, "ci_high": high, "truth": truth["mean"],
            "held": bool(low <= truth["mean"] <= high), "pareto_k": checks.get("pareto_k"), "ess": checks.get("ess")}


def _judged_text(judged: dict[str, Any]) -> str:
    """The per-cycle line's account of ``gate_against_truth``: the gate's interval, the truth, and the weights' k̂."""
    tail = "" if judged["pareto_k"] is None else f", k̂ {judged['pareto_k']:.2f}"
    return (f", gate DR {judged['dr']:+.2f} [{judged['ci_low']:+.2f}, {judged['ci_high']:+.2f}] for a true "
            f"{judged['truth']:+.2f} ({'held' if judged['held'] else 'missed'}{tail})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--sessions", type=int, default=20_000, help="sessions logged per cycle")
    p.add_argument("--eval-sessions", type=int, default=20_000, help="truth sessions, the same every cycle")
    p.add_argument("--seed", type=int, default=7, help="the world")
    p.add_argument("--first-session", type=int, default=0, help="first logged session (cycles take consecutive ranges)")
    p.add_argument("--config", type=Path, help="a TrainConfig JSON for every cycle")
    p.add_argument("--no-vw", action="store_true", help="skip Vowpal Wabbit")
    p.add_argument("--canary", type=float, default=0.0, metavar="FRACTION",
                   help="cycle --canary: a refused candidate the gate could not rule out serves this share of the next "
                        "sessions, and the next cycles judge it on-policy (default 0: a second look instead)")
    p.add_argument("--canary-level", type=float, metavar="LEVEL",
                   help="cycle --canary-level: the two-sided level of each canary look (default: the trainer's, 0.99)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "loop.json")
    p.add_argument("--workdir", type=Path,
                   help="keep the logs, weights and candidates here (an empty or new directory; default: a temporary one)")
    args = p.parse_args(argv)
    if not (1 <= args.cycles <= 20 and 500 <= args.sessions <= 200_000 and 500 <= args.eval_sessions <= 200_000):
        p.error("--cycles 1..20, --sessions and --eval-sessions 500..200,000")
    try:
        canary = canary_settings(args.canary, args.canary_level)
    except ValueError as exc:
        p.error(f"--canary / --canary-level: {exc}")
    if args.first_session + args.cycles * args.sessions > TRUTH_FIRST:
        p.error("the logged sessions would reach the truth sessions")
    from trainer.cli import UsageError

    try:  # read once: every cycle trains on a copy of these fields (in the run's directory), whatever happens to the file
        config_fields, config_resolved = resolved_config(args.config)
    except UsageError as exc:
        p.error(str(exc))
    vw_ok = not args.no_vw
    if vw_ok:
        try:
            import vowpalwabbit  # noqa: F401
        except ImportError:
            print("vowpalwabbit is not installed (pip install -e '.[bench]'): VW skipped", file=sys.stderr)
            vw_ok = False
    started, run_id = time.monotonic(), uuid.uuid4().hex
    world = World(SimConfig(), args.seed)
    truth = range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions)
    options = LoadOptions(device="cpu", warmup_batch=8)

    baselines, best_constant, oracle = references(world, truth)
    print(f"best constant: {best_constant['name']} {best_constant['objective']['mean']:.2f}; "
          f"intent policy {oracle['objective']['mean']:.2f}", flush=True)

    cycles: list[dict[str, Any]] = []
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        p.error(f"--workdir {args.workdir}: not empty")
    with contextlib.nullcontext(str(args.workdir)) if args.workdir else tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        logs, wdir = Path(tmp) / "logs", Path(tmp) / "weights"
        frozen = None
        if args.config is not None:
            Path(tmp).mkdir(parents=True, exist_ok=True)  # (a --workdir that does not exist yet)
            frozen = Path(tmp) / "train-config.json"
            frozen.write_text(json.dumps(config_fields))
        store = WeightsStore(wdir, verify)
        store.publish(make_bundle(*UNTRAINED))
        active = ModelSet.load(read_bundle(store.active_path), options)
        cycles.append({"cycle": 0, "version": active.version,
                       "truth": scored("untrained", run_in_process(world, active, truth, UTC), world, truth)})
        logged_before = 0
        for c in range(1, args.cycles + 1):
            t0 = time.monotonic()
            served = range(args.first_session + (c - 1) * args.sessions, args.first_session + c * args.sessions)
            routed = serving(store, active, options)
            served_versions = [active.version] + ([routed.route.model.version] if routed.route is not None else [])
            run_logged(world, routed, served, UTC, logs, SALT, clock=functools.partial(float, cycle_clock(c)))
            source = DirectorySource(logs)
            decisions, outcomes = source.table("decisions"), source.table("outcomes")
            mine = decisions.filter(pa.compute.equal(decisions.column("model_version"), active.version))
            code, report = run_cycle(logs, wdir, frozen, Path(tmp) / f"candidate-{c}.bundle", args.canary, args.canary_level)
            new_bundle = read_bundle(store.active_path)
            trained_window = (read_bundle(Path(report["candidate"])).manifest.get("trainer", {}).get("window")
                              if report.get("candidate") else None)  # the window of the bundle this cycle trained
            active = ModelSet.load(new_bundle, options)
            entry: dict[str, Any] = {
                "cycle": c, "exit": code, "gate": _gate_summary(report), "version": active.version,
                "logs": {"decisions_logged_this_cycle": decisions.num_rows - logged_before,
                         "decisions_of_version_served": mine.num_rows, "version_served": served_versions[0],
                         "decisions_in_directory": decisions.num_rows, **exploration(mine)},
                "manifest": {k: active.manifest.get("training_metrics", {}).get(k) for k in (
                    "kl_to_old", "kl_served_to_start", "kl_to_behavior", "updates_accepted", "updates_failed",
                    "surrogate_improvement", "effective_sample_size", "support_limited", "guard_served_kl",
                    "guard_kept_from_start", "guard_veto_dropped", "guard_veto_enabled", "guard_accuracy", "guard_never_block_accuracy",
                    "guard_false_block_rate", "guard_recall", "guard_auc", "offline_dr", "offline_dr_minus_current",
                    "engagement_mean_weight", "engagement_n_steps_weighted")},
                "window": active.manifest.get("trainer", {}).get("window"),  # the active bundle's (maybe an earlier cycle's)
                "trained_window": trained_window,
                "truth": scored(active.version, run_in_process(world, active, truth, UTC), world, truth),
            }
            if not report.get("published") and report.get("candidate"):  # refused: what the gate turned down, by the truth
                refused = ModelSet.load(read_bundle(Path(report["candidate"])), options)
                entry["refused_candidate"] = scored(refused.version, run_in_process(world, refused, truth, UTC), world, truth)
                entry["refused_candidate"]["vs_served"] = paired(entry["refused_candidate"], entry["truth"])
                entry["refused_candidate"]["manifest"] = {k: refused.manifest.get("training_metrics", {}).get(k) for k in (
                    "kl_served_to_start", "updates_accepted", "surrogate_improvement", "support_limited")}
            if "canary" in report:  # the look at a serving canary before this run trained (or instead)
                entry["canary"] = dict(report["canary"])
            if report.get("canary_started"):
                entry["canary_started"] = report["canary_started"]
            running = serving(store, active, options).route
            if running is not None:  # serving the next cycle's share: what it is worth, by the truth
                entry["canary_bundle"] = scored(running.model.version, run_in_process(world, running.model, truth, UTC), world, truth)
                entry["canary_bundle"]["vs_served"] = paired(entry["canary_bundle"], entry["truth"])
                entry["canary_bundle"]["fraction"] = running.fraction
            entry["canary_vs_truth"] = canary_against_truth(entry, cycles[-1])
            if vw_ok:
                features = VWFeatures(active.encoder.spec)
                settings = trained_window if trained_window is not None else window_settings(config_resolved, served_versions)
                window_d, window_o = trainer_window(decisions, outcomes, settings)
                vw, choice = tuned_vw(vw_rows(window_d, window_o, features))
                entry["vw"] = scored("vw cb_adf", play(world, truth, vw_chooser(vw, features)), world, truth)
                entry["vw"]["trained_on"] = {"window": "of the bundle trained this cycle" if trained_window is not None
                                             else "the window settings over the versions served (nothing trained)",
                                             "versions": sorted(set(window_d.column("model_version").to_pylist())),
                                             "sessions": len(pa.compute.unique(window_d.column("session_id"))),
                                             "decisions": window_d.num_rows}
                entry["vw"]["tuning"] = choice
                vw.finish()
            entry["gate_vs_truth"] = gate_against_truth(entry, cycles[-1])
            cycles.append(entry)
            logged_before = decisions.num_rows
            t = entry["truth"]["objective"]
            print(f"cycle {c}: exit {code}, {active.version}, objective {t['mean']:.2f} [{t['ci_low']:.2f}, {t['ci_high']:.2f}]"
                  + (f", refused candidate {entry['refused_candidate']['objective']['mean']:.2f}" if "refused_candidate" in entry else "")
                  + (_judged_text(g) if (g := entry["gate_vs_truth"]) else "")
                  + (f", canary {k['action']} {k['estimate']:+.2f} [{k['ci_low']:+.2f}, {k['ci_high']:+.2f}] for a true "
                     f"{k['truth']:+.2f}" if (k := entry["canary_vs_truth"]) else "")
                  + (f", canary serving {entry['canary_bundle']['objective']['mean']:.2f}" if "canary_bundle" in entry else "")
                  + (f", vw {entry['vw']['objective']['mean']:.2f} ({entry['vw']['tuning']['chosen']})" if vw_ok else "")
                  + f" ({time.monotonic() - t0:.0f} s)", flush=True)

    final = cycles[-1]
    # the guard table: the shipped guard against never blocking, and what its veto does to the truth
    metrics = active.manifest.get("training_metrics", {})
    guard: dict[str, Any] = {"shipped_threshold": active.manifest["guard"]["threshold"], "veto": active.manifest["guard"].get("veto"),
                             "veto_reason": active.manifest["guard"].get("veto_reason"),
                             "heldout": {k: v for k, v in metrics.items() if k.startswith("guard_")}}
    candidate = float(metrics.get("guard_candidate_threshold", 0.0))
    for name, threshold in (("never blocking", 0.0), ("candidate threshold", candidate)):
        model = ModelSet.load(new_bundle, dataclasses.replace(options, guard_threshold=threshold))
        guard[name] = scored(name, run_in_process(world, model, truth, UTC), world, truth)
        guard[name]["vs_shipped"] = paired(final["truth"], guard[name])
    judged = [c["gate_vs_truth"] for c in cycles[1:] if c.get("gate_vs_truth")]
    looked = [c["canary_vs_truth"] for c in cycles[1:] if c.get("canary_vs_truth")]
    targets = {  # of the last cycle's policy (the are by cycle 5: vs_best_constant_by_cycle has each cycle's)
        "after_cycle": cycles[-1]["cycle"],
        "vs_best_constant": paired(final["truth"], best_constant),
        "vs_best_constant_by_cycle": [paired(c["truth"], best_constant) for c in cycles],
        "vs_vw": paired(final["truth"], final["vw"]) if vw_ok else None,
        "share_of_intent_policy": final["truth"]["objective"]["mean"] / oracle["objective"]["mean"],
        "no_cycle_worse_beyond_ci": all(paired(b["truth"], a["truth"])["ci_high"] >= 0 for a, b in pairwise(cycles)),
        "cycle_vs_previous": [paired(b["truth"], a["truth"]) for a, b in pairwise(cycles)],
        "gate_intervals_held": [sum(bool(j["held"]) for j in judged), len(judged)],  # the gate's DR intervals vs the truth
        "canary_intervals_held": [sum(bool(k["held"]) for k in looked), len(looked)],
    }
    targets["met"] = bool(targets["vs_best_constant"]["ci_low"] > 0 and (not vw_ok or targets["vs_vw"]["ci_low"] > 0)
                          and targets["share_of_intent_policy"] >= 0.8 and targets["no_cycle_worse_beyond_ci"])

    result = public({"world_seed": args.seed, "sessions_per_cycle": args.sessions, "truth_sessions": [truth.start, truth.stop],
                    "config": str(args.config) if args.config else "default",
                    "config_fields": config_fields, "config_resolved": config_resolved, "first_session": args.first_session,
                    "code": code_version(), "run_id": run_id, "canary": args.canary,
                    "canary_level": canary.level if canary is not None else None,
                    "log_clock": {"cycle_1_s": cycle_clock(1), "interval_s": CRON_INTERVAL_S},
                    "seconds": time.monotonic() - started,
                    "constants": baselines, "best_constant": best_constant["name"], "intent_policy": oracle,
                    "cycles": cycles, "targets": targets, "guard": guard})
    # The per-session file first and the JSON last, each whole or not at all, both with the run's id: a reader that finds
    # the JSON finds its own run's per-session truth (bench.config_ab --reuse checks the id).
    written(per_session_path(args.out), lambda f: np.savez_compressed(
        f, _run_id=np.array(run_id), **{f"cycle{c['cycle']}.{k}": v for c in cycles for k, v in c["truth"]["_per_session"].items()}))
    write_results(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["targets"], indent=1, default=float))
    if "guard_accuracy" in metrics and "guard_never_block_accuracy" in metrics:
        from trainer.guard_threshold import guard_table

        print(guard_table(metrics))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = result["cycles"]
    xs = [c["cycle"] for c in cycles]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    best = next(b for b in result["constants"] if b["name"] == result["best_constant"])
    panels = ((axes[0], "objective", "objective per session (net GMV − 10/complaint)"), (axes[1], "net_gmv", "net GMV per session"))
    for ax, key, title in panels:
        def band(entries: list[dict[str, Any]], label: str, style: str, x: list[int], ax: Any = ax, key: str = key) -> None:
            m = [e[key]["mean"] for e in entries]
            lo = [e[key]["mean"] - e[key]["ci_low"] for e in entries]
            hi = [e[key]["ci_high"] - e[key]["mean"] for e in entries]
            ax.errorbar(x, m, yerr=[lo, hi], fmt=style, capsize=3, label=label)

        band([c["truth"] for c in cycles], "served policy (after cycle)", "o-", xs)
        if all("vw" in c for c in cycles[1:]) and len(cycles) > 1:
            band([c["vw"] for c in cycles[1:]], "VW cb_adf (tuned) on the cycle's trainer window", "s--", xs[1:])
        for ref, style in ((best, "k:"), (result["intent_policy"], "g-.")):
            ax.axhline(ref[key]["mean"], linestyle=style[1:], color=style[0], label=ref["name"])
        ax.set_xlabel("cycle")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    n_truth = result["truth_sessions"][1] - result["truth_sessions"][0]
    fig.suptitle(f"bench.loop: world {result['world_seed']}, {result['sessions_per_cycle']:,} sessions a cycle, "
                 f"truth on {n_truth:,} shared sessions", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
