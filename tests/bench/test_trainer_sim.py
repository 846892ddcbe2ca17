"""``bench.trainer_sim``, tiny: one world for the logs and the truth (disjoint sessions), and figures of the same
quantity side by side (the objective per session, γ = 1: true and offline DR), the training return apart."""

from __future__ import annotations

from typing import Any

import pytest

from bench import trainer_sim
from bench.loop import TRUTH_FIRST


def test_a_tiny_run_reports_comparable_figures_of_one_world(monkeypatch: pytest.MonkeyPatch) -> None:
    written: dict[str, Any] = {}
    monkeypatch.setattr(trainer_sim, "write_results", lambda path, result: written.update(result))
    assert trainer_sim.main(["--sessions", "300", "--eval-sessions", "200", "--advantages", "baseline", "--seed", "5",
                             "--json"]) == 0
    assert written["world_seed"] == 5 and written["logs"]["sessions"] == [0, 300]
    assert written["truth_sessions"] == [TRUTH_FIRST, TRUTH_FIRST + 200]
    for row in (written["behaviour"], written["baseline"]["true"]):
        assert set(row) >= {"objective_per_session", "training_return_g0_gamma_0.85"}
    assert "offline_dr_objective" in written["baseline"] and "offline_dr" not in written["baseline"]
    with pytest.raises(SystemExit):
        trainer_sim.main(["--eval-seed", "99"])  # one world: no separate truth world any more
