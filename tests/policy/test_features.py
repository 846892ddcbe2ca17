"""The feature encoder: layout of the state vector, the hashing trick, and the local hour."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pytest

from core.conditions import SchemaError
from core.domain import DecisionRequest, PageType
from policy.features import BUCKET_CACHE, FeatureEncoder, FeatureSpec, bucket, context_of

SPEC = FeatureSpec()
ITEM, BEHAVIOR, HOUR_AT = 768, 128, 768 + 128


@pytest.fixture(scope="module")
def table() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((2048, 128)).astype(np.float32)


@pytest.fixture(scope="module")
def encoder(table: np.ndarray) -> FeatureEncoder:
    return FeatureEncoder(SPEC, table)


def request(behaviors: tuple[str, ...] = (), event_time_s: float = 0.0, seed: int = 0, **kw: Any) -> DecisionRequest:
    embedding = np.random.default_rng(seed).standard_normal(768).astype(np.float32)
    fields: dict[str, Any] = {
        "user_id": "u", "session_id": "s", "item_id": "i", "item_embedding": embedding,
        "recent_behavior_ids": behaviors, "page_type": PageType.SEARCH, "event_time_s": event_time_s,
        "cart_item_count": 0,
    }
    fields.update(kw)
    return DecisionRequest(**fields)


def blake_row(behavior_id: str, buckets: int = 2048) -> int:
    return int.from_bytes(hashlib.blake2b(behavior_id.encode(), digest_size=8).digest(), "little") % buckets


def test_default_spec_is_920_dimensions() -> None:
    assert SPEC.state_dim == 920
    assert (SPEC.item_dim, SPEC.behavior_dim, SPEC.behavior_buckets, SPEC.behavior_window) == (768, 128, 2048, 3)


def test_bucket_is_blake2b_64_little_endian_mod_buckets() -> None:
    assert bucket("view:sku-123", 2048) == 2036  # pinned: a changed hash would remap every behaviour id
    assert bucket("cart:sku-9", 2048) == 1873
    for behavior_id in ["view:sku-123", "cart:sku-9", "", "ünïcode-id"]:
        assert bucket(behavior_id, 2048) == blake_row(behavior_id)
        assert bucket(behavior_id, 97) == blake_row(behavior_id, 97)


def test_bucket_remembers_a_bounded_number_of_ids() -> None:
    """Remembered ids give the same rows, and a stream of new ids only evicts: the memory stays bounded."""
    for i in range(BUCKET_CACHE + 500):
        assert bucket(f"view:new-{i}", 2048) == blake_row(f"view:new-{i}")
    info = bucket.cache_info()
    assert info.maxsize == BUCKET_CACHE and info.currsize == BUCKET_CACHE
    hits = info.hits
    assert bucket(f"view:new-{BUCKET_CACHE + 499}", 2048) == blake_row(f"view:new-{BUCKET_CACHE + 499}")
    assert bucket.cache_info().hits == hits + 1


def test_encode_layout_item_behaviour_hour(encoder: FeatureEncoder, table: np.ndarray) -> None:
    req = request(("view:a", "cart:b", "view:c", "view:d"), seed=1)
    state = encoder.encode(req, hour=13)
    assert state.shape == (920,)
    assert state.dtype == np.float32
    assert np.array_equal(state[:ITEM], req.item_embedding)
    rows = [blake_row(i) for i in ("view:a", "cart:b", "view:c")]  # the 3 most recent; "view:d" is outside the window
    np.testing.assert_allclose(state[ITEM:HOUR_AT], table[rows].mean(axis=0), rtol=1e-6, atol=1e-7)
    expected_hours = np.zeros(24, dtype=np.float32)
    expected_hours[13] = 1.0
    assert np.array_equal(state[HOUR_AT:], expected_hours)


def test_ids_outside_the_window_do_not_matter(encoder: FeatureEncoder) -> None:
    a = encoder.encode(request(("x", "y", "z", "older-1")), hour=0)
    b = encoder.encode(request(("x", "y", "z", "older-2", "older-3")), hour=0)
    c = encoder.encode(request(("x", "y", "w")), hour=0)
    assert np.array_equal(a, b)
    assert not np.array_equal(a[ITEM:HOUR_AT], c[ITEM:HOUR_AT])


def test_behaviour_mean_counts_repeated_ids_and_short_histories(encoder: FeatureEncoder, table: np.ndarray) -> None:
    state = encoder.encode(request(("p", "p", "q")), hour=5)
    rp, rq = table[blake_row("p")], table[blake_row("q")]
    np.testing.assert_allclose(state[ITEM:HOUR_AT], (2 * rp + rq) / 3, rtol=1e-6, atol=1e-7)
    single = encoder.encode(request(("q",)), hour=5)
    assert np.array_equal(single[ITEM:HOUR_AT], rq)


def test_no_behaviour_gives_zeros(encoder: FeatureEncoder) -> None:
    state = encoder.encode(request(()), hour=23)
    assert not state[ITEM:HOUR_AT].any()
    assert state[HOUR_AT + 23] == 1.0 and state[HOUR_AT:].sum() == 1.0


def test_encode_batch_rows_equal_single_encodings(encoder: FeatureEncoder) -> None:
    behaviours: list[tuple[str, ...]] = [(), ("a",), ("a", "b", "c"), ("x", "y", "z", "w", "v")]
    reqs = [request(b, seed=s) for s, b in enumerate(behaviours)]
    batch = encoder.encode_batch(reqs, [0, 5, 17, 23])
    assert batch.shape == (4, 920) and batch.dtype == np.float32
    for i, (r, hour) in enumerate(zip(reqs, [0, 5, 17, 23], strict=True)):
        assert np.array_equal(batch[i], encoder.encode(r, hour))
    assert not batch[0, ITEM:HOUR_AT].any()


def test_encoder_rejects_a_table_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"behavior table: expected shape \(2048, 128\), got \(2048, 64\)"):
        FeatureEncoder(SPEC, np.zeros((2048, 64), dtype=np.float32))


@pytest.mark.parametrize(("day", "expected_hour"), [((2026, 1, 15), 0), ((2026, 7, 15), 1)])
def test_context_uses_the_local_hour(day: tuple[int, int, int], expected_hour: int) -> None:
    berlin = ZoneInfo("Europe/Berlin")
    utc_2330 = datetime(*day, 23, 30, tzinfo=UTC)
    # independent expectation: CET (UTC+1) in winter, CEST (UTC+2) in summer
    assert utc_2330.astimezone(berlin).hour == expected_hour
    req = request(("a", "b"), event_time_s=utc_2330.timestamp(), page_type=PageType.CART, cart_item_count=4)
    c = context_of(req, berlin)
    assert (c.page_type, c.cart_item_count, c.hour, c.n_recent_behaviors) == (PageType.CART, 4, expected_hour, 2)
    assert context_of(req, UTC).hour == 23
    assert context_of(req, ZoneInfo("America/New_York")).hour == utc_2330.astimezone(ZoneInfo("America/New_York")).hour


def test_spec_json_round_trip() -> None:
    custom = FeatureSpec(item_dim=16, behavior_dim=8, behavior_buckets=64, behavior_window=5)
    for spec in (SPEC, custom):
        data = spec.to_json()
        assert data["state_dim"] == spec.state_dim and data["hour_dim"] == 24
        assert FeatureSpec.parse(data) == spec
    assert custom.state_dim == 16 + 8 + 24


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"item_dim": 0}, r"^feature_spec\.item_dim: expected a positive integer"),
        ({"behavior_window": True}, r"^feature_spec\.behavior_window: expected a positive integer"),
        # 100,000 passed every check, and each batch gathered batch × window × 128 floats: 138 MB to 2.7 GB (a review)
        ({"behavior_window": 100_000}, r"^feature_spec\.behavior_window: expected at most 64, got 100000$"),
        ({"behavior_buckets": 2048.0}, r"^feature_spec\.behavior_buckets: expected a positive integer"),
        ({"behavior_hash": "md5-mod"}, r"^feature_spec\.behavior_hash: only 'blake2b64-mod' is supported"),
        ({"state_dim": 921}, r"^feature_spec: hour_dim must be 24 and state_dim 920"),
        ({"hour_dim": 12}, r"^feature_spec: hour_dim must be 24"),
        ({"color": 1}, r"^feature_spec: unknown key\(s\) \['color'\]"),
    ],
)
def test_spec_parse_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        FeatureSpec.parse({**SPEC.to_json(), **change})


def test_spec_parse_requires_the_hash_and_an_object() -> None:
    data = SPEC.to_json()
    del data["behavior_hash"]
    with pytest.raises(SchemaError, match="behavior_hash"):
        FeatureSpec.parse(data)
    with pytest.raises(SchemaError, match=r"^feature_spec: expected an object"):
        FeatureSpec.parse([768])
