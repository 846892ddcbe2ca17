"""Harm labels for the Action Guard, from the decision and outcome logs (pyarrow, no torch).

**Labels** (``harmful_labels``). A logged decision is *harmful* when an outcome that names it
(by ``decision_id`` within its own session, after de-duplication by session and ``outcome_id`` as the episodes do) is one of
``GuardConfig.harmful_outcomes`` (COMPLAINT by default), or, when ``exit_counts``, is an EXIT
whose gap ``outcome.event_time_s − decision.event_time_s ≤ exit_within_s`` (the shopper left
right after the action). The outcome names its decision, so it follows it; a negative gap is
clock skew and counts as within the window. An EXIT after a served action in
``exit_exempt_actions`` (EXIT itself by default: serving it asks the shopper to leave) is not
harm. Outcomes naming decisions not in the table are ignored, and so is an outcome of another session that names a
decision's id: a report counts for the decision of its id in its own session only, as product rewards do
(``trainer.product_data.rewards``), so a row copied into another session under the same id labels nothing.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import Outcome
from experience.sessions import OUTCOME_COLUMNS, dedupe_outcomes
from trainer.config import GuardConfig

BoolArray = npt.NDArray[np.bool_]


def _require(table: pa.Table, columns: tuple[str, ...], kind: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{kind} table lacks column(s) {missing}")


def harmful_labels(decisions: pa.Table, outcomes: pa.Table, config: GuardConfig | None = None) -> BoolArray:
    """Per decision row (in table order): did it do harm? See the module doc for the rule.

    Reads ``session_id``, ``decision_id``, ``event_time_s`` and ``action`` of the decisions and the outcome
    columns that ``dedupe_outcomes`` keys on. Vectorised: one set-membership test for the
    harmful outcomes, one group-by (earliest EXIT per decision) and one hash lookup, on (session, decision) keys.
    """
    config = config or GuardConfig()
    _require(decisions, ("session_id", "decision_id", "event_time_s", "action"), "decisions")
    _require(outcomes, OUTCOME_COLUMNS, "outcomes")
    ids = _key(decisions)
    harmful = np.zeros(decisions.num_rows, dtype=np.bool_)
    chosen = outcomes.take(dedupe_outcomes(outcomes))
    kept = pa.table({"key": _key(chosen), "outcome": chosen["outcome"], "event_time_s": chosen["event_time_s"]})
    kind = kept["outcome"]
    if config.harmful_outcomes:
        codes = pa.array([int(o) for o in config.harmful_outcomes], type=kind.type)
        named = kept.filter(pc.is_in(kind, value_set=codes))["key"].combine_chunks()
        harmful |= np.asarray(pc.is_in(ids, value_set=named).to_numpy(zero_copy_only=False), dtype=np.bool_)
    if config.exit_counts:
        harmful |= _early_exit(decisions, ids, kept.filter(pc.equal(kind, int(Outcome.EXIT))), config)
    return harmful


def _key(table: pa.Table) -> pa.ChunkedArray:
    """Per row, its session and decision ids as one string (a separator no hex id or keyed hash holds)."""
    return pc.binary_join_element_wise(table["session_id"], table["decision_id"], "\x1f")


def _early_exit(decisions: pa.Table, ids: pa.ChunkedArray, exits: pa.Table, config: GuardConfig) -> BoolArray:
    """Per decision row (``ids``: its keys): its earliest EXIT is within ``exit_within_s`` and its action is not exempt."""
    first = exits.group_by("key").aggregate([("event_time_s", "min")])
    where = pc.index_in(ids, value_set=first["key"].combine_chunks())
    found = np.asarray(where.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    t_exit = np.full(decisions.num_rows, np.inf)
    t_exit[found] = first["event_time_s_min"].to_numpy()[where.to_numpy(zero_copy_only=False)[found].astype(np.int64)]
    gap = t_exit - np.asarray(decisions["event_time_s"].to_numpy(), dtype=np.float64)
    exempt = np.isin(decisions["action"].to_numpy(), [int(a) for a in config.exit_exempt_actions])
    return np.asarray(found & (gap <= config.exit_within_s) & ~exempt, dtype=np.bool_)
