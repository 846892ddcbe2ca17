"""``verify``: the full validation a server applies to a bundle, for the store and the command line.

In a child process under ``SandboxLimits`` (``weights.sandbox``) by default, so validating a
hostile file on an operator's machine or in the CronJob is as safe as it is on a server;
``limits=None`` validates in this process. With ``public_keys``, only a bundle signed by one of
them passes (``weights.signing``).
"""

from __future__ import annotations

from weights.bundle import Bundle, read_bundle
from weights.model_set import LoadOptions, ModelSet
from weights.sandbox import SandboxLimits, validate_in_child


def verify(data: bytes, public_keys: tuple[bytes, ...] = (), limits: SandboxLimits | None = SandboxLimits()) -> Bundle:  # noqa: B008
    """The bundle in ``data`` once it loaded, self-tested and warmed up as a server would (on CPU); else ``BundleError``."""
    options = LoadOptions(device="cpu", public_keys=public_keys)
    bundle = read_bundle(data)
    if limits is None:
        ModelSet.load(bundle, options)
    else:
        validate_in_child(data, options, limits)
    return bundle


def verified(data: bytes, where: str, public_keys: tuple[bytes, ...] = ()) -> Bundle:
    """``verify(data, public_keys)`` in a bounded child, its ``BundleError`` naming ``where`` (the file, or what it is):
    what a process that will load a bundle itself checks first, as a server checks a new file, so that a graph built to
    take its memory or its time stops in the child (the trainer: ``trainer.cli``, ``trainer.cycle``), and that a bundle
    the servers would refuse is not trained from either: unsigned by one of ``public_keys`` when there are any, or a
    candidate held for a second look (``weights.held``)."""
    from weights.bundle import BundleError
    from weights.held import refuse_held

    try:
        bundle = verify(data, public_keys)
        refuse_held(bundle.manifest, "a release")
        return bundle
    except BundleError as exc:
        raise BundleError(exc.reason, f"{where} ({exc.reason}): {exc}") from None
