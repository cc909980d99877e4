"""Regenerate pegaflow/proto/*_pb2*.py from proto/*.proto.

Uses grpcio-tools 1.71.x on purpose: it emits protobuf 5.29 gencode, which every
runtime in vLLM's allowed range (>=5.29.6, 6.33.5+, 7.x) accepts; newer tools
emit gencode that refuses older runtimes. The import of the generated gRPC module
is rewritten to a relative one so the package works wherever it is installed.

    python scripts/gen_proto.py          # write
    python scripts/gen_proto.py --check  # exit 1 if the files are stale
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "pegaflow" / "proto"
REQUIRED_TOOLS = "1.71."


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if not version.startswith(REQUIRED_TOOLS):
        sys.exit(f"grpcio-tools {REQUIRED_TOOLS}x required, found {version}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        rc = protoc.main(
            [
                "protoc",
                f"-I{PROTO_DIR}",
                f"-I{include}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(proto),
            ]
        )
        if rc != 0:
            sys.exit(f"protoc failed on {proto.name}")
    for grpc_file in out.glob("*_pb2_grpc.py"):
        text = grpc_file.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        grpc_file.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}
    if args.check:
        stale = [
            name
            for name, text in fresh.items()
            if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != text
        ]
        if stale:
            print(f"stale generated files: {', '.join(sorted(stale))}")
            return 1
        return 0
    for name, text in fresh.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {', '.join(sorted(fresh))} to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
