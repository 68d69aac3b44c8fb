"""The committed generated code matches the .proto files (regenerate: python proto/generate.py)."""
import subprocess
import sys

from .conftest import REPO


def test_generated_code_matches_proto_files():
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
