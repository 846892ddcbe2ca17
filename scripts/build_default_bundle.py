"""Build the embedded default bundle, weights/data/default.bundle, reproducibly.

Provenance: an untrained initial bundle from ``weights.initial.make_bundle`` with seed
20261130 and a fixed created-at, so the same code gives the same bytes (a test rebuilds it
and compares). Needs the ``onnx`` package (test extra). Later the trainer replaces this
with a policy trained on simulator logs, recorded in the manifest's provenance.

Run: ``python scripts/build_default_bundle.py [--check]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weights.initial import make_bundle  # noqa: E402

SEED = 20261130
VERSION = "default-init-20261130"
CREATED_AT = "2026-11-30T00:00:00Z"
TARGET = ROOT / "weights" / "data" / "default.bundle"


def build() -> bytes:
    return make_bundle(SEED, VERSION, CREATED_AT, provenance={"script": "scripts/build_default_bundle.py"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in bundle differs from a rebuild")
    args = parser.parse_args()
    data = build()
    if args.check:
        if TARGET.read_bytes() != data:
            print(f"{TARGET} differs from a rebuild; run python scripts/build_default_bundle.py")
            return 1
        return 0
    TARGET.write_bytes(data)
    print(f"wrote {TARGET} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
