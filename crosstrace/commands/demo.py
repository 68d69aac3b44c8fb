"""`crosstrace demo`: the main job, end to end on this machine."""
import argparse
import signal
import statistics
import sys

from rich.markup import escape
from rich.table import Table

from ..collector.durations import format_ns, format_within
from ..collector.views import terminal
from ..collector.views.summaries import stragglers
from ..demo import WORKLOADS
from .report import positive


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a traced multi-process system here and print its report",
                       description="Start a collector and traced worker processes with different simulated "
                                   "clocks on this machine, then analyse what they recorded.")
    p.add_argument("--out", default="crosstrace-demo", help="output folder; each run replaces its store and files (default ./%(default)s)")
    p.add_argument("--requests", type=positive, default=20, help="requests in the RPC workload (default %(default)s)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), type=_workloads,
                   help="comma-separated, from: " + "; ".join(f"{name} ({what})" for name, (_, _, what)
                                                               in WORKLOADS.items()) + " (default: all)")
    p.set_defaults(func=run)


def _workloads(text: str) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))   # each once, in order
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(WORKLOADS)}")
    return names


def run(args) -> int:
    from ..demo import run as run_demo

    from ..demo import injected_offset_at

    console = terminal.wide_console()
    say = lambda m: console.print(f"[dim]demo:[/] {escape(m)}")   # noqa: E731
    # SIGTERM, and SIGHUP (the terminal closed, an ssh session lost), end the demo as Ctrl-C does:
    # through the `finally`s that stop the workers and the collector, which run in sessions of
    # their own and would not see the hangup.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    try:
        report = run_demo(args.out, requests=args.requests, workloads=args.workloads, say=say)
    except (KeyboardInterrupt, SystemExit):
        say("interrupted; the workers and the collector are stopped")
        raise
    terminal.render(report, console)
    truth, epoch = report["demo"]["injected_clocks"], report["demo"]["clock_epoch_ns"]
    table = Table(title="clock recovery, both at the same instant: injected (never sent) vs. recovered from "
                        "clock samples; error = recovered - injected, within ± bound", title_justify="left")
    for col in ("node", "injected offset", "recovered", "error", "bound", "injected drift", "recovered drift"):
        table.add_column(col, justify="left" if col == "node" else "right")
    for node, clock in truth.items():
        got = report["clocks"].get(node)
        if got is None:
            continue
        injected = injected_offset_at(clock, epoch, got["at_local_ns"])
        bound = got["error_bound_ns"]
        table.add_row(node, format_within(injected, bound), format_within(got["offset_ns"], bound),
                      format_ns(got["offset_ns"] - injected), format_ns(got["error_bound_ns"]),
                      f"{clock['drift_ppm']:+.1f} ppm", _drift(got))
    console.print(table)
    findings = Table(title="workloads: what was injected vs. what the analysis found", title_justify="left")
    for col in ("workload", "injected", "found"):
        findings.add_column(col)
    for row in workload_findings(report):
        findings.add_row(*row)
    console.print(findings)
    files = report["demo"]["files"]
    console.print(escape(f"wrote {files['report_json']} (the whole report), {files['html']} (open it in a browser) "
                         f"and {files['perfetto']} (open it in ui.perfetto.dev)\n"
                         f"and more from the store: crosstrace report --store {report['store']} --limit 30"))
    return 0


def workload_findings(report: dict) -> list[tuple[str, str, str]]:
    """One row per workload: its injected fault or delay next to the analysis' finding."""
    injected, summary, rows = report["demo"]["workloads"], report.get("summary", {}), []
    traces = report["traces"]
    if "rpc" in injected:
        chain = [t for t in traces if {"frontend", "gateway", "model"} <= set(t["per_rank"])]
        rows.append(("rpc", f"{injected['rpc']['requests']} requests frontend -> gateway -> model, three clocks",
                     f"{len(chain)} traces across the three nodes"))
    if "edge" in injected:
        e = injected["edge"]
        legs = summary.get("edge-request", {}).get("attribution", {})
        found = ", ".join(f"{leg} p50 {format_ns(legs[leg]['p50_ns'])}" for leg in
                          ("network.uplink", "network.downlink") if leg in legs)
        rows.append(("edge", f"link {e['up_ms']} ms up, {e['down_ms']} ms down (±{e['jitter_ms']} ms); "
                             f"edge clock {e['edge_offset_ns'] / 1e6:+.0f} ms", found or "no edge requests"))
    if "ddp" in injected:
        d = injected["ddp"]
        steps = [t for t in traces if t["name"] == "ddp-step"]
        named = stragglers(steps, "ddp-step")
        top, times = named.most_common(1)[0] if named else (None, 0)
        waits = [t["per_rank"][n]["attribution"].get("collective.wait", 0) for t in steps
                 for n in t["per_rank"] if n != top]
        found = (f"straggler {top} in {times} of {len(steps)} steps; the other ranks' "
                 f"collective.wait median {format_ns(statistics.median(waits))}" if top else "no straggler")
        rows.append(("ddp", f"{d['straggler_node']} sleeps {d['straggle_ms']} ms at the end of its {d['straggler_span']} "
                            "(before backward)", found))
    if "pipeline" in injected:
        p = injected["pipeline"]
        fractions = [t["pipeline"]["bubble_fraction"] for t in traces
                     if t["name"] == "pipeline-step" and t.get("pipeline")]
        found = f"bubble fraction median {statistics.median(fractions):.2f}" if fractions else "no pipeline steps"
        rows.append(("pipeline", f"{p['schedule']}, {p['stages']} stages, {p['microbatches']} microbatches: "
                                 f"ideal bubble {p['ideal_bubble_fraction']:.2f}", found))
    return rows


def _drift(clock: dict) -> str:
    """The recovered drift with its bound; a run too short to tell drift from noise says so."""
    bound = clock["drift_bound_ppm"]          # None: unbounded (too few samples apart)
    if bound is None or bound > 100:
        first, last = clock.get("sampled_local_ns") or (0, 0)
        return f"unresolved ({(last - first) / 1e9:.1f} s of samples)"
    return f"{clock['drift_ppm']:+.2f} ± {bound:.2f} ppm"
