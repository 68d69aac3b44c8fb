"""The `crosstrace` command line: one module per command in crosstrace/commands/."""
import argparse
import os
import signal
import sys

from . import __version__
from .commands import budget, clocks, collector, demo, report
from .launch import CollectorDidNotStart
from .tracer.provider import hot_path_status

COMMANDS = [demo, collector, report, clocks, budget]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosstrace",
        description="Distributed tracing for multi-node ML jobs and edge-to-cloud inference: "
                    "aligned clocks, end-to-end DAGs, critical paths and latency attribution.",
        epilog="Start with `crosstrace demo`; `crosstrace COMMAND --help` explains each command.")
    parser.add_argument("--version", action="version",
                        version=f"crosstrace {__version__} (tracer hot path: {hot_path_status()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()   # here, where a closed pipe is caught, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_left()
    except (OSError, ValueError, CollectorDidNotStart) as exc:
        print(f"crosstrace: error: {_message(exc)}", file=sys.stderr)
        return 2


def _reader_left() -> int:
    """Output piped into a reader that stopped (`| head`): end quietly, as a program killed
    by SIGPIPE does, with what is left unwritten sent nowhere (else it fails at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _message(exc: Exception) -> str:
    """An OSError about a file as `path: what went wrong`, without its errno."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
