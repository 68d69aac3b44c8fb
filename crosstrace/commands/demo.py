"""`crosstrace demo`: the main job, end to end on this machine."""
from rich.console import Console
from rich.table import Table


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a traced multi-process system here and print its report",
                       description="Start a collector and traced worker processes with different simulated "
                                   "clocks on this machine, then analyse what they recorded.")
    p.add_argument("--out", default="crosstrace-demo", help="output folder (default ./%(default)s)")
    p.add_argument("--requests", type=int, default=20, help="requests in the RPC workload")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..collector.views import terminal
    from ..demo import run as run_demo

    console = Console()
    report = run_demo(args.out, requests=args.requests, say=lambda m: console.print(f"[dim]demo:[/] {m}"))
    terminal.render(report, console)
    truth = report["demo"]["injected_clocks"]
    table = Table(title="clock recovery: injected (never sent) vs. recovered from clock samples",
                  title_justify="left")
    for col in ("node", "injected offset", "recovered", "injected drift", "recovered drift", "bound"):
        table.add_column(col, justify="left" if col == "node" else "right")
    for node, clock in truth.items():
        got = report["clocks"].get(node)
        if got is None:
            continue
        table.add_row(node, terminal.fmt_ns(clock["offset_ns"]), terminal.fmt_ns(got["offset_ns"]),
                      f"{clock['drift_ppm']:+.1f} ppm", f"{got['drift_ppm']:+.2f} ppm",
                      terminal.fmt_ns(got["error_bound_ns"]))
    console.print(table)
    console.print(f"report: {report['demo']['report_json']}")
    return 0
