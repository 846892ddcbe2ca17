"""Build the embedded default bundle, weights/data/default.bundle, reproducibly, from the simulator loop.

Provenance (recorded in the manifest's ``provenance``):

1. an untrained initial bundle: ``weights.initial.make_bundle`` with seed ``INIT_SEED``;
2. ``SESSIONS`` simulated shopper sessions (``simulator``, world seed ``SIM_SEED``)
   served by it in-process, through the real decision code and the real log recorder (fixed
   clock and salt, so the logs are the same on every run);
3. the trainer (``trainer.train``, ``TrainConfig(seed=TRAIN_SEED)`` defaults) on those logs;
4. the gate: offline DR estimates of the trained and the initial bundle on the held-out
   sessions; the build fails unless the trained one is not worse;
5. the simulator's true value of both, on sessions the trainer never saw (``EVAL_SEED``).

Needs the ``train`` (or ``test``) extra: torch and onnx. Takes about two minutes on 2 cores.
On the same CPU type the bytes are identical; ``--check`` rebuilds and compares (bytes, or,
on another CPU where float rounding may differ, the networks' outputs within 1e-3).

Run: ``python scripts/build_default_bundle.py [--check]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from zoneinfo import ZoneInfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from experience.segments import DirectorySource  # noqa: E402
from simulator.config import SimConfig  # noqa: E402
from simulator.drive import run_in_process, run_logged  # noqa: E402
from simulator.world import World  # noqa: E402
from weights.bundle import read_bundle  # noqa: E402
from weights.embedded import DEFAULT_MODEL_VERSION  # noqa: E402
from weights.initial import make_bundle  # noqa: E402
from weights.model_set import LoadOptions, ModelSet  # noqa: E402

INIT_SEED = 20261130
INIT_VERSION = "default-init-20261130"
CREATED_AT = "2026-11-30T00:00:00Z"
SIM_SEED, SESSIONS = 1130, 6000
TRAIN_SEED = 0
EVAL_SEED, EVAL_SESSIONS = 2026, 3000
LOG_CLOCK_S = 1_795_996_800.0  # 2026-12-01T00:00:00Z: the logs' server time, fixed
TARGET = ROOT / "weights" / "data" / "default.bundle"


def initial() -> bytes:
    return make_bundle(INIT_SEED, INIT_VERSION, CREATED_AT, provenance={"script": "scripts/build_default_bundle.py"})


def build() -> bytes:
    from trainer.config import TrainConfig
    from trainer.data import episode_config, split
    from trainer.evaluation import evaluate_bundle, gate
    from trainer.train import train

    init = read_bundle(initial())
    options = LoadOptions(device="cpu", warmup_batch=8)
    init_model = ModelSet.load(init, options)
    config = TrainConfig(seed=TRAIN_SEED)
    with tempfile.TemporaryDirectory(prefix="default-bundle-") as tmp:
        logs = Path(tmp)
        run_logged(World(SimConfig(), SIM_SEED), init_model, range(SESSIONS), ZoneInfo("UTC"), logs,
                   b"default-bundle-salt".ljust(32, b"."), clock=lambda: LOG_CLOCK_S)
        source = DirectorySource(logs)
        decisions, outcomes = source.table("decisions"), source.table("outcomes")
    result = train(decisions, outcomes, init, config, device="cpu", model_version=DEFAULT_MODEL_VERSION)
    _, (held_d, held_o) = split(decisions, outcomes, config.heldout_fraction, config.seed)
    kwargs = {"n_boot": config.bootstrap, "seed": config.seed, "max_ratio": config.max_ratio}
    new_eval = evaluate_bundle(ModelSet.load(read_bundle(result.bundle), options), held_d, held_o, episode_config(config), **kwargs)
    verdict = gate(new_eval, evaluate_bundle(init_model, held_d, held_o, episode_config(config), **kwargs), config.tolerance)
    if not verdict.publish:
        raise SystemExit(f"the trained default did not pass the gate: {verdict.reason}")
    world = World(SimConfig(), EVAL_SEED)
    true_new = run_in_process(world, ModelSet.load(read_bundle(result.bundle), options), range(EVAL_SESSIONS), ZoneInfo("UTC"))
    true_init = run_in_process(world, init_model, range(EVAL_SESSIONS), ZoneInfo("UTC"))
    result.manifest["provenance"] = {
        **result.manifest["provenance"],
        "script": "scripts/build_default_bundle.py",
        "init": {"builder": "weights.initial.make_bundle", "seed": INIT_SEED, "model_version": INIT_VERSION},
        "logs": {"simulator_seed": SIM_SEED, "sessions": SESSIONS, "decisions": decisions.num_rows, "outcomes": outcomes.num_rows},
        "gate": {"dr_difference": verdict.difference.to_dict(), "reason": verdict.reason},
        "simulator_true_value": {"seed": EVAL_SEED, "sessions": EVAL_SESSIONS,
                                 "trained": round(true_new.value().mean, 4), "initial": round(true_init.value().mean, 4)},
    }
    report = new_eval.report
    return result.with_metrics({"offline_ips": report.ips.value, "offline_snips": report.snips.value,
                                "offline_dr": report.dr.value if report.dr is not None else float("nan"),
                                "offline_behavior_value": report.behavior_value.value,
                                "offline_dr_minus_current": verdict.difference.value})


def same_networks(a: bytes, b: bytes, tolerance: float = 1e-3) -> float:
    """Largest difference of the two bundles' outputs on random states (inf when their manifests differ in kind)."""
    ma, mb = (ModelSet.load(read_bundle(x), LoadOptions(device="cpu", warmup_batch=1)) for x in (a, b))
    if ma.version != mb.version or ma.encoder.spec != mb.encoder.spec:
        return float("inf")
    rng = np.random.default_rng(0)
    states = rng.standard_normal((256, ma.encoder.spec.state_dim)).astype(np.float32) * 0.05
    (la, aa), (lb, ab) = ma.infer(states), mb.infer(states)
    return float(max(np.abs(la - lb).max(), np.abs(aa - ab).max()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in bundle differs from a rebuild")
    args = parser.parse_args()
    data = build()
    if args.check:
        current = TARGET.read_bytes()
        if current == data:
            print("identical bytes")
            return 0
        diff = same_networks(current, data)
        if diff <= 1e-3:
            print(f"not bit-identical (float rounding of this CPU), networks agree within {diff:.2g}")
            return 0
        print(f"{TARGET} differs from a rebuild (outputs differ by {diff:.3g}); run python scripts/build_default_bundle.py")
        return 1
    TARGET.write_bytes(data)
    print(f"wrote {TARGET} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
