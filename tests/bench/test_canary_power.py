"""bench.canary_power: the looks' chances against closed forms, and what it reads from a loop run's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import NormalDist

import pytest

from bench import canary_power

Z99 = NormalDist().inv_cdf(0.995)


def test_one_look_is_the_normal_tail_and_more_looks_only_add() -> None:
    for gain, error in ((3.71, 1.43), (1.0, 1.0), (-2.0, 1.0)):
        first, last = canary_power.promoted_by_look(gain, [error, error / 2], 0.99, draws=400_000)
        assert first["promoted_by"] == pytest.approx(NormalDist().cdf(gain / error - Z99), abs=0.003)
        assert first["dropped_by"] == pytest.approx(NormalDist().cdf(-gain / error - Z99), abs=0.003)
        assert last["promoted_by"] + last["dropped_by"] == pytest.approx(1.0)  # undecided at max_looks: dropped (a review)
    # no gain, three cumulative looks at 0.99: each look alone promotes 0.5 %, the union bound allows 1.5 %
    looks = canary_power.promoted_by_look(0.0, [1.0, 1.0 / 2**0.5, 1.0 / 3**0.5], 0.99, draws=1_000_000)
    assert [look["promoted_by"] for look in looks] == sorted(look["promoted_by"] for look in looks)
    assert 0.005 < looks[2]["promoted_by"] < 0.015
    with pytest.raises(ValueError, match="errors: expected decreasing"):
        canary_power.promoted_by_look(1.0, [1.0, 1.2], 0.99)
    skipped = canary_power.promoted_by_look(3.0, [None, 1.0, 0.8], 0.99, draws=100_000)  # look 1 had too few sessions
    assert skipped[0]["promoted_by"] == skipped[0]["dropped_by"] == 0.0
    assert skipped[1]["promoted_by"] == pytest.approx(NormalDist().cdf(3.0 - Z99), abs=0.005)


def test_looks_are_numbered_by_the_judge_and_a_noisy_error_does_not_stop_the_bench() -> None:
    """A look without an interval (too few sessions) keeps the later looks' numbers; a later look whose error did not
    shrink (its variance jumped) is held just below the one before, and said so, instead of a traceback (a review)."""
    def one(n: int, low: float | None, high: float | None) -> dict[str, object]:
        return {"look": n, "level": 0.99, "ci_low": low, "ci_high": high}

    errors, clamped = canary_power.look_errors([one(1, None, None), one(2, -1.0, 6.0)], 3)
    assert errors[0] is None and errors[1] == pytest.approx(7.0 / (2 * Z99)) and not clamped
    assert errors[2] == pytest.approx(errors[1] * (2 / 3) ** 0.5)
    errors, clamped = canary_power.look_errors([one(1, -1.0, 6.0), one(2, -2.0, 6.0)], 2)
    assert clamped and errors[1] is not None and errors[0] is not None and errors[1] < errors[0]


def look(cycle: int, n: int, version: str, low: float, high: float, action: str = "wait") -> dict[str, object]:
    return {"cycle": cycle, "canary": {"model_version": version, "look": n, "level": 0.99, "estimate": (low + high) / 2,
                                       "ci_low": low, "ci_high": high, "action": action, "canary_sessions": 10_000 * n,
                                       "control_sessions": 10_000 * n}}


def run(looks: list[dict[str, object]], cycles: int = 5) -> dict[str, object]:
    """The fields of a ``bench.loop`` JSON that the bench reads: cycle 3's candidate refused (true gain +3), then looks."""
    entries: list[dict[str, object]] = [{"cycle": c, "gate": {"difference": None}} for c in range(cycles + 1)]
    entries[3] = {"cycle": 3, "gate": {"difference": {"value": 1.0, "ci_low": -3.0, "ci_high": 5.0}},
                  "refused_candidate": {"name": "cand", "vs_served": {"mean": 3.0, "ci_low": 2.5, "ci_high": 3.5}}}
    for entry in looks:
        entries[int(entry["cycle"])] = {**entries[int(entry["cycle"])], **entry}  # type: ignore[call-overload]
    return {"cycles": entries}


def test_a_runs_looks_are_read_by_version_and_the_missing_ones_extrapolated() -> None:
    waited = run([look(4, 1, "cand", -1.0, 6.0), look(5, 2, "cand", 0.5 - 2.5, 0.5 + 2.5), look(2, 1, "other", 9.0, 10.0)])
    (found,) = canary_power.canaries(waited)
    result = canary_power.power(found, max_looks=3, draws=200_000)
    errors = [c["standard_error"] for c in result["at"]["true gain"]["canary"]]
    assert errors[:2] == pytest.approx([7.0 / (2 * Z99), 5.0 / (2 * Z99)])
    assert errors[2] == pytest.approx(errors[1] * (2 / 3) ** 0.5)  # one more cycle's canary share of sessions
    assert [lk["look"] for lk in result["looks_observed"]] == [1, 2] and result["looks_the_run_had_room_for"] == 2
    gate_error = 8.0 / (2 * NormalDist().inv_cdf(0.975))
    assert result["at"]["true gain"]["gate_certifies"] == pytest.approx(1 - NormalDist().cdf(1.96 - 3.0 / gate_error), abs=1e-3)
    assert result["at"]["its interval's low end"]["gain"] == 2.5


def test_calibration_counts_only_canaries_whose_run_had_room_for_the_look() -> None:
    """A run that ends while a canary waits cannot say whether a later look would have promoted it; one promoted early
    can. Counting the second but not the first would favour promotions, so both need the run's room."""
    promoted, late, promoted_late = (canary_power.power(canary_power.canaries(run([look(c, 1, "cand", -1.0 + 1.5 * up, 6.0, a)]))[0],
                                                        3, 100_000)
                                     for c, a, up in ((4, "promote", 1), (5, "wait", 0), (5, "promote", 1)))
    few = canary_power.power(canary_power.canaries(run([look(4, 1, "cand", 0.0, 0.0) | {"canary": {  # type: ignore[operator]
        "model_version": "cand", "look": 1, "level": 0.99, "ci_low": None, "ci_high": None, "action": "wait"}}]))[0], 3, 1_000)
    assert few["at"]["true gain"]["canary"] == [] and few["looks_the_run_had_room_for"] == 2  # too few sessions: no interval
    checked = canary_power.calibration([promoted, late, promoted_late])
    assert [(c["look"], c["canaries"], c["promoted"]) for c in checked] == [(1, 3, 2), (2, 1, 1)]
    assert [c["canaries"] for c in canary_power.calibration([promoted, late, promoted_late, few])] == [4, 2]
    assert checked[0]["expected_promoted"] == pytest.approx(sum(r["at"]["true gain"]["canary"][0]["promoted_by"]
                                                                for r in (promoted, late, promoted_late)))


def test_a_file_that_is_not_a_loop_result_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"advantage": "critic"}))
    with pytest.raises(SystemExit) as exited:
        canary_power.main(["--loop", str(config)])
    assert exited.value.code == 2 and f"--loop {config}: not a bench.loop result (no cycles)" in capsys.readouterr().err
    good = tmp_path / "loop.json"
    good.write_text(json.dumps(run([look(4, 1, "cand", -1.0, 6.0)])))
    assert canary_power.main(["--loop", str(good), "--draws", "1000", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["candidates"][0]["candidate"] == "cand"
