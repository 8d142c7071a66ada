"""Generate the Python gRPC package from protos/ into services/tether/v1 (imported as tether.v1).

Run: python scripts/gen_protos.py [--check]
--check regenerates into a temporary folder and exits 1 when the committed files differ.
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
PROTOS = ROOT / "protos"
TARGET = ROOT / "services" / "tether" / "v1"


def generate(out: Path) -> None:
    # protoc writes tether/v1/*_pb2.py under --python_out; imports read "from tether.v1 import ...",
    # which resolves because services/tether is the `tether` package.
    work = out / "gen"
    work.mkdir(parents=True)
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={work}",
        f"--pyi_out={work}",
        f"--grpc_python_out={work}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen = work / "tether" / "v1"
    (gen / "__init__.py").write_text(
        '"""Generated from protos/tether/v1 by scripts/gen_protos.py. Do not edit."""\n'
    )
    shutil.move(str(gen), str(out / "v1"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "v1"
        if args.check:
            cmp = filecmp.dircmp(fresh, TARGET)
            stale = cmp.diff_files + cmp.left_only + cmp.right_only
            stale = [s for s in stale if s != "__pycache__"]
            if stale:
                print(f"generated protos are stale: {stale}; run python scripts/gen_protos.py")
                return 1
            print("protos up to date")
            return 0
        if TARGET.exists():
            shutil.rmtree(TARGET)
        shutil.copytree(fresh, TARGET)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
