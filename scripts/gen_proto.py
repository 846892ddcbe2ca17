"""Generate the Python gRPC code from proto/ into server/_gen/.

proto/ holds .proto files only. The generated modules live under
``server._gen`` (protoc's import-path mapping ``-Iserver/_gen=proto``), so their
imports need no rewriting and no top-level ``proto`` package is ever created
(that name belongs to the proto-plus library).

Run: ``python scripts/gen_proto.py`` (needs grpcio-tools). ``--check`` regenerates
into a temporary directory and exits 1 when the checked-in code differs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
GEN_PACKAGE = "server/_gen"


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every .proto under proto/; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_DIR) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{GEN_PACKAGE}={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"{GEN_PACKAGE}/{p.as_posix()}" for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen_root = out_root / GEN_PACKAGE
    for directory in [gen_root, *[p for p in gen_root.rglob("*") if p.is_dir()]]:
        (directory / "__init__.py").touch()
    return sorted(p for p in gen_root.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if regenerating changes anything")
    args = parser.parse_args()
    if not args.check:
        shutil.rmtree(ROOT / GEN_PACKAGE, ignore_errors=True)
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        fresh_rel = {p.relative_to(tmp) for p in fresh}
        current = {p.relative_to(ROOT) for p in (ROOT / GEN_PACKAGE).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
        stale = sorted(str(p) for p in fresh_rel ^ current)
        stale += sorted(str(p) for p in fresh_rel & current if not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False))
    if stale:
        print("generated code is out of date; run python scripts/gen_proto.py:", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
