"""Episodes: the decision log joined with the outcome log per session, with attributed rewards.

One session is one episode; its steps are its decisions in (event_time_s, decision_id) order,
and episodes come in session_id order (byte order), so the result does not depend on the
order of the input rows. Everything is vectorised over flat arrays: variable-length episodes
are ``starts`` / ``lengths`` into per-step arrays, never padded.

The join, for a session whose first decision is at ``t0`` (its horizon ends at ``t0 + horizon_s``):

- **Decisions** after the horizon end are dropped and the episode is marked ``truncated``.
- **Outcomes** are de-duplicated by session and ``outcome_id``: the copy with the smallest ``received_s``
  is kept, ties broken by the remaining columns, so the choice is deterministic. Outcomes are
  matched to decisions by session and event time (see ``experience.attribution``), so
  their arrival order does not matter. Only outcomes with ``t0 ≤ event_time_s ≤ t0 +
  horizon_s`` count; the others are ignored and counted (``n_outcomes_outside_horizon``), and
  so are outcomes whose session has no decision at all (``n_orphan_outcomes``).
- **Closed** episodes have an EXIT outcome that counts (within ``[t0, t0 + horizon_s]``); every
  other episode is **open**: cut by the horizon or still running when the logs end. ``closed``
  and ``truncated`` are independent flags (a session with decisions after its EXIT is closed).
- **Rewards** per step: the attribution rules; sessions without outcomes are valid episodes
  with all rewards 0. Then the terminal adjustment: ``open_terminal_reward`` is added to the
  last step's reward of every open episode (default 0).

- **Decisions** are de-duplicated by session and ``decision_id``: a server logs each decision once, under a fresh
  random id, so a second row of one (a segment copied under another name, a restored backup) is a copy; the first in
  episode order is kept (``n_duplicate_decisions``). A copied segment used to give each of its sessions every step
  twice, in training and in the gate's estimate.

Both horizon edges are inclusive.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import FloatArray, Outcome
from experience.attribution import COLUMNS, AttributionConfig, ConfigError, IntArray, attribute, config_object

BoolArray = npt.NDArray[np.bool_]

HORIZON_S = 72 * 3600.0
DECISION_COLUMNS = ("decision_id", "session_id", "event_time_s", "action")
OUTCOME_COLUMNS = ("outcome_id", "decision_id", "session_id", "outcome", "value", "coupon_discount", "event_time_s", "received_s")
_CONFIG_KEYS = ("horizon_s", "open_terminal_reward", "attribution")


@dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """How logs become episodes; a plain dict in trainer configs (``to_dict`` / ``from_dict``)."""

    horizon_s: float = HORIZON_S
    """Episode length limit from the session's first decision, in seconds (inclusive)."""
    open_terminal_reward: float = 0.0
    """Added to the last step's reward of every open (not closed) episode."""
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    """The reward rules."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.horizon_s) or self.horizon_s <= 0:
            raise ConfigError(f"horizon_s: expected a finite number > 0, got {self.horizon_s!r}")
        if not math.isfinite(self.open_terminal_reward):
            raise ConfigError(f"open_terminal_reward: expected a finite number, got {self.open_terminal_reward!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"horizon_s": self.horizon_s, "open_terminal_reward": self.open_terminal_reward, "attribution": self.attribution.to_dict()}

    @classmethod
    def from_dict(cls, spec: Any, where: str = "episodes") -> EpisodeConfig:
        """The inverse of ``to_dict``; missing keys take their defaults."""
        spec = config_object(spec, _CONFIG_KEYS, where)
        numbers: dict[str, float] = {}
        for key in ("horizon_s", "open_terminal_reward"):
            if key in spec:
                value = spec[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
                numbers[key] = float(value)
        attribution = AttributionConfig.from_dict(spec.get("attribution", {}), f"{where}.attribution")
        try:
            return cls(**numbers, attribution=attribution)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None


@dataclass(frozen=True, slots=True)
class JoinReport:
    """What the join dropped or ignored; all counts of rows."""

    n_decisions: int
    n_outcomes: int
    n_duplicate_outcomes: int
    """Outcome rows dropped as copies of an earlier-received row with the same session and ``outcome_id``."""
    n_orphan_outcomes: int
    """Distinct outcomes whose session has no decision."""
    n_outcomes_outside_horizon: int
    """Distinct outcomes before their session's first decision or after its horizon end."""
    n_truncated_steps: int
    """Decisions dropped after their session's horizon end."""
    n_duplicate_decisions: int = 0
    """Decision rows dropped as copies of an earlier row (in episode order) with the same session and ``decision_id``."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True, eq=False)
class Episodes:
    """Variable-length episodes over flat per-step arrays (no padding).

    Episode ``e`` is steps ``starts[e] : starts[e] + lengths[e]``; every length is ≥ 1 and the
    episodes tile the steps in order (``starts[0] == 0``, ``starts[e+1] == starts[e] + lengths[e]``).
    """

    rows: IntArray
    """Per step: the row index into the input decisions table (gather states, propensities)."""
    starts: IntArray
    lengths: IntArray
    session_ids: npt.NDArray[np.object_]
    """Per episode: the session id (str)."""
    rewards: FloatArray
    """Per step: attributed reward plus the terminal adjustment (float64)."""
    closed: BoolArray
    """Per episode: the session has an EXIT outcome within its horizon."""
    truncated: BoolArray
    """Per episode: decisions after the horizon were dropped."""
    report: JoinReport

    @property
    def n_episodes(self) -> int:
        return len(self.starts)

    @property
    def n_steps(self) -> int:
        return len(self.rows)

    @property
    def ends(self) -> IntArray:
        """Per episode: the index of its last step."""
        return self.starts + self.lengths - 1

    def episode_index(self) -> IntArray:
        """Per step: the episode it belongs to."""
        return np.repeat(np.arange(self.n_episodes, dtype=np.int64), self.lengths)


def _require(table: pa.Table, columns: tuple[str, ...], kind: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{kind} table lacks column(s) {missing}")
    for c in columns:
        if table[c].null_count:
            raise ValueError(f"{kind}.{c}: {table[c].null_count} null value(s)")


def _float(column: pa.ChunkedArray, name: str) -> FloatArray:
    values = np.asarray(column.to_numpy(), dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"{name}: {int((~np.isfinite(values)).sum())} non-finite value(s)")
    return values


def starts_of_runs(values: pa.ChunkedArray) -> IntArray:
    """Indices where a run of equal values begins (0 first), for a non-empty array."""
    n = len(values)
    first = np.ones(n, dtype=np.bool_)
    if n > 1:
        first[1:] = pc.not_equal(values.slice(1), values.slice(0, n - 1)).to_numpy()
    return np.flatnonzero(first)


def episode_order(decisions: pa.Table) -> IntArray:
    """Row indices of ``decisions`` sorted by (session_id, event_time_s, decision_id), stable."""
    keys = [("session_id", "ascending"), ("event_time_s", "ascending"), ("decision_id", "ascending")]
    return np.asarray(pc.sort_indices(decisions.select(list(DECISION_COLUMNS[:3])), sort_keys=keys), dtype=np.int64)


def first_copies(decisions: pa.Table, order: IntArray) -> IntArray:
    """``order`` (row indices) without the rows whose session and ``decision_id`` a row before them in ``order`` has."""
    ids = decisions["decision_id"]
    if len(pc.unique(ids)) == decisions.num_rows:  # every id once, the logs as servers write them (count_distinct: slower)
        return order
    placed = decisions.select(["session_id", "decision_id"]).take(pa.array(order, pa.int64()))
    placed = placed.append_column("at", pa.array(np.arange(len(order), dtype=np.int64)))
    first = placed.group_by(["session_id", "decision_id"]).aggregate([("at", "min")]).column("at_min")
    return order[np.sort(np.asarray(first.to_numpy(), dtype=np.int64))]


def first_received(table: pa.Table, id_column: str, tie_columns: Sequence[str]) -> IntArray:
    """Row indices of the distinct reports of ``table``: per session and ``id_column`` the copy with the smallest
    ``received_s``, ties broken by ``tie_columns`` in turn, so the choice does not depend on row order. An id is
    unique within its session: a frontend that numbers its reports per session (``order-1`` in every session) loses
    none of them, and the result is the same on any sharding of the sessions. The indices come in ``id_column`` order
    (then ``received_s`` and the ties)."""
    if table.num_rows == 0:
        return np.zeros(0, dtype=np.int64)
    columns = (id_column, "received_s", *tie_columns)
    keyed = table.select(list(columns)).append_column(
        "key", pc.binary_join_element_wise(table["session_id"], table[id_column], "\x00"))
    by_key = np.asarray(pc.sort_indices(keyed, sort_keys=[(c, "ascending") for c in ("key", *columns[1:])]), dtype=np.int64)
    kept = by_key[starts_of_runs(keyed["key"].take(by_key))]
    return kept[np.asarray(pc.sort_indices(keyed.take(kept), sort_keys=[(c, "ascending") for c in columns]), dtype=np.int64)]


def dedupe_outcomes(outcomes: pa.Table) -> IntArray:
    """Row indices of the distinct outcomes (``first_received`` by ``outcome_id``; ties by event time, then the rest).

    The order is the one from when outcome ids were de-duplicated across sessions: where ids are unique overall, the
    rows kept and their order are unchanged, and so is every sum over them.
    """
    return first_received(outcomes, "outcome_id",
                          ("event_time_s", "session_id", "decision_id", "outcome", "value", "coupon_discount"))


@dataclass(frozen=True, slots=True, eq=False)
class _Steps:
    """The decisions kept, in episode order, and their sessions."""

    rows: IntArray
    code: IntArray
    """Per step: its session's code, the rank of the session id."""
    time: FloatArray
    action: npt.NDArray[np.integer[Any]]
    starts: IntArray
    lengths: IntArray
    truncated: BoolArray
    session_ids: pa.Array
    t0: FloatArray
    """Per session: the first decision's event time."""
    n_dropped: int
    n_copies: int


def _steps(decisions: pa.Table, horizon_s: float) -> _Steps:
    """Sort the decisions into episodes; drop the copies of a decision and those after their session's horizon end."""
    order = episode_order(decisions)
    every = len(order)
    order = first_copies(decisions, order)
    sessions = decisions["session_id"].take(order)
    session_starts = starts_of_runs(sessions) if len(order) else np.zeros(0, dtype=np.int64)
    n_sessions = len(session_starts)
    is_first = np.zeros(len(order), dtype=np.bool_)
    is_first[session_starts] = True
    code = np.cumsum(is_first, dtype=np.int64) - 1
    time = _float(decisions["event_time_s"], "decisions.event_time_s")[order]
    t0 = time[session_starts]
    keep = time <= (t0 + horizon_s)[code]
    rows = order[keep]
    lengths = np.bincount(code[keep], minlength=n_sessions).astype(np.int64)
    return _Steps(
        rows=rows,
        code=code[keep],
        time=time[keep],
        action=np.asarray(decisions["action"].to_numpy())[rows],
        starts=(np.cumsum(lengths) - lengths).astype(np.int64),
        lengths=lengths,
        truncated=np.bincount(code[~keep], minlength=n_sessions) > 0,
        session_ids=sessions.take(pa.array(session_starts, pa.int64())).combine_chunks(),
        t0=t0,
        n_dropped=int((~keep).sum()),
        n_copies=every - len(order),
    )


def build_episodes(decisions: pa.Table, outcomes: pa.Table, config: EpisodeConfig | None = None) -> Episodes:
    """Join decisions and outcomes into episodes with attributed rewards (see the module doc).

    Both tables need at least ``DECISION_COLUMNS`` / ``OUTCOME_COLUMNS`` (extra columns are
    ignored); null keys or non-finite times raise ``ValueError``.
    """
    config = config or EpisodeConfig()
    _require(decisions, DECISION_COLUMNS, "decisions")
    _require(outcomes, OUTCOME_COLUMNS, "outcomes")
    steps = _steps(decisions, config.horizon_s)

    # Outcomes: distinct, in a session with decisions, within its horizon.
    kept = dedupe_outcomes(outcomes)
    out = outcomes.select(list(OUTCOME_COLUMNS)).take(pa.array(kept, pa.int64()))
    code = pc.index_in(out["session_id"].cast(steps.session_ids.type), value_set=steps.session_ids)
    code = np.asarray(code.fill_null(-1).to_numpy(), dtype=np.int64)
    orphan = code < 0
    time = _float(out["event_time_s"], "outcomes.event_time_s")
    inside = np.zeros(len(code), dtype=np.bool_)
    if len(steps.t0):
        t0 = steps.t0[np.where(orphan, 0, code)]
        inside = ~orphan & (time >= t0) & (time <= t0 + config.horizon_s)
    code, time, kind = code[inside], time[inside], np.asarray(out["outcome"].to_numpy())[inside]
    fields = {f: np.asarray(out[f].to_numpy(), dtype=np.float64)[inside] for f in COLUMNS}

    closed = np.zeros(len(steps.t0), dtype=np.bool_)
    closed[code[kind == int(Outcome.EXIT)]] = True
    rewards = attribute(steps.code, steps.time, steps.action, code, time, kind, fields, config.attribution.rules)
    if config.open_terminal_reward:
        rewards[(steps.starts + steps.lengths - 1)[~closed]] += config.open_terminal_reward

    report = JoinReport(
        n_decisions=decisions.num_rows,
        n_outcomes=outcomes.num_rows,
        n_duplicate_outcomes=outcomes.num_rows - len(kept),
        n_orphan_outcomes=int(orphan.sum()),
        n_outcomes_outside_horizon=int((~orphan & ~inside).sum()),
        n_truncated_steps=steps.n_dropped,
        n_duplicate_decisions=steps.n_copies,
    )
    return Episodes(
        rows=steps.rows,
        starts=steps.starts,
        lengths=steps.lengths,
        session_ids=steps.session_ids.to_numpy(zero_copy_only=False),
        rewards=rewards,
        closed=closed,
        truncated=steps.truncated,
        report=report,
    )


def session_codes(sessions: npt.NDArray[Any]) -> tuple[list[Any], npt.NDArray[np.int64]]:
    """The distinct session ids (first-seen order) and each row's index into them (a hash encode, no sort)."""
    encoded = pa.array(np.asarray(sessions)).dictionary_encode()
    return encoded.dictionary.to_pylist(), np.asarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int64)


def session_hashes(distinct: Sequence[Any], key: bytes) -> npt.NDArray[np.uint64]:
    """``blake2b_64(str(s), key=key)`` per session id: a session's draw depends on its id and the key alone."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(str(s).encode(), digest_size=8, key=key).digest(), "little") for s in distinct),
        dtype=np.uint64,
        count=len(distinct),
    )


def split_by_session(sessions: npt.NDArray[Any], holdout_fraction: float, seed: int = 0, salt: bytes = b"") -> BoolArray:
    """Held-out mask per row: session ``s`` is held out iff ``blake2b_64(str(s), key=salt ‖ seed) / 2⁶⁴ < holdout_fraction``.

    The hash runs once per distinct session; every row of a session lands on its side, and a
    session's side depends on its id alone (it stays there as the logs grow). Two splits of
    the same rows that must be independent (the trainer's gate split, and the guard's
    threshold split inside the training side) use different ``salt``.
    """
    distinct, inverse = session_codes(sessions)
    key = salt + int(seed).to_bytes(8, "little", signed=True)
    threshold = math.ceil(holdout_fraction * 2.0**64)  # h < cut ⟺ h < ⌈cut⌉ for integer h: exact, as before
    hashes = session_hashes(distinct, key)
    held = hashes < np.uint64(threshold) if threshold < 2**64 else np.ones(len(hashes), dtype=np.bool_)
    return held[inverse]
