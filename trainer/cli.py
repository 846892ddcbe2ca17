"""``shopping-agent train | evaluate | cycle`` (also ``python -m trainer …``, ``torchrun … -m trainer …``).

Torch is imported only by the commands that train: ``evaluate`` needs none.

``--logs`` is a directory or a URI (``s3://bucket/logs``, ``gs://…``, ``hdfs://…``, ``file://…``):
segments are listed and read through ``pyarrow.fs`` (``experience.segments.open_logs``).

- ``train --logs DIR --out BUNDLE [--init BUNDLE] [--device auto|cpu|cuda]``: a new bundle.
- ``evaluate BUNDLE --logs DIR [--json]``: offline estimates of the business objective per session on the
  logs (IPS, SNIPS, DR, TIS with 95 % intervals) and the logged behaviour's value. No torch.
- ``cycle --logs DIR --weights-dir DIR``: train from the active bundle, evaluate new and
  current on the held-out sessions, publish when the gate passes (``--force``: regardless;
  ``--candidate-out FILE``: keep the trained bundle whatever the verdict). A refused candidate
  gets a second look in the next run (``trainer.cycle``, ``trainer.second_look``), or with
  ``--canary FRACTION`` is served on that share of the sessions and judged on-policy by the
  next runs (``trainer.canary``).
  What the CronJob runs. Exit 0 published (or unchanged), 3 refused by the gate (or the active
  bundle changed during the run: nothing published), 1 failed, 2 bad usage (a bundle file that cannot be read or loaded,
  a ``--weights-dir`` or output file that cannot be written, a bad key file: ``before_logs``, ``trainer.cycle``) or no
  logs yet (or too few).

Config: ``--config FILE.json`` (any ``TrainConfig`` field, ``guard`` as an object), then the
flags below, over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.json_lines import json_line
from core.stopping import sigterm_interrupts, stopped
from policy.onnx_model import RuntimeMissing
from trainer.bootstrap import MAX_BOOTSTRAP, MIN_BOOTSTRAP
from trainer.config import MAX_SEED

if TYPE_CHECKING:
    from trainer.config import TrainConfig

log = logging.getLogger(__name__)

EXIT_REFUSED = 3


FLAG_FIELDS = ("seed", "updates", "kl_delta", "advantage")  # TrainConfig fields with a flag of their own (over --config)


class UsageError(ValueError):
    """A bad command line or config file: exit 2. Anything else that fails is exit 1."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("train", help="train a new bundle from decision and outcome logs (needs the train extra)")
    _common(p)
    p.add_argument("--out", type=Path, required=True, help="the bundle file to write")
    p.add_argument("--init", type=Path, help="start from this bundle (default: the embedded default)")
    p.set_defaults(handler=_train)

    p = subparsers.add_parser("train-products", help="train a bundle's RecommendProduct heads on its logged product decisions",
                              description="Exit 0: written and the product gate passed it; 3: written, but the gate refused "
                                          "it; 2: bad usage.")
    p.add_argument("--logs", required=True, metavar="DIR_OR_URI", help="the logs (with products/ records), as for train")
    p.add_argument("--init", type=Path, required=True, help="the bundle whose product heads to train (format 2)")
    p.add_argument("--out", type=Path, required=True, help="the bundle file to write")
    p.add_argument("--version", dest="model_version", type=_model_version,
                   help="model version of the new bundle (default products-<time>-s<seed>)")
    p.add_argument("--seed", type=_at_least(0, MAX_SEED), default=0)
    p.add_argument("--max-rows", type=int, default=None, help="product decisions trained on at most (default 40000)")
    for layer, delta in (("category", 0.03), ("sku", 0.05), ("price-band", 0.02)):
        p.add_argument(f"--delta-{layer}", type=float, default=delta, help=f"the {layer} layer's trust region (default {delta})")
    p.add_argument("--delta-encoder", type=float, default=None,
                   help="the shared encoder's region on the sum of the layers' KL (0 holds it fixed; default the trainer's)")
    p.add_argument("--encoder-layers", default=None, metavar="LAYERS",
                   help="comma-separated layers whose data the shared encoder learns from, among category, sku, price_band "
                        "(default all; bench.product_stability measures what leaving one out does)")
    p.add_argument("--guard-max-complaint", type=float, default=None,
                   help="train the per-layer guards and veto a candidate above this complaint probability (default 0.1)")
    p.add_argument("--no-guard", action="store_true", help="write the bundle without product guards (format version 2)")
    p.set_defaults(handler=_train_products)

    p = subparsers.add_parser("evaluate", help="offline estimates of a bundle's value on logs (IPS, SNIPS, DR, TIS)")
    p.add_argument("bundle", type=Path, help="a bundle file, or 'default' for the embedded default")
    p.add_argument("--logs", required=True, metavar="DIR_OR_URI",
                   help="the logs: a directory (serve --log-dir) or a URI pyarrow.fs opens (s3://, gs://, hdfs://, file://)")
    p.add_argument("--bootstrap", type=_at_least(MIN_BOOTSTRAP, MAX_BOOTSTRAP), default=200,
                   help=f"bootstrap resamples (default 200, {MIN_BOOTSTRAP} to {MAX_BOOTSTRAP:,})")
    p.add_argument("--seed", type=_at_least(0, MAX_SEED), default=0)
    p.add_argument("--max-session-order-value", type=_positive, metavar="AMOUNT",
                   help="leave out a session whose orders total more (default: TrainConfig's max_session_order_value, "
                        "1,000,000; set it to the servers' --max-outcome-value)")
    p.add_argument("--max-session-decisions", type=_at_least(1), metavar="N",
                   help="leave out a session of more decisions (default: TrainConfig's max_session_decisions, 1,000)")
    p.add_argument("--max-session-complaints", type=_at_least(0), metavar="N",
                   help="leave out a session with more complaints (default: TrainConfig's max_session_complaints, 10)")
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
    p.add_argument("--canary", type=float, default=0.0, metavar="FRACTION",
                   help="serve a refused candidate the gate could not rule out on this share of the sessions (≤ 0.5), and "
                        "judge it on-policy in the next runs (trainer.canary); 0 (default): a second look instead")
    p.add_argument("--canary-level", type=float, default=0.99, help="two-sided level of each canary look (default 0.99)")
    p.add_argument("--canary-max-looks", type=int, default=3,
                   help="runs that judge a canary before it is dropped undecided (default 3)")
    p.add_argument("--canary-min-sessions", type=int, default=200,
                   help="sessions each side needs to be compared; fewer: no verdict, the run still counts (default 200)")
    p.add_argument("--canary-max-sessions", type=_sessions_or_all, default=200_000,
                   help="sessions of each side a canary look reads at most, a keyed sample; 'all': every one (default 200000)")
    p.set_defaults(handler=_cycle)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--logs", required=True, metavar="DIR_OR_URI",
                   help="the logs: a directory (serve --log-dir) or a URI pyarrow.fs opens (s3://, gs://, hdfs://, file://)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="torch device (default auto: CUDA when present)")
    p.add_argument("--config", type=Path, help="a JSON file of TrainConfig fields")
    p.add_argument("--seed", type=int, help="TrainConfig.seed")
    p.add_argument("--updates", type=int, help="TrainConfig.updates")
    p.add_argument("--kl-delta", type=float, help="TrainConfig.kl_delta")
    p.add_argument("--advantage", choices=("baseline", "group", "critic"), help="TrainConfig.advantage (default critic)")
    p.add_argument("--version", dest="model_version", type=_model_version,
                   help="model version of the new bundle (default trained-<the logs' newest time>-<a digest of the starting "
                        "version, the config and the logs' row counts>)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer train|evaluate|cycle …``: the entry point ``torchrun -m trainer`` runs."""
    return run(_parsed(argv))


def _parsed(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``sys.argv`` when None), with the process's logging set up for it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[1] == "--":
        # `torchrun ... -m trainer train -- --logs DIR`: torchrun's own parser would take
        # --logs for its --logs-specs, so the options travel after a "--"; drop it here.
        del argv[1]
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Train, evaluate and publish bundles.")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    world = os.environ.get("WORLD_SIZE", "1")
    rank = f"rank {os.environ.get('RANK', '0')}/{world} " if world != "1" else ""  # torchrun: whose line it is
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {rank}%(name)s %(message)s")
    return args


def process_main() -> int:
    """``main`` as the process's entry point (``python -m trainer``, torchrun's ranks): SIGTERM ends it as Ctrl-C does,
    with one line and 128 + the signal's number, as ``shopping-agent`` does. Only here: a caller of ``main`` inside
    Python (the benches, the tests) keeps its own handlers, and an interrupt stops it rather than returning a code."""
    with sigterm_interrupts():
        args = _parsed(None)
        try:
            return run(args)
        except KeyboardInterrupt as exc:
            return stopped(args.command, exc)


def run(args: argparse.Namespace) -> int:
    from trainer.window import NoDecisions, TooFewLogs

    completed = False
    try:
        code = int(args.handler(args))
        completed = True
        return code
    except UsageError as exc:
        print(f"shopping-agent {args.command}: {exc}", file=sys.stderr)
        return 2
    except NoDecisions as exc:  # no logs yet, or too few (a new deployment's first runs): retrying gives the same answer
        what = "not enough logs yet" if isinstance(exc, TooFewLogs) else "no logs yet"
        print(f"shopping-agent {args.command}: --logs {_shown(args.logs)}: {what}: {exc}", file=sys.stderr)
        return 2
    except (ModuleNotFoundError, RuntimeMissing):
        raise  # a package not installed: the command line names what to install (server/cli.py; exit 2, not retried)
    except Exception as exc:  # bad data, a bad bundle, a full disk: the CronJob must tell these from bad usage
        log.exception("%s failed", args.command)
        print(f"shopping-agent {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if "torch.distributed" in sys.modules:
            from trainer.distributed import shutdown

            # Only a rank that finished waits for the others: one that failed or was stopped (a peer died in a collective;
            # torchrun stops every rank when one fails) may have no peers left, and the barrier's error replaced its own.
            shutdown(together=completed)


def _config(args: argparse.Namespace) -> TrainConfig:
    return config_fields(config_file(args.config), args)


def config_file(path: Path | None) -> Any:
    """A ``--config`` file's JSON (``{}`` without one), read once; ``UsageError`` when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"--config: {exc}") from None


def config_fields(values: Any, args: argparse.Namespace | None = None) -> TrainConfig:
    """The TrainConfig a ``--config`` file's JSON gives (the defaults for the fields it leaves out), with ``args``' flags
    over it, checked as ``train`` and ``cycle`` check it (``UsageError`` naming the field)."""
    from experience.attribution import config_object
    from experience.engagement import EngagementWeights
    from trainer.config import GuardConfig, ProductStepConfig, TrainConfig

    if not isinstance(values, dict):
        raise UsageError("--config: expected a JSON object of TrainConfig fields")
    values = dict(values)  # (the flags go into it below: the caller's stays as it was)
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    try:
        config_object(values, fields, "--config")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    flags = {name: "--" + name.replace("_", "-") for name in FLAG_FIELDS if getattr(args, name, None) is not None}
    values.update({name: getattr(args, name) for name in flags})
    try:
        if "guard" in values:
            values["guard"] = GuardConfig(**config_object(values["guard"], [f.name for f in dataclasses.fields(GuardConfig)],
                                                          "guard"))
        if "products" in values:
            values["products"] = ProductStepConfig(**config_object(values["products"],
                                                                   [f.name for f in dataclasses.fields(ProductStepConfig)],
                                                                   "products"))
        if values.get("engagement_weights") is not None:
            values["engagement_weights"] = EngagementWeights.from_dict(values["engagement_weights"])
        return TrainConfig(**values)
    except (TypeError, ValueError) as exc:  # TrainConfig checks the flags' values too: each problem named where it came from
        raise UsageError(_named(str(exc), flags, fields)) from None


def _named(message: str, flags: dict[str, str], fields: Sequence[str]) -> str:
    """A config's problems (``field: why; field: why``: split only where a field's name follows, since a ``why`` may
    hold "; " itself), each after the flag that set its field, else after ``--config``."""
    named = []
    for problem in re.split("; (?=(?:{}):)".format("|".join(map(re.escape, fields))), message):
        field, _, why = problem.partition(":")
        named.append(f"{flags[field]}:{why}" if field in flags else f"--config: {problem}")
    return "; ".join(named)


def _source(location: str, bundle: Any) -> Any:
    """The logs at ``location`` as a ``DirectorySource``; version-1 segments are read for ``bundle``'s feature spec.

    Their ids are hashed on read with the salt a local server kept next to the logs, if there
    is one (so they join its version-2 records); the trainer is never given the servers' salt.
    """
    from experience.kinds import KINDS
    from experience.segments import open_logs
    from policy.features import FeatureSpec

    try:
        source = open_logs(location, FeatureSpec.parse(bundle.manifest["feature_spec"]))
    except ValueError as exc:  # no filesystem takes it: bad usage. An OSError (out of reach) goes on: exit 1, retried
        raise UsageError(f"--logs: {exc}") from None
    if not source.has("decisions"):
        raise UsageError(f"--logs: {_shown(location)} has no decisions/ directory")
    for kind in KINDS:  # one that is a file: "Not a directory" after the read began, exit 1 and retried (a review)
        if source.blocked(kind):
            raise UsageError(f"--logs: {_shown(location)}'s {kind} is not a directory")
    return source


def _shown(location: str) -> str:
    from experience.segments import redacted

    return redacted(location)


def _logs(location: str, bundle: Any, max_order_value: float | None, max_decisions: int | None,
          max_complaints: int | None) -> tuple[Any, Any]:
    """Every decision and outcome (``evaluate``: judged on all it is given) but the sessions holding a row no server
    writes or more than the session limits allow (``trainer.log_checks``; None: the default limit)."""
    from trainer.log_checks import DEFAULT_LIMITS, SessionLimits, usable

    limits = SessionLimits(DEFAULT_LIMITS.max_order_value if max_order_value is None else max_order_value,
                           DEFAULT_LIMITS.max_decisions if max_decisions is None else max_decisions,
                           DEFAULT_LIMITS.max_complaints if max_complaints is None else max_complaints)
    source = _source(location, bundle)
    decisions, outcomes, _ = usable(source.table("decisions"), source.table("outcomes"), source.spec, limits)
    return decisions, outcomes


def _window(location: str, bundle: Any, config: TrainConfig, *, serving: Sequence[str] = (), gate: bool = False) -> Any:
    """What a run reads: its window and sample, in two passes (``trainer.reading``); under torchrun this rank's shard
    of its sessions. ``serving``: the versions served now (``cycle``), in a versions window whatever their age; ``gate``:
    name the gate's held-out sessions too (``cycle``: read after training)."""
    from trainer.distributed import DistEnv
    from trainer.reading import read_window

    where = DistEnv.parse(os.environ)
    return read_window(_source(location, bundle), config, shard=(where.rank, where.world_size), serving=serving, gate=gate)


def _bundle(path: Path | None, trains_policy: bool = True, public_keys: tuple[bytes, ...] = ()) -> Any:
    """The ``--init`` bundle (None or 'default': the embedded default, which needs no check); a named file is loaded
    as a server loads it (``_loaded``; signed by one of ``public_keys`` when there are any) and, for a run that trains
    its policy and guard (``trains_policy``), must be one such a run can continue from (``_trainable``), so a bad one is
    refused before any log is read."""
    if _default(path):
        from weights.embedded import default_bundle

        return default_bundle()
    bundle, model = _loaded(path, "--init: ", public_keys)
    _trainable(bundle, model, f"--init: {path}: ", trains_policy)
    return bundle


def _trainable(bundle: Any, model: Any, where: str, policy: bool = True) -> None:
    """``UsageError`` (exit 2, not retried), after ``where``, unless a run can continue from ``bundle``'s arrays, which
    ``model`` runs (``trainer.init_arrays``): the policy's and the guard's (``policy``), and the product heads' and
    guards' when it has them (a run trains them, or carries them over)."""
    from trainer.init_arrays import trainable, trainable_product, trainable_product_guards
    from weights.bundle import BundleError

    try:
        if policy:
            trainable(bundle, model)
        if model.product is not None:
            trainable_product(bundle, model)
            if model.product.guard is not None:  # train-products carries their vetoes forward
                trainable_product_guards(bundle, model)
    except BundleError as exc:
        raise UsageError(f"{where}{exc}") from None


def _default(path: Path | None) -> bool:
    """Whether a bundle argument means the embedded default (absent, or the word ``default``)."""
    return path is None or str(path) == "default"


def _loaded(path: Path | None, flag: str = "", public_keys: tuple[bytes, ...] = ()) -> tuple[Any, Any]:
    """The bundle at ``path`` (None or 'default': the embedded default) and its ``ModelSet``. A file that cannot be
    read or loaded, or (with ``public_keys``) is not signed by one of them, is bad usage, after ``flag``, before any log
    is read: exit 2, not retried."""
    from weights.bundle import BundleError, read_file
    from weights.model_set import LoadOptions, ModelSet, load_file
    from weights.validate import verified

    options = LoadOptions(device="cpu", warmup_batch=1)
    try:
        if path is None or _default(path):
            return load_file(None, options)
        # in a bounded child first (``verified``): a graph built to take this process's memory or time stops there (an
        # attack review, 2026-12-06: 2.3 GB for `evaluate`); the bytes checked are the bytes loaded
        bundle = verified(read_file(path), f"invalid bundle {path}", public_keys)  # (read_file's message names the file too)
        return bundle, ModelSet.load(bundle, options)
    except BundleError as exc:  # its message names the file
        raise UsageError(f"{flag}{exc}") from None


def _trained(args: argparse.Namespace, init: Any, window: Any, config: Any) -> Any:
    """Train; under torchrun every rank runs this and takes the identical step (only rank 0 writes)."""
    from trainer.distributed import init_from_env, make_reducer
    from trainer.train import train

    where = init_from_env(os.environ)
    args.rank = where.rank
    result = train(window.decisions, window.outcomes, init, config, device=args.device, reducer=make_reducer(where),
                   world=where.world_size, model_version=args.model_version, provenance={"logs": _shown(args.logs)},
                   window=window)
    for warning in result.warnings:
        log.warning("%s", warning)
    return result


def before_logs(args: argparse.Namespace, *outputs: tuple[str, Path | None]) -> None:
    """``UsageError`` (exit 2) for what would otherwise fail only after the logs were read and a model trained: a
    ``--device cuda`` torch cannot see, an output file (``(flag, path)``) whose directory cannot be written (checked
    where it is written: under torchrun, rank 0 only)."""
    if getattr(args, "device", None) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device (--device auto uses one when there is one)")
    from trainer.distributed import DistEnv

    if DistEnv.parse(os.environ).rank != 0:
        return
    for flag, path in outputs:
        if path is None:
            continue
        where = path.parent
        if path.is_dir():  # atomic_write's rename would fail on it, after the training
            raise UsageError(f"{flag} {path}: is a directory")
        if not where.is_dir():
            raise UsageError(f"{flag} {path}: {where} is not a directory")
        if not os.access(where, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: {where} cannot be written")


def _train(args: argparse.Namespace) -> int:
    from weights.store import atomic_write

    config = _config(args)
    before_logs(args, ("--out", args.out))
    init = _bundle(args.init)
    result = _trained(args, init, _window(args.logs, init, config), config)
    if args.rank != 0:
        return 0
    atomic_write(args.out, result.bundle)
    print(json_line({"out": str(args.out), "model_version": result.manifest["model_version"], "metrics": result.metrics}))
    return 0


def _train_products(args: argparse.Namespace) -> int:
    from trainer.config import ProductStepConfig
    from trainer.product_train import ProductTrainConfig, train_products
    from weights.store import atomic_write

    try:  # the flags are cycle's "products" object: checked once, there, and named here as the flags they came from
        step = ProductStepConfig(delta_category=args.delta_category, delta_sku=args.delta_sku,
                                 delta_price_band=args.delta_price_band, delta_encoder=args.delta_encoder,
                                 encoder_layers=args.encoder_layers, max_rows=args.max_rows, guard=not args.no_guard,
                                 guard_max_complaint=args.guard_max_complaint)
    except ValueError as exc:
        fields = "|".join(f.name for f in dataclasses.fields(ProductStepConfig) if f.name != "guard")
        raise UsageError(re.sub(rf"\b({fields})\b", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(exc).removeprefix("products: "))) from None
    before_logs(args, ("--out", args.out))
    init = _bundle(args.init, trains_policy=False)  # (its product heads are checked: they are what it trains)
    source = _source(args.logs, init)
    if not source.has("products"):
        raise UsageError(f"--logs: {_shown(args.logs)} has no products/ directory (serve RecommendProduct with --log-dir)")
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    version = args.model_version or f"products-{created.replace('-', '').replace(':', '')}-s{args.seed}"
    config = ProductTrainConfig.of(step, seed=args.seed)
    try:
        result = train_products(source.table("products"), source.table("outcomes"), init, version, created, config)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    atomic_write(args.out, result.bundle)
    print(json_line({"out": str(args.out), "model_version": version, "publish": result.publish, "metrics": result.metrics}))
    if not result.publish:
        log.warning("the product gate refused the new heads (the bundle is written all the same): %s", result.metrics["gate"]["reason"])
    return 0 if result.publish else EXIT_REFUSED


def _evaluate(args: argparse.Namespace) -> int:
    """The gate's view of one bundle: its business objective per session on the logs (``trainer.evaluation``)."""
    from trainer.evaluation import evaluate_bundle

    bundle, model = _loaded(args.bundle)
    decisions, outcomes = _logs(args.logs, bundle, args.max_session_order_value, args.max_session_decisions,
                                args.max_session_complaints)
    if decisions.num_rows == 0:
        from trainer.window import NoDecisions

        raise NoDecisions("no logged decisions to evaluate on")  # as train and cycle: exit 2, one line
    result = {"bundle": str(args.bundle), "model_version": model.version, "value": "business objective per session",
              **evaluate_bundle(model, decisions, outcomes, n_boot=args.bootstrap, seed=args.seed).to_dict()}
    if args.json:
        print(json_line(result))
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


def _model_version(text: str) -> str:
    """``--version``: a name every reader of the bundle accepts (``weights.bundle.MODEL_VERSION``), checked before training."""
    from weights.bundle import MODEL_VERSION, MODEL_VERSION_RULE

    if not MODEL_VERSION.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: use {MODEL_VERSION_RULE}")
    return text


def _at_least(least: int, most: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {least}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer <= {most}")
        return value

    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def _sessions_or_all(text: str) -> int | None:
    return None if text == "all" else int(text)


def _cycle(args: argparse.Namespace) -> int:
    from trainer.canary import settings_from
    from trainer.cycle import run_cycle

    try:
        settings_from(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return run_cycle(args)
