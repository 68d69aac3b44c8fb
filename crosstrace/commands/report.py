"""`crosstrace report` and `crosstrace export`: read a store, analyse, write views."""
import json
import sys


def progress(message: str) -> None:
    print(f"crosstrace: {message}", file=sys.stderr, flush=True)


def register(sub) -> None:
    p = sub.add_parser("report", help="analyse a store and print the report",
                       description="Align clocks, stitch every trace, find critical paths and attribute "
                                   "latency; print a summary, and write the JSON report with --json.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--json", metavar="FILE", help="write the machine-readable report here ('-' for stdout)")
    p.add_argument("--trace", action="append", metavar="TRACE_ID", help="only this trace (repeatable)")
    p.add_argument("--limit", type=int, default=10, help="traces shown in the terminal (default %(default)s)")
    p.set_defaults(func=run_report)

    p = sub.add_parser("export", help="write spans on the aligned timeline for other tools",
                       description="Export the store's spans, mapped onto the aligned timeline.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--jsonl", metavar="FILE", required=True,
                   help="one JSON object per span: trace_id, span_id, parent_span_id, name, kind, node_id, "
                        "rank, start_ns, end_ns, error_bound_ns, attributes")
    p.add_argument("--trace", action="append", metavar="TRACE_ID", help="only this trace (repeatable)")
    p.set_defaults(func=run_export)


def build_report(store_path: str, trace_ids=None, quiet: bool = False):
    from ..collector import report as report_mod
    from ..collector.store import Store

    store = Store(store_path, readonly=True)
    try:
        analysed = report_mod.analyse_store(store, trace_ids, progress=None if quiet else progress)
        return report_mod.build(store, analysed), analysed
    finally:
        store.close()


def run_report(args) -> int:
    from ..collector.views import terminal

    report, _ = build_report(args.store, args.trace, quiet=args.json == "-")
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
        progress(f"wrote {args.json}")
    terminal.render(report, limit=args.limit)
    return 0


def run_export(args) -> int:
    from ..collector import report as report_mod
    from ..collector.store import Store
    from ..collector.views import jsonl

    store = Store(args.store, readonly=True)
    try:
        analysed = report_mod.analyse_store(store, args.trace, progress=progress)
    finally:
        store.close()
    n = jsonl.write(args.jsonl, analysed)
    progress(f"wrote {n:,} spans to {args.jsonl}")
    return 0
