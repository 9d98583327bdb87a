"""Generate the Python modules of the KServe v2 gRPC protocol (Triton's `grpc_service.proto` and
`model_config.proto`, vendored with their BSD licence in server/protos/) with grpcio-tools:

    python -m tools.grpc_protos            # writes server/protos/*_pb2.py(i), *_pb2_grpc.py
    python -m tools.grpc_protos --check    # exit 1 if the committed modules differ from the protos

The modules are committed, so the server needs only grpcio and protobuf at run time; protoc's
top-level imports (`import model_config_pb2`) become package imports.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "server" / "protos"
SOURCES = ("model_config.proto", "grpc_service.proto")
PACKAGE = "server.protos"


def generate() -> dict[str, str]:
    """The generated modules' (and their type stubs') texts by file name."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev extra only: the modules are committed

    with tempfile.TemporaryDirectory() as out:
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *(str(PROTOS / s) for s in SOURCES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(SOURCES)}")
        texts = {}
        for path in sorted(Path(out).glob("*.py*")):
            if path.name == "model_config_pb2_grpc.py":
                continue  # no service in it
            texts[path.name] = re.sub(
                r"^import (\w+_pb2) as", rf"from {PACKAGE} import \1 as", path.read_text(), flags=re.M
            )
        return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    texts = generate()
    if args.check:
        stale = [name for name, text in texts.items() if (PROTOS / name).read_text() != text]
        for name in stale:
            print(f"server/protos/{name} differs from what the protos generate", file=sys.stderr)
        return 1 if stale else 0
    for name, text in texts.items():
        (PROTOS / name).write_text(text)
        print(f"wrote server/protos/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
