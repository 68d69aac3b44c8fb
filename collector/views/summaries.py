"""What every view says of a report alike (terminal, HTML, the demo's findings): which
traces come first, which nodes were stragglers, which clocks to show, how a budget's
value reads. Plain text, no rich markup."""
import collections
import math

from ..durations import format_ns
from ..wording import counted

CLOCK_ROWS, NODES_LISTED = 16, 8


def clocks_to_show(clocks: dict, rows: int | None = CLOCK_ROWS) -> list[str]:
    """Every node where they fit in `rows` (None: all); else the flagged ones and the widest
    error bounds first."""
    nodes = list(clocks)
    if rows is not None and len(nodes) > rows:
        def need(node):   # an unknown bound (None) is the widest
            bound = clocks[node]["error_bound_ns"]
            return not clocks[node]["flags"], -(math.inf if bound is None else bound)
        nodes = sorted(nodes, key=need)[:rows]
    return nodes


def slowest_first(traces: list[dict]) -> list[dict]:
    """Traces by duration, the slowest first, the earlier first among equals: one order for
    every view, so that they name the same slowest trace."""
    return sorted(traces, key=lambda t: (-t["duration_ns"], t["start_ns"]))


def errors_line(traces: list[dict]) -> str:
    errors = sum(t.get("errors", 0) for t in traces)
    if not errors:
        return ""
    failed = sum(1 for t in traces if t.get("errors"))
    return f"{counted(errors, 'span')} with status ERROR in {counted(failed, 'trace')}"


def stragglers(traces: list[dict], name: str) -> collections.Counter:
    """How many traces of kind `name` name each node as their straggler."""
    return collections.Counter(t["straggler"]["node"] for t in traces if t["name"] == name and t.get("straggler"))


def stragglers_line(name: str, n_traces: int, traces: list[dict]) -> str | None:
    """"stragglers: trainer-3 in 10 of 10": the nodes the traces of one kind name (None: none)."""
    named = stragglers(traces, name)
    if not named:
        return None
    more = len(named) - NODES_LISTED
    return ("stragglers: " + ", ".join(f"{node} in {n} of {n_traces}" for node, n in named.most_common(NODES_LISTED))
            + (f", {more} more nodes" if more > 0 else ""))


def largest_segments(segments: list[dict], n: int) -> list[dict]:
    """The n segments with the largest mean, still in path order."""
    keep = {id(s) for s in sorted(segments, key=lambda s: -s["mean_ns"])[:n]}
    return [s for s in segments if id(s) in keep]


def format_value(entry: dict, value, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value * 100:.{digits - 1}g}%" if entry["unit"] == "share" else format_ns(value, digits)


def format_worst(entry: dict) -> str:
    """The traces with the worst samples, each by its id's first 16 digits and its value (and
    for a span, the node it ran on)."""
    return ", ".join(f"{w['trace_id'][:16]} ({format_value(entry, w['value'])}"
                     + (f" on {w['node']})" if "node" in w else ")") for w in entry["worst"]) or "-"


def format_measured(entry: dict) -> tuple[str, str]:
    """(measured, limit) with the digits it takes to tell them apart: a value just over its
    limit printed as the limit itself beside VIOLATED."""
    measured, limit = entry["measured"], entry["limit"]
    for digits in range(4, 16):
        shown = format_value(entry, measured, digits), format_value(entry, limit, digits)
        if measured is None or measured == limit or shown[0] != shown[1]:
            return shown
    return shown


def verdict(results: list[dict]) -> str:
    """One line: how many budgets were violated, and how many had no trace to measure."""
    violated = sum(r["status"] == "violated" for r in results)
    empty = sum(r["status"] == "no_data" for r in results)
    if not violated and not empty:
        return f"all {len(results)} budgets hold" if len(results) > 1 else "the budget holds"
    parts = [f"{violated} of {len(results)} budgets violated"] if violated else []
    if empty:
        parts.append(f"{empty} of {len(results)} without data (no span or trace matched)")
    return ", ".join(parts)
