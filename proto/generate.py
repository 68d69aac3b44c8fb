"""Regenerate the Python code for proto/*.proto: `python proto/generate.py`.

grpc_tools writes absolute imports (`from crosstrace.v1 import ...`) that would
resolve against the `crosstrace` package itself; they are rewritten as relative.
`--check` exits 1 when the committed files differ from what would be generated.
"""
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = sorted(HERE.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *map(str, PROTOS)]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    for path in out_dir.rglob("*_grpc.py"):
        text = re.sub(r"^from crosstrace\.v1 import", "from . import", path.read_text(), flags=re.M)
        path.write_text(text)


def generated_files(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*_pb2*.py*"))}


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            generate(pathlib.Path(tmp))
            fresh = generated_files(pathlib.Path(tmp))
        committed = generated_files(HERE)
        stale = sorted(name for name in fresh.keys() | committed.keys()
                       if fresh.get(name) != committed.get(name))
        if stale:
            print("generated code is stale; run `python proto/generate.py`:", *stale, sep="\n  ")
            return 1
        print("generated code matches the .proto files")
        return 0
    generate(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
