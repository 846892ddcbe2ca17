"""A cycle that publishes signed bundles trains only from bundles signed by a key it trusts.

A security review (2026-12-06) planted an unsigned ``weights_active.bundle`` (its guardrails pushing coupons, a rule of its
own) where the servers, requiring signatures, refused it; the CronJob's ``cycle`` trained from it anyway and published
the successor, with the planted settings, under the real key. Now the run refuses before any log is read (exit 2: the
same answer until a signed bundle is put back), and so does an unsigned ``--init``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import trainer_in_process
from weights.embedded import default_bundle_bytes
from weights.signing import keypair_pem, load_private_key, sign
from weights.store import ACTIVE_NAME


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    private, public = keypair_pem()
    (tmp_path / "mine.pem").write_bytes(private)
    (tmp_path / "mine.pub").write_bytes(public)
    return tmp_path / "mine.pem", tmp_path / "mine.pub"


def test_an_unsigned_active_bundle_or_init_is_not_trained_from_or_published_under_the_key(tmp_path: Path) -> None:
    private, public = _keys(tmp_path)
    weights, logs = tmp_path / "w", tmp_path / "logs"
    weights.mkdir()
    (logs / "decisions").mkdir(parents=True)
    planted = default_bundle_bytes()  # a valid bundle, but no one's signature
    (weights / ACTIVE_NAME).write_bytes(planted)
    cycle = ("cycle", "--logs", str(logs), "--weights-dir", str(weights), "--public-key", str(public), "--sign-key", str(private))
    code, out, err = trainer_in_process(*cycle)
    assert code == 2 and f"the active bundle {weights / ACTIVE_NAME} (signature)" in err, err
    assert "the servers refuse it too: put a signed bundle back" in err and out == ""
    assert (weights / ACTIVE_NAME).read_bytes() == planted and sorted(p.name for p in weights.iterdir()) == [".lock", ACTIVE_NAME]

    (weights / ACTIVE_NAME).write_bytes(sign(planted, load_private_key(private)))  # signed: the run goes on, to the logs
    code, _, err = trainer_in_process(*cycle)
    assert code == 2 and err.strip().endswith("no logs yet: no logged decisions on the training side"), err
    unsigned = tmp_path / "unsigned.bundle"
    unsigned.write_bytes(planted)
    code, _, err = trainer_in_process(*cycle, "--init", str(unsigned))
    assert code == 2 and f"--init: invalid bundle {unsigned} (signature)" in err, err


def _held(data: bytes, private: Path) -> bytes:
    """``data`` as the trainer keeps a refused candidate: marked (``weights.held``), signed."""
    import io

    from weights.bundle import read_bundle, write_bundle
    from weights.held import marked

    bundle = read_bundle(data)
    out = io.BytesIO()
    write_bundle(out, marked(bundle.manifest), dict(bundle.parts))
    return sign(out.getvalue(), load_private_key(private))


def test_a_held_candidate_moved_to_the_active_name_or_given_as_init_is_not_trained_from(tmp_path: Path) -> None:
    """Signed by the trusted key, but a candidate the gate refused (an attack on the first fix, 2026-12-06: moved to the
    active name, it was trained from and its successor published under the key)."""
    private, public = _keys(tmp_path)
    weights, logs = tmp_path / "w", tmp_path / "logs"
    weights.mkdir()
    (logs / "decisions").mkdir(parents=True)
    held = _held(default_bundle_bytes(), private)
    (weights / ACTIVE_NAME).write_bytes(held)
    cycle = ("cycle", "--logs", str(logs), "--weights-dir", str(weights), "--public-key", str(public), "--sign-key", str(private))
    code, _, err = trainer_in_process(*cycle)
    assert code == 2 and "held for a second look, not a release" in err and "put a release back" in err, err
    (weights / ACTIVE_NAME).write_bytes(sign(default_bundle_bytes(), load_private_key(private)))
    (tmp_path / "held.bundle").write_bytes(held)
    code, _, err = trainer_in_process(*cycle, "--init", str(tmp_path / "held.bundle"))
    assert code == 2 and "--init: invalid bundle" in err and "held for a second look, not a release" in err, err


def test_the_active_bundle_after_a_canary_promotion_is_checked_too(tmp_path: Path, sim_logs: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The run goes on from the bundle a promotion made active, read again: a writer of the volume could swap it in that
    moment (the promotion drops the canary's file, a cue an inotify watch sees). Here the stand-in for the promotion
    leaves an unsigned file there; the run refuses it as it refuses one at its start."""
    import trainer.canary

    private, public = _keys(tmp_path)
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / ACTIVE_NAME).write_bytes(sign(default_bundle_bytes(), load_private_key(private)))

    def promoted_then_swapped(*_: object, **__: object) -> dict[str, object]:
        (weights / ACTIVE_NAME).write_bytes(default_bundle_bytes())  # unsigned, in the promotion's place
        return {"action": "promote", "published": "promoted-1"}

    monkeypatch.setattr(trainer.canary, "look", promoted_then_swapped)
    code, _, err = trainer_in_process("cycle", "--logs", str(sim_logs), "--weights-dir", str(weights), "--public-key",
                                      str(public), "--sign-key", str(private))
    assert code == 2 and f"the active bundle {weights / ACTIVE_NAME} (signature)" in err, err


def test_a_refused_candidates_candidate_out_is_marked_as_the_kept_one_is(tmp_path: Path, sim_logs: Path) -> None:
    """--candidate-out writes the bytes published, or those kept: a refused candidate's carry the mark, signed, so that file
    is no release either (it was written signed and unmarked)."""
    import json

    from tests.harness import FAST_CYCLE
    from weights.bundle import read_bundle
    from weights.store import WeightsStore
    from weights.validate import verify

    private, public = _keys(tmp_path)
    weights, out, config = tmp_path / "w", tmp_path / "candidate.bundle", tmp_path / "strict.json"
    weights.mkdir()
    (weights / ACTIVE_NAME).write_bytes(sign(default_bundle_bytes(), load_private_key(private)))
    config.write_text(json.dumps({**FAST_CYCLE, "gate_min_ess": 1e9}))  # a gate that cannot pass
    code, _, err = trainer_in_process("cycle", "--logs", str(sim_logs), "--weights-dir", str(weights), "--public-key",
                                      str(public), "--sign-key", str(private), "--config", str(config), "--candidate-out",
                                      str(out), "--device", "cpu")
    assert code == 3, err[-2000:]
    written = read_bundle(out.read_bytes())
    assert written.manifest["held"] is True and written.signature is not None
    store = WeightsStore(weights, lambda data: verify(data))
    assert store.pending() == out.read_bytes()  # the very bytes kept
