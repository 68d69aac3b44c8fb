import contextlib
import sys


def open_output(path: str):
    """The binary file a view is written to; '-' is stdout (left open)."""
    return contextlib.nullcontext(sys.stdout.buffer) if path == "-" else open(path, "wb")
