"""The report in the terminal (rich tables)."""
from rich.console import Console
from rich.table import Table


def fmt_ns(ns) -> str:
    if ns is None:
        return "-"
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}" if abs(ns) < 100 * scale else f"{ns / scale:.0f} {unit}"
    return f"{ns:.0f} ns"


def render(report: dict, console: Console | None = None, limit: int = 10) -> None:
    console = console or Console()
    traces = report["traces"]
    console.print(f"[bold]crosstrace report[/]  {report['store']}: {len(traces)} traces, "
                  f"{sum(t['spans'] for t in traces):,} spans")
    if traces:
        table = Table(title=f"slowest traces (of {len(traces)})", title_justify="left")
        for col in ("trace", "name", "duration", "spans", "nodes", "top attribution"):
            table.add_column(col, justify="right" if col in ("duration", "spans", "nodes") else "left")
        for t in sorted(traces, key=lambda t: -t["duration_ns"])[:limit]:
            attribution = sorted(t["attribution"].items(), key=lambda kv: -kv[1])[:3]
            top = ", ".join(f"{k} {fmt_ns(v)}" for k, v in attribution) or "-"
            table.add_row(t["trace_id"][:16], t["name"], fmt_ns(t["duration_ns"]), str(t["spans"]),
                          str(t["nodes"]), top)
        console.print(table)
    clocks = Table(title="clocks (offset = node clock - reference)", title_justify="left")
    for col in ("node", "offset", "drift", "error bound", "samples", "flags"):
        clocks.add_column(col, justify="left" if col in ("node", "flags") else "right")
    for node, c in report["clocks"].items():
        clocks.add_row(node, fmt_ns(c["offset_ns"]), f"{c['drift_ppm']:+.3f} ppm", fmt_ns(c["error_bound_ns"]),
                       str(c["samples"]), ", ".join(c["flags"]) or "-")
    console.print(clocks)
    dropped = {n: c for n, c in report["dropped_spans"].items() if c}
    console.print("dropped spans (tracer queues full or collector unreachable): "
                  + (", ".join(f"{n}: {c:,}" for n, c in dropped.items()) if dropped else "none"))
    if report["rejected_spans"]:
        console.print("rejected by the collector: "
                      + ", ".join(f"{r}: {c:,}" for r, c in report["rejected_spans"].items()))
    unmatched = {k: v for k, v in report.get("unmatched", {}).items() if v}
    if unmatched:
        console.print("spans whose partner is missing (lost, sampled out or in flight): "
                      + ", ".join(f"{k}: {v}" for k, v in unmatched.items()))
