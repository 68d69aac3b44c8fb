"""`crosstrace clocks`: each node's clock model, as the report's `clocks` section has it."""
import json
import sys

from ..collector.report import analyse_store, clocks_section, open_store
from .report import add_window


def register(sub) -> None:
    p = sub.add_parser("clocks", help="show each node's clock offset, drift and error bound",
                       description="Fit every node's clock model from its samples (two-way probes over UDP "
                                   "and gRPC, RPC piggyback, NTP, PTP), refine it with the trace's causality, "
                                   "and print offset = node clock - collector clock, drift, error bound, "
                                   "sources and flags.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--json", action="store_true", help="print the clocks section as JSON")
    add_window(p)
    p.set_defaults(func=run)


def clocks(store_path: str, last: int | None = None) -> tuple[dict, dict]:
    """(clocks section, summary of the causality check) for a store (its last `last` ns of data)."""
    store = open_store(store_path, last)
    try:
        alignment = analyse_store(store).alignment
    finally:
        store.close()
    return clocks_section(alignment.models), {"facts": alignment.facts, "violations": alignment.violations}


def run(args) -> int:
    section, check = clocks(args.store, args.last)
    if args.json:
        json.dump({"clocks": section, "causality": check}, sys.stdout, indent=1)
        print()
        return 0
    from ..collector.views.terminal import render_clocks, wide_console

    console = wide_console()
    render_clocks(section, console, rows=None, detail=True)
    verdict = ("consistent" if not check["violations"]
               else f"[bold red]{check['violations']} still broken: a clock inconsistency[/]")
    console.print(f"causality: {check['facts']:,} facts from the trace; {verdict}")
    return 0
