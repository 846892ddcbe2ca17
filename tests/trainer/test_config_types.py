"""A ``--config`` is JSON, so any field can arrive as any type: each is checked against its annotation and named."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.harness import trainer_in_process
from trainer.config import GuardConfig, ProductStepConfig, TrainConfig


@pytest.mark.parametrize(("fields", "message"), [
    ({"updates": "ten"}, "updates: expected an integer, got 'ten'"),
    ({"updates": 1.5}, "updates: expected an integer, got 1.5"),
    ({"seed": True}, "seed: expected an integer, got True"),  # a bool is no number
    ({"kl_delta": "0.05"}, "kl_delta: expected a number, got '0.05'"),
    ({"window_versions": 2.0}, "window_versions: expected an integer or null, got 2.0"),
    ({"trust_region": 1}, "trust_region: expected a string, got 1"),
    ({"second_look_level": []}, "second_look_level: expected a number or null, got []"),
])
def test_a_field_of_the_wrong_type_is_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        TrainConfig(**fields)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_seeds_and_keys_out_of_their_range_are_named_before_any_log_is_read() -> None:
    """A negative seed trained and then failed at export; a sample key past 64 bits failed after the read (a review)."""
    for fields, message in (({"seed": -1}, "seed: expected an integer >= 0, got -1"),
                            ({"sample_key": 2**63}, f"sample_key: expected a signed 64-bit integer, got {2**63}")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(**fields)  # type: ignore[arg-type]
    assert TrainConfig(sample_key=-(2**63)).sample_key == -(2**63)  # hashed as signed bytes: negative keys are keys


def test_a_seed_past_64_bits_is_named_before_any_log_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``train --seed 2**63`` read the logs, trained, then failed (``int too big to convert``, exit 1: the CronJob's
    retries fail alike); the guard's seeds past 64 bits failed in torch. Every seed is named with its range at once."""
    from trainer.cli import main

    with pytest.raises(ValueError, match=rf"^seed: expected an integer <= {2**63 - 1} \(2\*\*63 - 1\), got {2**63}$"):
        TrainConfig(seed=2**63)
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1
    for name, value in (("seed", 2**64), ("split_seed", -(2**63) - 1)):
        with pytest.raises(ValueError, match=rf"^guard: {name}: expected a signed 64-bit integer, got {value}$"):
            GuardConfig(**{name: value})
    assert GuardConfig(seed=2**63 - 1, split_seed=-(2**63)).split_seed == -(2**63)
    code, _, err = trainer_in_process("train", "--logs", str(tmp_path / "nologs"), "--out", str(tmp_path / "x.bundle"),
                                      "--seed", str(2**63), "--device", "cpu")
    assert code == 2 and err.strip().endswith(f"--seed: expected an integer <= {2**63 - 1} (2**63 - 1), got {2**63}"), err
    for command in (["evaluate", "default"], ["train-products", "--init", "x", "--out", "y"]):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--logs", str(tmp_path), "--seed", str(2**63)])
        assert exited.value.code == 2 and f"argument --seed: '{2**63}': expected an integer <= {2**63 - 1}" in capsys.readouterr().err


def test_an_integer_too_large_for_a_number_field_is_named() -> None:
    """JSON's 1e999 is infinity, which the ranges refuse; an integer of 400 digits is an int, and ``math.isfinite`` of it
    raised ``OverflowError`` (a traceback, exit 1) for every number field of a ``--config``."""
    from trainer.cli import UsageError, config_fields

    huge = 10**400
    for fields, says in (({"kl_delta": huge}, "--config: kl_delta: expected a number, got an integer beyond a float's range"),
                         ({"guard": {"learning_rate": huge}},
                          "--config: guard: learning_rate: expected a number, got an integer beyond a float's range"),
                         ({"products": {"delta_sku": huge}},
                          "--config: products: delta_sku: expected a number, got an integer beyond a float's range"),
                         ({"engagement_weights": {"high": huge}}, "--config: engagement_weights.high: expected a finite number")):
        with pytest.raises(UsageError) as caught:
            config_fields(fields)
        assert str(caught.value).startswith(says), caught.value


@pytest.mark.parametrize(("fields", "message"), [
    ({"tolerance": math.nan}, "tolerance: expected a number, got NaN"),  # published whatever the gate's bound (a review)
    ({"damping": math.nan}, "damping: expected a number, got NaN"),  # trained nothing, exit 0
    ({"gate_max_pareto_k": math.nan}, "gate_max_pareto_k: expected a number, got NaN"),
    ({"tolerance": math.inf}, "tolerance: expected a finite number >= 0, got inf"),
    ({"damping": -1.0}, "damping: expected a finite number >= 0, got -1.0"),
    ({"cg_residual_tol": -1.0}, "cg_residual_tol: expected a finite number >= 0, got -1.0"),
    ({"open_terminal_reward": math.inf}, "open_terminal_reward: expected a finite number, got inf"),  # failed after reading
    ({"horizon_hours": 1e306}, "horizon_hours: expected a number of hours whose seconds are finite, got 1e+306"),
    ({"group_std_floor": 0.0}, "group_std_floor: expected a finite number > 0, got 0.0"),
    ({"behavior_kl_warn": -1.0}, "behavior_kl_warn: expected a finite number > 0, got -1.0"),
    ({"max_behavior_kl": -1.0}, "max_behavior_kl: expected a finite number >= 0, or None, got -1.0"),  # trained nothing
    ({"guard_kl_budget": math.inf}, "guard_kl_budget: expected a finite number >= 0, or None, got inf"),
])
def test_a_number_field_out_of_its_range_or_nan_is_named(fields: dict[str, object], message: str) -> None:
    """A review (2026-12-07) found these accepted: NaN passes every ``x < limit`` check, so ``{"tolerance": NaN}``
    published a candidate the gate had bounded at −12.66; the others trained nothing or failed after the logs' read."""
    with pytest.raises(ValueError) as caught:
        TrainConfig(**fields)  # type: ignore[arg-type]
    assert str(caught.value) == message
    assert TrainConfig(open_terminal_reward=-2.0, max_behavior_kl=None, guard_kl_budget=0.0).open_terminal_reward == -2.0


def test_the_guards_problems_are_named_as_the_guards() -> None:
    """A run's config has a ``seed`` and epochs of its own: ``--config: epochs: expected >= 1`` did not say it was the
    guard's."""
    from trainer.cli import UsageError, config_fields

    with pytest.raises(UsageError, match=r"^--config: guard: epochs: expected >= 1, got 0$"):
        config_fields({"guard": {"epochs": 0}})


def test_the_critics_weight_cap_is_a_weight_or_none() -> None:
    for bad in (0.5, float("inf")):
        with pytest.raises(ValueError, match="critic_weight_cap: expected >= 1 and finite, or None"):
            TrainConfig(critic_weight_cap=bad)
    with pytest.raises(ValueError, match=r"^critic_weight_cap: expected a number, got NaN$"):
        TrainConfig(critic_weight_cap=float("nan"))
    assert TrainConfig(advantage="critic", critic_weight_cap=1).critic_weight_cap == 1
    assert TrainConfig(advantage="critic", critic_weight_cap=None).critic_weight_cap is None  # unweighted, by choice


def test_numbers_of_any_kind_that_fit_are_accepted() -> None:
    config = TrainConfig(seed=np.int64(3), kl_delta=1, window_versions=None, guard=GuardConfig(learning_rate=np.float32(0.01)))
    assert config.seed == 3 and config.kl_delta == 1


def test_the_command_refuses_a_wrong_type_before_reading_any_logs(tmp_path: Path) -> None:
    """Exit 2 naming the field, before the logs (here: none at all, which would be exit 2 for another reason)."""
    config = tmp_path / "c.json"
    for fields, says in (({"updates": 1.5}, "--config: updates: expected an integer, got 1.5"),
                         ({"guard": None}, "--config: guard: expected an object, got NoneType"),
                         ({"guard": {"epoch": 2}},
                          f"--config: guard: unknown key(s) ['epoch']; allowed: {[f.name for f in dataclasses.fields(GuardConfig)]}"),
                         ({"guard": {"epochs": "2"}}, "--config: guard: epochs: expected an integer, got '2'"),
                         ({"products": {"delta_sku": 0}}, "--config: products: delta_sku: expected > 0, got 0"),
                         ({"products": {"guard": False, "guard_steps": 10}},
                          "--config: products: guard_steps: the guards are not trained (guard false)"),
                         ({"products": {"encoder_layers": "sku,colour"}}, "--config: products: encoder_layers: expected distinct "
                          "layers among category, sku, price_band, got 'sku,colour'"),
                         ({"products": {"delta": 1}}, "--config: products: unknown key(s) ['delta']; allowed: "
                          f"{[f.name for f in dataclasses.fields(ProductStepConfig)]}")):
        config.write_text(json.dumps(fields))
        code, _, err = trainer_in_process("train", "--logs", str(tmp_path / "nologs"), "--out", str(tmp_path / "x.bundle"),
                                          "--config", str(config), "--device", "cpu")
        assert code == 2 and err.strip().endswith(says), err


def test_cycles_products_become_the_config_train_products_flags_make() -> None:
    """``cycle``'s ``products`` and ``train-products``' flags build one ``ProductTrainConfig`` (``ProductTrainConfig.of``);
    what is left unset keeps that command's defaults."""
    from trainer.product_train import MAX_ROWS, ProductTrainConfig
    from trainer.product_update import DELTAS, ENCODER_DELTA

    default = ProductTrainConfig.of(ProductStepConfig(), seed=3, tolerance=0.5, max_rows=12_000)
    assert default == ProductTrainConfig(seed=3, tolerance=0.5, max_rows=12_000)
    assert dict(default.deltas) == DELTAS and default.encoder_delta == ENCODER_DELTA and default.guard is not None
    step = ProductStepConfig(delta_sku=0.07, delta_encoder=0.0, max_rows=500, guard_max_complaint=0.2, guard_steps=50)
    made = ProductTrainConfig.of(step)
    assert dict(made.deltas) == {**DELTAS, "sku": 0.07} and made.encoder_delta == 0.0 and made.max_rows == 500
    assert made.guard is not None and (made.guard.max_complaint, made.guard.steps) == (0.2, 50)
    assert ProductTrainConfig.of(ProductStepConfig(guard=False)).guard is None
    assert ProductTrainConfig.of(ProductStepConfig(encoder_layers="sku,price-band")).encoder_layers == ("sku", "price_band")
    assert ProductTrainConfig.of(ProductStepConfig()).max_rows == MAX_ROWS  # train-products' own
    assert TrainConfig(products=step).to_dict()["products"]["delta_sku"] == 0.07  # recorded in the manifest


def test_too_few_bootstrap_resamples_are_refused_by_the_config_and_by_evaluate(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``evaluate --bootstrap 1`` printed a 95 % interval of one resample, [19.53, 19.53] for an estimate of 21.11."""
    with pytest.raises(ValueError, match=r"bootstrap: expected >= 20 resamples .*got 19"):
        TrainConfig(bootstrap=19)
    assert TrainConfig(bootstrap=20).bootstrap == 20
    with pytest.raises(ValueError, match=r"bootstrap: expected <= 100000 resamples .*got 100001"):
        TrainConfig(bootstrap=100_001)  # 50,000,000 reached 2.3 GB and a MemoryError (a review, 2026-12-07)
    assert TrainConfig(bootstrap=100_000).bootstrap == 100_000
    with pytest.raises(SystemExit) as exited:  # argparse: exit 2, the flag named
        from trainer.cli import main

        main(["evaluate", "default", "--logs", str(tmp_path), "--bootstrap", "19"])
    assert exited.value.code == 2 and "argument --bootstrap: '19': expected an integer >= 20" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["evaluate", "default", "--logs", str(tmp_path), "--bootstrap", "99999999999999999999"])
    assert exited.value.code == 2 and "expected an integer <= 100000" in capsys.readouterr().err


def test_an_interrupt_stops_a_caller_of_main_inside_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ``process_main`` (python -m trainer, torchrun's ranks) turns Ctrl-C or SIGTERM into an exit code: a bench or a
    test that calls ``main`` must stop when interrupted, not go on with a code (a review found the benches' loops did)."""
    import trainer.cli as cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["evaluate", "default", "--logs", "/nowhere"])


def test_an_integer_in_a_number_field_is_the_same_configuration_as_its_float() -> None:
    """A version's name hashes the configuration's JSON (``trainer.train``): a file writing the weight cap as ``100``
    named other versions than the default's ``100.0``, and so drew other canary sessions (a nine-world run, 2026-12-07).
    An integer given for a number field is that number, in the run's config and in the JSON the manifest records."""
    from trainer.cli import config_fields

    as_ints = {"critic_weight_cap": 100, "kl_delta": 1, "guard": {"learning_rate": 1}, "products": {"delta_sku": 2},
               "engagement_weights": {"high": 2}}
    as_floats = {"critic_weight_cap": 100.0, "kl_delta": 1.0, "guard": {"learning_rate": 1.0}, "products": {"delta_sku": 2.0},
                 "engagement_weights": {"high": 2.0}}
    written, default = (json.dumps(config_fields(c).to_dict(), sort_keys=True) for c in (as_ints, as_floats))
    assert written == default and '"critic_weight_cap": 100.0' in written and '"high": 2.0' in written
    assert json.dumps(config_fields({}).to_dict()) == json.dumps(TrainConfig().to_dict())
    assert TrainConfig(updates=3).to_dict()["updates"] == 3 and isinstance(TrainConfig(updates=3).updates, int)  # ints stay
