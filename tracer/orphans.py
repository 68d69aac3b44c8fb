"""A forked child's last batches, sent by a process of their own where the parent's tracer
no longer takes them (it shut down first).

The child must not open a gRPC channel itself: gRPC skips its fork handlers while the
parent has a call open (its export stream always has), and a channel of the child's own
then aborted in gRPC's poller now and then (3 of 20 runs of a test whose children mostly
sent their own). A new interpreter (fork and exec) has no such state. It gets the child's
configuration and batches on its stdin, sends each batch under its own (session, seq), as
a relay does, and exits 0 once the collector has acked them all (3 where it has not).

    python -P -m crosstrace.tracer.orphans TIMEOUT_S < records
"""
import dataclasses
import json
import os
import struct
import subprocess
import sys

_LENGTH = struct.Struct("<I")
_NOT_ACKED = 3


def send(cfg, batches: list[bytes], timeout_s: float) -> bool | None:
    """Whether the collector acked `batches` (serialized SpanBatches) within timeout_s,
    sent from a new process; None where that process could not run. The configuration goes
    on stdin, not the command line, where any user could read its token."""
    try:
        config = json.dumps(dataclasses.asdict(cfg), default=_plain).encode()
    except (TypeError, ValueError):
        return None
    payload = b"".join(_LENGTH.pack(len(record)) + record for record in (config, *batches))
    # -P: the installed crosstrace, not a `crosstrace` folder where the program runs
    command = [sys.executable, "-P", "-m", "crosstrace.tracer.orphans", str(timeout_s)]
    try:
        done = subprocess.run(command, input=payload, capture_output=True, timeout=timeout_s + 10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode:   # what went wrong, as the sender said it (the collector out of reach, say)
        sys.stderr.write(done.stderr.decode(errors="replace")[-2000:])
    if done.returncode not in (0, _NOT_ACKED):   # it did not get to send (an import error, say)
        return None
    return done.returncode == 0


def _plain(value):
    """A configuration value as JSON has it: a path as text, a numpy number as Python's."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} in the configuration")


def _records(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        (n,) = _LENGTH.unpack_from(data, at)
        out.append(data[at + 4:at + 4 + n])
        at += 4 + n
    return out


def main() -> int:
    from ..proto import pb
    from .config import Config
    from .exporter import Exporter

    timeout_s = float(sys.argv[1])
    config, *batches = _records(sys.stdin.buffer.read())
    exporter = Exporter.forwarding(Config(**json.loads(config)), forked=True)
    for data in batches:
        exporter.forward(pb.SpanBatch.FromString(data))
    return 0 if exporter.shutdown(timeout_s) else _NOT_ACKED


if __name__ == "__main__":
    sys.exit(main())
