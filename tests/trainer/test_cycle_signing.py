"""A cycle that publishes signed bundles trains only from bundles signed by a key it trusts.

A security review (2026-12-06) planted an unsigned ``weights_active.bundle`` (its guardrails pushing coupons, a rule of its
own) where the servers, requiring signatures, refused it; the CronJob's ``cycle`` trained from it anyway and published
the successor, with the planted settings, under the real key. Now the run refuses before any log is read (exit 2: the
same answer until a signed bundle is put back), and so does an unsigned ``--init``.
"""

from __future__ import annotations

from pathlib import Path

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
