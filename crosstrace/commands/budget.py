"""`crosstrace budget check`: latency budgets as a CI gate (exit 1 when one is violated or has no data)."""
import argparse
import json

from .report import add_trace, add_window, check_writable

EXAMPLE = """\
budget file (TOML), one [[budget]] table per limit:

  [[budget]]                    # edge.preprocess p99 <= 5ms
  span = "preprocess"           # spans of this name (glob) ...
  node = "edge*"                # ... on nodes whose node id or role matches (optional)
  percentile = 99
  max = "5ms"

  [[budget]]                    # network.uplink p95 <= 20ms (on the critical path)
  category = "network.uplink"
  percentile = 95
  max = "20ms"

  [[budget]]                    # collective.wait <= 10% of step (worst rank)
  category = "collective.wait"
  traces = "*step"
  max = "10%"

keys: max (required: "800ns", "250us", "5ms", "1.5s", "2min" or a share "10%" of the
trace's duration, or per rank of the rank's window); percentile (default 100: every
sample; nearest rank); span + node, or category (+ measure: critical_path, worst_rank,
mean_rank; waits and bubble default to worst_rank, and collective.wait and p2p.wait are
never on the critical path), or neither (the trace's duration); traces (glob on the trace
name); name (a label). A span budget takes one sample per span, the others one per trace
(a category budget, per trace that can have it: with RPCs for network.*, collectives for
collective.*, sends or receives for p2p.*, a pipeline for bubble).
A budget that matches nothing fails. `crosstrace report --budget` shows the same table.
exit status: 0 all budgets hold, 1 a budget is violated or has no data, 2 bad input.
"""


def register(sub) -> None:
    p = sub.add_parser("budget", help="check latency budgets against a store (CI gate)",
                       description="Latency budgets: limits per span or attribution category, as time or "
                                   "share of the trace, at a percentile across traces.")
    budget_sub = p.add_subparsers(dest="budget_command", metavar="SUBCOMMAND", required=True)
    check = budget_sub.add_parser("check", help="measure every budget; exit 1 if one is violated or has no data",
                                  description="Print every budget with its measured value across traces and "
                                              "the worst traces; exit 1 when one is violated or has no data.",
                                  epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--store", required=True, help="store file written by `crosstrace collector`")
    check.add_argument("--budget", required=True, metavar="FILE", help="budget file (TOML, see below)")
    add_trace(check, analysed=True)
    check.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout only)")
    add_window(check)
    check.set_defaults(func=run_check)


def run_check(args) -> int:
    from ..collector.report import analyse_report

    check_writable(args.json)
    report, _, _ = analyse_report(args.store, args.trace, budget_file=args.budget, last=args.last)
    results = report["budgets"]
    if args.json:
        text = json.dumps(results, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as out:
                out.write(text + "\n")
    if args.json != "-":
        from ..collector.views.terminal import render_budgets

        render_budgets(results, len(report["traces"]))
    return 0 if all(r["ok"] for r in results) else 1
