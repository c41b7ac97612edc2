"""Generate the Python stubs of protos/ into vlmesh/v1 (the one documented step).

Run with grpcio-tools 1.84.0 (pinned in pyproject's dev extra): its stubs import on
grpcio >= 1.84.0 and on protobuf 7.35.1 or newer, which covers the GPU machine
(grpcio 1.84, protobuf 7.36). tests/unit/common/test_protos.py regenerates into a temporary folder
and fails if the committed stubs differ.

    python scripts/gen_protos.py            # rewrite vlmesh/v1/*_pb2*.py
    python scripts/gen_protos.py --out DIR  # write elsewhere (for the drift test)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    """Run protoc on every proto under protos/ into `out`; return the files written."""
    from grpc_tools import protoc  # imported late: only this step needs grpcio-tools

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    # protoc resolves relative proto paths against the include dirs, so run from PROTO_ROOT.
    cwd = Path.cwd()
    try:
        os.chdir(PROTO_ROOT)
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out / "vlmesh").rglob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo root)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
