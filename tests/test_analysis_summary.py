"""Traces of one kind summarised together: every critical-path segment and category at
p50/p95/p99 across the traces of the same root name, per trace in the JSON, and in the
terminal report, on hand-built edge -> cloud requests whose numbers are known."""
import numpy as np
from rich.console import Console

from crosstrace.collector.attribution import attribute
from crosstrace.collector.matching import match
from crosstrace.collector.report import Analysed, kind_summaries, traces_with_details
from crosstrace.collector.views import terminal
from crosstrace.collector.views.summaries import slowest_first
from crosstrace.proto.semconv import Kind

from .test_analysis_units import MS, Spans, build

REQUESTS = 20
PATH = ["edge request (host.overhead)", "edge preprocess (compute)", "edge infer (network.uplink)",
        "cloud queue (host.overhead)", "cloud inference (compute)", "edge infer (network.downlink)"]


def edge_requests(s: Spans, first_trace: int = 1) -> None:
    """Request i (1..20): 1 ms before preprocess, preprocess 2 + 0.1 i ms, uplink 30 ms,
    queue i ms, inference 5 ms, downlink 10 ms, 1 ms after."""
    for i in range(1, REQUESTS + 1):
        tr, pre, queue = first_trace + i - 1, 2 + 0.1 * i, float(i)
        call_start = 1 + pre
        total = call_start + 30 + queue + 5 + 10 + 1
        root = s.add("request", Kind.INTERNAL, 0, total, "edge", trace=tr)
        s.add("preprocess", Kind.COMPUTE, 1, 1 + pre, "edge", root, trace=tr)
        call = s.add("infer", Kind.RPC_CLIENT, call_start, total - 1, "edge", root, trace=tr)
        served = call_start + 30
        srv = s.add("infer", Kind.RPC_SERVER, served, served + queue + 5, "cloud", call, trace=tr)
        s.add("queue", Kind.INTERNAL, served, served + queue, "cloud", srv, trace=tr)
        s.add("inference", Kind.COMPUTE, served + queue, served + queue + 5, "cloud", srv, trace=tr)


def summarise(spans, nodes):
    table, alignment = build(spans, nodes)
    analysed = Analysed(table, alignment, match(table))
    at = attribute(table, alignment, analysed.matches)
    traces = traces_with_details(analysed, at)
    return traces, kind_summaries(table, at, traces)


def nearest_rank(values, q):
    return np.percentile(values, q, method="inverted_cdf")


def test_segments_of_edge_requests_at_percentiles():
    s = Spans()
    edge_requests(s)
    traces, summary = summarise(s.spans, {"edge": -1, "cloud": -1})
    assert list(summary) == ["request"]
    k = summary["request"]
    assert k["traces"] == REQUESTS
    segments = {seg["segment"]: seg for seg in k["segments"]}
    assert list(segments) == PATH                                  # in path order, nothing else
    queue = segments["cloud queue (host.overhead)"]
    assert (queue["node"], queue["span"], queue["category"]) == ("cloud", "queue", "host.overhead")
    queues = np.arange(1, REQUESTS + 1) * MS
    for q in (50, 95, 99):
        assert queue[f"p{q}_ns"] == nearest_rank(queues, q)
        assert segments["edge infer (network.uplink)"][f"p{q}_ns"] == 30 * MS
        assert segments["edge infer (network.downlink)"][f"p{q}_ns"] == 10 * MS
        assert segments["cloud inference (compute)"][f"p{q}_ns"] == 5 * MS
    pre = np.round((2 + 0.1 * np.arange(1, REQUESTS + 1)) * MS)
    assert segments["edge preprocess (compute)"]["p95_ns"] == nearest_rank(pre, 95)
    assert queue["mean_ns"] == queues.mean() and queue["max_ns"] == queues.max()
    assert all(seg["traces"] == REQUESTS for seg in k["segments"])

    durations = np.array([t["duration_ns"] for t in traces])
    assert k["duration"]["p99_ns"] == nearest_rank(durations, 99) == durations.max()
    # Categories: compute is preprocess + inference; host.overhead the edge's 2 ms and the queue.
    assert k["attribution"]["compute"]["p50_ns"] == nearest_rank(pre + 5 * MS, 50)
    assert k["attribution"]["host.overhead"]["p99_ns"] == nearest_rank(queues + 2 * MS, 99)
    assert set(k["attribution"]) == {"compute", "network.uplink", "network.downlink", "host.overhead"}

    # Per request: its own segments, in path order, adding up to its duration.
    for t in traces:
        assert list(t["segments"]) == PATH
        assert sum(t["segments"].values()) == t["duration_ns"]
        assert t["segments"]["cloud queue (host.overhead)"] == \
            t["duration_ns"] - 47 * MS - t["segments"]["edge preprocess (compute)"]


def test_kinds_are_summarised_apart_and_absent_segments_count_zero():
    s = Spans()
    edge_requests(s)
    for tr in (101, 102, 103):                  # another kind of trace on the same nodes
        root = s.add("health", Kind.INTERNAL, 0, 4, "edge", trace=tr)
        if tr == 101:
            s.add("probe", Kind.COMPUTE, 1, 3, "edge", root, trace=tr)
    traces, summary = summarise(s.spans, {"edge": -1, "cloud": -1})
    assert summary["request"]["traces"] == REQUESTS and summary["health"]["traces"] == 3
    health = {seg["segment"]: seg for seg in summary["health"]["segments"]}
    probe = health["edge probe (compute)"]
    assert probe["traces"] == 1 and probe["p50_ns"] == 0 and probe["p99_ns"] == 2 * MS
    overhead = health["edge health (host.overhead)"]             # 4 ms, 2 ms beside the probe
    assert (overhead["p50_ns"], overhead["p99_ns"], overhead["mean_ns"]) == (4 * MS, 4 * MS, round(10 / 3 * MS))


def test_terminal_shows_segments_percentiles_and_requests():
    s = Spans()
    edge_requests(s)
    traces, summary = summarise(s.spans, {"edge": -1, "cloud": -1})
    console = Console(record=True, width=140)
    terminal.render_kinds(summary, traces, console, limit=5)
    text = console.export_text()
    assert "'request': 20 traces, p50" in text
    for label in PATH:
        assert label in text
    queue_row = next(line for line in text.splitlines() if "cloud queue (host.overhead)" in line)
    assert [cell.strip() for cell in queue_row.split("│")[2:5]] == ["10 ms", "19 ms", "20 ms"]   # nearest rank of 1..20 ms
    # The slowest requests, one column per segment: the slowest waited 20 ms in the queue.
    assert "slowest 'request' traces" in text
    rows = [line for line in text.splitlines() if "71 ms" in line and "20 ms" in line]
    assert rows, text


def test_views_name_one_slowest_trace_and_only_categories_with_time():
    """Two traces of equal duration: the terminal and the HTML page name the same one as
    the slowest (the earlier); a trace of one untyped span lists host.overhead alone, not
    categories with no time."""
    from crosstrace.collector.views import html

    s = Spans(trace=1)
    s.add("first", Kind.INTERNAL, 0, 10, "n0")
    s.add("second", Kind.INTERNAL, 20, 30, "n0", trace=2)
    table, alignment = build(s.spans, {"n0": 0})
    analysed = Analysed(table, alignment, match(table))
    at = attribute(table, alignment, analysed.matches)
    traces = traces_with_details(analysed, at)
    report = {"store": "s", "traces": traces, "budgets": [], "unmatched": {}, "clocks": {}, "dropped_spans": {},
              "rejected_spans": {}}
    console = Console(record=True, width=200)
    terminal.render(report, console)
    out = console.export_text()
    assert "host.overhead 10 ms" in out
    assert "compute 0" not in out and "data 0" not in out
    slowest = slowest_first(traces)[0]
    assert slowest["name"] == "first" and "│ host.overhead │ n0   │ first │" in out   # its critical path
    page = html.render(report, analysed, at)
    first = page.index(f"slowest of 1 trace of its kind: first <code>{slowest['trace_id'][:16]}")
    assert first < page.index("slowest of 1 trace of its kind: second")   # one kind each: the slowest first


def test_the_json_report_is_one_document_whatever_it_holds(tmp_path):
    """Written a trace at a time (json.dump with an indent took 7 of 11 s of a large
    report): one JSON document, with what json would make of integer keys, integers beyond
    64 bits and an empty trace list."""
    import json

    from crosstrace.collector.views import report_json

    for report in ({"store": "s", "traces": [{"trace_id": "a", "per_rank": {3: {"x": 2**70}}}, {"trace_id": "b"}],
                    "clocks": {"n": {"offset_ns": -1, "flags": []}}, "budgets": []},
                   {"traces": [], "clocks": {}}):
        path = tmp_path / "r.json"
        report_json.write(str(path), report)
        assert json.loads(path.read_text()) == json.loads(json.dumps(report))
