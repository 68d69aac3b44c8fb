"""The report in the terminal (rich tables)."""
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..durations import format_ns, format_within
from ..wording import counted
from .summaries import (CLOCK_ROWS, NODES_LISTED, clocks_to_show, errors_line, format_measured, format_worst,
                        largest_segments, slowest_first, stragglers_line, verdict)

# Every name that comes from the traced program (spans, nodes, traces, budgets, the store's
# path) goes through escape(): rich reads `[...]` as markup, and a module path such as
# `layers[/0]` crashed the report, `fwd[stage1]` lost its brackets.


def wide_console() -> Console:
    """rich's console, 200 columns wide where output goes to a file or a pipe (rich takes 80
    there, and cut the report's tables), unless COLUMNS says otherwise."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return _Console(width=200 if piped else None)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A reader that stopped (`| head`): raised for the command line to end as any
        command does there (rich exits 1 on its own)."""
        self.quiet = True
        raise BrokenPipeError


def render(report: dict, console: Console | None = None, limit: int = 10) -> None:
    console = console or wide_console()
    traces = report["traces"]
    errors = errors_line(traces)
    console.print(f"[bold]crosstrace report[/]  {escape(report['store'])}: {counted(len(traces), 'trace')}, "
                  f"{counted(sum(t['spans'] for t in traces), 'span')}" + (f", [red]{errors}[/]" if errors else ""))
    if traces:
        ordered = slowest_first(traces)
        table = Table(title=f"slowest traces (of {len(traces)})", title_justify="left")
        columns = ("trace", "name", "duration", "spans", "nodes") + (("errors",) if errors else ()) + ("top attribution",)
        for col in columns:
            table.add_column(col, justify="right" if col in ("duration", "spans", "nodes", "errors") else "left")
        for t in ordered[:limit]:
            attribution = sorted(((k, v) for k, v in t["attribution"].items() if v > 0), key=lambda kv: -kv[1])[:3]
            top = ", ".join(f"{k} {format_ns(v)}" for k, v in attribution) or "-"
            cells = [t["trace_id"][:16], escape(t["name"]), format_ns(t["duration_ns"]), str(t["spans"]), str(t["nodes"])]
            if errors:
                cells.append(f"[red]{t['errors']}[/]" if t["errors"] else "0")
            table.add_row(*cells, top)
        console.print(table)
        render_slowest(ordered[0], console)
        render_kinds(report.get("summary", {}), traces, console, limit)
    if report.get("budgets"):
        render_budgets(report["budgets"], len(traces), console)
    render_clocks(report["clocks"], console)
    dropped = sorted(((c, n) for n, c in report["dropped_spans"].items() if c), reverse=True)
    shown = ", ".join(f"{escape(n)}: {c:,}" for c, n in dropped[:NODES_LISTED])
    if len(dropped) > NODES_LISTED:
        shown += f" and {len(dropped) - NODES_LISTED:,} more nodes ({sum(c for c, _ in dropped):,} in all)"
    console.print("dropped spans (tracer queues full or collector unreachable): " + (shown or "none"))
    if report["rejected_spans"]:
        console.print("rejected by the collector: "
                      + ", ".join(f"{r}: {c:,}" for r, c in report["rejected_spans"].items()))
    handovers = report.get("collector_clocks", [])[1:]
    if handovers:
        console.print(f"the store was written on {len(handovers) + 1} collector clocks (the collector's machine "
                      "rebooted, or the store moved): spans on either side of a change are placed relative to "
                      "each other within the wall clock's error, not the clocks' error bounds")
    unmatched = {k: v for k, v in report.get("unmatched", {}).items() if v}
    if unmatched:
        console.print("spans whose partner is missing (lost, sampled out or in flight): "
                      + ", ".join(f"{k}: {v}" for k, v in unmatched.items()))


# A job of thousands of ranks gets the nodes that need a look, not thousands of rows; the
# JSON report and `crosstrace clocks` have them all.
def render_clocks(clocks: dict, console: Console, rows: int | None = CLOCK_ROWS, detail: bool = False) -> None:
    """Every node's clock where they fit in `rows` (None: all); else the flagged ones and
    the widest error bounds first, and a line for the rest. `detail` adds the drift's bound
    and the sources (`crosstrace clocks`)."""
    nodes = clocks_to_show(clocks, rows)
    rest = len(clocks) - len(nodes)
    table = Table(title="clocks (offset = node clock - collector clock)"
                  + (f", {len(nodes)} of {len(clocks):,} nodes: flagged and widest error bounds first" if rest else ""),
                  title_justify="left", caption_justify="left",
                  caption=f"... and {rest:,} more nodes: `crosstrace clocks` or --json" if rest else None)
    columns = [col for col in ("node", "offset", "drift", "error bound", "drift bound", "samples", "sources", "flags")
               if detail or col not in ("drift bound", "sources")]
    for col in columns:
        table.add_column(col, justify="left" if col in ("node", "sources", "flags") else "right")
    for node in nodes:
        c = clocks[node]
        cells = {"node": escape(node), "offset": format_within(c["offset_ns"], c["error_bound_ns"]),
                 "drift": f"{c['drift_ppm']:+.3f} ppm",
                 "error bound": format_ns(c["error_bound_ns"]), "samples": str(c["samples"]),
                 "drift bound": "-" if c["drift_bound_ppm"] is None else f"{c['drift_bound_ppm']:.3f} ppm",
                 "sources": escape(", ".join(c["sources"])) or "-", "flags": escape(", ".join(c["flags"])) or "-"}
        table.add_row(*(cells[col] for col in columns))
    console.print(table)


def render_slowest(trace: dict, console: Console, limit: int = 12) -> None:
    """The slowest trace's critical path (longest segments first), straggler and pipeline."""
    path = Table(title=f"critical path of the slowest trace {trace['trace_id'][:16]} ({format_ns(trace['duration_ns'])}), "
                       f"longest segments", title_justify="left")
    for col in ("category", "node", "span", "duration", "share", "confidence"):
        path.add_column(col, justify="right" if col in ("duration", "share", "confidence") else "left")
    for seg in sorted(trace["critical_path"], key=lambda s: -s["duration_ns"])[:limit]:
        node = f"{seg['from_node']} -> {seg['node']}" if "from_node" in seg else seg["node"]
        path.add_row(seg["category"], escape(node), escape(seg["span"] or "-"), format_ns(seg["duration_ns"]),
                     f"{seg['duration_ns'] / max(trace['duration_ns'], 1):.0%}", f"{seg['confidence']:.2f}")
    console.print(path)
    s = trace.get("straggler")
    if s:
        rank = f" (rank {s['rank']})" if s["rank"] >= 0 else ""
        console.print(f"straggler: {escape(s['node'])}{rank}, busy in {escape(repr(s['span']))}, made others wait "
                      f"{format_ns(s['delay_cost_ns'])} in all")
    p = trace.get("pipeline")
    if p:
        console.print(f"pipeline {escape(str(p['schedule']))}: bubble {p['bubble_fraction']:.1%} measured, "
                      f"{p['ideal_bubble_fraction']:.1%} ideal ({p['ranks']} ranks, {p['microbatches']} microbatches, "
                      f"{p['stages_per_rank']} stage(s) per rank)")


# Category names short enough for a column header.
SHORT = {"network.uplink": "uplink", "network.downlink": "downlink", "host.overhead": "overhead",
         "collective.wait": "coll.wait", "collective.transfer": "coll.xfer", "p2p.transfer": "p2p.xfer",
         "clock.uncertainty": "clock unc."}


def render_kinds(summary: dict, traces: list[dict], console: Console, limit: int = 10, kinds: int = 5,
                 rows: int = 14) -> None:
    """Per kind of trace (same root name): where its critical path goes at p50/p95/p99, by
    segment in path order and by category, then the slowest traces segment by segment."""
    for name, k in sorted(summary.items(), key=lambda kv: -kv[1]["traces"])[:kinds]:
        d = k["duration"]
        table = Table(title=f"{escape(repr(name))}: {counted(k['traces'], 'trace')}, p50 {format_ns(d['p50_ns'])}, p95 {format_ns(d['p95_ns'])}, "
                            f"p99 {format_ns(d['p99_ns'])}", title_justify="left")
        table.add_column("critical path: segment (path order), category")
        for col in ("p50", "p95", "p99", "mean", "share", "on path"):
            table.add_column(col, justify="right", no_wrap=True)
        shown = largest_segments(k["segments"], rows)
        for seg in shown:
            table.add_row(escape(seg["segment"]), *_stat_cells(seg), f"{seg['share']:.0%}", f"{seg['traces']}/{k['traces']}")
        if len(shown) < len(k["segments"]):
            table.add_row(f"... {len(k['segments']) - len(shown)} smaller segments in the JSON report", *[""] * 6)
        table.add_section()
        for category, stats in sorted(k["attribution"].items(), key=lambda kv: -kv[1]["mean_ns"]):
            table.add_row(f"[italic]{category}[/]", *_stat_cells(stats), "", "")
        console.print(table)
        line = stragglers_line(name, k["traces"], traces)
        if line:
            console.print(escape(line))
        if k["traces"] > 1:
            _per_trace(name, k, traces, console, limit)


def _stat_cells(stats: dict) -> list[str]:
    return [format_ns(stats[key]) for key in ("p50_ns", "p95_ns", "p99_ns", "mean_ns")]


def _per_trace(name: str, k: dict, traces: list[dict], console: Console, limit: int) -> None:
    """The slowest traces of a kind, one column per segment (as many as the console fits)."""
    fits = max(1, (console.width - 32) // 12)
    shown = largest_segments(k["segments"], fits if len(k["segments"]) <= fits else fits - 1)
    other = len(shown) < len(k["segments"])
    table = Table(title=f"slowest {escape(repr(name))} traces: critical path per segment", title_justify="left")
    table.add_column("trace", no_wrap=True)
    table.add_column("duration", justify="right", no_wrap=True)
    for seg in shown:
        header = escape("\n".join(x for x in (seg["node"], seg["span"], SHORT.get(seg["category"], seg["category"])) if x))
        table.add_column(header, justify="right", overflow="fold")
    if other:
        table.add_column("other", justify="right")
    mine = slowest_first([t for t in traces if t["name"] == name])[:limit]
    for t in mine:
        values = t.get("segments", {})
        cells = [format_ns(values.get(seg["segment"], 0)) for seg in shown]
        if other:
            cells.append(format_ns(sum(values.values()) - sum(values.get(seg["segment"], 0) for seg in shown)))
        table.add_row(t["trace_id"][:16], format_ns(t["duration_ns"]), *cells)
    console.print(table)


def render_budgets(results: list[dict], n_traces: int, console: Console | None = None) -> None:
    console = console or wide_console()
    table = Table(title=f"budgets ({counted(n_traces, 'trace')})", title_justify="left")
    for col in ("budget", "measured", "limit", "samples", "status", "worst traces"):
        table.add_column(col, justify="right" if col in ("measured", "limit", "samples") else "left")
    styles = {"ok": "[green]ok[/]", "violated": "[bold red]VIOLATED[/]", "no_data": "[red]no data[/]"}
    for r in results:
        worst = format_worst(r)
        label = r["rule"] if r["name"] == r["rule"] else f"{r['name']}: {r['rule']}"
        table.add_row(escape(label), *format_measured(r), str(r["samples"]), styles[r["status"]], worst)
    console.print(table)
    console.print(verdict(results))
