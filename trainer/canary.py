"""The canary judge: the candidate against the active bundle on the sessions each really served.

Why. Off-policy, the gate's estimate of a candidate several steps from the logs comes out low
(``docs/performance.md``, "What the gate can certify"): long products of ratios make a heavy
tail that a few thousand sessions rarely sample, and the caps add to it. A canary asks the
shoppers instead: ``cycle --canary F`` serves a candidate the gate refused but could not rule
out on a share F of the sessions (``weights.canary``: a keyed hash of the session id, the
same on every replica), and the next runs compare the two sides on what they earned.

How. From the logs themselves (``read_sides``: the narrow columns of every decision and the
chosen sessions' outcomes; not the training window, whose sample may hold few canary
sessions), a session is the canary's when the canary served its first decision, the
control's when the active version served its first decision no earlier than the canary's
first (so both sides share the same hours). That is intent to treat, as an A/B test counts:
the hash assigned the session, whatever a replica that had not yet loaded the canary served
later. At most ``max_sessions`` of each side are read (a keyed sample). Each side's business
objective per session (``experience.objective``: net GMV − complaint cost, what the gate and
the simulator judge) gives a difference of means with a normal (Welch) interval at ``level``:

- **promote** when its lower bound is ≥ −tolerance (the gate's rule, on-policy),
- **drop** when its upper bound is < −tolerance (worse), or when ``max_looks`` looks have
  not decided (inconclusive: the canary stops costing sessions),
- otherwise **wait**: the canary keeps serving, and the run trains nothing (a new active
  bundle would change the control under the experiment).

Every run that judges a canary counts one look, also one that found too few sessions on a side
(``min_sessions``) to compare: so a canary serves for at most ``max_looks`` CronJob periods,
and a shop too quiet to judge it is not left without training for longer.

Error rate, nominally. Each look is two-sided at ``level`` (default 0.99); by the union bound a
canary worse by more than the tolerance is promoted with probability at most
``max_looks · (1 − level) / 2`` (1.5 % with 3 looks). The sides are independent (no session
is on both), so the interval is unpaired; randomisation by the hash makes it unbiased.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import NormalDist
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from experience.objective import BusinessObjective
from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from experience.sessions import session_hashes
from trainer import reading
from trainer.log_checks import DEFAULT_LIMITS, SessionLimits, outside, sessions_with_bad_outcomes
from trainer.session_index import NARROW, SessionIndex

if TYPE_CHECKING:
    from weights.model_set import LoadOptions, ModelSet
    from weights.store import WeightsStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CanarySettings:
    """``cycle --canary …``: the share a new canary serves, and how it is judged."""

    fraction: float = 0.0
    """Share of the sessions a refused candidate serves as a canary; 0: no canaries (a second look instead)."""
    level: float = 0.99
    """Two-sided level of each look's interval."""
    max_looks: int = 3
    """Runs that judge a canary before it is dropped undecided: so it serves at most this many CronJob periods."""
    min_sessions: int = 200
    """Sessions each side needs to be compared (fewer: no interval; the run still counts as a look)."""
    max_sessions: int | None = 200_000
    """Sessions of each side a look reads at most (a keyed sample): bounds its memory; None: all."""

    def __post_init__(self) -> None:
        problems = settings_problems(self.fraction, self.level, self.max_looks, self.min_sessions, self.max_sessions)
        if problems:
            raise ValueError("; ".join(f"canary {field}: {problem}" for field, problem in problems))


FLAGS = {"fraction": "--canary", "level": "--canary-level", "max_looks": "--canary-max-looks",
         "min_sessions": "--canary-min-sessions", "max_sessions": "--canary-max-sessions"}
"""``cycle``'s flag for each field of ``CanarySettings``."""


def settings_problems(fraction: float, level: float, max_looks: int, min_sessions: int,
                      max_sessions: int | None) -> list[tuple[str, str]]:
    """What is wrong with these ``CanarySettings`` values: (field, what), none when they are usable."""
    problems = []
    if not 0.0 <= fraction <= 0.5:
        problems.append(("fraction", f"expected in [0, 0.5], got {fraction}"))
    if not 0.5 <= level < 1.0:
        problems.append(("level", f"expected in [0.5, 1), got {level}"))
    if max_looks < 1:
        problems.append(("max_looks", f"expected >= 1, got {max_looks}"))
    if min_sessions < 2:
        problems.append(("min_sessions", f"expected >= 2, got {min_sessions}"))
    elif max_sessions is not None and max_sessions < min_sessions:
        problems.append(("max_sessions", f"expected >= the minimum ({min_sessions}) or all, got {max_sessions}"))
    return problems


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Literal["promote", "drop", "wait"]
    reason: str
    canary_sessions: int
    control_sessions: int
    estimate: float = math.nan
    ci_low: float = math.nan
    ci_high: float = math.nan
    level: float = math.nan
    look: int = 0
    """Which look this was: one more than the looks before it that ended in ``wait`` (only those are counted; after a
    promotion or a drop there is no canary to count for)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SIDE_SALT = b"canary-side-sample"  # independent of the routing's hash (keyed by the canary's version) and the window's


@dataclass(frozen=True, slots=True)
class Sides:
    """The sessions a look compares, and their outcomes."""

    canary: pa.ChunkedArray
    control: pa.ChunkedArray
    outcomes: pa.Table


def sides_of(index: SessionIndex, canary_version: str, current_version: str,
             max_sessions: int | None = None) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
    """The canary's sessions and the control's, by their first decision (intent to treat): the canary's are those it
    began, the control's those the active version began no earlier than the canary's first. With ``max_sessions``,
    at most that many of each side, a keyed sample of the session ids (bottom-k, as the window's sample)."""
    first = index.sessions
    versions, times = first.column("model_version"), first.column("time_s")
    canary = first.filter(pc.equal(versions, canary_version))
    if canary.num_rows == 0:
        empty = pa.chunked_array([], pa.string())
        return empty, empty
    since = pc.min(canary.column("time_s"))
    control = first.filter(pc.and_(pc.equal(versions, current_version), pc.greater_equal(times, since)))
    return _sample(canary.column("session_id"), max_sessions), _sample(control.column("session_id"), max_sessions)


def _sample(ids: pa.ChunkedArray, k: int | None) -> pa.ChunkedArray:
    if k is None or len(ids) <= k:
        return ids
    hashes = session_hashes(ids.to_numpy(zero_copy_only=False), SIDE_SALT)
    return ids.take(pa.array(np.argsort(hashes, kind="stable")[:k]))


def read_sides(source: DirectorySource, canary_version: str, current_version: str, max_sessions: int | None,
               limits: SessionLimits = DEFAULT_LIMITS) -> Sides:
    """The two sides from the logs themselves, not from the training window and its sample (which may hold few of the
    canary's sessions): the narrow columns of every decision, then the chosen sessions' outcomes. No embeddings. A
    session with an outcome row no server writes, or orders or complaints past ``limits``, is left out."""
    index = SessionIndex.of(reading.read_segments(source, "decisions", "read.canary", NARROW))
    canary, control = sides_of(index, canary_version, current_version, max_sessions)
    del index
    wanted = pa.chunked_array(canary.chunks + control.chunks, pa.string())
    outcomes = pa.Table.from_batches(list(reading.rows_of(reading.read_segments(source, "outcomes", "read.canary-outcomes"), wanted)),
                                     schema=SCHEMAS["outcomes"])
    bad = sessions_with_bad_outcomes(outcomes, limits)  # an amount no server writes (NaN, inf, negative), or orders or
    # complaints past the limits: that session is left out
    if len(bad):
        log.warning("sessions with outcome rows no server writes, or past the session limits, are left out of the canary's look",
                    extra={"fields": {"sessions": len(bad)}})
        canary, control = canary.filter(outside(canary, bad)), control.filter(outside(control, bad))
        outcomes = outcomes.filter(outside(outcomes.column("session_id"), bad))
    return Sides(canary, control, outcomes)


def judge(sides: Sides, settings: CanarySettings, looks_before: int, tolerance: float = 0.0,
          objective: BusinessObjective | None = None) -> Verdict:
    """The verdict on the canary from its sessions and the control's (``looks_before`` looks already spent)."""
    canary_ids = sides.canary.to_numpy(zero_copy_only=False)
    control_ids = sides.control.to_numpy(zero_copy_only=False)
    n_a, n_b, look = len(canary_ids), len(control_ids), looks_before + 1
    if min(n_a, n_b) < settings.min_sessions:
        few = (f"too few sessions to judge: {n_a} on the canary, {n_b} on the active bundle since it started (each side "
               f"needs {settings.min_sessions})")
        if look >= settings.max_looks:
            return Verdict("drop", f"{few} after {look} runs (max_looks {settings.max_looks})", n_a, n_b, look=look)
        return Verdict("wait", f"{few}, at run {look} of {settings.max_looks}", n_a, n_b, look=look)
    objective = objective or BusinessObjective()
    a = objective.per_session(canary_ids, sides.outcomes).objective
    b = objective.per_session(control_ids, sides.outcomes).objective
    value = float(a.mean() - b.mean())
    half = NormalDist().inv_cdf(0.5 + settings.level / 2) * math.sqrt(float(a.var(ddof=1)) / n_a + float(b.var(ddof=1)) / n_b)
    if not half > 0:  # every session alike on both sides: no outcomes (not reported, or not in these logs), no evidence
        few = (f"nothing to judge: every session on both sides earned {float(a[0]) if len(a) else 0.0:g} ({n_a} on the canary, "
               f"{n_b} on the active bundle): no outcome reports for them in these logs?")
        log.warning("the canary's look found no outcome spread; it is not promoted on it",
                    extra={"fields": {"canary_sessions": n_a, "control_sessions": n_b}})
        if look >= settings.max_looks:
            return Verdict("drop", f"{few} after {look} runs (max_looks {settings.max_looks})", n_a, n_b, look=look)
        return Verdict("wait", f"{few}, at run {look} of {settings.max_looks}", n_a, n_b, look=look)
    low, high = value - half, value + half
    figures = f"canary − active = {value:+.4g} [{low:+.4g}, {high:+.4g}] at {settings.level:g} on {n_a} + {n_b} sessions"
    action: Literal["promote", "drop", "wait"]
    if low >= -tolerance:
        action, why = "promote", f"lower bound ≥ −{tolerance:g}"
    elif high < -tolerance:
        action, why = "drop", f"worse (upper bound < −{tolerance:g})"
    elif look >= settings.max_looks:
        action, why = "drop", f"undecided after {look} looks (max_looks {settings.max_looks})"
    else:
        action, why = "wait", f"undecided at look {look} of {settings.max_looks}"
    return Verdict(action, f"{figures}: {why}", n_a, n_b, value, low, high, settings.level, look)


def settings_from(args: argparse.Namespace) -> CanarySettings:
    """``--canary`` and its companions (the defaults where absent); ``ValueError`` naming each flag that is wrong."""
    defaults = CanarySettings()
    values = (getattr(args, "canary", defaults.fraction), getattr(args, "canary_level", defaults.level),
              getattr(args, "canary_max_looks", defaults.max_looks), getattr(args, "canary_min_sessions", defaults.min_sessions),
              getattr(args, "canary_max_sessions", defaults.max_sessions))
    problems = settings_problems(*values)
    if problems:
        raise ValueError("; ".join(f"{FLAGS[field]}: {problem}" for field, problem in problems))
    return CanarySettings(*values)


def look(store: WeightsStore, tolerance: float, current: ModelSet, source: Callable[[], DirectorySource],
         options: LoadOptions, settings: CanarySettings, limits: SessionLimits = DEFAULT_LIMITS,
         replacing: str | EllipsisType | None = ...) -> dict[str, Any] | None:
    """Judge the canary, if one is serving, on its sessions and the control's in the logs ``source()`` opens
    (``read_sides``, ``judge``): promote it, drop it, or let it serve on. None without a canary. A promotion replaces
    ``current`` only (``replacing``: its file's sha256, as ``WeightsStore.publish`` takes it); if another bundle became
    active meanwhile, the canary serves on and the next run judges it against that one.

    A canary that cannot be judged (unreadable, refused by the store's check, a failure on the way) is dropped, so it
    cannot block every later run; so is one already active (a promotion interrupted before its drop). A full volume
    (ENOSPC, EDQUOT) is not the canary's fault: the error is raised (the run fails, visibly) and the canary serves on.
    Only a look that ends in ``wait`` is counted; a promotion refused because the active bundle moved is not.
    """
    from weights.model_set import ModelSet
    from weights.store import ActiveMoved

    try:
        data = store.canary()
        if data is None:
            return None
        version = ModelSet.load(store.validate(data), options).version
        head: dict[str, Any] = {"model_version": version, "current_version": current.version}
        if version == current.version:
            store.drop_canary()
            return {**head, "action": "drop", "reason": "the canary is the active bundle already"}
        sides = read_sides(source(), version, current.version, settings.max_sessions, limits)
        verdict = judge(sides, settings, store.canary_looks(version), tolerance)
        report = {**head, **verdict.to_dict()}
        log.info("canary %s: %s: %s", version, verdict.action, verdict.reason)
        if verdict.action == "promote":
            try:
                report["published"] = str(store.promote_canary(replacing, judged=data).status)
            except ActiveMoved as exc:
                report |= {"action": "wait", "reason": str(exc)}  # judged against a bundle gone: not counted
        elif verdict.action == "drop":
            store.drop_canary()
        else:
            store.count_canary_look(version)
        return report
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # a full volume passes: keep the canary and its sessions' evidence, and fail the run so it is seen
        log.exception("no canary look; the canary is dropped")
        try:
            store.drop_canary()
        except OSError as drop:
            log.warning("the canary could not be removed: %s", drop)
        return {"action": "drop", "reason": f"no canary look: {type(exc).__name__}: {exc}"}
