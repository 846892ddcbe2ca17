"""``shopping-agent weights …``: create, verify, show, publish and roll back bundles.

Each command prints one line a CronJob log makes sense of (``--json`` and ``show`` print
more) and exits 0 on success, 1 when a bundle is invalid or the store refuses the request,
2 on a usage or I/O problem (a missing file, an unwritable volume, a missing package).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from weights.bundle import BundleError, parse_time, read_bundle, read_file, sha256
from weights.canary import fraction_of
from weights.held import refuse_held
from weights.sandbox import MAX_MEMORY_MB, SandboxLimits
from weights.signing import KeyFileError, key_id, keypair_pem, load_private_key, load_public_keys, sign, signed_by
from weights.store import PublishResult, StoreError, Validator, WeightsStore, atomic_write, check_version_name
from weights.validate import verify

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_ERROR = 2
_IO_REASONS = {"io", "index"}
PUBLIC_KEY_ENV = "SHOPPING_AGENT_BUNDLE_PUBLIC_KEY"
"""The servers' ``--bundle-public-key`` as an environment variable (``server.config``): the default of ``--public-key``."""

Handler = Callable[[argparse.Namespace], int]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``weights`` command and its subcommands to the CLI."""
    parser = subparsers.add_parser(
        "weights", help="create, verify, show, publish and roll back bundles",
        description="Create, verify, show, publish and roll back weight bundles. "
                    "Exit codes: 0 done, 1 invalid bundle or refused, 2 usage or I/O problem.",
    )
    sub = parser.add_subparsers(dest="weights_command", required=True)

    p = sub.add_parser("init", help="write a fresh, valid bundle (untrained networks from a seed)")
    p.add_argument("--out", type=Path, required=True, help="the bundle file to write (atomically)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed of the networks (default 0)")
    p.add_argument("--version", dest="model_version", help="model version (default init-<seed>)")
    p.add_argument("--created-at", type=_time, help="the manifest's created_at, an ISO 8601 time with a zone (default now, "
                                                  "UTC); fix it for identical bytes")
    p.add_argument("--product-heads", action="store_true",
                   help="also RecommendProduct's untrained networks (bundle format 2); without them its layers answer by rules")
    p.set_defaults(weights_handler=_init)

    p = sub.add_parser("verify", help="validate a bundle fully, as a server would load it")
    p.add_argument("file", type=Path)
    _validation(p)
    p.set_defaults(weights_handler=_verify)

    p = sub.add_parser("keygen", help="make an Ed25519 key pair for signing bundles (PEM files)")
    p.add_argument("--private", type=Path, required=True, help="where to write the private key (mode 0600; keep it secret)")
    p.add_argument("--public", type=Path, required=True, help="where to write the public key (for --bundle-public-key)")
    p.set_defaults(weights_handler=_keygen)

    p = sub.add_parser("sign", help="sign a bundle with an Ed25519 private key")
    p.add_argument("file", type=Path)
    p.add_argument("--key", type=Path, required=True, help="the private key (PEM)")
    p.add_argument("--out", type=Path, help="where to write the signed bundle (default: replace FILE atomically)")
    p.set_defaults(weights_handler=_sign)

    p = sub.add_parser("show", help="print a bundle's manifest, or a weights directory's active bundle and history")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("file", type=Path, nargs="?", help="a bundle file")
    what.add_argument("--dir", type=Path, help="a weights directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(weights_handler=_show)

    p = sub.add_parser("publish", help="validate a bundle and make it the active one in a weights directory")
    p.add_argument("file", type=Path)
    p.add_argument("--dir", type=Path, required=True, help="the weights directory (the volume the servers watch)")
    p.add_argument("--keep", type=_positive, default=10, help="published versions to keep for rollback (default 10)")
    p.add_argument("--sign-key", type=Path, help="sign the bundle with this Ed25519 private key (PEM) before publishing")
    _validation(p)
    p.set_defaults(weights_handler=_publish, weights_verdict="refused")

    p = sub.add_parser("rollback", help="make the previously published (or a named) version the active one")
    p.add_argument("--dir", type=Path, required=True, help="the weights directory")
    p.add_argument("--to", metavar="VERSION", help="the version to activate (default: the newest published before the active one "
                                                   "that was not itself rolled back from)")
    _validation(p)
    p.set_defaults(weights_handler=_rollback, weights_verdict="refused")


def _validation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--public-key", type=Path, default=_path_from_env(PUBLIC_KEY_ENV),
                   help=f"accept only bundles signed by this Ed25519 public key (PEM; a file may hold several), as the "
                        f"servers do (default: ${PUBLIC_KEY_ENV}, the servers' --bundle-public-key, so a publish or rollback "
                        "where they set it activates nothing they would refuse)")
    p.add_argument("--validate-memory-mb", type=_memory_mb, default=SandboxLimits().memory_bytes // 2**20,
                   help="address-space limit of the validating child process (default %(default)s; 0: validate in-process)")


def _path_from_env(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


def _validator(args: argparse.Namespace, keys: tuple[bytes, ...]) -> Validator:
    """The servers' check of a bundle, trusting ``keys`` (``_keys``: those of ``--public-key``)."""
    limits = None if args.validate_memory_mb == 0 else SandboxLimits(memory_bytes=args.validate_memory_mb * 2**20)
    return lambda data: verify(data, keys, limits)


def _keys(args: argparse.Namespace) -> tuple[bytes, ...]:
    return () if args.public_key is None else load_public_keys(args.public_key)


def run(args: argparse.Namespace) -> int:
    """Run the chosen ``weights`` subcommand; the exit code for the CronJob log."""
    handler: Handler = args.weights_handler
    try:
        return handler(args)
    except BundleError as exc:  # publish and rollback refuse an invalid bundle; verify and show call it invalid
        verdict = getattr(args, "weights_verdict", "invalid")
        return _fail(EXIT_ERROR if exc.reason in _IO_REASONS else EXIT_INVALID, verdict, exc.reason, exc)
    except StoreError as exc:
        return _fail(EXIT_ERROR if exc.reason in _IO_REASONS else EXIT_INVALID, "refused", exc.reason, exc)
    except KeyFileError as exc:  # (a missing onnxruntime or onnx: the command line names the install, server/cli.py)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _fail(code: int, verdict: str, reason: str, exc: Exception) -> int:
    print(f"{'error' if code == EXIT_ERROR else verdict} ({reason}): {exc}", file=sys.stderr)
    return code


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**63:  # numpy's generators take no negative seed: a traceback (a review)
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63 - 1, got {value}")
    return value


def _time(text: str) -> str:
    if parse_time(text) is None:  # what every server and verify refuse: init wrote such a bundle and exited 0 (a review)
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 time with a zone (2026-11-30T00:00:00Z), got {text!r}")
    return text


def _memory_mb(text: str) -> int:
    value = int(text)
    if value != 0 and not 256 <= value <= MAX_MEMORY_MB:  # a traceback below, every bundle refused above (a review)
        raise argparse.ArgumentTypeError(f"expected 0 (validate in-process) or 256 to {MAX_MEMORY_MB} MiB, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# --- commands --------------------------------------------------------------------------------


def _init(args: argparse.Namespace) -> int:
    # before any work: without onnx or threadpoolctl (the train extra) the command line names what to install
    # (server/cli.py, exit 2)
    import onnx  # noqa: F401  (make_bundle imports it only when it builds the graphs)
    import threadpoolctl  # noqa: F401  (weights.golden imports it only when it computes the golden outputs)

    from weights.initial import make_bundle

    version = args.model_version or f"init-{args.seed}"
    try:
        check_version_name(version)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    created_at = args.created_at or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    data = make_bundle(args.seed, version, created_at, product_heads=args.product_heads)
    atomic_write(args.out, data)
    print(f"created {version} in {args.out} (sha256 {sha256(data)})")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    try:
        keys = _keys(args)
        bundle = _validator(args, keys)(read_file(args.file))
        refuse_held(bundle.manifest, "refused as a release")  # what every server refuses, verify refuses
    except BundleError as exc:  # named: the line may be one of many in a script's log
        raise BundleError(exc.reason, f"{args.file}: {exc}") from None
    signer = signed_by(bundle, keys)
    signed = f" (signed by key {key_id(signer)})" if signer is not None else " (signed)" if bundle.signature is not None else ""
    print(f"ok {bundle.model_version}{signed}")  # which key: during a rotation, whether the old one is still needed
    return EXIT_OK


def _keygen(args: argparse.Namespace) -> int:
    if args.private.resolve() == args.public.resolve():
        print(f"error: --private and --public name one file ({args.private}): the pair needs two", file=sys.stderr)
        return EXIT_ERROR
    for flag, path in (("--private", args.private), ("--public", args.public)):
        if os.path.lexists(path):  # --public over the signing key replaced it, and the publisher lost it (a review)
            print(f"error: {flag} {path}: exists; keygen never overwrites a key file", file=sys.stderr)
            return EXIT_ERROR
    private, public = keypair_pem()
    atomic_write(args.private, private, mode=0o600, replace=False)  # never overwrite a key; never leave half of one
    try:
        atomic_write(args.public, public, replace=False)
    except BaseException:
        args.private.unlink(missing_ok=True)  # the pair or nothing: a private key without its public half only blocks a rerun
        raise
    print(f"wrote {args.private} (private, 0600) and {args.public} (public, key {key_id(load_public_keys(args.public)[0])})")
    return EXIT_OK


def _sign(args: argparse.Namespace) -> int:
    data = sign(read_file(args.file), load_private_key(args.key))
    atomic_write(args.out or args.file, data)
    print(f"signed {read_bundle(data).model_version} into {args.out or args.file} (sha256 {sha256(data)})")
    return EXIT_OK


def _publish(args: argparse.Namespace) -> int:
    data = read_file(args.file)
    if args.sign_key is not None:
        data = sign(data, load_private_key(args.sign_key))
    result = WeightsStore(args.dir, _validator(args, _keys(args)), keep=args.keep).publish(data)
    print(_result_line(result))
    return EXIT_OK


def _rollback(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():  # a volume not mounted is no refusal (exit 1 reads as one to the Job): nothing to roll
        print(f"error (io): --dir {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    result = WeightsStore(args.dir, _validator(args, _keys(args))).rollback(args.to)
    print(_result_line(result))
    return EXIT_OK


def _result_line(result: PublishResult) -> str:
    verb = {"published": "published", "unchanged": "unchanged", "rolled_back": "rolled back to"}[result.status]
    since = f" (was {result.previous})" if result.previous and result.previous != result.model_version else ""
    return f"{verb} {result.model_version}{since}"


def _show(args: argparse.Namespace) -> int:
    if args.dir is None:
        data = read_file(args.file)
        manifest = read_bundle(data).manifest
        if args.json:
            print(json.dumps(manifest, indent=2, sort_keys=True))
        else:
            _print_lines([_row("file", f"{args.file} ({len(data)} bytes, sha256 {sha256(data)})"), *_manifest_lines(manifest)])
        return EXIT_OK
    return _show_dir(WeightsStore(args.dir, verify), args.json)  # reads manifests only: never validates


def _show_dir(store: WeightsStore, as_json: bool) -> int:
    if not store.directory.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such weights directory", str(store.directory))
    entries = store.history()
    active_sha = store.active_sha256()
    manifest: dict[str, Any] | None = None
    problem: BundleError | None = None
    try:
        manifest = store.active()
    except BundleError as exc:
        problem = exc
    history = [{**vars(e), "active": e.sha256 == active_sha} for e in entries]
    canary = _canary_of(store)
    pending = _pending_of(store)
    if as_json:
        out: dict[str, Any] = {"directory": str(store.directory), "active_sha256": active_sha, "active": manifest, "history": history,
                               "canary": canary, "pending": pending}
        if problem is not None:
            out["active_error"] = {"reason": problem.reason, "message": str(problem)}
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        lines = [_row("directory", str(store.directory))]
        if problem is not None:
            lines.append(_row("active", f"invalid ({problem.reason}): {problem}"))
        elif manifest is None:
            lines.append(_row("active", "(none)"))
        else:
            lines.append(_row("active", f"{store.active_path.name} (sha256 {active_sha})"))
            lines += ["  " + line for line in _manifest_lines(manifest)]
        lines.append(_row("history", f"{len(entries)} kept, oldest first (* = active)" if entries else "(none)"))
        lines += [f"  {'*' if h['active'] else ' '} {e.model_version}  published {e.published_at}  sha256 {e.sha256}"
                  + (f"  rolled back from {e.rolled_back_at} (a plain rollback skips it)" if e.rolled_back_at else "")
                  for e, h in zip(entries, history, strict=True)]
        lines.append(_kept_row("canary", canary, lambda c: f"{c['model_version']} asks for {c['fraction']:g} of the sessions "
                                                           f"(each server caps it at its --max-canary-fraction), judged "
                                                           f"{c['looks']} times (sha256 {c['sha256']})"))
        lines.append(_kept_row("pending", pending, lambda p: f"{p['model_version']}, kept for a second look (sha256 "
                                                             f"{p['sha256']}; rm {store.pending_path} to discard it)"))
        _print_lines(lines)
    return EXIT_INVALID if problem is not None else EXIT_OK


def _canary_of(store: WeightsStore) -> dict[str, Any] | None:
    """The canary in the store as ``show --dir`` reports it (its manifest only, never validated); None without one."""
    def described(manifest: dict[str, Any], version: str) -> dict[str, Any]:
        return {"fraction": fraction_of(manifest), "looks": store.canary_looks(version)}

    return _kept_file(store.canary, described)


def _pending_of(store: WeightsStore) -> dict[str, Any] | None:
    """The candidate kept for a second look (its manifest only, never validated); None without one."""
    return _kept_file(store.pending, lambda manifest, version: {})


def _kept_file(read: Callable[[], bytes | None], described: Callable[[dict[str, Any], str], dict[str, Any]]
               ) -> dict[str, Any] | None:
    """A bundle the store keeps beside the active one, by its manifest: its version, sha256 and what ``described`` adds;
    ``{"error": ...}`` when it cannot be read; None when there is none."""
    try:
        data = read()
        if data is None:
            return None
        manifest = read_bundle(data).manifest
        version = str(manifest["model_version"])
        return {"model_version": version, **described(manifest, version), "sha256": sha256(data)}
    except (BundleError, KeyError, ValueError, OSError) as exc:
        return {"error": str(exc)}


def _kept_row(label: str, kept: dict[str, Any] | None, text: Callable[[dict[str, Any]], str]) -> str:
    """``show --dir``'s line for a kept bundle (``_kept_file``)."""
    if kept is None:
        return _row(label, "(none)")
    return _row(label, f"unreadable: {kept['error']}" if "error" in kept else text(kept))


# --- human-readable manifest -----------------------------------------------------------------

_WIDTH = 18


def _print_lines(lines: list[str]) -> None:
    """``lines`` for a person's terminal, each with its control characters and lone surrogates written as escapes: a
    manifest is anyone's text (an ESC sequence in one retitled the terminal and moved its cursor, and a lone surrogate
    stopped `show` with a traceback: an attack review, 2026-12-06); a backslash too, so that no text passes for an
    escape. JSON output escapes them itself."""
    print("\n".join("".join(c if c.isprintable() and c != "\\" else ascii(c)[1:-1] for c in line) for line in lines))


def _row(label: str, value: str) -> str:
    return f"{label:<{_WIDTH}}{value}"


def _inline(value: Any) -> str:
    """A compact one-line rendering: ``k=v`` pairs, comma lists, JSON for anything nested deeper."""
    if isinstance(value, dict):
        return " ".join(f"{k}={_scalar(v)}" for k, v in value.items()) if value else "(none)"
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value) if value else "(none)"
    return _scalar(value)


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return ",".join(str(v) for v in value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _named(items: Any) -> list[str]:
    """One line per rule: ``name: the rest``."""
    if not isinstance(items, list) or not items:
        return [_inline(items)]
    lines = []
    for item in items:
        if isinstance(item, dict) and "name" in item:
            rest = {k: v for k, v in item.items() if k != "name"}
            lines.append(f"{item['name']}: {_inline(rest)}")
        else:
            lines.append(_scalar(item))
    return lines


def _manifest_lines(m: dict[str, Any]) -> list[str]:
    lines: list[str] = []

    def rows(label: str, values: list[str]) -> None:
        lines.append(_row(label, values[0] if values else ""))
        lines.extend(_row("", v) for v in values[1:])

    rows("model_version", [str(m.get("model_version"))])
    rows("created_at", [str(m.get("created_at", "(not set)"))])
    rows("format", [f"{m.get('format')} version {m.get('format_version')}"])
    rows("feature_spec", [_inline(m.get("feature_spec"))])
    rows("actions", [_inline(m.get("actions"))])
    guardrails = m.get("guardrails")
    if isinstance(guardrails, dict):
        rows("guardrails", [f"static {_inline(guardrails.get('static'))}", *(f"rule {r}" for r in _named(guardrails.get("rules")))])
    else:
        rows("guardrails", [_inline(guardrails)])
    rows("fallback_rules", _named(m.get("fallback_rules")))
    guard = m.get("guard")
    rows("guard_threshold", [_scalar(guard.get("threshold")) if isinstance(guard, dict) else _inline(guard)])
    rows("decoder", [_inline(m.get("decoder"))])
    if "product" in m:
        rows("product", [_inline(m.get("product"))])
    rows("golden", [_inline(m.get("golden"))])
    rows("training_metrics", [_inline(m.get("training_metrics", {}))])
    if "provenance" in m:
        rows("provenance", [_inline(m["provenance"])])
    known = {"model_version", "created_at", "format", "format_version", "feature_spec", "actions", "guardrails",
             "fallback_rules", "guard", "decoder", "golden", "training_metrics", "provenance", "parts", "product"}
    for key in sorted(set(m) - known):
        rows(key, [_inline(m[key])])
    parts = m.get("parts")
    if isinstance(parts, dict):
        rows("parts", [f"{name:<20}{_scalar(p.get('size')):>10} bytes  sha256 {p.get('sha256')}" if isinstance(p, dict)
                       else f"{name:<20}{_scalar(p)}" for name, p in parts.items()])
    return lines
