"""``shopping-agent train | evaluate | cycle`` (also ``python -m trainer …``, ``torchrun … -m trainer …``).

Torch is imported only by the commands that train: ``evaluate`` needs none.

- ``train --logs DIR --out BUNDLE [--init BUNDLE] [--device auto|cpu|cuda]``: a new bundle.
- ``evaluate BUNDLE --logs DIR [--json]``: offline estimates of the business objective per session on the
  logs (IPS, SNIPS, DR with 95 % intervals) and the logged behaviour's value. No torch.
- ``cycle --logs DIR --weights-dir DIR``: train from the active bundle, evaluate new and
  current on the held-out sessions, publish when the gate passes (``--force``: regardless;
  ``--candidate-out FILE``: keep the trained bundle whatever the verdict).
  What the CronJob runs. Exit 0 published (or unchanged), 3 refused by the gate, 1 failed,
  2 bad usage.

Config: ``--config FILE.json`` (any ``TrainConfig`` field, ``guard`` as an object), then the
flags below, over the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig

log = logging.getLogger(__name__)

EXIT_REFUSED = 3


class UsageError(ValueError):
    """A bad command line or config file: exit 2. Anything else that fails is exit 1."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("train", help="train a new bundle from decision and outcome logs (needs the train extra)")
    _common(p)
    p.add_argument("--out", type=Path, required=True, help="the bundle file to write")
    p.add_argument("--init", type=Path, help="start from this bundle (default: the embedded default)")
    p.set_defaults(handler=_train)

    p = subparsers.add_parser("evaluate", help="offline estimates of a bundle's value on logs (IPS, SNIPS, DR)")
    p.add_argument("bundle", type=Path, help="a bundle file, or 'default' for the embedded default")
    p.add_argument("--logs", type=Path, required=True, help="a log directory (serve --log-dir)")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_evaluate)

    p = subparsers.add_parser("cycle", help="train → evaluate → gate → publish (the CronJob's command)")
    _common(p)
    p.add_argument("--weights-dir", type=Path, required=True, help="the served weights directory (publish target)")
    p.add_argument("--force", action="store_true", help="publish even when the gate refuses")
    p.add_argument("--sign-key", type=Path, help="sign the new bundle with this Ed25519 private key (PEM) before publishing")
    p.add_argument("--public-key", type=Path, help="validate as servers with --bundle-public-key do (needs --sign-key)")
    p.add_argument("--init", type=Path, help="start from this bundle (default: the active one, else the embedded default)")
    p.add_argument("--json", action="store_true", help="print the gate's report as JSON")
    p.add_argument("--candidate-out", type=Path,
                   help="also write the trained bundle here, whatever the verdict (to inspect or replay a refused candidate)")
    p.set_defaults(handler=_cycle)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logs", type=Path, required=True, help="a log directory (serve --log-dir)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="torch device (default auto: CUDA when present)")
    p.add_argument("--config", type=Path, help="a JSON file of TrainConfig fields")
    p.add_argument("--seed", type=int, help="TrainConfig.seed")
    p.add_argument("--updates", type=int, help="TrainConfig.updates")
    p.add_argument("--kl-delta", type=float, help="TrainConfig.kl_delta")
    p.add_argument("--advantage", choices=("baseline", "group", "critic"), help="TrainConfig.advantage")
    p.add_argument("--version", dest="model_version", help="model version of the new bundle (default trained-<time>-s<seed>)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer train|evaluate|cycle …``: the entry point ``torchrun -m trainer`` runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[1] == "--":
        # `torchrun ... -m trainer train -- --logs DIR`: torchrun's own parser would take
        # --logs for its --logs-specs, so the options travel after a "--"; drop it here.
        del argv[1]
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Train, evaluate and publish bundles.")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return run(args)


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"shopping-agent {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # bad data, a bad bundle, a full disk: the CronJob must tell these from bad usage
        log.exception("%s failed", args.command)
        print(f"shopping-agent {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if "torch.distributed" in sys.modules:
            from trainer.distributed import shutdown

            shutdown()


def _config(args: argparse.Namespace) -> TrainConfig:
    from trainer.config import GuardConfig, TrainConfig

    try:
        values: dict[str, Any] = json.loads(args.config.read_text()) if args.config else {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"--config: {exc}") from None
    if not isinstance(values, dict):
        raise UsageError("--config: expected a JSON object of TrainConfig fields")
    for name in ("seed", "updates", "kl_delta", "advantage"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    try:
        if "guard" in values:
            values["guard"] = GuardConfig(**values["guard"])
        return TrainConfig(**values)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--config: {exc}") from None


def _logs(path: Path, bundle: Any) -> tuple[Any, Any]:
    """The decision and outcome tables; version-1 segments are read for ``bundle``'s feature spec.

    Their ids are hashed on read with the salt a local server kept next to the logs, if there
    is one (so they join its version-2 records); the trainer is never given the servers' salt.
    """
    from experience.salt import read_salt
    from experience.segments import DirectorySource
    from experience.upgrade import V1Reading
    from policy.features import FeatureSpec

    if not (path / "decisions").is_dir():
        raise UsageError(f"--logs: {path} has no decisions/ directory")
    source = DirectorySource(path, V1Reading(read_salt(path) or b"", FeatureSpec.parse(bundle.manifest["feature_spec"])))
    return source.table("decisions"), source.table("outcomes")


def _bundle(path: Path | None) -> Any:
    from weights.bundle import read_bundle
    from weights.embedded import default_bundle

    return default_bundle() if path is None or str(path) == "default" else read_bundle(path)


def _trained(args: argparse.Namespace, init: Any, decisions: Any, outcomes: Any, config: Any) -> Any:
    """Train; under torchrun every rank runs this and takes the identical step (only rank 0 writes)."""
    from trainer.distributed import init_from_env, make_reducer
    from trainer.train import train

    where = init_from_env(os.environ)
    args.rank = where.rank
    result = train(decisions, outcomes, init, config, device=args.device, reducer=make_reducer(where), rank=where.rank,
                   world=where.world_size, model_version=args.model_version, provenance={"logs": str(args.logs)})
    for warning in result.warnings:
        log.warning("%s", warning)
    return result


def _train(args: argparse.Namespace) -> int:
    from weights.store import atomic_write

    config = _config(args)
    init = _bundle(args.init)
    decisions, outcomes = _logs(args.logs, init)
    result = _trained(args, init, decisions, outcomes, config)
    if args.rank != 0:
        return 0
    atomic_write(args.out, result.bundle)
    print(json.dumps({"out": str(args.out), "model_version": result.manifest["model_version"], "metrics": result.metrics}))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    """The gate's view of one bundle: its business objective per session on the logs (``trainer.evaluation``)."""
    from trainer.evaluation import evaluate_bundle
    from weights.model_set import LoadOptions, ModelSet

    bundle = _bundle(args.bundle)
    model = ModelSet.load(bundle, LoadOptions(device="cpu", warmup_batch=1))
    decisions, outcomes = _logs(args.logs, bundle)
    result = {"bundle": str(args.bundle), "model_version": model.version, "value": "business objective per session",
              **evaluate_bundle(model, decisions, outcomes, n_boot=args.bootstrap, seed=args.seed).to_dict()}
    if args.json:
        print(json.dumps(result, allow_nan=False, default=float))
    else:
        print("business objective per session (net GMV − complaint costs), estimated on the logs:")
        for key in ("ips", "snips", "dr", "tis", "behavior_value"):
            est = result[key]
            print(f"{key:15s} {est['value']:10.4f}   95% CI [{est['ci_low']:.4f}, {est['ci_high']:.4f}]")
        diagnostics = result["diagnostics"]
        print(f"ess             {diagnostics['ess']:10.1f}   of {diagnostics['n_episodes']} sessions")
        print(f"unsupported     {result['unsupported_mass']:10.4g}   (mean probability on actions the logs never served)")
        print(f"kl_to_behavior  {result['kl_to_behavior']:10.4g}   steps {result['steps']}")
    return 0


def _cycle(args: argparse.Namespace) -> int:
    """Train, then gate on the business objective of the held-out sessions (whatever reward the training used).

    Before training, a candidate an earlier run refused gets its second look (``trainer.second_look``).
    """
    from trainer.distributed import DistEnv
    from trainer.window import select as select_window
    from weights.bundle import read_bundle
    from weights.model_set import LoadOptions, ModelSet
    from weights.signing import load_public_key, public_key_bytes
    from weights.store import WeightsStore, atomic_write
    from weights.validate import verify

    config = _config(args)
    key = None if args.public_key is None else public_key_bytes(load_public_key(args.public_key))
    store = WeightsStore(args.weights_dir, lambda data: verify(data, key))
    current_bundle = read_bundle(store.active_path) if store.active_path.exists() else _bundle(None)
    init = _bundle(args.init) if args.init else current_bundle
    decisions, outcomes = _logs(args.logs, init)
    window = select_window(decisions, outcomes, config.window_hours, config.window_versions)  # the logs the run reads
    options = LoadOptions(device="cpu", warmup_batch=1)
    current_model = ModelSet.load(current_bundle, options)
    # One process only: under torchrun every rank would have to agree on the look before any trains.
    second = config.second_look_level is not None and DistEnv.parse(os.environ).world_size == 1
    looked = _second_look(args, store, config, current_model, window) if second else None
    if looked is not None and looked.get("publish"):
        print(json.dumps(looked, default=float) if args.json else f"published the kept candidate: {looked['reason']}")
        return 0
    result = _trained(args, init, decisions, outcomes, config)
    if args.rank != 0:
        return 0  # rank 0 evaluates, gates and publishes
    from trainer.data import split
    from trainer.evaluation import gate

    _, (held_d, held_o) = split(window.decisions, window.outcomes, config.heldout_fraction, config.seed)
    new_model = ModelSet.load(read_bundle(result.bundle), options)
    verdict = gate(_judged(config, new_model, held_d, held_o), _judged(config, current_model, held_d, held_o), config.tolerance,
                   **config.gate_limits())
    report: dict[str, Any] = {"model_version": new_model.version, "current_version": current_model.version, **verdict.to_dict()}
    if looked is not None:
        report["second_look"] = looked
    if args.candidate_out is not None:
        atomic_write(args.candidate_out, result.bundle)
        report["candidate"] = str(args.candidate_out)
    published = verdict.publish or args.force
    estimates = verdict.new.report
    result.with_metrics({f"offline_{name}": getattr(estimates, name).value for name in ("ips", "snips", "dr", "tis", "behavior_value")
                         if getattr(estimates, name) is not None}
                        | {"offline_dr_minus_current": verdict.difference.value, "offline_ess": estimates.ess,
                           "offline_unsupported_mass": verdict.new.unsupported_mass})
    if published or second:
        signed = _signed(args, result.bundle)
        if published:
            report["published"] = _publish(args, store, signed)
        else:
            report["kept_for_second_look"] = store.hold(signed)
    print(json.dumps(report, default=float) if args.json else f"{'published' if published else 'refused'}: {verdict.reason}")
    if not published:
        log.warning("nothing published: %s", verdict.reason)
        return EXIT_REFUSED
    return 0


def _judged(config: TrainConfig, model: Any, decisions: Any, outcomes: Any, level: float | None = None) -> Any:
    """The gate's view: the objective's episodes and γ = 1, not the training reward's."""
    from trainer.evaluation import evaluate_bundle
    from trainer.offline import LEVEL

    return evaluate_bundle(model, decisions, outcomes, n_boot=config.bootstrap, seed=config.seed, max_ratio=config.max_ratio,
                           level=LEVEL if level is None else level)


def _signed(args: argparse.Namespace, data: bytes) -> bytes:
    from weights.signing import load_private_key, sign

    return data if args.sign_key is None else sign(data, load_private_key(args.sign_key))


def _publish(args: argparse.Namespace, store: Any, data: bytes) -> str:
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    return str(store.publish(data).status)


def _second_look(args: argparse.Namespace, store: Any, config: TrainConfig, current: Any, window: Any) -> dict[str, Any] | None:
    """Judge the kept candidate, if any, on the window's sessions it never saw; publish it if the gate passes.

    Returns the look's report (None without a kept candidate). The candidate is dropped either way:
    each gets one second look.
    """
    from trainer.evaluation import gate
    from trainer.second_look import stale_reason, unseen_sessions
    from weights.bundle import BundleError
    from weights.model_set import LoadOptions, ModelSet

    data = store.pending()
    if data is None:
        return None
    try:
        candidate = ModelSet.load(store.validate(data), LoadOptions(device="cpu", warmup_batch=1))
    except (BundleError, ValueError) as exc:
        store.drop_pending()
        log.warning("the kept candidate is not a valid bundle, dropped: %s", exc)
        return {"publish": False, "reason": f"the kept candidate is not a valid bundle: {exc}"}
    stale = stale_reason(candidate.manifest, current.version)
    if stale is not None:
        store.drop_pending()
        log.info("the kept candidate %s is stale, dropped: %s", candidate.version, stale)
        return {"model_version": candidate.version, "publish": False, "reason": f"stale: {stale}"}
    unseen = unseen_sessions(window, candidate.manifest)
    level = config.second_look_level
    assert level is not None
    verdict = gate(_judged(config, candidate, unseen.decisions, unseen.outcomes, level),
                   _judged(config, current, unseen.decisions, unseen.outcomes, level), config.tolerance, **config.gate_limits())
    report: dict[str, Any] = {"model_version": candidate.version, "current_version": current.version, "second_look": True,
                              "level": level, "sessions": unseen.describe(), **verdict.to_dict()}
    log.info("second look at %s on %d unseen sessions: %s", candidate.version, unseen.n_fresh + unseen.n_heldout, verdict.reason)
    if verdict.publish:
        report["published"] = _publish(args, store, data)  # the bytes kept: signed already when signing is on
    store.drop_pending()
    return report
