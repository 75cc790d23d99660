"""Regenerates corral/_proto from the repository's proto/ with grpcio-tools.

Run from anywhere: `python sdk/python/generate.py`. The messages are kept
private (corral._proto); the protobuf package stays corral.v1, so the wire
names are the worker's own. tests/test_proto.py fails when they are stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent.parent / "proto" / "corral" / "v1" / "worker.proto"
OUT = HERE / "corral" / "_proto"


def generate(out: Path) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as tmp:
        # Placed as corral/_proto/worker.proto, so the generated module
        # knows itself as corral._proto.worker_pb2.
        src = Path(tmp) / "corral" / "_proto"
        src.mkdir(parents=True)
        shutil.copy(PROTO, src / "worker.proto")
        gen = Path(tmp) / "out"
        gen.mkdir()
        code = protoc.main(
            [
                "protoc",
                f"-I{tmp}",
                f"--python_out={gen}",
                f"--pyi_out={gen}",
                str(src / "worker.proto"),
            ]
        )
        if code != 0:
            raise SystemExit(f"protoc failed ({code})")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("worker_pb2.py", "worker_pb2.pyi"):
            shutil.copy(gen / "corral" / "_proto" / name, out / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
