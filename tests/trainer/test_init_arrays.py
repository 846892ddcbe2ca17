"""A run continues only from arrays that are what the servers run, and loads no bundle unchecked (``trainer.init_arrays``,
``trainer.cli._loaded``, ``trainer.cycle._active``): an attack review of the weights volume, 2026-12-06."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.harness import fresh_bundle, trainer_in_process
from tests.weights import hostile
from trainer.cli import UsageError, _loaded
from trainer.cycle import _active
from trainer.init_arrays import RANDOM_STATES, trainable, trainable_product, trainable_product_guards
from weights.bundle import BundleError, read_bundle
from weights.embedded import default_bundle
from weights.initial import make_bundle
from weights.model_set import PROBE_BATCHES, LoadOptions, ModelSet
from weights.product_guard import GUARD_PART
from weights.product_heads import PART
from weights.store import WeightsStore
from weights.validate import verify

OPTIONS = LoadOptions(device="cpu", warmup_batch=1)
CREATED = "2026-01-01T00:00:00Z"


def test_the_bundles_the_trainer_writes_are_never_refused() -> None:
    for bundle in (default_bundle(), fresh_bundle(), read_bundle(make_bundle(3, "heads-3", CREATED, product_heads=True)),
                   hostile.guarded_heads()):
        model = ModelSet.load(bundle, OPTIONS)
        trainable(bundle, model)
        if model.product is not None:
            assert set(trainable_product(bundle, model)) == set(PART)
        if model.product is not None and model.product.guard is not None:
            assert set(trainable_product_guards(bundle, model)) == set(GUARD_PART)


def _unseen_hour_column() -> int:
    """A state column of an hour that neither the golden states nor the load's probe states hold and the check's random
    states do: a graph may differ there and still load."""
    bundle = default_bundle()
    model = ModelSet.load(bundle, OPTIONS)
    rng = np.random.default_rng(0)
    seen = np.concatenate([bundle.array("golden_states.npy"), *(model.random_states(n, rng) for n in PROBE_BATCHES)])
    checked = model.random_states(RANDOM_STATES, np.random.default_rng(0))
    hours = range(seen.shape[1] - 24, seen.shape[1])
    return next(c for c in hours if not seen[:, c].any() and checked[:, c].any())


@pytest.mark.parametrize(("make", "message"), [
    (hostile.renamed_policy, "no initializer 'b1'"),  # a bare KeyError stopped every cycle (exit 1, retried)
    (hostile.transposed_policy, "do not form the layout the trainer writes"),
    (hostile.shifted_policy, "do not compute what their graphs serve"),  # trained silently from a policy never served
    (hostile.shifted_guard, "do not compute what their graphs serve"),
    (hostile.off_golden_policy, "do not compute what their graphs serve"),  # the golden states alone pass it
    (lambda: hostile.infinite_off_golden_policy(_unseen_hour_column()), "outputs on random requests' states"),
])
def test_a_graph_the_servers_accept_in_another_layout_is_refused(make: Callable[[], bytes], message: str) -> None:
    data = make()
    verify(data)  # every server accepts it
    bundle = read_bundle(data)
    with pytest.raises(BundleError, match=message) as info:
        trainable(bundle, ModelSet.load(bundle, OPTIONS))
    assert info.value.reason == "graph"


def test_product_heads_the_servers_run_otherwise_are_refused() -> None:
    """``train-products`` trained from, and every run carried over, product heads read back by name: a head adding a
    constant to its logit was trained, or re-exported, without it."""
    data = hostile.shifted_product_head()
    verify(data)  # every server accepts it
    bundle = read_bundle(data)
    with pytest.raises(BundleError, match="do not compute what their graphs serve") as info:
        trainable_product(bundle, ModelSet.load(bundle, OPTIONS))
    assert info.value.reason == "graph"


@pytest.mark.parametrize(("make", "message"), [
    (hostile.shifted_product_guard, "do not compute what their graphs serve"),  # its vetoes carried without the shift
    (hostile.renamed_product_guard, "no initializer 'b1'"),  # a bare KeyError stopped train-products (exit 1)
])
def test_product_guards_the_servers_run_otherwise_are_refused(make: Callable[[], bytes], message: str) -> None:
    """``train-products`` carries the old guards' vetoes into its new ones (``PreviousGuard``), from arrays read back by
    name."""
    data = make()
    verify(data)  # every server accepts it
    bundle = read_bundle(data)
    model = ModelSet.load(bundle, OPTIONS)
    trainable_product(bundle, model)  # the heads are what they serve
    with pytest.raises(BundleError, match=message) as info:
        trainable_product_guards(bundle, model)
    assert info.value.reason == "graph"


def test_train_and_cycle_refuse_such_a_start_before_reading_logs_and_train_products_does_not(tmp_path: Path) -> None:
    """Bad usage (exit 2, not retried), naming the file; ``train-products`` trains no policy, so it does not ask."""
    path = tmp_path / "init.bundle"
    path.write_bytes(hostile.renamed_policy())
    message, no_logs = "no initializer 'b1'", str(tmp_path / "no-logs-read")
    code, _, err = trainer_in_process("train", "--logs", no_logs, "--init", str(path), "--out", str(tmp_path / "out.bundle"),
                                      "--device", "cpu")
    assert code == 2 and f"--init: {path}: " in err and message in err, err
    store = tmp_path / "weights"
    store.mkdir()
    (store / "weights_active.bundle").write_bytes(path.read_bytes())
    code, _, err = trainer_in_process("cycle", "--logs", no_logs, "--weights-dir", str(store), "--device", "cpu")
    assert code == 2 and f"the active bundle {store / 'weights_active.bundle'}: " in err and message in err, err
    code, _, err = trainer_in_process("cycle", "--logs", no_logs, "--weights-dir", str(store), "--init", "default",
                                      "--device", "cpu")  # the run starts elsewhere: the active bundle's layout is no matter
    assert code == 2 and "has no decisions/ directory" in err and message not in err, err  # past it, to the logs
    (tmp_path / "empty").mkdir()
    code, _, err = trainer_in_process("train-products", "--logs", str(tmp_path / "empty"), "--init", str(path), "--out",
                                      str(tmp_path / "products.bundle"))
    assert code == 2 and f"--logs: {tmp_path / 'empty'} has no" in err and "--init" not in err, err  # past --init
    heads = tmp_path / "heads.bundle"
    heads.write_bytes(hostile.shifted_product_head())  # its heads, which train-products trains, are another matter
    code, _, err = trainer_in_process("train-products", "--logs", str(tmp_path / "empty"), "--init", str(heads), "--out",
                                      str(tmp_path / "products.bundle"))
    assert code == 2 and f"--init: {heads}: " in err and "do not compute what their graphs serve" in err, err
    guards = tmp_path / "guards.bundle"
    guards.write_bytes(hostile.shifted_product_guard())  # and so are the guards it carries vetoes from
    code, _, err = trainer_in_process("train-products", "--logs", str(tmp_path / "empty"), "--init", str(guards), "--out",
                                      str(tmp_path / "products.bundle"))
    assert code == 2 and f"--init: {guards}: " in err and "do not compute what their graphs serve" in err, err


def test_a_bundle_every_server_refuses_for_its_memory_is_never_loaded_by_the_trainer(tmp_path: Path) -> None:
    """Its guard holds a 1 GiB intermediate: `evaluate` and `train --init` loaded it in process (2.3 GB), and `cycle` the
    active file (2.4 GB; one of 14 GB would have had the CronJob's pod killed on every run). Now the bounded child that
    a server's check runs in refuses it first, for the memory its graph asks for."""
    path, store = _placed(hostile.broadcasting_active(16_000), tmp_path)
    with pytest.raises(UsageError, match=rf"invalid bundle {path} \((shape|limits)\): .*(allocate|memory|died)"):
        _loaded(path)
    with pytest.raises(BundleError, match=rf"the active bundle {store.active_path} \((shape|limits)\)"):
        _active(store)


def test_the_same_graph_small_enough_is_loaded(tmp_path: Path) -> None:
    path, store = _placed(hostile.broadcasting_active(16), tmp_path)
    assert _loaded(path)[0].model_version == _active(store)[0].model_version


def _placed(data: bytes, tmp_path: Path) -> tuple[Path, WeightsStore]:
    """``data`` as a bundle file and as a store's active bundle."""
    path = tmp_path / "given.bundle"
    path.write_bytes(data)
    store = WeightsStore(tmp_path / "weights", verify)
    store.directory.mkdir()
    store.active_path.write_bytes(data)
    return path, store
