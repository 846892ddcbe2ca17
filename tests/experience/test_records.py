"""The ids the logs hold: keyed hashes that stay the same across versions, and issued ids kept only in their own form."""

from __future__ import annotations

import hashlib

from experience.records import DECISION, ITEM, SESSION, hash_id, outcome_decision_id

KEY = bytes(range(32))


def test_a_hash_is_pinned_so_logs_from_before_and_after_a_deploy_still_join() -> None:
    """The session join, the canary's sides and the trainer's de-duplication all compare hashes made by different
    server versions: the function must not drift (a known answer, as test_features pins bucket())."""
    expected = hashlib.blake2b(b"alice-session", key=KEY, digest_size=16, person=SESSION).hexdigest()  # the documented construction
    assert hash_id("alice-session", KEY, SESSION) == expected == "08624da530b329c23697e5d823ca1632"


def test_each_column_hashes_the_same_value_apart_and_empty_stays_empty() -> None:
    assert hash_id("x-1", KEY, SESSION) != hash_id("x-1", KEY, ITEM) != hash_id("x-1", KEY, DECISION)
    assert hash_id("x-1", KEY, SESSION) != hash_id("x-1", bytes(32), SESSION)
    assert hash_id("", KEY, SESSION) == ""


def test_only_an_id_of_the_issued_form_is_kept_as_it_is() -> None:
    issued = "0123456789abcdef0123456789abcdef"
    assert outcome_decision_id(issued, KEY) == issued
    for callers in (issued + "-alice@example.com", "alice@example.com-" + issued, issued[:-1], issued.upper() + "x"):
        logged = outcome_decision_id(callers, KEY)
        assert logged == hash_id(callers, KEY, DECISION) and "alice" not in logged
