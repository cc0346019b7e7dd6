"""Regenerate ``swarm/proto/swarm_pb2*.py`` from ``proto/swarm.proto``.

The generated modules are committed (one copy, made one way); ``tests/test_proto.py`` checks that
running this script changes nothing. Run it after editing the .proto:
``python -m swarm.proto.generate`` (needs the pinned ``grpcio-tools`` from the test extra).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write swarm_pb2.py and swarm_pb2_grpc.py into ``out_dir``; return their paths."""
    from grpc_tools import protoc

    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / "swarm.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc exited with {code} while compiling {PROTO_DIR / 'swarm.proto'}")
    grpc_module = out_dir / "swarm_pb2_grpc.py"
    # protoc emits an absolute import; make it package-relative so the module works as swarm.proto.*
    text = re.sub(
        r"^import swarm_pb2 as", "from . import swarm_pb2 as", grpc_module.read_text(), flags=re.M
    )
    grpc_module.write_text(text)
    return [out_dir / "swarm_pb2.py", grpc_module]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(f"wrote {path}")
