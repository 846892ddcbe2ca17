"""A canary on the weights volume: a real server answers its share of the sessions with it, by the same keyed hash the
trainer and the simulator use, and stops when the file goes or cannot be served."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from tests.harness import ServerThread, request, running_server, stub, until
from tests.server.test_hot_swap import bundle_bytes, publish
from weights.canary import takes
from weights.store import CANARY_DIR, CANARY_NAME

SESSIONS = [f"shopper-{i}" for i in range(120)]


@pytest.fixture
def weights_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "weights"
    (directory / CANARY_DIR).mkdir(parents=True)
    publish(directory, bundle_bytes("v1"))
    publish(directory / CANARY_DIR, bundle_bytes("c1", canary={"fraction": 0.3}), CANARY_NAME)
    return directory


def _fraction(live: ServerThread, version: str) -> float | None:
    return live.registry.get_sample_value("shopping_agent_canary_fraction", {"model_version": version})


def _served(live: ServerThread) -> dict[str, str]:
    with grpc.insecure_channel(live.target) as ch:
        call = stub(ch).RecommendAction
        return {s: call(request(session_id=s, request_id=f"r-{s}"), timeout=5).model_version for s in SESSIONS}


def _serve(weights_dir: Path, **overrides: object) -> ServerThread:
    return running_server(weights_dir=weights_dir, weights_poll_seconds=0.1, weights_debounce_ms=20, **overrides)  # type: ignore[return-value]


def test_the_canary_serves_its_share_by_the_session_hash_and_stops_when_its_file_goes(weights_dir: Path) -> None:
    with _serve(weights_dir) as live:
        until(lambda: _fraction(live, "c1") == 0.3, "the canary to load")
        assert "shopping_agent_canary_fraction{model_version=\"c1\"} 0.3" in generate_latest(live.registry).decode()
        served = _served(live)
        assert served == {s: "c1" if takes("c1", s, 0.3) else "v1" for s in SESSIONS}
        assert 15 < sum(v == "c1" for v in served.values()) < 60  # the hash does split them
        assert _served(live) == served  # a session stays on its side call after call

        (weights_dir / CANARY_DIR / CANARY_NAME).unlink()
        until(lambda: _fraction(live, "c1") is None, "the canary to stop")
        assert set(_served(live).values()) == {"v1"}


def test_a_canary_of_the_active_version_serves_nobody_and_the_gauge_says_so(weights_dir: Path) -> None:
    """Its promotion published it and stopped before dropping its file: every session gets the active set, so no series
    (the gauge said 0.3: a review of the weights workflows)."""
    with _serve(weights_dir) as live:
        until(lambda: _fraction(live, "c1") == 0.3, "the canary to load")
        publish(weights_dir, bundle_bytes("c1", canary={"fraction": 0.3}))  # the same bytes as the canary's file
        until(lambda: _fraction(live, "c1") is None, "the gauge to follow the swap")
        assert set(_served(live).values()) == {"c1"}
        publish(weights_dir, bundle_bytes("v2"))  # another active version: the canary serves its share again
        until(lambda: _fraction(live, "c1") == 0.3, "the canary to serve beside v2")


def test_the_servers_cap_bounds_the_share_and_a_cap_of_zero_serves_no_canary(weights_dir: Path) -> None:
    with _serve(weights_dir, max_canary_fraction=0.1) as live:
        until(lambda: _fraction(live, "c1") == 0.1, "the capped canary to load")
        assert _served(live) == {s: "c1" if takes("c1", s, 0.1) else "v1" for s in SESSIONS}
    with _serve(weights_dir, max_canary_fraction=0.0) as live:
        time.sleep(0.5)  # five polls: a watcher would have loaded it by now
        assert _fraction(live, "c1") is None and set(_served(live).values()) == {"v1"}


def test_a_canary_file_that_cannot_be_served_ends_the_canary_and_is_counted_as_refused(weights_dir: Path) -> None:
    with _serve(weights_dir) as live:
        until(lambda: _fraction(live, "c1") == 0.3, "the canary to load")
        refused = live.registry.get_sample_value("shopping_agent_model_swaps_total", {"result": "rejected", "reason": "schema"})
        publish(weights_dir / CANARY_DIR, bundle_bytes("c2"), CANARY_NAME)  # a bundle that asks for no share: no canary
        until(lambda: _fraction(live, "c1") is None, "the canary to end")
        after = live.registry.get_sample_value("shopping_agent_model_swaps_total", {"result": "rejected", "reason": "schema"})
        assert after == (refused or 0) + 1
        assert set(_served(live).values()) == {"v1"}
        gauge = {file: live.registry.get_sample_value("shopping_agent_weights_refused", {"file": file}) for file in ("active", "canary")}
        assert gauge == {"active": 0, "canary": 1}
        (weights_dir / CANARY_DIR / CANARY_NAME).unlink()
        until(lambda: live.registry.get_sample_value("shopping_agent_weights_refused", {"file": "canary"}) == 0, "the canary's removal")
