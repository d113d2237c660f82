"""Regenerate ``backend_pb2.py`` / ``backend_pb2_grpc.py`` from ``backend.proto`` (LocalAI's proto, verbatim).

    python -m app.localai.protogen            # rewrites the committed modules beside this file
    python -m app.localai.protogen OUT_DIR    # writes them to OUT_DIR (the tests compare the two)

``grpc_tools.protoc`` (package ``grpcio-tools``, a test/dev dependency, never needed at run time) writes
``import backend_pb2 as backend__pb2`` into the gRPC module: a top-level import that only works when the
folder is on ``sys.path``. :func:`fix_import` makes it the package-relative ``from . import backend_pb2``.

The generated modules carry version floors: ``backend_pb2`` needs a protobuf runtime at least as new as
the protoc that generated it ("Protobuf Python Version" in its header) and ``backend_pb2_grpc`` needs
grpcio at least as new as grpcio-tools (``GRPC_GENERATED_VERSION``). Regenerate with the OLDEST
grpcio-tools the deployments should support, and keep the LocalAI packaging's requirements in step.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "backend.proto"
MODULES = ("backend_pb2.py", "backend_pb2_grpc.py")
GENERATED_IMPORT = "import backend_pb2 as backend__pb2"
PACKAGE_IMPORT = "from . import backend_pb2 as backend__pb2"


def fix_import(source: str) -> str:
    """The gRPC module with its import of ``backend_pb2`` made package-relative (exactly one occurrence)."""
    lines = source.split("\n")
    hits = [i for i, line in enumerate(lines) if line == GENERATED_IMPORT]
    if len(hits) != 1:
        raise RuntimeError(f"expected one line {GENERATED_IMPORT!r} in the generated gRPC module, found {len(hits)}")
    lines[hits[0]] = PACKAGE_IMPORT
    return "\n".join(lines)


def generate(out_dir: str | Path) -> list[Path]:
    """Run protoc on ``backend.proto`` into ``out_dir`` and fix the import; returns the two paths."""
    from grpc_tools import protoc  # grpcio-tools: a build tool, imported only here

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "backend.proto"           # compiled as "backend.proto": the descriptor's file name
        shutil.copyfile(PROTO, src)
        include = str(Path(protoc.__file__).parent / "_proto")   # google/protobuf/*.proto
        rc = protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", str(src)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc}")
        grpc_module = Path(tmp) / "backend_pb2_grpc.py"
        grpc_module.write_text(fix_import(grpc_module.read_text(encoding="utf-8")), encoding="utf-8")
        paths = []
        for name in MODULES:
            shutil.copyfile(Path(tmp) / name, out / name)
            paths.append(out / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else HERE
    for path in generate(out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
