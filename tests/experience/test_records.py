"""The writer's keyed id hashes: keyed once per batch, the same digests as the one-off functions the readers use."""

from __future__ import annotations

import pytest

from experience.records import ITEM, REQUEST, SESSION, IdHasher, hash_id, hash_user

SALT = bytes(range(32))
VALUES = ["", "u-1", "ü-ß-漢字", "x" * 256, "same"]


@pytest.mark.parametrize("column", [SESSION, ITEM, REQUEST])
def test_a_column_hasher_gives_hash_id(column: bytes) -> None:
    hasher = IdHasher(SALT, column)
    assert [hasher(v) for v in VALUES] == [hash_id(v, SALT, column) for v in VALUES]
    assert hasher("") == ""  # an id not sent stays empty


def test_the_user_hasher_gives_hash_user_and_columns_stay_apart() -> None:
    user = IdHasher(SALT, None)
    assert [user(v) for v in VALUES] == [hash_user(v, SALT) for v in VALUES]
    assert len({user("same"), IdHasher(SALT, ITEM)("same"), IdHasher(SALT, SESSION)("same")}) == 3
    assert IdHasher(bytes(32), None)("same") != user("same")  # keyed: another salt, another digest
