"""The canary: which sessions it serves (a keyed hash, the same everywhere), and its slot in the weights store."""

from __future__ import annotations

import hashlib
import json
import math
from functools import partial
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from experience.records import SESSION, hash_id
from experience.segments import DirectorySource
from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from tests.harness import fresh_bundle_bytes, variant_bytes
from weights.bundle import BundleError, read_bundle
from weights.canary import CanaryRoute, Routed, fraction_of, takes
from weights.model_set import LoadOptions, ModelSet
from weights.store import StoreError, WeightsStore
from weights.validate import verify as verify_in_child

verify = partial(verify_in_child, limits=None)
IDS = [f"session-{i}" for i in range(20_000)]


def _model(data: bytes) -> ModelSet:
    return ModelSet.load(read_bundle(data), LoadOptions(warmup_batch=8))


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5])
def test_a_canary_takes_its_share_of_the_sessions_and_the_same_ones_every_time(fraction: float) -> None:
    taken = [takes("v2", s, fraction) for s in IDS]
    share, sd = sum(taken) / len(IDS), math.sqrt(fraction * (1 - fraction) / len(IDS))
    assert abs(share - fraction) < 4 * sd
    assert taken == [takes("v2", s, fraction) for s in IDS]  # what every replica (and the simulator) computes


def test_which_sessions_a_canary_takes_is_pinned() -> None:
    """Every replica of every version, and the simulator, must put a session on the same side during a rollout: the
    draw is the documented keyed hash of the session id, and its answers are pinned (a known answer)."""
    def documented(version: str, session: str, fraction: float) -> bool:
        digest = hashlib.blake2b(session.encode(), key=version.encode()[:64], digest_size=8).digest()
        return int.from_bytes(digest, "big") < fraction * 2**64

    assert all(takes("v2", s, 0.2) == documented("v2", s, 0.2) for s in IDS[:2000])
    assert [i for i in range(40) if takes("v2", IDS[i], 0.2)] == [2, 11, 13, 19, 21, 23, 29, 35]


def test_a_canary_under_the_active_bundles_version_serves_nobody() -> None:
    """Sessions logged under one version must come from one set of weights, or the judge cannot tell the sides apart."""
    current = _model(variant_bytes("v7"))
    route = CanaryRoute(_model(variant_bytes("v7", canary=0.5)), 0.5)  # other bytes under the active bundle's name
    picked = [s for s in IDS[:200] if route.takes(s)]
    assert picked and all(route.choose(current, s) is current for s in picked)
    other = CanaryRoute(_model(variant_bytes("v8", canary=0.5)), 0.5)
    assert all(other.choose(current, s) is other.model for s in IDS[:200] if other.takes(s))


def test_each_canary_draws_its_own_shoppers_and_a_smaller_share_is_inside_a_larger_one() -> None:
    a, b = ({s for s in IDS if takes(v, s, 0.2)} for v in ("v2", "v3"))
    assert abs(len(a & b) / len(IDS) - 0.04) < 0.01  # independent draws: 0.2 × 0.2 overlap, not the same shoppers
    assert {s for s in IDS if takes("v2", s, 0.05)} <= a
    assert not any(takes("v2", s, 0.0) for s in IDS)


@pytest.mark.parametrize(("manifest", "expected"), [({}, 0.0), ({"canary": {"fraction": 0.1}}, 0.1), ({"canary": {"fraction": 0}}, 0.0)])
def test_the_share_a_manifest_asks_for(manifest: dict[str, object], expected: float) -> None:
    assert fraction_of(manifest) == expected


@pytest.mark.parametrize("section", [{"fraction": 0.6}, {"fraction": -0.1}, {"fraction": float("nan")}, {"fraction": "0.1"},
                                     {"fraction": True}, {}, [0.1], "0.1"])
def test_a_share_that_is_not_one_is_refused_naming_the_field(section: object) -> None:
    with pytest.raises(ValueError, match=r"canary\.fraction"):
        fraction_of({"canary": section})


def test_routed_sends_each_session_to_its_side_and_a_canary_that_cannot_read_the_requests_to_none(tmp_path: Path) -> None:
    current, canary = _model(fresh_bundle_bytes()), _model(variant_bytes("canary-v", canary=0.5))
    world, sessions = World(SimConfig(), 3), range(300)
    run_logged(world, Routed(current, CanaryRoute(canary, 0.5)), sessions, ZoneInfo("UTC"), tmp_path, b"k" * 32)
    decisions = DirectorySource(tmp_path).table("decisions")  # the logs' session ids are hashed: route by the request's
    by_session: dict[str, set[str]] = {}
    for s, v in zip(decisions.column("session_id").to_pylist(), decisions.column("model_version").to_pylist(), strict=True):
        by_session.setdefault(s, set()).add(v)
    assert all(len(v) == 1 for v in by_session.values()) and len(by_session) == 300  # a whole session on one side
    expected = {hash_id(sid, b"k" * 32, SESSION): canary.version if takes(canary.version, sid, 0.5) else current.version
                for sid in (world.session(i).session_id for i in sessions)}
    assert {s: v.pop() for s, v in by_session.items()} == expected  # each on the side its raw id hashes to
    assert 100 < sum(v == canary.version for v in expected.values()) < 200
    route = CanaryRoute(canary, 0.5)
    assert route.choose(current, next(s for s in by_session if takes(canary.version, s, 0.5))) is canary

    class OtherDim:
        version, item_dim = "other", current.item_dim + 1

    assert all(route.choose(OtherDim(), s) is not canary for s in by_session)  # the request was validated for another size
    same = CanaryRoute(current, 1.0)
    assert all(same.choose(current, s) is current for s in by_session)  # a canary equal to the active one is no canary


@pytest.fixture
def store(tmp_path: Path) -> WeightsStore:
    store = WeightsStore(tmp_path / "pv", verify)
    store.publish(fresh_bundle_bytes())
    return store


def test_the_store_serves_one_validated_canary_counts_its_looks_and_promotes_its_very_bytes(store: WeightsStore) -> None:
    first, second = variant_bytes("canary-1", canary=0.1), variant_bytes("canary-2", canary=0.2)
    assert store.canary() is None and store.canary_looks("canary-1") == 0
    assert store.start_canary(first) == "canary-1" and store.canary() == first
    assert [store.count_canary_look("canary-1") for _ in range(2)] == [1, 2] and store.canary_looks("canary-1") == 2
    assert store.canary_looks("canary-2") == 0  # a count is for its own version only
    assert store.start_canary(second) == "canary-2" and store.canary_looks("canary-2") == 0  # replaced, counted afresh
    active = store.active_path.read_bytes()
    result = store.promote_canary()
    assert result.status == "published" and result.model_version == "canary-2"
    assert store.active_path.read_bytes() == second and store.canary() is None and not store.looks_path.exists()
    assert [e.model_version for e in store.history()][-1] == "canary-2" and active != second
    with pytest.raises(StoreError) as caught:
        store.promote_canary()
    assert caught.value.reason == "no_canary"


@pytest.mark.parametrize(("data", "error", "match"), [
    (variant_bytes("no-share"), StoreError, "canary.fraction"),
    (variant_bytes("too-much", canary=0.9), StoreError, r"canary\.fraction"),
    (b"PK\x03\x04 not a bundle", BundleError, "zip|bundle|format"),
])
def test_what_cannot_be_a_canary_is_refused_and_nothing_is_served(store: WeightsStore, data: bytes, error: type[Exception],
                                                                  match: str) -> None:
    with pytest.raises(error, match=match):
        store.start_canary(data)
    assert store.canary() is None and not store.looks_path.exists()


def test_the_active_bundle_cannot_be_its_own_canary_and_drop_is_idempotent(store: WeightsStore) -> None:
    active = read_bundle(store.active_path.read_bytes())
    same = variant_bytes(active.model_version, canary=0.1)
    store.start_canary(same)  # other bytes under the active's name: served nowhere (the route never picks it)
    store.drop_canary()
    store.drop_canary()
    assert store.canary() is None
    store.active_path.write_bytes(variant_bytes("canary-x", canary=0.1))  # as a promotion that crashed before its drop
    with pytest.raises(StoreError, match="active bundle"):
        store.start_canary(store.active_path.read_bytes())


def test_an_unreadable_looks_file_counts_as_no_looks(store: WeightsStore) -> None:
    store.start_canary(variant_bytes("canary-1", canary=0.1))
    for text in ("not json", json.dumps({"model_version": "canary-1", "looks": -3}), json.dumps([1])):
        store.looks_path.write_text(text)
        assert store.canary_looks("canary-1") == 0
