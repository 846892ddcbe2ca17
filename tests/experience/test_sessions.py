"""The decision/outcome join: episode order, de-duplication, orphans, horizon, closed/open, terminal adjustment."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from core.domain import Action, Outcome
from experience.attribution import ConfigError
from experience.schema import DECISIONS, OUTCOMES
from experience.sessions import HORIZON_S, EpisodeConfig, Episodes, build_episodes
from tests.log_tables import decisions, outcome_table

T0 = 1_700_000_000.0
HOUR = 3_600.0
CART, VIEW = int(Action.ADD_TO_CART), int(Action.VIEW_DETAIL)
ORDER, EXIT = int(Outcome.ORDER), int(Outcome.EXIT)


def outcomes(*rows: tuple[Any, ...]) -> pa.Table:
    """Rows of (outcome_id, session_id, outcome, event_time_s, value[, received_s]); received 1 s after the event by default."""
    keys = ("outcome_id", "session_id", "outcome", "event_time_s", "value", "received_s")
    return outcome_table(dict(zip(keys, r, strict=False)) for r in rows)

def with_schema(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` widened to the full log schema: the missing columns get zeros, empty strings and lists."""
    columns = []
    for f in schema:
        if f.name in table.column_names:
            columns.append(table[f.name].cast(f.type))
        elif pa.types.is_fixed_size_list(f.type):
            columns.append(pa.array([[f.type.value_type.to_pandas_dtype()(0)] * f.type.list_size] * table.num_rows, f.type))
        elif pa.types.is_list(f.type):
            columns.append(pa.array([[]] * table.num_rows, f.type))
        elif pa.types.is_string(f.type):
            columns.append(pa.array([""] * table.num_rows, f.type))
        else:
            columns.append(pa.array([0] * table.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=schema)


def by_decision(episodes: Episodes, d: pa.Table) -> dict[str, float]:
    ids = d["decision_id"].to_pylist()
    return {ids[row]: float(r) for row, r in zip(episodes.rows, episodes.rewards, strict=True)}


def step_ids(episodes: Episodes, d: pa.Table) -> list[list[str]]:
    ids = d["decision_id"].to_pylist()
    return [[ids[r] for r in episodes.rows[s : s + n]] for s, n in zip(episodes.starts, episodes.lengths, strict=True)]


THREE_SESSIONS = decisions(
    ("b2", "s-b", T0 + 20, VIEW),
    ("a1", "s-a", T0 + 5, CART),
    ("c1", "s-c", T0, VIEW),
    ("b1", "s-b", T0 + 10, CART),
    ("a3", "s-a", T0 + 9, VIEW),
    ("a2", "s-a", T0 + 9, CART),  # a2 and a3 tie on time: decision_id decides
)


def test_episode_layout() -> None:
    e = build_episodes(THREE_SESSIONS, outcomes())
    assert e.session_ids.tolist() == ["s-a", "s-b", "s-c"]
    assert e.starts.tolist() == [0, 3, 5] and e.lengths.tolist() == [3, 2, 1] and e.ends.tolist() == [2, 4, 5]
    assert step_ids(e, THREE_SESSIONS) == [["a1", "a2", "a3"], ["b1", "b2"], ["c1"]]
    assert e.episode_index().tolist() == [0, 0, 0, 1, 1, 2]
    assert (e.n_episodes, e.n_steps) == (3, 6)
    # Sessions without outcomes are episodes with zero rewards, open, not truncated.
    assert e.rewards.dtype == np.float64 and e.rewards.tolist() == [0.0] * 6
    assert not e.closed.any() and not e.truncated.any()


def test_order_does_not_depend_on_input_row_order() -> None:
    rng = np.random.default_rng(7)
    o = outcomes(("o1", "s-a", ORDER, T0 + 9.5, 100.0), ("o2", "s-b", ORDER, T0 + 30, 10.0), ("x", "s-c", EXIT, T0 + 1, 0.0))
    reference = build_episodes(THREE_SESSIONS, o)
    for _ in range(5):
        d2 = THREE_SESSIONS.take(rng.permutation(THREE_SESSIONS.num_rows))
        o2 = o.take(rng.permutation(o.num_rows))
        e = build_episodes(d2, o2)
        assert step_ids(e, d2) == step_ids(reference, THREE_SESSIONS)
        np.testing.assert_array_equal(e.rewards, reference.rewards)
        np.testing.assert_array_equal(e.closed, reference.closed)
    # The default rules credit an order's net value to the latest decision at or before it: a3 (after a2 on the tie), b2.
    assert by_decision(reference, THREE_SESSIONS) == {"a1": 0.0, "a2": 0.0, "a3": 100.0, "b1": 0.0, "b2": 10.0, "c1": 0.0}
    assert reference.closed.tolist() == [False, False, True]


def test_out_of_order_outcomes() -> None:
    d = decisions(("a1", "s", T0, CART), ("a2", "s", T0 + 100, CART))
    # Arrival order (received_s) is the reverse of event order.
    o = outcomes(("late", "s", ORDER, T0 + 150, 10.0, T0 + 200), ("early", "s", ORDER, T0 + 50, 100.0, T0 + 300))
    assert by_decision(build_episodes(d, o), d) == {"a1": 100.0, "a2": 10.0}


def test_duplicate_outcomes_keep_the_first_received() -> None:
    d = decisions(("a", "s", T0, CART))
    o = outcomes(
        ("o", "s", ORDER, T0 + 5, 100.0, T0 + 30), ("o", "s", ORDER, T0 + 10, 999.0, T0 + 20), ("o", "s", ORDER, T0 + 1, 555.0, T0 + 40)
    )
    e = build_episodes(d, o)
    assert e.rewards.tolist() == [999.0]
    assert e.report.n_duplicate_outcomes == 2 and e.report.n_outcomes == 3


def test_duplicate_ties_are_broken_by_content_not_row_order() -> None:
    d = decisions(("a", "s", T0, CART))
    rows = [("o", "s", ORDER, T0 + 10, 200.0, T0 + 20), ("o", "s", ORDER, T0 + 10, 100.0, T0 + 20)]
    first = build_episodes(d, outcomes(*rows))
    second = build_episodes(d, outcomes(*reversed(rows)))
    assert first.rewards.tolist() == second.rewards.tolist() == [100.0]  # the smaller value sorts first
    assert first.report.n_duplicate_outcomes == 1


def test_an_outcome_id_is_unique_within_its_session_only() -> None:
    """A frontend that numbers outcomes per session (``order-1`` everywhere) loses none of them."""
    d = decisions(("a", "s-a", T0, CART), ("b", "s-b", T0, CART))
    o = outcomes(("order-1", "s-a", ORDER, T0 + 5, 100.0), ("order-1", "s-b", ORDER, T0 + 5, 40.0),
                 ("order-1", "s-b", ORDER, T0 + 5, 40.0, T0 + 60))  # s-b's resend: a duplicate
    e = build_episodes(d, o)
    assert by_decision(e, d) == {"a": 100.0, "b": 40.0}
    assert e.report.n_duplicate_outcomes == 1


def test_a_copy_of_a_decision_is_one_step() -> None:
    """A segment copied under another name logged each of its decisions twice: every step counted twice, in training
    and in the gate. A copy (same session, same id, wherever it lies in the rows) is dropped and counted; the same id in
    another session is another decision."""
    rows = [("a1", "s-a", T0, CART), ("a2", "s-a", T0 + 5, VIEW), ("b1", "s-b", T0, CART), ("a1", "s-b", T0 + 3, VIEW)]
    o = outcomes(("o", "s-a", ORDER, T0 + 7, 100.0))
    once = build_episodes(decisions(*rows), o)
    copied = decisions(*rows, *rows[:2], rows[0])  # the first session's rows again, its first row twice more
    twice = build_episodes(copied, o)
    assert step_ids(twice, copied) == step_ids(once, decisions(*rows)) == [["a1", "a2"], ["b1", "a1"]]
    assert twice.rewards.tolist() == once.rewards.tolist()
    assert twice.report.n_duplicate_decisions == 3 and once.report.n_duplicate_decisions == 0


def test_orphan_outcomes_are_counted_and_ignored() -> None:
    d = decisions(("a", "s", T0, CART))
    o = outcomes(("o1", "ghost", ORDER, T0 + 1, 100.0), ("o2", "ghost", EXIT, T0 + 2, 0.0), ("o3", "s", ORDER, T0 + 3, 10.0))
    e = build_episodes(d, o)
    assert e.rewards.tolist() == [10.0] and not e.closed[0]
    assert e.report.n_orphan_outcomes == 2 and e.report.n_outcomes_outside_horizon == 0


def test_horizon_truncates_and_ignores_late_outcomes() -> None:
    h = HORIZON_S
    d = decisions(
        ("d0", "s", T0, VIEW),
        ("d1", "s", T0 + 71 * HOUR, CART),
        ("d2", "s", T0 + h, CART),
        ("d3", "s", T0 + h + 1, CART),
        ("d4", "s", T0 + h + 50, VIEW),
        ("u", "u", T0, CART),
    )
    o = outcomes(
        ("in", "s", ORDER, T0 + h, 100.0),  # at the horizon end: counts, credits d2
        ("late", "s", ORDER, T0 + h + 2, 1000.0),  # after: ignored although d3 is 1 s before it
        ("exit", "s", EXIT, T0 + h + 3, 0.0),  # after: ignored, the episode stays open
        ("early", "u", ORDER, T0 - 1, 1000.0),
    )  # before u's first decision
    e = build_episodes(d, o)
    assert step_ids(e, d) == [["d0", "d1", "d2"], ["u"]]
    assert e.truncated.tolist() == [True, False] and e.closed.tolist() == [False, False]
    assert by_decision(e, d) == {"d0": 0.0, "d1": 0.0, "d2": 100.0, "u": 0.0}
    assert e.report.n_truncated_steps == 2 and e.report.n_outcomes_outside_horizon == 3


def test_horizon_is_configurable() -> None:
    d = decisions(("d0", "s", T0, CART), ("d1", "s", T0 + 10, CART), ("d2", "s", T0 + 11, CART))
    e = build_episodes(d, outcomes(("o", "s", ORDER, T0 + 10.5, 100.0)), EpisodeConfig(horizon_s=10.0))
    assert step_ids(e, d) == [["d0", "d1"]] and e.truncated.tolist() == [True]
    assert e.rewards.tolist() == [0.0, 0.0] and e.report.n_outcomes_outside_horizon == 1


def test_closed_needs_an_exit_within_the_horizon() -> None:
    d = decisions(("a", "a", T0, VIEW), ("b", "b", T0, VIEW), ("c", "c", T0, VIEW), ("e", "e", T0, VIEW))
    o = outcomes(
        ("1", "a", EXIT, T0, 0.0),  # at the first decision: closed
        ("2", "b", EXIT, T0 - 1, 0.0),  # before it: open
        ("3", "c", ORDER, T0 + 5, 0.0),
    )  # no exit: open
    e = build_episodes(d, o)
    assert e.closed.tolist() == [True, False, False, False]


def test_terminal_adjustment_for_open_episodes() -> None:
    d = decisions(("a1", "a", T0, CART), ("a2", "a", T0 + 1, VIEW), ("b1", "b", T0, CART), ("b2", "b", T0 + 1, VIEW), ("c1", "c", T0, VIEW))
    o = outcomes(("o", "a", ORDER, T0 + 2, 100.0), ("x", "b", EXIT, T0 + 3, 0.0))
    e = build_episodes(d, o, EpisodeConfig(open_terminal_reward=-2.5))
    assert by_decision(e, d) == {"a1": 0.0, "a2": 97.5, "b1": 0.0, "b2": 0.0, "c1": -2.5}  # a2: the order, then −2.5
    assert by_decision(build_episodes(d, o), d)["a2"] == 100.0  # default: no adjustment


def test_empty_inputs() -> None:
    e = build_episodes(decisions(), outcomes())
    assert (e.n_episodes, e.n_steps) == (0, 0)
    assert e.rows.tolist() == e.starts.tolist() == e.lengths.tolist() == e.rewards.tolist() == []
    e = build_episodes(decisions(), outcomes(("o", "s", ORDER, T0, 1.0), ("x", "s", EXIT, T0, 0.0)))
    assert e.n_episodes == 0 and e.report.n_orphan_outcomes == 2


def test_full_schema_tables() -> None:
    d = with_schema(decisions(("a", "s", T0, CART), ("v", "s", T0 + 1, VIEW)), DECISIONS)
    o = with_schema(outcomes(("o", "s", ORDER, T0 + 2, 50.0)), OUTCOMES)
    e = build_episodes(d, o)
    assert d.schema == DECISIONS and e.rewards.tolist() == [0.0, 50.0]


def test_bad_tables() -> None:
    d = decisions(("a", "s", T0, CART))
    with pytest.raises(ValueError, match=r"decisions table lacks column\(s\) \['action'\]"):
        build_episodes(d.drop_columns(["action"]), outcomes())
    with pytest.raises(ValueError, match=r"outcomes table lacks column\(s\) \['received_s'\]"):
        build_episodes(d, outcomes().drop_columns(["received_s"]))
    with pytest.raises(ValueError, match=r"decisions\.session_id: 1 null"):
        build_episodes(d.set_column(1, "session_id", pa.array([None], pa.string())), outcomes())
    with pytest.raises(ValueError, match=r"decisions\.event_time_s: 1 non-finite"):
        build_episodes(d.set_column(2, "event_time_s", pa.array([float("nan")])), outcomes())


def test_config_round_trips_and_names_bad_keys() -> None:
    config = EpisodeConfig(horizon_s=3600.0, open_terminal_reward=-1.0)
    assert EpisodeConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert EpisodeConfig.from_dict({}) == EpisodeConfig()
    cases = [
        ({"horizon": 1}, "episodes: unknown key(s) ['horizon']"),
        ({"horizon_s": 0}, "episodes.horizon_s: expected a finite number > 0"),
        ({"horizon_s": "72h"}, "episodes.horizon_s: expected a number"),
        ({"open_terminal_reward": None}, "episodes.open_terminal_reward: expected a number"),
        (
            {"attribution": {"rules": [{"action": "exit", "outcome": "order", "window_s": 1, "field": "value", "weight": "x"}]}},
            "episodes.attribution.rules[0].weight: expected a number",
        ),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError) as info:
            EpisodeConfig.from_dict(spec)
        assert str(info.value).startswith(message), str(info.value)
