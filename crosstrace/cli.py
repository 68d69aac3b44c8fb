"""The `crosstrace` command line."""
import argparse
import sys

from . import __version__


def _collector(args) -> int:
    from .collector_main import run_collector

    return run_collector(args.listen, args.store, sync=args.sync, quiet=args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosstrace",
        description="Distributed tracing for multi-node ML jobs and edge-to-cloud inference: "
                    "aligned clocks, end-to-end DAGs, critical paths and latency attribution.",
        epilog="Start with `crosstrace demo`; `crosstrace COMMAND --help` explains each command.")
    parser.add_argument("--version", action="version", version=f"crosstrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("collector", help="run a collector: gRPC server + durable store",
                       description="Receive spans and clock samples from tracers over gRPC and store them "
                                   "durably (SQLite, WAL). Runs until SIGTERM or Ctrl-C.")
    p.add_argument("--listen", default="127.0.0.1:4327",
                   help="host:port to listen on (default %(default)s; port 0 picks a free one)")
    p.add_argument("--store", required=True, help="path of the store file (created if missing)")
    p.add_argument("--sync", choices=("normal", "full"), default="normal",
                   help="normal: an acked batch survives the collector being killed; full: also a "
                        "power loss (an fsync per commit)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_collector)
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
