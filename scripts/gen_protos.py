"""Generate Pagoda's Python protobuf and gRPC code from protos/pagoda/v1/*.proto.

    python scripts/gen_protos.py --out services/pb     # regenerate (what `make protos` runs)
    python scripts/gen_protos.py --check services/pb   # exit 1 if services/pb is stale

Output is flat (services/pb/common_pb2.py, services/pb/worker_pb2_grpc.py, ... and .pyi stubs):
protoc writes `from pagoda.v1 import common_pb2`, which is rewritten to
`from services.pb import common_pb2`, so the generated code needs no path tricks. The same
grpcio-tools version (pinned) gives the same bytes, which is what makes --check meaningful.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("pagoda") / "v1"
PYTHON_PACKAGE = "services.pb"
# Hand-written files that live beside the generated ones.
NOT_GENERATED = frozenset({"__init__.py", "__pycache__"})

_IMPORT_RE = re.compile(r"^from pagoda\.v1 import (\w+_pb2)\b", re.MULTILINE)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto files to compile, relative to proto_root, in a fixed order."""
    files = sorted((proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    return [f.relative_to(proto_root) for f in files]


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto into out_dir (flat, imports rewritten); return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="pagoda-protoc-") as raw:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={proto_root}",
            f"--proto_path={well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(p.as_posix() for p in proto_files(proto_root)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed (see its messages above)")
        written = []
        for src in sorted((Path(raw) / PROTO_PACKAGE_DIR).iterdir()):
            dst = out_dir / src.name
            dst.write_text(_rewrite_imports(src.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(dst)
    return written


def _rewrite_imports(source: str) -> str:
    return _IMPORT_RE.sub(rf"from {PYTHON_PACKAGE} import \1", source)


def _generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name not in NOT_GENERATED}


def check(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate into a temporary directory and compare with out_dir byte for byte.

    Returns one line per problem ("stale: x", "missing: x", "extra: x"); empty when up to date.
    """
    if not out_dir.is_dir():
        return [f"missing: {out_dir} (no such directory)"]
    with tempfile.TemporaryDirectory(prefix="pagoda-protos-check-") as tmp:
        fresh_dir = Path(tmp)
        generate(fresh_dir, proto_root)
        fresh, current = _generated_names(fresh_dir), _generated_names(out_dir)
        problems = [f"missing: {name}" for name in sorted(fresh - current)]
        problems += [f"extra: {name}" for name in sorted(current - fresh)]
        problems += [
            f"stale: {name}"
            for name in sorted(fresh & current)
            if not filecmp.cmp(fresh_dir / name, out_dir / name, shallow=False)
        ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, metavar="DIR", help="regenerate the code into DIR")
    mode.add_argument("--check", type=Path, metavar="DIR", help="exit 1 if DIR differs from a fresh generation")
    args = parser.parse_args(argv)

    if args.out is not None:
        for path in generate(args.out):
            print(f"wrote {path}")
        return 0
    problems = check(args.check)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{args.check} is out of date with protos/: run `make protos`", file=sys.stderr)
        return 1
    print(f"{args.check} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
