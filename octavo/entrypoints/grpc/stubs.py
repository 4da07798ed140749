"""Generate the Python stubs of octavo.proto (octavo_pb2.py, .pyi and octavo_pb2_grpc.py) with
grpcio-tools: `python -m octavo.entrypoints.grpc.stubs` rewrites the committed ones; the tests
generate them into a scratch folder and compare."""
from __future__ import annotations

import sys
from pathlib import Path

PROTO = "octavo/entrypoints/grpc/octavo.proto"  # relative to the folder holding octavo/
STUBS = ("octavo_pb2.py", "octavo_pb2.pyi", "octavo_pb2_grpc.py")
ROOT = Path(__file__).resolve().parents[3]


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under `out_root`/octavo/entrypoints/grpc/; returns their paths. The
    proto is named from the package root, so the stubs import each other as
    octavo.entrypoints.grpc modules."""
    from grpc_tools import protoc

    out = Path(out_root)
    (out / Path(PROTO).parent).mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out / Path(PROTO).parent / name for name in STUBS]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path)
    sys.exit(0)
