"""The `crosstrace` command line: one module per command in crosstrace/commands/."""
import argparse
import sys

from . import __version__
from .commands import budget, clocks, collector, demo, report

COMMANDS = [demo, collector, report, clocks, budget]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosstrace",
        description="Distributed tracing for multi-node ML jobs and edge-to-cloud inference: "
                    "aligned clocks, end-to-end DAGs, critical paths and latency attribution.",
        epilog="Start with `crosstrace demo`; `crosstrace COMMAND --help` explains each command.")
    parser.add_argument("--version", action="version", version=f"crosstrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:
        print(f"crosstrace: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
