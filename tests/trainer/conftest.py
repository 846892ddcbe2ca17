from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import torch

from simulator.config import SimConfig
from simulator.drive import run_logged
from simulator.world import World
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: one torch thread (with two, the OpenMP hand-off costs more than the products on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model() -> ModelSet:
    return ModelSet.load(default_bundle(), LoadOptions(warmup_batch=8))


@pytest.fixture(scope="session")
def sim_logs(tmp_path_factory: pytest.TempPathFactory, default_model: ModelSet) -> Path:
    """Real logs: 400 simulated sessions served by the embedded default bundle, through the real recorder."""
    root = tmp_path_factory.mktemp("sim-logs")
    run_logged(World(SimConfig(), 7), default_model, range(400), ZoneInfo("UTC"), root, b"salt" * 8)
    return root
