"""Sessions with log rows no server writes are left out of training and of the gate, whole, and counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from experience.schema import SCHEMAS
from experience.segments import DirectorySource
from policy.features import FeatureSpec
from tests.harness import ROOT
from tests.log_tables import with_value
from trainer.log_checks import usable


def _poisoned(decisions: pa.Table, outcomes: pa.Table) -> tuple[pa.Table, pa.Table, set[str]]:
    """Three sessions poisoned as the review found them: a NaN propensity, a propensity that is not the served
    probability it claims (the gate-flip attack), a negative outcome value."""
    sessions = decisions.column("session_id").to_pylist()
    rows = [sessions.index(s) for s in sorted(set(sessions))[:2]]
    decisions = with_value(decisions, "propensity", rows[0], float("nan"))
    served = decisions.column("served_probs").to_pylist()[rows[1]]
    action = decisions.column("action").to_pylist()[rows[1]] - 1
    decisions = with_value(decisions, "propensity", rows[1], min(1.0, served[action] * 3 + 0.01))
    third = next(s for s in outcomes.column("session_id").to_pylist() if s not in {sessions[r] for r in rows})
    outcomes = with_value(outcomes, "value", outcomes.column("session_id").to_pylist().index(third), -1e9)
    return decisions, outcomes, {sessions[rows[0]], sessions[rows[1]], third}


def test_the_sessions_of_rows_no_server_writes_are_dropped_whole(sim_logs: Path) -> None:
    source = DirectorySource(sim_logs)
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    same = usable(decisions, outcomes)
    assert same[0] is decisions and same[1] is outcomes and same[2].sessions == 0  # real logs pass untouched
    poisoned_d, poisoned_o, bad = _poisoned(decisions, outcomes)
    kept_d, kept_o, dropped = usable(poisoned_d, poisoned_o)
    assert dropped.sessions == 3 and dropped.reasons == {"propensity outside (0, 1]": 1,  # the NaN, which is also
                                                         "propensity not the served probability of the action": 2,
                                                         "value not a finite amount >= 0": 1}
    left = set(decisions.column("session_id").to_pylist()) - bad
    assert set(kept_d.column("session_id").to_pylist()) == left
    assert set(kept_o.column("session_id").to_pylist()) <= left
    assert kept_d.num_rows + dropped.decisions == decisions.num_rows
    assert kept_o.num_rows + dropped.outcomes == outcomes.num_rows
    not_bad = pc.invert(pc.is_in(decisions.column("session_id"), value_set=pa.array(sorted(bad))))
    expected = decisions.filter(not_bad)
    for column in ("decision_id", "propensity", "served_probs"):  # every other row as it was, in its order
        assert kept_d.column(column).to_pylist() == expected.column(column).to_pylist()


@pytest.mark.parametrize("served", [[0.5, 0.5, 0.5, 0.0, 0.0], [float("nan")] * 5, [1.2, -0.2, 0.0, 0.0, 0.0], None,
                                    [0.2, None, 0.3, 0.5, 0.0]])
def test_a_served_distribution_that_is_none_is_a_bad_row(sim_logs: Path, served: list[float | None] | None) -> None:
    decisions = DirectorySource(sim_logs).table("decisions").slice(0, 50)
    decisions = with_value(decisions, "served_probs", 7, served)
    _, _, dropped = usable(decisions, SCHEMAS["outcomes"].empty_table())
    assert dropped.sessions == 1 and "served_probs not a distribution" in dropped.reasons


def _poisoned_dir(sim_logs: Path, root: Path) -> set[str]:
    source = DirectorySource(sim_logs)
    decisions, outcomes, bad = _poisoned(source.table("decisions"), source.table("outcomes"))
    for kind, table in (("decisions", decisions), ("outcomes", outcomes)):
        (root / kind).mkdir()
        with pa.OSFile(str(root / kind / "poisoned.arrows"), "wb") as sink, \
                pa.ipc.new_stream(sink, SCHEMAS[kind]) as writer:
            writer.write_table(table.cast(SCHEMAS[kind]))
    return bad


def test_the_trainers_window_and_gate_reads_leave_them_out(sim_logs: Path, tmp_path: Path) -> None:
    from trainer.config import TrainConfig
    from trainer.reading import read_gate, read_window

    bad = _poisoned_dir(sim_logs, tmp_path)
    window = read_window(DirectorySource(tmp_path), TrainConfig(gate_sessions=10_000), gate=True)
    assert window.gate is not None
    held_d, held_o = read_gate(DirectorySource(tmp_path), window.gate)
    for table in (window.decisions, window.outcomes, held_d, held_o):
        assert table.num_rows and not bad & set(table.column("session_id").to_pylist())


@pytest.mark.parametrize("action", [0, 6, -1, None])
def test_an_action_outside_the_five_is_a_bad_row(sim_logs: Path, action: int | None) -> None:
    """It used to pass the check and stop evaluate (actions: action indices must be in 0..4)."""
    decisions = DirectorySource(sim_logs).table("decisions").slice(0, 50)
    decisions = with_value(decisions, "action", 3, action)
    _, _, dropped = usable(decisions, SCHEMAS["outcomes"].empty_table())
    assert dropped.sessions == 1 and dropped.reasons["action outside 1..5"] == 1


@pytest.mark.parametrize("hour", [24, 99, -5])
def test_an_hour_no_day_has_is_a_bad_row(sim_logs: Path, hour: int) -> None:
    """99 stopped evaluate (the hour's one-hot); −5 was read as 19."""
    decisions = DirectorySource(sim_logs).table("decisions").slice(0, 50)
    decisions = with_value(decisions, "hour", 3, hour)
    _, _, dropped = usable(decisions, SCHEMAS["outcomes"].empty_table())
    assert dropped.sessions == 1 and dropped.reasons == {"hour outside 0..23": 1}


@pytest.mark.parametrize(("column", "value", "reason"), [
    ("item_embedding", [float("nan")] * 768, "item_embedding NaN"),
    ("behavior_bucket_indices", [-1], "behavior_bucket_indices outside the logged bucket count"),
    ("behavior_bucket_indices", [2048], "behavior_bucket_indices outside the logged bucket count"),
])
def test_a_shopper_no_request_describes_is_a_bad_row(sim_logs: Path, column: str, value: object, reason: str) -> None:
    """A NaN embedding stopped evaluate (the model's output NaN); a bucket past the logged count stopped the encoder."""
    decisions = DirectorySource(sim_logs).table("decisions").slice(0, 50)
    _, _, dropped = usable(with_value(decisions, column, 3, value), SCHEMAS["outcomes"].empty_table())
    assert dropped.sessions == 1 and dropped.reasons == {reason: 1}


def test_evaluate_on_poisoned_logs_leaves_the_sessions_out_and_says_so(sim_logs: Path, tmp_path: Path) -> None:
    """Before: the NaN propensity stopped evaluate (and cycle, on every later run) with exit 1."""
    _poisoned_dir(sim_logs, tmp_path)
    out = subprocess.run([sys.executable, "-m", "server", "evaluate", "default", "--logs", str(tmp_path), "--bootstrap", "20",
                          "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sessions with log rows no server writes are left out of this run" in out.stderr
    assert '"sessions": 3' in out.stderr or "sessions=3" in out.stderr
    assert np.isfinite(json.loads(out.stdout.strip().splitlines()[-1])["dr"]["value"])


def test_rows_the_bundle_cannot_rebuild_are_left_out_when_its_spec_is_known(sim_logs: Path, tmp_path: Path) -> None:
    """One row of another embedding length (a server of another spec, or none) stopped every run whose window held it
    with "item_embedding: row … has 512 values, the bundle expects 768"; read for a bundle, it is left out with its
    session. Without a spec (logs compact, a bare reader) nothing is judged by one."""
    source = DirectorySource(sim_logs)
    decisions, outcomes = source.table("decisions"), source.table("outcomes")
    spec = FeatureSpec()
    decisions = with_value(decisions, "item_embedding", 7, [0.0] * 512)
    assert usable(decisions, outcomes)[2].sessions == 0
    decisions = with_value(decisions, "behavior_bucket_count", 11, 4096)
    _, _, dropped = usable(decisions, outcomes, spec)
    assert dropped.reasons == {"item_embedding not the bundle's 768 values": 1, "behavior_bucket_count not the bundle's 2048": 1}
    (tmp_path / "decisions").mkdir()
    (tmp_path / "outcomes").mkdir()
    for kind, table in (("decisions", decisions), ("outcomes", outcomes)):
        with pa.OSFile(str(tmp_path / kind / "mixed.arrows"), "wb") as sink, pa.ipc.new_stream(sink, SCHEMAS[kind]) as writer:
            writer.write_table(table.cast(SCHEMAS[kind]))
    out = subprocess.run([sys.executable, "-m", "server", "evaluate", "default", "--logs", str(tmp_path), "--bootstrap", "20",
                          "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and "item_embedding not the bundle's 768 values" in out.stderr, out.stderr[-2000:]
