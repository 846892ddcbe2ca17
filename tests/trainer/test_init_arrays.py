"""A run continues only from arrays that are what the servers run, and loads no bundle unchecked (``trainer.init_arrays``,
``trainer.cli._loaded``, ``trainer.cycle._active``): an attack review of the weights volume, 2026-12-06."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.harness import fresh_bundle, trainer_in_process
from tests.weights import hostile
from trainer.cli import UsageError, _loaded
from trainer.cycle import _active
from trainer.init_arrays import trainable
from weights import mlp
from weights.bundle import BundleError, read_bundle
from weights.embedded import default_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.store import WeightsStore
from weights.validate import verify

OPTIONS = LoadOptions(device="cpu", warmup_batch=1)


def test_the_arrays_of_the_bundles_the_trainer_writes_are_read_back() -> None:
    for bundle in (default_bundle(), fresh_bundle()):
        policy, guard = trainable(bundle, ModelSet.load(bundle, OPTIONS))
        expected = mlp.policy_params_from_onnx(bundle.parts["policy.onnx"])
        assert all(np.array_equal(policy[k], expected[k]) for k in mlp.POLICY_KEYS)
        assert np.array_equal(guard["w1"], mlp.guard_params_from_onnx(bundle.parts["guard.onnx"])["w1"])


@pytest.mark.parametrize(("make", "message"), [
    (hostile.renamed_policy, "no initializer 'b1'"),  # a bare KeyError stopped every cycle (exit 1, retried)
    (hostile.shifted_policy, "do not compute what their graphs serve"),  # trained silently from a policy never served
])
def test_a_graph_the_servers_accept_in_another_layout_is_refused(make: object, message: str, tmp_path: Path) -> None:
    data = make()  # type: ignore[operator]
    verify(data)  # every server accepts it
    bundle = read_bundle(data)
    with pytest.raises(BundleError, match=message) as info:
        trainable(bundle, ModelSet.load(bundle, OPTIONS))
    assert info.value.reason == "graph"
    path = tmp_path / "init.bundle"
    path.write_bytes(data)
    code, _, err = trainer_in_process("train", "--logs", str(tmp_path / "no-logs-read"), "--init", str(path), "--out",
                                      str(tmp_path / "out.bundle"), "--device", "cpu")
    assert code == 2 and f"--init: {path}: " in err and message in err, err  # bad usage, before any log is read
    store = tmp_path / "weights"
    store.mkdir()
    (store / "weights_active.bundle").write_bytes(data)
    code, _, err = trainer_in_process("cycle", "--logs", str(tmp_path / "no-logs-read"), "--weights-dir", str(store),
                                      "--device", "cpu")
    assert code == 2 and f"the active bundle {store / 'weights_active.bundle'}: " in err and message in err, err


def test_a_bundle_every_server_refuses_for_its_memory_is_never_loaded_by_the_trainer(tmp_path: Path) -> None:
    """Its guard holds a 1 GiB intermediate: `evaluate` and `train --init` loaded it in process (2.3 GB), and `cycle` the
    active file (2.4 GB; one of 14 GB would have had the CronJob's pod killed on every run). Now the bounded child that
    a server's check runs in refuses it first."""
    data = hostile.broadcasting_active()
    path = tmp_path / "big.bundle"
    path.write_bytes(data)
    with pytest.raises(UsageError, match=rf"invalid bundle {path} \("):
        _loaded(path)
    store = WeightsStore(tmp_path / "weights", verify)
    store.directory.mkdir()
    store.active_path.write_bytes(data)
    with pytest.raises(BundleError, match=rf"the active bundle {store.active_path} \("):
        _active(store)
