"""``cycle``, the CronJob's command: a canary or a kept candidate judged, else train → gate → publish, or keep the refused one.

0. A canary, if one is serving (``cycle --canary``, ``trainer.canary``), is judged on the window's
   sessions: promoted (published; the run goes on from it, on the same window), left serving (the
   run ends: a new active bundle would change its control), or dropped (the run goes on).
1. A candidate an earlier run refused, if one is kept, is judged again on the window's sessions
   it never saw (``trainer.second_look``); passed, it is published and the run ends.
2. Otherwise: train from the active bundle on the window, evaluate new and current on the
   held-out sessions (the business objective, γ = 1), publish when the gate passes; a refused
   candidate is kept for step 1 of a later run, or with ``--canary F`` one the gate could not rule
   out (the paired upper bound ≥ −tolerance) is served on F of the sessions for step 0. A candidate that serves what
   the active bundle serves on every held-out page is neither kept nor canaried (``same_as_active``: nothing to judge).
3. With product heads, the ``RecommendProduct`` heads are trained on the window's product decisions and gated on
   their own (``trainer.cycle_products``): passed heads go into the candidate; when it is not published they are
   also published alone, on the active bundle's flat decision.

Every publish (and a canary's promotion) replaces only the active bundle the run read at its start (after a promotion,
that one): if an operator published or rolled back meanwhile, the run publishes nothing (``not_published``) and a
canary due for promotion serves on.

Exit codes (``trainer.cli``): 0 published or unchanged (a canary promoted counts), or a canary still serving;
3 refused (a canary started is a refusal: no flat candidate was published; new product heads may have been,
``products.published`` says), or not published because the active bundle changed during the run; 1 failed (a full
weights volume during a canary's look included: the canary serves on); 2 bad usage (a ``--weights-dir`` that cannot be
created or written, an unusable key file, a ``--sign-key`` that ``--public-key`` does not trust or ``--public-key``
without ``--sign-key`` included: refused before the logs
are read), or no logs yet (or too few to hold some out).
Keeping or looking at a candidate never turns a refusal into a failure: what goes wrong there
(an unreadable kept file, a full disk) is logged and reported, and the candidate dropped.
"""

from __future__ import annotations

import argparse
import errno
import io
import logging
import os
from typing import TYPE_CHECKING, Any

from core.json_lines import json_line
from weights import held

if TYPE_CHECKING:
    from collections.abc import Callable

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from trainer.config import TrainConfig
    from trainer.cycle_products import ProductStep
    from trainer.evaluation import Evaluation, GateResult
    from trainer.window import Window
    from weights.model_set import LoadOptions, ModelSet
    from weights.store import WeightsStore

log = logging.getLogger(__name__)

LOOK_BOOTSTRAP = 1000
"""Bootstrap resamples of the second look at least: its 0.5 % tail needs more than the first look's 200."""


def run_cycle(args: argparse.Namespace) -> int:
    from trainer.canary import look, settings_from
    from trainer.cli import EXIT_REFUSED, UsageError, _bundle, _config, _source, _trainable, _trained, _window, before_logs
    from trainer.distributed import shutdown
    from trainer.evaluation import gate
    from trainer.reading import read_gate
    from trainer.replay import serves_alike
    from weights.bundle import read_bundle
    from weights.model_set import LoadOptions, ModelSet
    from weights.signing import KeyFileError, load_private_key, load_public_keys, public_key_bytes
    from weights.store import ActiveMoved, WeightsStore, atomic_write
    from weights.validate import verify

    config = _config(args)
    before_logs(args, ("--candidate-out", args.candidate_out))
    if args.public_key is not None and args.sign_key is None:  # nothing it trains could be published
        raise UsageError("--public-key: the weights directory takes only signed bundles: give --sign-key too")
    try:
        keys = () if args.public_key is None else load_public_keys(args.public_key)
    except KeyFileError as exc:
        raise UsageError(f"--public-key: {exc}") from None
    try:  # read once, before the training: a bad key fails here, not after it
        private = None if args.sign_key is None else load_private_key(args.sign_key)
    except KeyFileError as exc:
        raise UsageError(f"--sign-key: {exc}") from None
    if private is not None and keys and public_key_bytes(private.public_key()) not in keys:
        # what it signs would fail the store's check after the training: a refusal dropped, a publish a retried failure
        raise UsageError(f"--sign-key: {args.sign_key}: its public key is not among --public-key {args.public_key}'s "
                         f"{len(keys)}: the bundles it signs would not verify")
    sign_bundle = _signer(private)
    store = WeightsStore(args.weights_dir, lambda data: verify(data, keys))
    _usable(store)  # before any log is read: not a refusal after an hour's training
    current_bundle, judged_against = _active(store, keys)  # every publish below replaces exactly this bundle, or none
    options = LoadOptions(device="cpu", warmup_batch=1)
    current = ModelSet.load(current_bundle, options)
    if not args.init:  # the run continues from what the servers serve: its arrays must be what they run
        _trainable(current_bundle, current, f"the active bundle {store.active_path}: ")
    init = _bundle(args.init, public_keys=keys) if args.init else current_bundle
    # The logs the run reads, in two passes; under torchrun this rank's shard. The gate's held-out sessions (of the whole
    # window, every shard) are named now and read by rank 0 after training (the other ranks do not wait for it).
    window = _window(args.logs, init, config, serving=_serving(store, current_bundle), gate=True)
    settings = settings_from(args)
    judging = _operator_left_it(args)
    canaried = look(store, config.tolerance, current, lambda: _source(args.logs, init), options, settings,
                    config.session_limits(), judged_against) if judging else None
    if canaried is not None and canaried["action"] == "wait":  # still serving: a new active bundle would change its control
        print(json_line({"canary": canaried}) if args.json else f"canary {canaried['action']}: {canaried['reason']}")
        return 0
    promoted = canaried is not None and canaried.get("published") is not None
    if promoted:  # the run goes on from the bundle now active, on the same window (its logged propensities are exact)
        current_bundle, judged_against = _active(store, keys)
        init = current_bundle
        current = ModelSet.load(current_bundle, options)
        _trainable(current_bundle, current, f"the active bundle {store.active_path} (the canary just promoted): ")
    looks = _looks_apply(args, config)
    looked = second_look(sign_bundle, store, config, current, window, options, judged_against) if looks else None
    if looked is not None and looked.get("published"):
        print(json_line(looked) if args.json else f"published the kept candidate: {looked['reason']}")
        return 0
    try:
        if _one_rank():  # (ranks must not part ways before training's collectives; the publish checks again anyway)
            store.expect_active(judged_against)
    except ActiveMoved as exc:  # training now would end in a publish the store refuses
        stopped: dict[str, Any] = {"current_version": current.version, "not_published": str(exc),
                                   **({"second_look": looked} if looked else {})}
        print(json_line(stopped) if args.json else f"not published: {exc}")
        log.warning("nothing trained: %s", exc)
        return EXIT_REFUSED

    result = _trained(args, init, window, config)
    gate_sessions, versions, since = window.gate, list(window.versions), window_start(window)
    del window  # the training sample's rows: not held while the gate reads and judges its own
    shutdown()  # every rank together, training done: rank 0 gates alone, with no rank left waiting in a collective
    if args.rank != 0:
        return 0  # rank 0 evaluates, gates and publishes
    held_d, held_o = read_gate(_source(args.logs, init), gate_sessions, config.session_limits())
    new = ModelSet.load(read_bundle(result.bundle), options)
    verdict = gate(judged(config, new, held_d, held_o), judged(config, current, held_d, held_o), config.tolerance,
                   **config.gate_limits())
    published = verdict.publish or args.force
    # Two bundles that serve alike get bit-identical per-session estimates, so the paired difference is exactly [0, 0]:
    # only then is the replay of both on the held-out pages (minutes at millions of rows) worth running.
    difference = verdict.difference
    alike = not published and difference.value == difference.ci_low == difference.ci_high == 0.0 and serves_alike(new, current, held_d)
    del held_d, held_o  # judged: not held while the product step reads and trains
    report: dict[str, Any] = {"model_version": new.version, "current_version": current.version, **verdict.to_dict()}
    if looked is not None:
        report["second_look"] = looked
    if canaried is not None:
        report["canary"] = canaried
    products = _products(args, init, result, versions, since, config)
    if products is not None:
        report["products"] = products.report
        if products.passed:  # the new heads travel with the candidate, whatever becomes of it; its version names them
            assert products.trained is not None
            report["model_version"] = f"{result.manifest['model_version']}-p{products.digest}"
            result.product, result.manifest = products.params, {**result.manifest, "model_version": report["model_version"],
                                                                "product_training": products.trained.metrics}
    result.with_metrics(offline_metrics(verdict))
    signed = sign_bundle(result.bundle if published else _with_manifest(result.bundle, held.marked))  # refused: no release
    if args.candidate_out is not None:
        atomic_write(args.candidate_out, signed)  # the very bytes published, or those kept for a second look
        report["candidate"] = str(args.candidate_out)
    moved = None
    if published:
        try:
            report["published"] = _publish(store, signed, judged_against)
        except ActiveMoved as exc:
            moved = report["not_published"] = str(exc)
    elif alike:
        report["same_as_active"] = ("the candidate serves what the active bundle serves on every held-out page: nothing for a "
                               "canary or a second look to judge")
    elif judging and settings.fraction > 0 and difference.ci_high >= -config.tolerance:  # refused, not ruled out
        report["canary_started"] = _keep(store.start_canary, sign_bundle(_with_canary(result.bundle, settings.fraction)), report,
                                         "canary_not_started", "started as a canary: the refused candidate")
    elif looks:
        report["kept_for_second_look"] = _keep(store.hold, signed, report, "not_kept", "kept for a second look: the refused candidate")
    if not published and products is not None and products.passed and args.init is None:
        # the flat candidate refused (kept, canaried or dropped): the active bundle's flat decision with the new heads
        assert products.trained is not None
        report["products"]["published"] = _keep(lambda data: _publish(store, data, judged_against),
                                                sign_bundle(products.trained.bundle),
                                                report["products"], "not_published", "published: the new product heads")
    print(json_line(report) if args.json else _outcome(report, verdict, published, moved, settings.fraction, store))
    if moved is not None:
        log.warning("nothing published: %s", moved)
        return EXIT_REFUSED
    if promoted and not published:
        log.warning("the canary was promoted; its successor was not published: %s", verdict.reason)
        return 0
    if not published:
        log.warning("nothing published: %s", verdict.reason)
        return EXIT_REFUSED
    return 0


def _outcome(report: dict[str, Any], verdict: GateResult, published: bool, moved: str | None, fraction: float,
             store: WeightsStore) -> str:
    """What the run did, for a person (``--json``: the report): the verdict, forced past or not, and a canary started."""
    if moved is not None:
        line = f"not published: {moved}"
    elif published and not verdict.publish:
        line = f"published (forced past the gate: {verdict.reason})"
    else:
        line = f"{'published' if published else 'refused'}: {verdict.reason}"
    if report.get("products", {}).get("published"):
        line += " (new product heads published)"
    if report.get("canary_started"):
        line += (f"\ncanary started: {report['canary_started']} now serves {fraction * 100:g} % of the sessions from "
                 f"{store.canary_path}; the next runs judge it")
    elif "canary_not_started" in report:
        line += f"\ncanary not started: {report['canary_not_started']}"
    return line


def window_start(window: Window) -> float | None:
    """The earliest ``time_s`` of the window's decisions (None when it has none, or one that orders nothing)."""
    from trainer.reading import earliest_time

    return earliest_time(window.decisions.column("time_s"))


def _products(args: argparse.Namespace, init: Any, result: Any, versions: list[str], since: float | None,
              config: TrainConfig) -> ProductStep | None:
    """The product step (``trainer.cycle_products``) when the trained bundle carries product heads, as the run's
    ``products`` asks, with its seed and gate tolerance; a failure there is reported and leaves the flat decision's
    outcome alone."""
    from trainer.cli import _source
    from trainer.cycle_products import MAX_ROWS as PRODUCT_ROWS
    from trainer.cycle_products import ProductStep, product_step
    from trainer.product_train import ProductTrainConfig

    if result.product is None:
        return None
    try:
        return product_step(_source(args.logs, init), init, versions, result.manifest["created_at"],
                            ProductTrainConfig.of(config.products, config.seed, config.tolerance, PRODUCT_ROWS), since=since)
    except Exception as exc:  # optional: the flat decision is published or refused on its own merits
        log.exception("the product step failed; the candidate keeps the heads it was trained from")
        return ProductStep({"error": f"{type(exc).__name__}: {exc}"})


def _serving(store: WeightsStore, active: Any) -> list[str]:
    """The versions the servers serve now: the active bundle's, and the canary's (its name only: it is validated before
    it is judged; an unreadable canary adds nothing)."""
    from weights.bundle import BundleError, read_bundle

    versions = [active.model_version]
    try:
        data = store.canary()
        if data is not None:
            versions.append(read_bundle(data).model_version)
    except (BundleError, OSError) as exc:
        log.warning("the canary's version could not be read: %s", exc)
    return versions


def _operator_left_it(args: argparse.Namespace) -> bool:
    """Whether this run may look at kept candidates and canaries: not with ``--init`` or ``--force`` (the operator chose),
    not under torchrun (every rank would have to agree on the look before any trains)."""
    return args.init is None and not args.force and _one_rank()


def _one_rank() -> bool:
    """Whether this run is one process (not a rank under torchrun)."""
    from trainer.distributed import DistEnv

    return DistEnv.parse(os.environ).world_size == 1


def _looks_apply(args: argparse.Namespace, config: TrainConfig) -> bool:
    """Whether this run looks at and keeps candidates for a second look (``second_look_level`` set)."""
    return config.second_look_level is not None and _operator_left_it(args)


def judged(config: TrainConfig, model: ModelSet, decisions: Any, outcomes: Any, level: float | None = None,
           n_boot: int | None = None) -> Evaluation:
    """The gate's view of ``model``: the objective's episodes and γ = 1, not the training reward's."""
    from trainer.evaluation import evaluate_bundle
    from trainer.offline import LEVEL

    return evaluate_bundle(model, decisions, outcomes, n_boot=n_boot or config.bootstrap, seed=config.seed,
                           max_ratio=config.max_ratio, level=LEVEL if level is None else level)


def offline_metrics(verdict: GateResult) -> dict[str, float]:
    """The gate's estimates of the new bundle, for its manifest's training metrics (and the served gauges)."""
    estimates = verdict.new.report
    values = {f"offline_{name}": getattr(estimates, name).value for name in ("ips", "snips", "dr", "tis", "behavior_value")
              if getattr(estimates, name) is not None}
    return values | {"offline_dr_minus_current": verdict.difference.value, "offline_ess": estimates.ess,
                     "offline_unsupported_mass": verdict.new.unsupported_mass}


def _signer(key: Ed25519PrivateKey | None) -> Callable[[bytes], bytes]:
    """What every bundle this run writes to the weights directory goes through: signed with ``key``, or as it is."""
    from weights.signing import sign

    return (lambda data: data) if key is None else (lambda data: sign(data, key))


def _publish(store: WeightsStore, data: bytes, replacing: str | None) -> str:
    """Publish ``data`` in place of the active bundle whose sha256 is ``replacing`` (None: none is active), the one
    this run judged against; ``ActiveMoved`` if another became active meanwhile. (The store makes its directory.)"""
    return str(store.publish(data, replacing).status)


SETUP_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP,
                          errno.ENAMETOOLONG})
"""What makes a ``--weights-dir`` one no run can write (bad usage, exit 2); another ``OSError`` (I/O, a full volume) is
a failure, retried."""


def _usable(store: WeightsStore) -> None:
    """Make the weights directory and its lock file: a directory that cannot be written is a ``UsageError``."""
    from trainer.cli import UsageError
    from weights.store import StoreError

    try:
        store.ensure_writable()
    except StoreError as exc:  # (``layout``: a store directory that is a link, which every publish would refuse)
        raise UsageError(f"--weights-dir {store.directory}: {exc}") from None
    except OSError as exc:
        if exc.errno not in SETUP_ERRNOS:
            raise
        raise UsageError(f"--weights-dir {store.directory}: cannot be created or written: {exc}{_owner(exc)}") from None


def _owner(exc: OSError) -> str:
    """For a file this process may not write (a lock file an operator's publish left, say): whose it is."""
    if exc.errno not in (errno.EACCES, errno.EPERM) or not exc.filename:
        return ""
    try:
        owner = os.stat(exc.filename).st_uid
    except OSError:
        return ""
    return f" (owned by uid {owner}; this run is uid {os.getuid()}: give it to the publishers' user, or remove it)"


def _active(store: WeightsStore, public_keys: tuple[bytes, ...] = ()) -> tuple[Any, str | None]:
    """The bundle the servers serve (the embedded default when the store has none) and the sha256 of its file (None).
    Validated in a bounded child first, as a server validates a new file, before this run loads it: an active bundle
    whose guard made a 1 GiB intermediate took `cycle` to 2.4 GB, where every server refused it (an attack review,
    2026-12-06; one of 14 GB would have had the CronJob's pod killed on every run). With ``public_keys`` (``--public-key``)
    it must be signed by one of them, as the servers require: otherwise a file anyone who can write the volume put
    there, refused by every server, would be trained from and its settings (guardrails, rules, actions) published under
    this run's signature (a security review, 2026-12-06). Refused as bad usage (exit 2): the run gives the same answer
    until someone puts a signed bundle back."""
    from trainer.cli import UsageError
    from weights.bundle import BundleError, sha256
    from weights.embedded import default_bundle
    from weights.validate import verified

    data = store.active_bytes()
    if data is None:
        return default_bundle(), None
    try:
        return verified(data, f"the active bundle {store.active_path}", public_keys), sha256(data)
    except BundleError as exc:  # unsigned, or a candidate the gate refused moved there (an attack, 2026-12-06)
        if exc.reason not in ("signature", "held"):
            raise
        back = "a signed bundle back" if exc.reason == "signature" else "a release back"
        raise UsageError(f"{exc}; the servers refuse it too: put {back} (shopping-agent weights rollback --dir "
                         f"{store.directory}{' --public-key ...' if public_keys else ''}) or publish one") from None


def _keep(write: Callable[[bytes], str], data: bytes, report: dict[str, Any], failure: str, what: str) -> str | None:
    """Write ``data`` with ``write`` (``store.hold`` or ``store.start_canary`` for a refused candidate, a publish for new
    product heads alone): its version; on failure (a full disk, a bundle the store's check refuses, a version already
    taken by other bytes) say why under ``report[failure]`` and write nothing: a refusal stays a refusal."""
    from weights.bundle import BundleError
    from weights.store import StoreError

    try:
        return write(data)
    except (BundleError, StoreError, OSError) as exc:
        log.warning("not %s: %s", what, exc)
        report[failure] = str(exc)
        return None


def second_look(sign_bundle: Callable[[bytes], bytes], store: WeightsStore, config: TrainConfig, current: ModelSet,
                window: Window, options: LoadOptions, replacing: str | None) -> dict[str, Any] | None:
    """Judge the kept candidate, if any, on the window's sessions it never saw; publish it if the gate passes (in place
    of ``current``, whose file's sha256 is ``replacing``: ``_publish``).

    Returns the look's report (None without a kept candidate). The candidate is dropped once
    looked at, or when it cannot be (stale, unreadable, a failure on the way); it stays only
    while too few sessions have been logged since it was trained (``waiting``).
    """
    from weights.store import ActiveMoved

    try:
        data = store.pending()
        if data is None:
            return None
        report = _look(sign_bundle, store, config, current, window, options, data, replacing)
    except Exception as exc:  # the look is optional: a kept file that always fails must not block every later run
        if isinstance(exc, ActiveMoved):  # judged against a bundle no longer active: stale, as it will be
            log.warning("the kept candidate is dropped: %s", exc)
        else:
            log.exception("no second look; the kept candidate is dropped")
        report = {"publish": False, "reason": f"no second look: {type(exc).__name__}: {exc}"}
    if not report.get("waiting"):
        try:
            store.drop_pending()
        except OSError as exc:
            log.warning("the kept candidate could not be removed: %s", exc)
    return report


def _look(sign_bundle: Callable[[bytes], bytes], store: WeightsStore, config: TrainConfig, current: ModelSet, window: Window,
          options: LoadOptions, data: bytes, replacing: str | None) -> dict[str, Any]:
    from trainer.cycle_products import same_flat_as
    from trainer.evaluation import gate
    from trainer.second_look import candidate_record, unseen_sessions
    from weights.model_set import ModelSet

    candidate = ModelSet.load(store.validate(data), options)
    head: dict[str, Any] = {"model_version": candidate.version, "current_version": current.version}
    record = candidate_record(candidate.manifest, current.version, same_flat_as(current.manifest))
    if isinstance(record, str):
        log.info("the kept candidate %s is stale: %s", candidate.version, record)
        return {**head, "publish": False, "reason": f"stale: {record}"}
    unseen = unseen_sessions(window, record)
    if unseen.n_fresh < max(unseen.n_heldout, 1):  # a judge at least the size of the first look, or wait
        reason = (f"waiting: {unseen.n_fresh} sessions logged since it was trained, fewer than the {unseen.n_heldout} "
                  "its first look had")
        log.info("the kept candidate %s is %s", candidate.version, reason)
        return {**head, "publish": False, "waiting": True, "reason": reason, "sessions": unseen.describe()}
    level = config.second_look_level
    if level is None:
        raise ValueError("second_look_level: None turns the second look off")
    n_boot = max(config.bootstrap, LOOK_BOOTSTRAP)
    verdict = gate(judged(config, candidate, unseen.decisions, unseen.outcomes, level, n_boot),
                   judged(config, current, unseen.decisions, unseen.outcomes, level, n_boot), config.tolerance,
                   **config.gate_limits())
    report = {**head, "second_look": True, "level": level, "bootstrap": n_boot, "sessions": unseen.describe(), **verdict.to_dict()}
    log.info("second look at %s on %d unseen sessions: %s", candidate.version, unseen.n_fresh + unseen.n_heldout, verdict.reason)
    if verdict.publish:  # with the estimates of this look in its manifest, signed with today's key
        report["published"] = _publish(store, sign_bundle(_released(data, offline_metrics(verdict) | {"second_look": 1.0})),
                                       replacing)
    return report


def _released(data: bytes, extra: dict[str, float]) -> bytes:
    """The kept candidate ``data`` as a second look publishes it: ``extra`` over its training metrics, without the mark
    that kept every server from serving it (``weights.held``; unsigned: sign it again)."""
    return _with_manifest(data, lambda m: held.released({**m, "training_metrics": {**m.get("training_metrics", {}), **extra}}))


def _with_canary(data: bytes, fraction: float) -> bytes:
    """The bundle ``data`` asking to serve ``fraction`` of the sessions as a canary (``weights.canary``; unsigned)."""
    return _with_manifest(data, lambda m: {**m, "canary": {"fraction": fraction}})


def _with_manifest(data: bytes, change: Callable[[dict[str, Any]], dict[str, Any]]) -> bytes:
    from weights.bundle import read_bundle, write_bundle

    bundle = read_bundle(data)
    manifest = change(bundle.manifest)
    out = io.BytesIO()
    write_bundle(out, manifest, dict(bundle.parts))  # every part of its format version
    return out.getvalue()
