"""The report as one self-contained HTML page (inline SVG, CSS and a few lines of script;
nothing loaded from elsewhere).

It shows: budget status; timelines of the slowest trace of each kind (and of a typical one
where there is one kind) with one lane per node, spans stacked by nesting and concurrent
ones in rows of their own (a span with children faint), collective/p2p/RPC spans split
into their wait, transfer and network parts, and the critical path drawn over the lanes;
stacked attribution bars per trace (critical path) and per rank (each trace drawn); per
kind of trace (same root name), every critical-path segment at p50/p95/p99.
Clicking a legend entry hides or shows that category.
"""
import html

import numpy as np

from ...proto.semconv import KIND_NAMES, Status
from .. import attribution
from ..durations import format_ns, format_within
from ..wording import counted
from .summaries import (clocks_to_show, errors_line, format_measured, format_worst, largest_segments,
                        slowest_first, stragglers_line, verdict)

COLOURS = {"compute": "#4e79a7", "data": "#76b7b2", "network.uplink": "#f28e2b", "network.downlink": "#ffbe7d",
           "collective.wait": "#e15759", "collective.transfer": "#ff9d9a", "p2p.wait": "#b07aa1",
           "p2p.transfer": "#d4a6c8", "bubble": "#edc948", "host.overhead": "#bab0ac",
           "clock.uncertainty": "#9c755f", "remote": "#e6e6e6"}
WIDTH, LABEL, ROW, MAX_ROWS = 1100, 170, 14, 8

STYLE = """
body{font:13px system-ui,sans-serif;margin:20px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}small{color:#666}
.ok{color:#2a7d2a;font-weight:600}.violated,.no_data,.error{color:#c0392b;font-weight:600}
.legend span{display:inline-block;margin:2px 10px 2px 0;cursor:pointer;user-select:none}
.legend i,table.kind i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.legend .off{opacity:.35}.hidden{display:none}
svg text{font:11px system-ui,sans-serif}.lane-label{font-weight:600}
.critical{fill:none;stroke:#111;stroke-width:2.5}
"""
SCRIPT = """
document.querySelectorAll('.legend span').forEach(function (item) {
  item.addEventListener('click', function () {
    var cls = item.dataset.cat, off = item.classList.toggle('off');
    document.querySelectorAll('.' + cls).forEach(function (el) { el.classList.toggle('hidden', off); });
  });
});
"""


def _cls(category: str) -> str:
    return "cat-" + category.replace(".", "-")


def _rect(x, y, w, h, category, title, extra=""):
    return (f'<rect class="{_cls(category)}" x="{x:.2f}" y="{y:.1f}" width="{max(w, 0.5):.2f}" height="{h}" '
            f'fill="{COLOURS[category]}"{extra}><title>{html.escape(title)}</title></rect>')


def _legend() -> str:
    items = "".join(f'<span data-cat="{_cls(c)}"><i style="background:{COLOURS[c]}"></i>{c}</span>'
                    for c in attribution.NAMES)
    return f'<div class="legend">{items}</div>'


def _bar(values: dict, total: float, width: float, height: int = 14) -> str:
    """A stacked bar of category -> ns, scaled so that `total` ns is `width` px."""
    x, parts = 0.0, []
    for name in attribution.NAMES:
        v = values.get(name, 0)
        if v <= 0:
            continue
        w = v / max(total, 1) * width
        parts.append(_rect(x, 0, w, height, name, f"{name}: {format_ns(v)}"))
        x += w
    return f'<svg width="{width + 2:.0f}" height="{height}">{"".join(parts)}</svg>'


def _rows(rows: np.ndarray, node: np.ndarray, parent: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each span's row in its node's lane (`rows`: a trace's spans, in table order): below
    its parent there, and clear of the spans already in that row, so concurrent spans of one
    node (requests on several threads, asyncio tasks) each get a row (by nesting depth alone
    they were drawn over each other). Parents are placed before their children (a child may
    start first: OpenTelemetry lets a span say its start), then by start, longest first. A
    lane has MAX_ROWS rows: what does not fit above shares the last."""
    n = len(rows)
    at = np.searchsorted(rows, parent[rows])   # the parent's position in `rows`, where it is one
    up = np.where((parent[rows] >= 0) & (at < n) & (rows[np.minimum(at, n - 1)] == parent[rows]), at, -1) if n else at
    up = np.where((up >= 0) & (node[rows][np.maximum(up, 0)] == node[rows]), up, -1)   # on the same node
    depth, first, above = np.zeros(n, dtype=np.int64), start[rows].copy(), up.copy()
    while (above >= 0).any():   # depth on the node, and the latest start of a span and those above it
        on = above >= 0
        depth += on
        first[on] = np.maximum(first[on], start[rows][above[on]])
        above = np.where(on, up[np.maximum(above, 0)], -1)
    row_of = [0] * n
    busy_until: dict[int, list[int]] = {}   # node -> the end of the last span in each row
    starts, ends, lanes, ups = start[rows].tolist(), end[rows].tolist(), node[rows].tolist(), up.tolist()
    for i in np.lexsort((-end[rows], depth, first)).tolist():
        row = min(row_of[ups[i]] + 1, MAX_ROWS - 1) if ups[i] >= 0 else 0
        busy = busy_until.setdefault(lanes[i], [])
        while row < min(len(busy), MAX_ROWS - 1) and busy[row] > starts[i]:
            row += 1
        if row == len(busy):
            busy.append(ends[i])
        else:
            busy[row] = max(busy[row], ends[i])
        row_of[i] = row
    return np.array(row_of, dtype=np.int64)


def _timeline(trace: dict, index: int, analysed, at, kinds, pieces) -> str:
    """One trace: a lane per node, spans in rows (_rows), the critical path on top."""
    t, dag, paths = analysed.table, at.dag, at.paths
    rows = np.flatnonzero(t.trace == index)
    t0, duration = trace["start_ns"], max(trace["duration_ns"], 1)
    scale = (WIDTH - LABEL - 10) / duration
    start, end = dag.starts, dag.ends

    span_row = _rows(rows, t.node, dag.parent, start, end)
    nodes = sorted(set(t.node[rows].tolist()), key=lambda k: (t.resources[k].rank < 0, t.resources[k].rank, t.nodes[k]))
    lane_height = {k: (int(span_row[t.node[rows] == k].max()) + 1) * ROW + 8 for k in nodes}
    top, y = {}, 26
    for k in nodes:
        top[k] = y
        y += lane_height[k]
    height = y + 24

    def x_of(ns):
        return LABEL + (ns - t0) * scale

    parts = ['<text x="4" y="16" class="lane-label">critical path</text>']
    for k in nodes:
        r = t.resources[k]
        label = t.nodes[k] + (f" (rank {r.rank})" if r.rank >= 0 else "")
        parts.append(f'<g class="lane" data-node="{html.escape(t.nodes[k])}">'
                     f'<rect x="0" y="{top[k] - 2}" width="{WIDTH}" height="{lane_height[k] - 2}" fill="#f7f7f7"/>'
                     f'<text x="4" y="{top[k] + 11}" class="lane-label">{html.escape(_short(label))}</text></g>')
    # Colours as the per-rank breakdown counts them (attribution decides, not this view); a
    # span with children faint, since its colour is that of its own time only (a pipeline
    # step drawn solid in bubble's read as a step all bubble).
    pipeline = at.group_pipeline[at.group]
    has_child = np.zeros(len(t), dtype=bool)
    has_child[dag.parent[rows][dag.parent[rows] >= 0]] = True
    for r, d, c in zip(rows.tolist(), span_row.tolist(), attribution.self_categories(kinds[rows], pipeline[rows]).tolist()):
        y0 = top[int(t.node[r])] + d * ROW
        kind = KIND_NAMES.get(int(t.kind[r]), "internal")
        title = f"{t.names[t.name[r]]} ({kind}) {format_ns(end[r] - start[r])} on {t.nodes[t.node[r]]}"
        outline = ' stroke="#fff" stroke-width="0.5"' + (' fill-opacity="0.3"' if has_child[r] else "")
        if t.status[r] == Status.ERROR:
            message = t.extras.get(r, {}).get("status_message")
            title += f"\nERROR: {message}" if message else "\nERROR"
            outline = ' stroke="#c00" stroke-width="2"'
        parts.append(_rect(x_of(start[r]), y0, (end[r] - start[r]) * scale, ROW - 2, attribution.NAMES[c], title,
                           outline))
    # Split spans: the wait, transfer and network parts drawn over their spans.
    p_rows, s, e, cat = pieces
    mine = np.isin(p_rows, rows)
    cat = attribution.rank_categories(cat, pipeline[p_rows])
    row_of = dict(zip(rows.tolist(), span_row.tolist()))
    for r, a, b, c in zip(p_rows[mine].tolist(), s[mine].tolist(), e[mine].tolist(), cat[mine].tolist()):
        name = attribution.NAMES[c]
        y0 = top[int(t.node[r])] + row_of[r] * ROW + 3
        parts.append(_rect(x_of(a), y0, (b - a) * scale, ROW - 8, name, f"{name}: {format_ns(b - a)} in {t.names[t.name[r]]}"))
    # The critical path: a strip on top, and a line through the lanes it visits.
    lo, hi = paths.bounds[index], paths.bounds[index + 1]
    points = []
    for k in range(lo, hi):
        a, b = int(paths.start[k]), int(paths.end[k])
        name = attribution.NAMES[at.segment_category[k]]
        node = int(dag.node[paths.dst[k]])
        span = at.segment_row[k]
        label = f"{name}: {format_ns(b - a)}" + (f" in {t.names[t.name[span]]}" if span >= 0 else "") + f" on {t.nodes[node]}"
        if b > a:
            parts.append(_rect(x_of(a), 6, (b - a) * scale, 12, name, label))
        yy = top[node] + lane_height[node] - 6
        points += [(x_of(a), yy), (x_of(b), yy)]
    if points:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline class="critical" points="{path}"><title>critical path</title></polyline>')
    for i in range(6):
        ns = duration * i / 5
        anchor = "end" if i == 5 else "middle"
        parts.append(f'<text x="{LABEL + ns * scale:.1f}" y="{height - 6}" text-anchor="{anchor}">{format_ns(ns)}</text>')
    return (f'<svg class="timeline" width="{WIDTH}" height="{height}" data-trace="{trace["trace_id"]}">'
            f'{"".join(parts)}</svg>')


def _short(label: str, most: int = 26) -> str:
    """A lane's label within its margin, its end kept (the rank: host names share their start)."""
    return label if len(label) <= most else label[:most // 2 - 2] + "…" + label[-(most // 2 + 1):]


def _budgets(report: dict) -> str:
    if not report.get("budgets"):
        return "<p>No budgets given (<code>--budget FILE</code>).</p>"
    rows = []
    for b in report["budgets"]:
        worst = format_worst(b)
        measured, limit = format_measured(b)
        rule = f'<br><small>{html.escape(b["rule"])}</small>' if b["rule"] != b["name"] else ""   # (a name given)
        rows.append(f'<tr><td>{html.escape(b["name"])}{rule}</td>'
                    f'<td class="num">{measured}</td><td class="num">{limit}</td>'
                    f'<td class="num">{b["samples"]}</td><td class="{b["status"]}">{b["status"].replace("_", " ")}</td>'
                    f'<td>{html.escape(worst)}</td></tr>')
    return (f"<p>{html.escape(verdict(report['budgets']))}</p>"
            "<table><tr><th>budget</th><th>measured</th><th>limit</th><th>samples</th>"
            f"<th>status</th><th>worst traces</th></tr>{''.join(rows)}</table>")


def _bars_table(headers: tuple[str, ...], rows: list[tuple[list[str], dict, int]]) -> str:
    """One row per item: its leading cells, then a bar of its attribution (with "remote"),
    as long as its length against the longest item's."""
    longest = max((length for _, _, length in rows), default=1)
    cells = []
    for leading, entry, length in rows:
        values = {**entry["attribution"], "remote": entry.get("remote_ns", 0)}
        cells.append("<tr>" + "".join(leading)
                     + f"<td>{_bar(values, longest, 600 * length / max(longest, 1))}</td></tr>")
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in headers) + f"</tr>{''.join(cells)}</table>"


def _trace_bars(traces: list[dict], limit: int = 40) -> str:
    slowest = slowest_first(traces)[:limit]
    shown = f" (the {len(slowest)} slowest of {len(traces):,})" if len(slowest) < len(traces) else ""
    return f"<h2>traces: where the critical path goes{shown}</h2>" + _bars_table(("trace", "name", "duration", "errors", "critical path by category"), [
        ([f'<td><code>{tr["trace_id"][:16]}</code></td>', f'<td>{html.escape(tr["name"])}</td>',
          f'<td class="num">{format_ns(tr["duration_ns"])}</td>',
          f'<td class="num{" error" if tr["errors"] else ""}">{tr["errors"]}</td>'], tr, tr["duration_ns"])
        for tr in slowest])


def _clocks(report: dict) -> str:
    """Each node's recovered clock (the flagged and least certain first, where there are
    many), and the spans that tracers dropped or the collector rejected."""
    clocks, out = report.get("clocks", {}), ""
    if clocks:
        nodes = clocks_to_show(clocks)
        rows = "".join(
            f'<tr><td>{html.escape(node)}</td><td class="num">{format_within(c["offset_ns"], c["error_bound_ns"])}</td>'
            f'<td class="num">{c["drift_ppm"]:+.3f} ppm</td><td class="num">{format_ns(c["error_bound_ns"])}</td>'
            f'<td class="num">{c["samples"]}</td><td>{html.escape(", ".join(c["flags"])) or "-"}</td></tr>'
            for node, c in ((node, clocks[node]) for node in nodes))
        out = ("<h2>clocks (offset = node clock - collector clock)</h2><table><tr><th>node</th><th>offset</th>"
               f"<th>drift</th><th>error bound</th><th>samples</th><th>flags</th></tr>{rows}</table>")
        if len(nodes) < len(clocks):
            out += f"<p>... and {len(clocks) - len(nodes):,} more nodes: <code>crosstrace clocks</code></p>"
    lost = [(f"dropped by {node}", n) for node, n in report.get("dropped_spans", {}).items() if n]
    lost += [(f"rejected by the collector ({reason})", n) for reason, n in report.get("rejected_spans", {}).items() if n]
    if lost:
        out += '<p class="error">spans lost: ' + ", ".join(f"{html.escape(what)}: {n:,}" for what, n in lost) + "</p>"
    return out


def _rank_bars(trace: dict) -> str:
    ranks = sorted(trace["per_rank"].items(), key=lambda kv: (kv[1]["rank"] < 0, kv[1]["rank"], kv[0]))
    return _bars_table(("node", "rank", "window", "time by category"), [
        ([f"<td>{html.escape(node)}</td>", f'<td class="num">{v["rank"] if v["rank"] >= 0 else "-"}</td>',
          f'<td class="num">{format_ns(v["window_ns"])}</td>'], v, v["window_ns"]) for node, v in ranks])


def _kinds(summary: dict, traces: list[dict], limit: int = 5, rows: int = 14) -> str:
    """Per kind of trace (root name): each critical-path segment at p50/p95/p99, in path order."""
    out = []
    for name, k in sorted(summary.items(), key=lambda kv: -kv[1]["traces"])[:limit]:
        d = k["duration"]
        cells = "".join(
            f'<tr><td><i style="background:{COLOURS[seg["category"]]}"></i> {html.escape(seg["segment"])}</td>'
            + "".join(f'<td class="num">{format_ns(seg[f"{q}_ns"])}</td>' for q in ("p50", "p95", "p99", "mean"))
            + f'<td class="num">{seg["share"]:.0%}</td></tr>'
            for seg in largest_segments(k["segments"], rows))
        out.append(f'<h3>{html.escape(name)}: {counted(k["traces"], "trace")}, p50 {format_ns(d["p50_ns"])}, '
                   f'p95 {format_ns(d["p95_ns"])}, p99 {format_ns(d["p99_ns"])}</h3>'
                   f'<table class="kind"><tr><th>critical-path segment (path order)</th><th>p50</th><th>p95</th>'
                   f'<th>p99</th><th>mean</th><th>share</th></tr>{cells}</table>')
        line = stragglers_line(name, k["traces"], traces)
        if line:
            out.append(f"<p>{html.escape(line)}</p>")
    if len(summary) > limit:
        out.append(f"<p>{counted(len(summary) - limit, 'kind')} with fewer traces not shown here: "
                   "<code>crosstrace report --json</code> has every kind.</p>")
    return "".join(out)


def _shown(traces: list[dict], most: int = 4) -> list[tuple[str, dict]]:
    """The traces drawn on a timeline: the slowest of each kind (root name), the slowest
    kinds first, up to `most`; of a single kind, its slowest and its typical (median) trace.
    The slowest and median of all mixed kinds hid a store's training steps behind its
    requests, and the straggler never showed on a timeline."""
    by_kind: dict[str, list[dict]] = {}
    for trace in slowest_first(traces):
        by_kind.setdefault(trace["name"], []).append(trace)
    if len(by_kind) == 1:
        (ordered,) = by_kind.values()
        typical = ordered[len(ordered) // 2]
        return [("slowest trace", ordered[0])] + (
            [("typical trace (median duration)", typical)] if typical is not ordered[0] else [])
    shown = [(f"slowest of {counted(len(kind), 'trace')} of its kind", kind[0]) for kind in by_kind.values()]
    return shown[:most]


def _trace_section(title: str, trace: dict, analysed, at, kinds, pieces) -> str:
    index = analysed.table.trace_ids.index(trace["trace_id"])
    s = trace.get("straggler")
    straggler = ""
    if s:
        rank = f" (rank {s['rank']})" if s["rank"] >= 0 else ""
        straggler = (f"<p>Straggler: <b>{html.escape(s['node'])}</b>{rank}, busy in "
                     f"<b>{html.escape(str(s['span']))}</b>, made others wait {format_ns(s['delay_cost_ns'])} in all.</p>")
    pipe = trace.get("pipeline")
    if pipe:
        straggler += (f"<p>Pipeline {html.escape(str(pipe['schedule']))}: bubble {pipe['bubble_fraction']:.1%} "
                      f"(ideal {pipe['ideal_bubble_fraction']:.1%} for {pipe['ranks']} ranks, "
                      f"{pipe['microbatches']} microbatches).</p>")
    return (f'<section class="trace"><h2>{title}: {html.escape(trace["name"])} <code>{trace["trace_id"][:16]}</code>, '
            f'{format_ns(trace["duration_ns"])}, {counted(trace["spans"], "span")} on {counted(trace["nodes"], "node")}</h2>{straggler}'
            f'{_timeline(trace, index, analysed, at, kinds, pieces)}<h3>per rank</h3>{_rank_bars(trace)}</section>')


def render(report: dict, analysed, attributed) -> str:
    traces = report["traces"]
    errors = errors_line(traces)
    body = [f"<h1>crosstrace report</h1><p>{html.escape(str(report['store']))}: {counted(len(traces), 'trace')}, "
            f"{counted(sum(tr['spans'] for tr in traces), 'span')}" + (f', <span class="error">{errors}</span>' if errors else "")
            + "</p>", _legend(), "<h2>budgets</h2>", _budgets(report)]
    if not traces:
        body.append("<p>No traces in this store (or in its window, with <code>--last</code>).</p>")
    else:
        dag, n = attributed.dag, len(analysed.table)     # the spans split at partners and joins, once
        kinds = attribution.self_kinds(analysed.table, dag)
        pieces = attribution.pieces(analysed.table, dag, kinds, dag.starts, dag.ends,
                                    dag.error[0:2 * n:2])
        for title, trace in _shown(traces):
            body.append(_trace_section(title, trace, analysed, attributed, kinds, pieces))
        body.append(_trace_bars(traces))
        if report.get("summary"):
            body += ["<h2>traces of one kind: the critical path by segment</h2>", _kinds(report["summary"], traces)]
    body.append(_clocks(report))
    unmatched = {k: v for k, v in report.get("unmatched", {}).items() if v}
    if unmatched:
        body.append("<p>Spans whose partner is missing: "
                    + ", ".join(f"{html.escape(k)}: {v}" for k, v in unmatched.items()) + "</p>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>crosstrace report</title>'
            f'<style>{STYLE}</style></head><body>{"".join(body)}<script>{SCRIPT}</script></body></html>')


def write(path: str, report: dict, analysed, attributed) -> None:
    with open(path, "w", encoding="utf-8") as out:
        out.write(render(report, analysed, attributed))
