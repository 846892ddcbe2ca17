"""The gate-power bench: its summary arithmetic, and a tiny end-to-end run on two real bundles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import gate_power
from weights.initial import make_bundle


def test_the_summary_counts_widths_errors_and_coverage() -> None:
    rows = [{"truth": 1.0, "estimate": 2.0, "ci_low": 0.0, "ci_high": 4.0, "publish": True},
            {"truth": 1.0, "estimate": -2.0, "ci_low": -3.0, "ci_high": 0.5, "publish": False}]
    s = gate_power.summary(rows)
    assert s == {"chunks": 2, "mean_width": 3.75, "rmse_vs_truth": pytest.approx((0.5 * (1 + 9)) ** 0.5), "held_truth": 1,
                 "published": 1}


def test_the_canary_compares_the_two_groups_on_policy() -> None:
    candidate = np.array([5.0, 7.0, 100.0, 5.0, 7.0, 100.0])
    current = np.array([100.0, 100.0, 2.0, 100.0, 100.0, 4.0])
    in_canary = np.array([True, True, False, True, True, False])  # the candidate's sessions; the rest the current's
    got = gate_power.canary(candidate, current, in_canary)
    half = 1.96 * ((np.var([5, 7, 5, 7], ddof=1) / 4) + (np.var([2, 4], ddof=1) / 2)) ** 0.5
    assert got["estimate"] == pytest.approx(3.0) and got["ci_low"] == pytest.approx(3.0 - half)
    assert got["canary_sessions"] == 4 and got["publish"] == (3.0 - half >= 0)
    with pytest.raises(ValueError, match="at least 2 sessions"):
        gate_power.canary(candidate, current, np.array([True] * 5 + [False]))


def test_a_tiny_run_judges_every_chunk_with_both_q_models(tmp_path: Path) -> None:
    current, candidate = tmp_path / "a.bundle", tmp_path / "b.bundle"
    current.write_bytes(make_bundle(1, "a", "2026-12-01T00:00:00Z"))
    candidate.write_bytes(make_bundle(2, "b", "2026-12-01T00:00:00Z"))
    assert gate_power.main(["--current", str(current), "--candidate", str(candidate), "--sessions", "500",
                            "--sizes", "250,500", "--canary", "0.2", "--json", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert [result["sizes"][s]["gate_q"]["chunks"] for s in ("250", "500")] == [2, 1]
    assert [result["sizes"][s]["canary"]["chunks"] for s in ("250", "500")] == [2, 1]
    assert all(0 < r["canary_sessions"] < 250 for r in result["sizes"]["250"]["canary"]["per_chunk"])
    for by_q in result["sizes"].values():
        for s in by_q.values():
            assert s["mean_width"] > 0 and all(r["ci_low"] <= r["estimate"] <= r["ci_high"] for r in s["per_chunk"])
    gate, oracle = result["sizes"]["250"]["gate_q"]["per_chunk"], result["sizes"]["250"]["oracle_q"]["per_chunk"]
    assert any(g["estimate"] != o["estimate"] for g, o in zip(gate, oracle, strict=True))  # the oracle's features were really used
    assert result["current"] == "a" and result["candidate"] == "b"
