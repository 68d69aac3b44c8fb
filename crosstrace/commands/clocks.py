"""`crosstrace clocks`: each node's clock model, as the report's `clocks` section has it."""
import json
import sys

from ..collector.report import analyse_store, clocks_section
from ..collector.store import Store


def register(sub) -> None:
    p = sub.add_parser("clocks", help="show each node's clock offset, drift and error bound",
                       description="Fit every node's clock model from its samples (two-way probes over UDP "
                                   "and gRPC, RPC piggyback, NTP, PTP), refine it with the trace's causality, "
                                   "and print offset = node clock - collector clock, drift, error bound, "
                                   "sources and flags.")
    p.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    p.add_argument("--json", action="store_true", help="print the clocks section as JSON")
    p.set_defaults(func=run)


def clocks(store_path: str) -> tuple[dict, dict]:
    """(clocks section, summary of the causality check) for a store."""
    store = Store(store_path, readonly=True)
    try:
        alignment = analyse_store(store).alignment
    finally:
        store.close()
    return clocks_section(alignment.models), {"facts": alignment.facts, "violations": alignment.violations}


def run(args) -> int:
    section, check = clocks(args.store)
    if args.json:
        json.dump({"clocks": section, "causality": check}, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    from ..collector.views.terminal import fmt_ns

    table = Table(title="clocks (offset = node clock - collector clock)", title_justify="left")
    for col in ("node", "offset", "drift", "error bound", "drift bound", "samples", "sources", "flags"):
        table.add_column(col, justify="left" if col in ("node", "sources", "flags") else "right")
    for node, c in section.items():
        drift_bound = "-" if c["drift_bound_ppm"] is None else f"{c['drift_bound_ppm']:.3f} ppm"
        table.add_row(node, fmt_ns(c["offset_ns"]), f"{c['drift_ppm']:+.3f} ppm", fmt_ns(c["error_bound_ns"]),
                      drift_bound, str(c["samples"]), ", ".join(c["sources"]) or "-", ", ".join(c["flags"]) or "-")
    console = Console()
    console.print(table)
    verdict = ("consistent" if not check["violations"]
               else f"[bold red]{check['violations']} still broken: a clock inconsistency[/]")
    console.print(f"causality: {check['facts']:,} facts from the trace; {verdict}")
    return 0
