"""`crosstrace report` and `crosstrace export`: read a store, analyse, write views."""
import argparse
import os
import sys

from ..collector.durations import parse_ns
from ..collector.wording import counted
from ..proto.endpoint import target_of


def progress(message: str) -> None:
    print(f"crosstrace: {message}", file=sys.stderr, flush=True)


def register(sub) -> None:
    p = sub.add_parser("report", help="analyse a store and print the report",
                       description="Align clocks, stitch every trace, find critical paths and attribute "
                                   "latency; print a summary, and write the JSON report with --json.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--json", metavar="FILE", help="write the machine-readable report here ('-' for stdout)")
    add_trace(p, analysed=True)
    p.add_argument("--limit", type=positive, default=10, help="traces shown in the terminal (default %(default)s)")
    p.add_argument("--html", metavar="FILE",
                   help="write one self-contained HTML page: timelines of the slowest and a typical trace "
                        "(nodes as lanes, critical path highlighted), attribution per trace and per rank, budgets")
    p.add_argument("--budget", metavar="FILE",
                   help="check these latency budgets (TOML; see `crosstrace budget check --help`) and "
                        "include them in the report; the exit status stays 0 whatever they say: gate CI "
                        "with `crosstrace budget check`")
    add_window(p)
    p.set_defaults(func=run_report)

    p = sub.add_parser("export", help="write spans on the aligned timeline for other tools",
                       description="Export the store's spans, mapped onto the aligned timeline.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--jsonl", metavar="FILE",
                   help="one JSON object per span ('-' for stdout): trace_id, span_id, parent_span_id, name, "
                        "kind, node_id, rank, start_ns, end_ns, error_bound_ns, attributes, status, "
                        "status_message, events, links")
    p.add_argument("--perfetto", metavar="FILE",
                   help="Chrome trace-event JSON ('-' for stdout) for Perfetto UI (ui.perfetto.dev) or "
                        "chrome://tracing: one process per node, flow arrows for send/recv, RPCs and collective "
                        "joins, and a critical-path track")
    p.add_argument("--otlp", metavar="ENDPOINT",
                   help="send the spans to an OTLP/gRPC backend (OpenTelemetry Collector, Jaeger, Tempo): "
                        "host:port or http://host:port in plaintext, https://host:port over TLS; times are "
                        "Unix epoch on the aligned timeline, each span with crosstrace.error_bound_ns")
    p.add_argument("--otlp-header", action="append", default=[], metavar="KEY=VALUE",
                   help="metadata on every OTLP request, e.g. 'authorization=Bearer T' (repeatable)")
    p.add_argument("--otlp-ca", metavar="PEM",
                   help="CA bundle that signed the backend's certificate (means TLS, as https:// does)")
    add_trace(p, analysed=False)
    add_window(p)
    p.set_defaults(func=run_export)


def check_writable(*paths: str | None) -> None:
    """Say now, before minutes of analysis, that an output cannot be written."""
    for path in paths:
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"cannot write {path}: it is a folder")
        if not os.path.isdir(folder):
            raise ValueError(f"cannot write {path}: there is no folder {folder}")
        if not os.access(path if os.path.exists(path) else folder, os.W_OK):
            raise ValueError(f"cannot write {path}: permission denied")


def run_report(args) -> int:
    from ..collector.report import analyse_report
    from ..collector.views import terminal

    check_writable(args.json, args.html)
    report, analysed, attributed = analyse_report(args.store, args.trace, None if args.json == "-" else progress,
                                                  budget_file=args.budget, last=args.last)
    if args.html:
        from ..collector.views import html

        html.write(args.html, report, analysed, attributed)
        progress(f"wrote {args.html}")
    if args.json:
        from ..collector.views import report_json

        report_json.write(args.json, report)
        if args.json == "-":
            return 0
        progress(f"wrote {args.json}")
    terminal.render(report, limit=args.limit)
    return 0


def run_export(args) -> int:
    from ..collector import report as report_mod
    from ..collector.views import jsonl, perfetto

    if not (args.jsonl or args.perfetto or args.otlp):
        raise ValueError("nothing to export: give --jsonl FILE, --perfetto FILE and/or --otlp ENDPOINT")
    if args.jsonl == args.perfetto == "-":
        raise ValueError("--jsonl and --perfetto cannot both go to stdout ('-')")
    if (args.otlp_header or args.otlp_ca) and not args.otlp:
        raise ValueError(f"{'--otlp-header' if args.otlp_header else '--otlp-ca'} goes with --otlp ENDPOINT")
    headers = [_header(h) for h in args.otlp_header]
    if args.otlp:   # before the store is read: a typo failed once the analysis was done
        try:
            target_of(args.otlp)
        except ValueError as exc:
            raise ValueError(f"--otlp {args.otlp}: {exc}") from None
    check_writable(args.jsonl, args.perfetto)
    store = report_mod.open_store(args.store, args.last)
    try:
        analysed = report_mod.analyse_store(store, args.trace, progress=progress)
    finally:
        store.close()
    if args.jsonl:
        n = jsonl.write(args.jsonl, analysed)
        progress(f"wrote {counted(n, 'span')} to {_shown(args.jsonl)}")
    if args.perfetto:
        from ..collector import attribution

        attributed = attribution.attribute(analysed.table, analysed.alignment, analysed.matches)
        n = perfetto.write(args.perfetto, analysed, attributed)
        progress(f"wrote {counted(n, 'span')} to {_shown(args.perfetto)} (open it in ui.perfetto.dev or chrome://tracing)")
    if args.otlp:
        export_otlp(args.otlp, analysed, headers, args.otlp_ca)
    return 0


def _shown(path: str) -> str:
    return "stdout" if path == "-" else path


def duration(text: str) -> int:
    """argparse type of a duration such as 90s, 15min, 2h or 7d (collector/durations.py), in
    ns, at most 100 years."""
    value = parse_ns(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15min, 2h or 7d (ns, us, ms, s, "
                                         "min, h or d)")
    if not 0 < value <= 100 * 365 * 86400e9:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 and at most 100 years")
    return round(value)


def add_trace(p, analysed: bool) -> None:
    """--trace; `analysed`: for a report of the traces, which analyses every trace of the
    store (or window) to give them the whole report's numbers (analyse_for_report)."""
    among = ("; it is shown as the whole store's (or --last window's) report has it: every trace there is "
             "analysed" if analysed else "")
    p.add_argument("--trace", action="append", metavar="TRACE_ID",
                   help=f"only this trace: its id or a unique prefix, any case (repeatable){among}")


def add_window(p) -> None:
    p.add_argument("--last", type=duration, metavar="DURATION",
                   help="only the spans that reached the store in its last DURATION of data (90s, 15min, 2h, "
                        "7d): a store kept for weeks costs what the window holds")


def positive(text: str) -> int:
    """argparse type of a count of at least 1 (its name is in argparse's message on a non-number)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--otlp-header expects KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def export_otlp(endpoint: str, analysed, headers, ca) -> None:
    import grpc

    from ..collector.views import otlp

    try:
        result = otlp.send(endpoint, analysed, headers, ca)
    except grpc.RpcError as err:
        raise OSError(f"OTLP export to {endpoint} failed: {err.code().name}: {err.details()}") from None
    progress(f"sent {counted(result.spans, 'span')} to {endpoint} in {counted(result.requests, 'request')}"
             + (f"; the backend rejected {result.rejected:,}" if result.rejected else "")
             + (f"; {counted(result.unplaced, 'span')} of nodes without a clock model left out"
                if result.unplaced else "")
             + (f"; {counted(result.oversize, 'span')} larger than {otlp.MAX_REQUEST_BYTES >> 20} MB left out"
                if result.oversize else ""))
