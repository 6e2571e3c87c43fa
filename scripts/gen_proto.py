"""Generates proto/shoal_pb2.py, shoal_pb2.pyi and shoal_pb2_grpc.py from proto/shoal.proto.

The .proto is compiled as if it lived at shoal/proto/shoal.proto, so the generated
modules import each other as ``shoal.proto.shoal_pb2``. ``--check`` compares
freshly generated code with what is committed and exits 1 if it is stale.
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUTPUTS = ("shoal_pb2.py", "shoal_pb2.pyi", "shoal_pb2_grpc.py")


def generate(out: Path) -> Path:
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{include}",
        f"-Ishoal/proto={PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        "shoal/proto/shoal.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return out / "shoal" / "proto"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gen = generate(Path(tmp))
        if opts.check:
            stale = [n for n in OUTPUTS if not (PROTO_DIR / n).exists()
                     or not filecmp.cmp(gen / n, PROTO_DIR / n, shallow=False)]
            if stale:
                print(f"stale generated code: {', '.join(stale)}; run `make proto`", file=sys.stderr)
                return 1
            return 0
        for name in OUTPUTS:
            shutil.copyfile(gen / name, PROTO_DIR / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
