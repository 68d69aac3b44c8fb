"""Analysis in batches of traces gives exactly the result of one pass over the table: on a
table of many hand-built traces (stragglers, pipelines, RPCs, missing partners, a
collective split across traces, neighbouring pipeline steps), its rows shuffled, cut into
batches of every size."""
import random

import numpy as np
import pytest

from crosstrace.collector.attribution import attribute
from crosstrace.collector.matching import match
from crosstrace.collector.report import trace_details
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind

from .test_analysis_summary import edge_requests
from .test_analysis_units import Spans, build, coll, gpipe, p2p, straggler_step


def many_traces():
    spans, nodes = [], {}

    def add(more, more_nodes, trace):
        for span in more:
            span["trace"] = trace
        spans.extend(more)
        nodes.update(more_nodes)

    add(*straggler_step(), trace=1)
    add(*gpipe(), trace=2)
    # The next pipeline step, on stage0 where the first ends (10 ms), on stage1 as soon as its
    # own part of the first is done: each rank's window in a step ends where its next begins,
    # which a batch without the neighbouring step did not see (stage1's window 9.5 ms in one
    # pass, 10 ms in batches).
    step, _ = gpipe()
    for span in step:
        span["start"], span["end"] = span["start"] + 10, span["end"] + 10
        if span["parent"] == 0 and span["node"] == "stage1":
            span["start"] = 9.5
    add(step, {}, trace=6)
    s = Spans(trace=3)
    root = s.add("request", Kind.INTERNAL, 0, 50, "edge")
    s.add("call", Kind.RPC_CLIENT, 5, 45, "edge", root)
    s.add("recv", Kind.RECV, 0, 10, "b", **p2p(0, 1, 7))
    s.add("all_reduce", Kind.COLLECTIVE, 0, 20, "c", **coll(3, [0, 1, 2]))
    s.add("orphan", Kind.COMPUTE, 10, 12, "b", parent=999)
    s.add("barrier", Kind.COLLECTIVE, 0, 5, "x", **coll(9, [0, 1], op="barrier"))
    s.add("barrier", Kind.COLLECTIVE, 1, 5, "y", trace=4, **coll(9, [0, 1], op="barrier"))
    s.add("send", Kind.SEND, 1, 2, "x", trace=4, **p2p(0, 1, 8))
    s.add("recv", Kind.RECV, 1, 3, "y", **p2p(0, 1, 8))                      # its send is in trace 4
    for r, node in enumerate("pqr"):             # a broadcast whose non-root r enters late
        s.add("broadcast", Kind.COLLECTIVE, 10 + 20 * (r == 2), 35, node, trace=5,
              **coll(4, [0, 1, 2], op="broadcast"), **{sc.COLL_ROOT: 0})
    spans.extend(s.spans)
    nodes.update({"edge": -1, "b": 1, "c": 0, "x": 0, "y": 1, "p": 0, "q": 1, "r": 2})
    s = Spans()
    edge_requests(s, first_trace=10)
    spans.extend(s.spans)
    nodes["cloud"] = -1
    random.Random(7).shuffle(spans)
    return spans, nodes


@pytest.mark.parametrize("batch_spans", [1, 5, 40])
def test_batches_give_the_result_of_one_pass(batch_spans):
    table, alignment = build(*many_traces())
    matches = match(table)
    whole = attribute(table, alignment, matches, batch_spans=10 ** 9)
    parts = attribute(table, alignment, matches, batch_spans=batch_spans)
    assert trace_details(table, parts) == trace_details(table, whole)
    for name in ("critical", "per_rank", "group", "group_trace", "group_node", "window", "segment_category",
                 "segment_row"):
        assert np.array_equal(getattr(parts, name), getattr(whole, name)), name
    for name in ("parent", "prev", "partner", "trace_start", "trace_end", "lane", "released_by"):
        assert np.array_equal(getattr(parts.dag, name), getattr(whole.dag, name)), name
    for name in ("start", "end", "trace", "edge", "error", "violation", "bounds"):
        assert np.array_equal(getattr(parts.paths, name), getattr(whole.paths, name)), name
    # Join events are numbered batch by batch, but every path step names the same spans.
    for end in ("src", "dst"):
        rows = [at.dag.row_of(np.maximum(getattr(at.paths, end), 0)) for at in (parts, whole)]
        assert np.array_equal(*rows), end
    n = len(table)
    assert np.array_equal(parts.dag.time[:2 * n], whole.dag.time[:2 * n])
    assert sorted(parts.dag.join_time.tolist()) == sorted(whole.dag.join_time.tolist())
    assert {k: sorted(v.tolist()) for k, v in parts.dag.unmatched.items()} == \
        {k: sorted(v.tolist()) for k, v in whole.dag.unmatched.items()}
    assert len(whole.dag.unmatched["cross_trace"]) == 4 and parts.pipelines == whole.pipelines
