"""Analysis on hand-built span tables where every number is known: stitching, critical
path, attribution, stragglers, pipelines, and the edge cases (missing partners, nesting,
overlapping threads, clock errors, cycles)."""
import numpy as np
import pytest

from crosstrace.collector import attribution
from crosstrace.collector.align import Alignment
from crosstrace.collector.attribution import CATEGORIES, REMOTE, attribute
from crosstrace.collector.dag import Edge
from crosstrace.collector.matching import match
from crosstrace.collector.report import segment_label, trace_details
from crosstrace.collector.spantable import SpanTable
from crosstrace.proto import pb
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind

MS = 1_000_000


def build(spans: list[dict], nodes: dict[str, int], errors_ms: dict | None = None):
    """A SpanTable and its Alignment from span dicts (times in ms, already aligned):
    trace, id, parent, name, kind, start, end, node, thread, attrs."""
    names: dict[str, int] = {}
    traces = sorted({s["trace"] for s in spans})
    node_ids = list(nodes)

    def col(key, default=0, dtype=np.int64):
        return np.array([s.get(key, default) for s in spans], dtype=dtype)

    table = SpanTable(
        trace_hi=np.zeros(len(spans), np.uint64), trace_lo=col("trace", dtype=np.uint64),
        span_id=col("id", dtype=np.uint64), parent_id=col("parent", dtype=np.uint64),
        start=np.array([round(s["start"] * MS) for s in spans], np.int64),
        end=np.array([round(s["end"] * MS) for s in spans], np.int64),
        kind=np.array([int(s.get("kind", Kind.INTERNAL)) for s in spans], np.uint8),
        status=np.zeros(len(spans), np.uint8),
        name=np.array([names.setdefault(s["name"], len(names)) for s in spans], np.int32),
        thread=col("thread", 1, np.uint64), node=np.array([node_ids.index(s["node"]) for s in spans], np.int32),
        trace=np.array([traces.index(s["trace"]) for s in spans], np.int32),
        attributes=[s.get("attrs") for s in spans], extras={}, names=list(names), nodes=node_ids,
        resources=[pb.Resource(node_id=n, rank=r, job_id="job") for n, r in nodes.items()],
        trace_ids=[f"{x:032x}" for x in traces])
    error = np.array([round((errors_ms or {}).get(s["node"], 0) * MS) for s in spans], np.int64)
    return table, Alignment({}, table.start.copy(), table.end.copy(), error, 0)


class Spans:
    """Builds span dicts with fresh ids: add(...) returns the new span's id."""

    def __init__(self, trace: int = 1):
        self.spans, self.trace, self._next = [], trace, 1

    def add(self, name, kind, start, end, node, parent=0, thread=1, trace=None, **attrs) -> int:
        sid = self._next
        self._next += 1
        self.spans.append(dict(trace=trace or self.trace, id=sid, parent=parent, name=name, kind=kind, start=start,
                               end=end, node=node, thread=thread, attrs=attrs or None))
        return sid


def coll(seq, ranks, group="world", op="all_reduce"):
    return {sc.COLL_GROUP: group, sc.COLL_SEQ: seq, sc.COLL_OP: op, sc.COLL_RANKS: ranks}


def p2p(src, dst, seq, **pp):
    return {sc.P2P_SRC: src, sc.P2P_DST: dst, sc.P2P_TAG: 0, sc.P2P_SEQ: seq, **pp}


def analyse(spans, nodes, errors_ms=None):
    table, alignment = build(spans, nodes, errors_ms)
    at = attribute(table, alignment, match(table))
    return table, at, trace_details(table, at)


def ms(values: dict) -> dict:
    return {k: round(v / MS, 3) for k, v in values.items() if v}


def check_tiles(at):
    """Every critical path runs back to back from its trace's first event to its last."""
    p, dag = at.paths, at.dag
    for tr in range(len(dag.trace_start)):
        lo, hi = p.bounds[tr], p.bounds[tr + 1]
        assert hi > lo
        assert p.start[lo] == dag.trace_start[tr] and p.end[hi - 1] == dag.trace_end[tr]
        assert np.array_equal(p.start[lo + 1:hi], p.end[lo:hi - 1])
        assert at.critical[tr].sum() == dag.trace_end[tr] - dag.trace_start[tr]


def straggler_step(late_ms=50.0):
    s = Spans()
    for r in range(3):
        node = f"rank{r}"
        root = s.add("step", Kind.INTERNAL, 0, 100, node)
        s.add("forward", Kind.COMPUTE, 1, 10, node, root)
        back_end = 20 + (late_ms if r == 2 else 0)
        s.add("backward", Kind.COMPUTE, 10, back_end, node, root)
        s.add("all_reduce", Kind.COLLECTIVE, back_end + 1, 80, node, root, **coll(1, [0, 1, 2]))
        s.add("optimizer", Kind.COMPUTE, 80, 90, node, root)
    return s.spans, {f"rank{r}": r for r in range(3)}


def test_straggler_compute_on_critical_path_and_wait_on_the_others():
    table, at, out = analyse(*straggler_step())
    check_tiles(at)
    trace = out[0]
    path = [(seg["category"], seg["node"], seg["span"]) for seg in trace["critical_path"]]
    assert ("compute", "rank2", "backward") in path
    assert ("compute", "rank0", "backward") not in path and ("compute", "rank1", "backward") not in path
    backward = [seg for seg in trace["critical_path"] if seg["span"] == "backward"][0]
    assert backward["duration_ns"] == 60 * MS and backward["confidence"] == 1.0
    for node in ("rank0", "rank1"):
        per = trace["per_rank"][node]["attribution"]
        assert per["collective.wait"] == 50 * MS
        assert per["collective.transfer"] == 9 * MS
        assert sum(per.values()) == trace["per_rank"][node]["window_ns"] == 100 * MS
    assert trace["per_rank"]["rank2"]["attribution"]["collective.wait"] == 0
    s = trace["straggler"]
    assert (s["node"], s["rank"], s["span"], s["delay_cost_ns"]) == ("rank2", 2, "backward", 100 * MS)
    assert s["waits"][0]["op"] == "all_reduce" and s["waits"][0]["lateness_ns"] == 50 * MS
    assert trace["collectives"]["all_reduce"] == {"count": 1, "wait_ns": 100 * MS, "transfer_ns": 27 * MS,
                                                  "critical_path_ns": 9 * MS}
    assert trace["attribution"]["compute"] == (9 + 60 + 10) * MS


@pytest.mark.parametrize("late_ms,named", [(2.0, False), (3.0, True)])
def test_a_straggler_is_named_from_5_percent_of_its_trace(late_ms, named):
    """Two ranks wait late_ms each for rank2 in a 100 ms step: a delay cost of 4 ms is
    noise (balanced pipeline stages reached 2.8 %), 6 ms a straggler."""
    _, _, out = analyse(*straggler_step(late_ms))
    s = out[0]["straggler"]
    assert (s is not None) == named
    assert s is None or (s["node"], s["span"], s["delay_cost_ns"]) == ("rank2", "backward", 2 * late_ms * MS)


@pytest.mark.parametrize("op,root,late,waits", [
    ("broadcast", 0, 0, {"r0": 0, "r1": 30, "r2": 30}),     # late root: everyone waits for it
    ("broadcast", 0, 2, {"r0": 30, "r1": 0, "r2": 0}),      # a late receiver: the root waits, not r1
    ("reduce", 1, 2, {"r0": 30, "r1": 30, "r2": 0}),        # the non-roots wait as well
    ("gather", 0, 2, {"r0": 30, "r1": 0, "r2": 0}),
    ("scatter", 0, 2, {"r0": 30, "r1": 0, "r2": 0}),
    ("scatter", 2, 2, {"r0": 30, "r1": 30, "r2": 0}),       # late root
    ("all_reduce", None, 2, {"r0": 30, "r1": 30, "r2": 0}),
])
def test_rooted_collectives(op, root, late, waits):
    """As gloo does (3 ranks, one 300 ms late): a late rank holds up the root of every rooted
    op, and in a reduce the other non-roots too, where MPI's semantics would let them go; a
    broadcast's, gather's or scatter's non-root waits for its root alone (N x N had r1 wait
    for r2, and in the demo two non-roots ended 2.5 ms before the late one entered)."""
    s = Spans()
    for r in range(3):
        enter = 10 + (30 if r == late else 0)
        s.add("work", Kind.COMPUTE, 0, enter, f"r{r}")
        attrs = coll(1, [0, 1, 2], op=op)
        if root is not None:
            attrs[sc.COLL_ROOT] = root
        s.add(op, Kind.COLLECTIVE, enter, 45, f"r{r}", **attrs)
    table, at, out = analyse(s.spans, {"r0": 0, "r1": 1, "r2": 2})
    check_tiles(at)
    got = {n: round(v["attribution"]["collective.wait"] / MS) for n, v in out[0]["per_rank"].items()}
    assert got == waits
    if any(waits.values()):
        assert out[0]["straggler"]["node"] == f"r{late}" and out[0]["straggler"]["delay_cost_ns"] == \
            sum(waits.values()) * MS
    else:
        assert out[0]["straggler"] is None


def test_missing_partners_are_reported_and_their_spans_kept():
    s = Spans()
    root = s.add("request", Kind.INTERNAL, 0, 50, "edge")
    s.add("call", Kind.RPC_CLIENT, 5, 45, "edge", root)                      # its server never arrived
    s.add("recv", Kind.RECV, 0, 10, "b", **p2p(0, 1, 7))                        # its send never arrived
    s.add("all_reduce", Kind.COLLECTIVE, 0, 20, "c", **coll(3, [0, 1, 2]))      # one of three ranks only
    s.add("orphan", Kind.COMPUTE, 10, 12, "b", parent=999)                       # its parent never arrived
    table, at, out = analyse(s.spans, {"edge": -1, "b": 1, "c": 0})
    check_tiles(at)
    counts = {k: len(v) for k, v in at.dag.unmatched.items() if len(v)}
    assert counts == {"rpc_client": 1, "recv": 1, "collective": 1, "parent": 1}
    assert out[0]["unmatched"] == counts
    # The unmatched RPC is remote time, not network: nothing says how it splits.
    assert out[0]["per_rank"]["edge"]["remote_ns"] == 40 * MS
    assert out[0]["per_rank"]["b"]["attribution"]["p2p.transfer"] == 10 * MS
    assert out[0]["per_rank"]["c"]["attribution"]["collective.transfer"] == 20 * MS


def test_nested_spans_and_thread_order():
    s = Spans()
    root = s.add("step", Kind.INTERNAL, 0, 30, "n")
    fwd = s.add("forward", Kind.COMPUTE, 2, 20, "n", root)
    s.add("layer1", Kind.COMPUTE, 3, 8, "n", fwd)
    s.add("layer2", Kind.DATA, 10, 18, "n", fwd)
    s.add("optimizer", Kind.COMPUTE, 22, 28, "n", root)
    table, at, out = analyse(s.spans, {"n": 0})
    check_tiles(at)
    dag = at.dag
    rows = {table.names[table.name[i]]: i for i in range(len(table))}
    assert dag.prev[rows["layer2"]] == rows["layer1"]
    assert dag.prev[rows["optimizer"]] == rows["forward"]
    assert dag.parent[rows["layer1"]] == rows["forward"]
    cp = out[0]["attribution"]
    # forward's own time (2-3, 8-10, 18-20) is compute, layer2 is data, step's gaps are host.overhead
    assert ms(cp) == {"compute": 5 + 5 + 6, "data": 8, "host.overhead": 2 + 2 + 2}
    assert out[0]["per_rank"]["n"]["attribution"] == cp


def test_overlapping_threads_count_each_instant_once():
    s = Spans()
    s.add("backward", Kind.COMPUTE, 0, 10, "n", thread=1)
    s.add("all_reduce", Kind.COLLECTIVE, 2, 12, "n", thread=2)    # async, overlaps compute
    s.add("load", Kind.DATA, 11, 14, "n", thread=3)
    table, at, out = analyse(s.spans, {"n": 0})
    per = out[0]["per_rank"]["n"]
    assert ms(per["attribution"]) == {"compute": 10, "data": 3, "collective.transfer": 1}
    assert sum(per["attribution"].values()) == per["window_ns"] == 14 * MS
    check_tiles(at)


def test_rpc_network_legs_and_clock_uncertainty():
    s = Spans()
    root = s.add("request", Kind.INTERNAL, 0, 60, "edge")
    s.add("preprocess", Kind.COMPUTE, 1, 6, "edge", root)
    call = s.add("infer", Kind.RPC_CLIENT, 7, 59, "edge", root)
    srv = s.add("infer", Kind.RPC_SERVER, 37, 49.5, "cloud", call)
    s.add("model", Kind.COMPUTE, 38, 49, "cloud", srv)
    table, at, out = analyse(s.spans, {"edge": -1, "cloud": -1}, errors_ms={"edge": 0.3, "cloud": 0.3})
    check_tiles(at)
    trace = out[0]
    assert ms(trace["attribution"]) == {"compute": 5 + 11, "network.uplink": 30, "network.downlink": 9.5,
                                        "host.overhead": 1 + 1 + 1 + 0.5 + 1}
    legs = {seg["category"]: seg for seg in trace["critical_path"] if seg["category"].startswith("network")}
    assert legs["network.uplink"]["from_node"] == "edge" and legs["network.uplink"]["node"] == "cloud"
    assert legs["network.uplink"]["error_ns"] == 0.6 * MS
    assert legs["network.uplink"]["confidence"] == pytest.approx(1 - 0.6 / 30)
    edge = trace["per_rank"]["edge"]
    assert ms(edge["attribution"]) == {"compute": 5, "network.uplink": 30, "network.downlink": 9.5,
                                       "host.overhead": 3}
    assert edge["remote_ns"] == 12.5 * MS

    # Legs no longer than their clock error bound cannot be placed.
    table, at, out = analyse(s.spans, {"edge": -1, "cloud": -1}, errors_ms={"edge": 6, "cloud": 6})
    assert out[0]["attribution"]["network.uplink"] == 30 * MS
    assert out[0]["attribution"]["network.downlink"] == 0
    assert out[0]["attribution"]["clock.uncertainty"] == 9.5 * MS


def test_a_call_in_a_task_of_its_own_comes_after_what_its_parents_task_did_first():
    """grpc.aio runs a client span in a task of its own (another lane): the request's
    preprocessing before the call is on the path, as with a call on the request's own lane
    (it was host.overhead: the task had no edge from it)."""
    s = Spans()
    root = s.add("request", Kind.INTERNAL, 0, 60, "edge")
    s.add("preprocess", Kind.COMPUTE, 1, 6, "edge", root)
    call = s.add("infer", Kind.RPC_CLIENT, 7, 59, "edge", root, thread=2)
    srv = s.add("infer", Kind.RPC_SERVER, 37, 49.5, "cloud", call)
    s.add("model", Kind.COMPUTE, 38, 49, "cloud", srv)
    table, at, out = analyse(s.spans, {"edge": -1, "cloud": -1})
    check_tiles(at)
    assert ms(out[0]["attribution"]) == {"compute": 5 + 11, "network.uplink": 30, "network.downlink": 9.5,
                                         "host.overhead": 1 + 1 + 1 + 0.5 + 1}


def test_late_sender_and_late_receiver():
    s = Spans()
    s.add("fwd", Kind.COMPUTE, 0, 5, "a")
    s.add("send", Kind.SEND, 5, 6, "a", **p2p(0, 1, 0))
    s.add("recv", Kind.RECV, 0, 6.5, "b", **p2p(0, 1, 0))       # posted 5 ms before the send
    s.add("fwd", Kind.COMPUTE, 6.5, 10, "b")
    s.add("send", Kind.SEND, 10, 13, "b", **p2p(1, 0, 0))         # waits 2 ms for a late receive
    s.add("recv", Kind.RECV, 12, 13, "a", **p2p(1, 0, 0))
    table, at, out = analyse(s.spans, {"a": 0, "b": 1})
    check_tiles(at)
    trace = out[0]
    assert ms(trace["per_rank"]["b"]["attribution"]) == {"p2p.wait": 5 + 2, "p2p.transfer": 1.5 + 1,
                                                         "compute": 3.5}
    # b's send ended when a posted its receive, after 6 ms of nothing: a's idling decided the
    # end, not b's forward (the path ran b's forward into a 3 ms 'transfer' of its send).
    path = [(seg["node"], seg["span"], seg["category"], seg["duration_ns"] / MS)
            for seg in trace["critical_path"] if seg["duration_ns"]]
    assert path == [("a", "fwd", "compute", 5), ("a", "send", "p2p.transfer", 1),
                    ("a", "recv", "host.overhead", 6), ("b", "send", "p2p.transfer", 1)]
    assert Edge(int(at.paths.edge[-1])) == Edge.RENDEZVOUS
    s_ = trace["straggler"]
    assert s_["node"] == "a" and s_["delay_cost_ns"] == 7 * MS
    assert {(w["late_node"], w["wait_caused_ns"]) for w in s_["waits"]} == {("a", 5 * MS), ("a", 2 * MS)}
    # What the late rank was busy with: before its late send, its forward; before its late
    # receive its own send, which was a transfer: its forward again (transfers and
    # collectives are waiting, not work). The costliest wait names the straggler's span.
    assert [w["cause_span"] for w in s_["waits"]] == ["fwd", "fwd"] and s_["span"] == "fwd"


def test_a_send_waits_for_its_receive_and_the_path_goes_to_the_late_receiver():
    """1F1B's steady state, as torch.distributed.pipelining runs it on gloo: the last stage
    posts its gradient's isend and the next activation's irecv together and waits for them
    in that order, and a gloo send completes only once its receive is posted. The slow
    stage computes its forward for 20 ms, then sends the activation and posts the gradient's
    receive. The irecv's end came after the isend's (program order), and the isend's end
    had no edge from the receive it waited for: the path stayed on the last stage, 19 ms of
    'p2p.transfer' from its posts, and never reached the slow stage's forward."""
    s = Spans()
    slow, last = s.add("step", Kind.INTERNAL, 0, 21.7, "s1"), s.add("step", Kind.INTERNAL, 0, 22, "s2")
    s.add("forward", Kind.COMPUTE, 0.5, 20, "s1", slow)
    s.add("isend", Kind.SEND, 20.1, 20.2, "s1", slow, **p2p(1, 2, 1))        # the activation
    s.add("irecv", Kind.RECV, 20.15, 20.5, "s1", slow, **p2p(2, 1, 0))       # the gradient
    s.add("backward", Kind.COMPUTE, 20.6, 21.5, "s1", slow)
    s.add("isend", Kind.SEND, 1, 20.3, "s2", last, **p2p(2, 1, 0))           # waits for s1's irecv
    s.add("irecv", Kind.RECV, 1.01, 20.4, "s2", last, **p2p(1, 2, 1))        # waited after the isend
    s.add("forward", Kind.COMPUTE, 20.5, 21.9, "s2", last)
    table, at, out = analyse(s.spans, {"s1": 1, "s2": 2})
    check_tiles(at)
    on_path = [(seg["node"], seg["span"], seg["category"]) for seg in out[0]["critical_path"]
               if seg["duration_ns"] >= MS]
    assert ("s1", "forward", "compute") in on_path, out[0]["critical_path"]
    assert out[0]["attribution"].get("p2p.transfer", 0) < MS
    assert Edge.RENDEZVOUS in [Edge(int(e)) for e in at.paths.edge]


def test_a_send_that_ended_before_its_receive_was_posted_did_not_wait_for_it():
    """An eager send (buffered, done before the receiver posted) or one on a device (ended when
    queued): no edge from the receive's start, which would pull the path to a later event."""
    s = Spans()
    s.add("send", Kind.SEND, 0, 1, "a", **p2p(0, 1, 0))
    s.add("recv", Kind.RECV, 5, 6, "b", **p2p(0, 1, 0))
    s.add("send", Kind.SEND, 10, 11, "a", **p2p(0, 1, 1, **{sc.P2P_DEVICE: "cuda:0"}))
    s.add("recv", Kind.RECV, 10.5, 12, "b", **p2p(0, 1, 1, **{sc.P2P_DEVICE: "cuda:0"}))
    table, at, out = analyse(s.spans, {"a": 0, "b": 1})
    check_tiles(at)
    assert Edge.RENDEZVOUS not in [Edge(int(e)) for e in at.dag.edge]
    assert [Edge(int(e)) for e in at.dag.edge].count(Edge.MESSAGE) == 2


def gpipe(p=2, m=4, f=1.0, b=1.0):
    """An exact GPipe schedule: stage s runs F(i) at (i + s) f, B in reverse after all F."""
    s = Spans()
    attrs = {sc.PP_SCHEDULE: "ScheduleGPipe", sc.PP_NUM_STAGES: p, sc.PP_NUM_MICROBATCHES: m,
             sc.PP_STAGES_PER_RANK: 1}
    total = (m + p - 1) * (f + b)
    for stage in range(p):
        node = f"stage{stage}"
        root = s.add("step", Kind.INTERNAL, 0, total if stage == 0 else total - stage * b, node)
        for i in range(m):
            t0 = (i + stage) * f
            s.add("forward", Kind.COMPUTE, t0, t0 + f, node, root, **{sc.PP_STAGE: stage, sc.PP_MICROBATCH: i,
                                                                   sc.PP_ACTION: "F", **attrs})
        for i in range(m):
            t0 = (m + p - 1) * f + (i + p - 1 - stage) * b
            s.add("backward", Kind.COMPUTE, t0, t0 + b, node, root, **{sc.PP_STAGE: stage, sc.PP_MICROBATCH: i,
                                                                    sc.PP_ACTION: "B", **attrs})
    return s.spans, {f"stage{i}": i for i in range(p)}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_pipeline_bubble_fraction_matches_the_schedule(p, m):
    table, at, out = analyse(*gpipe(p, m))
    pipe = out[0]["pipeline"]
    ideal = (p - 1) / (m + p - 1)
    assert pipe["ideal_bubble_fraction"] == pytest.approx(ideal)
    assert pipe["bubble_fraction"] == pytest.approx(ideal)
    assert (pipe["ranks"], pipe["microbatches"], pipe["schedule"]) == (p, m, "ScheduleGPipe")
    for node, per in out[0]["per_rank"].items():
        assert per["pipeline"] and per["window_ns"] == out[0]["per_rank"]["stage0"]["window_ns"]
        assert ms(per["attribution"]) == {"compute": 2 * m, "bubble": 2 * (p - 1)}


def test_a_pipeline_steps_lead_in_is_not_the_late_stages_bubble():
    """Stage 1 enters the step at 0 and waits for activations; stage 0 enters at 10, still
    in its previous step before. The path begins at stage 0's entry: the 10 ms before it
    were counted as stage 0's bubble, time it was busy in another trace."""
    s = Spans()
    pp = {sc.PP_SCHEDULE: "ScheduleGPipe", sc.PP_NUM_STAGES: 2, sc.PP_NUM_MICROBATCHES: 1, sc.PP_STAGES_PER_RANK: 1}
    first = s.add("step", Kind.INTERNAL, 10, 13, "stage0")
    s.add("forward", Kind.COMPUTE, 10, 11, "stage0", first, **{sc.PP_STAGE: 0, sc.PP_MICROBATCH: 0, sc.PP_ACTION: "F", **pp})
    s.add("send", Kind.SEND, 11, 12, "stage0", first, **p2p(0, 1, 0, **{sc.PP_STAGE: 0, **pp}))
    second = s.add("step", Kind.INTERNAL, 0, 13, "stage1")
    s.add("recv", Kind.RECV, 0, 12, "stage1", second, **p2p(0, 1, 0, **{sc.PP_STAGE: 1, **pp}))
    s.add("forward", Kind.COMPUTE, 12, 13, "stage1", second, **{sc.PP_STAGE: 1, sc.PP_MICROBATCH: 0, sc.PP_ACTION: "F", **pp})
    table, at, out = analyse(s.spans, {"stage0": 0, "stage1": 1})
    check_tiles(at)
    lead = out[0]["critical_path"][0]
    assert (lead["node"], lead["span"], lead["category"], lead["duration_ns"]) == ("stage0", None, "host.overhead", 10 * MS)
    assert out[0]["per_rank"]["stage1"]["attribution"]["bubble"] == 11 * MS   # its wait is a bubble still


def test_clock_violation_is_clamped_and_reported():
    s = Spans()
    call = s.add("call", Kind.RPC_CLIENT, 10, 20, "a")
    s.add("handle", Kind.RPC_SERVER, 8, 21, "b", call)     # before and after its client: clocks are off
    table, at, out = analyse(s.spans, {"a": -1, "b": -1}, errors_ms={"a": 0.1, "b": 0.1})
    check_tiles(at)
    # The path ends at the server's end and steps back to the client's start, 2 ms after it.
    assert at.paths.violation.max() == 2 * MS
    assert (at.paths.end >= at.paths.start).all()


def test_parent_cycle_does_not_hang():
    spans = [dict(trace=1, id=1, parent=2, name="a", kind=Kind.COMPUTE, start=0, end=5, node="n"),
             dict(trace=1, id=2, parent=1, name="b", kind=Kind.COMPUTE, start=0, end=5, node="n")]
    table, at, out = analyse(spans, {"n": 0})
    assert sum(out[0]["attribution"].values()) == 5 * MS


def test_collective_split_across_traces_and_many_traces():
    s = Spans()
    for tr in (1, 2, 3):
        s.add("step", Kind.COMPUTE, 0, 10 * tr, "x", trace=tr)
    s.add("barrier", Kind.COLLECTIVE, 0, 5, "x", trace=1, **coll(9, [0, 1], op="barrier"))
    s.add("barrier", Kind.COLLECTIVE, 1, 5, "y", trace=2, **coll(9, [0, 1], op="barrier"))
    table, at, out = analyse(s.spans, {"x": 0, "y": 1})
    check_tiles(at)
    assert len(at.dag.unmatched["cross_trace"]) == 2
    # In trace 1 the barrier runs on the step's thread inside the step: the thread is in it.
    assert [o["attribution"]["compute"] for o in out] == [5 * MS, 20 * MS, 30 * MS]
    assert out[0]["attribution"]["collective.transfer"] == 5 * MS


def test_empty_table():
    table, alignment = build([], {})
    at = attribute(table, alignment, match(table))
    assert len(at.paths) == 0 and at.critical.shape == (0, REMOTE + 1)
    assert trace_details(table, at) == []


def test_every_category_has_a_priority():
    assert set(attribution.PRIORITY) == set(CATEGORIES) - {"host.overhead"} | {REMOTE}


def test_a_send_and_a_receive_of_different_sizes_are_not_paired():
    """Two receives from any source waited out of order took each other's numbers: the
    sizes tell, and the pairs stay unmatched rather than joined wrong."""
    s = Spans()
    s.add("send", Kind.SEND, 0, 1, "a", **p2p(0, 1, 0, **{sc.P2P_BYTES: 4}))
    s.add("send", Kind.SEND, 2, 3, "a", **p2p(0, 1, 1, **{sc.P2P_BYTES: 16}))
    s.add("recv", Kind.RECV, 0, 5, "b", **p2p(0, 1, 1, **{sc.P2P_BYTES: 4}))
    s.add("recv", Kind.RECV, 0, 6, "b", **p2p(0, 1, 0, **{sc.P2P_BYTES: 16}))
    s.add("send", Kind.SEND, 7, 8, "a", **p2p(0, 1, 2, **{sc.P2P_BYTES: 8}))
    s.add("recv", Kind.RECV, 6, 9, "b", **p2p(0, 1, 2, **{sc.P2P_BYTES: 8}))
    table, _ = build(s.spans, {"a": 0, "b": 1})
    m = match(table)
    assert m.p2p.tolist() == [[4, 5]]
    assert m.unmatched["send"].tolist() == [0, 1] and m.unmatched["recv"].tolist() == [2, 3]


def test_a_collectives_facts_are_those_its_clocks_bounds_leave_open():
    """Clocks known to 1 us leave a 10 ms collective's start-before-end facts no room to
    bind: none is made. Clocks known to 20 ms leave every pair open; 3 ms, the pairs of
    the late starter and the early ender."""
    from crosstrace.clock_sync.model import line
    from crosstrace.collector.align import causality

    s = Spans()
    for node, (start, end) in {"a": (0.0, 10.0), "b": (1.0, 11.0), "c": (8.0, 12.0)}.items():
        s.add("all_reduce", Kind.COLLECTIVE, start=start, end=end, node=node, **coll(0, [0, 1, 2]))
    table, _ = build(s.spans, {"a": 0, "b": 1, "c": 2})
    matches = match(table)

    def pairs(error_ms):
        models = [line(0.0, 0.0, 0, error_ms * MS) for _ in table.nodes]
        row_a, _, row_b, _ = causality(table, matches, models)
        return {(table.nodes[table.node[a]], table.nodes[table.node[b]]) for a, b in zip(row_a, row_b)}
    assert pairs(0.001) == set()
    assert pairs(20) == {(x, y) for x in "abc" for y in "abc" if x != y}
    assert pairs(3) == {("c", "a"), ("c", "b")}   # a and b end >= 10 ms, c starts at 8 ms: 2 ms < 2 x 3 ms


def test_facts_left_out_by_the_bounds_come_back_where_the_trace_breaks_the_bounds():
    """Clocks 'known to 1 us' that the trace contradicts by 10 ms: the correction has to
    leave a bound, and then the facts the bounds had ruled out must hold too (c's g3
    all_reduce must not end before b's begins)."""
    from crosstrace.clock_sync.model import line
    from crosstrace.collector.align import align

    s = Spans()
    s.add("all_reduce", Kind.COLLECTIVE, start=20.0, end=30.0, node="a", **coll(0, [0, 1]))
    s.add("all_reduce", Kind.COLLECTIVE, start=0.0, end=10.0, node="b", **coll(0, [0, 1]))
    s.add("all_reduce", Kind.COLLECTIVE, start=200.0, end=206.0, node="b", **coll(0, [1, 2], group="g3"))
    s.add("all_reduce", Kind.COLLECTIVE, start=199.0, end=205.0, node="c", **coll(0, [1, 2], group="g3"))
    table, _ = build(s.spans, {"a": 0, "b": 1, "c": 2})
    al = align(table, {n: line(0.0, 0.0, 0, 1000.0) for n in table.nodes})
    assert al.violations == 0
    assert al.start[0] <= al.end[1] and al.start[1] <= al.end[0]
    assert al.start[2] <= al.end[3] and al.start[3] <= al.end[2]


def test_a_collective_key_gathering_many_spans_gives_nodes_x_nodes_facts():
    """Every start before every end, per node reduced to the member that starts last and the
    one that ends first: the same bounds as all pairs, in nodes x nodes facts, where all
    pairs of thousands of spans under one key (a client's) took gigabytes."""
    from crosstrace.collector.align import causality

    s = Spans()
    for i in range(3000):
        node = ("a", "b", "c")[i % 3]
        s.add("all_reduce", Kind.COLLECTIVE, start=i * 0.001, end=10 + i * 0.001, node=node, **coll(0, [0, 1, 2]))
    table, _ = build(s.spans, {"a": 0, "b": 1, "c": 2})
    row_a, a_end, row_b, b_end = causality(table, match(table))
    assert len(row_a) == 6 and not a_end.any() and b_end.all()       # 3 x 3 node pairs, less a node with itself
    last_start = {n: max(r for r in range(3000) if r % 3 == n) for n in range(3)}
    first_end = {n: min(r for r in range(3000) if r % 3 == n) for n in range(3)}
    assert {(int(a), int(b)) for a, b in zip(row_a, row_b)} == {(last_start[x], first_end[y])
                                                                for x in range(3) for y in range(3) if x != y}


@pytest.mark.parametrize("marker_at", [40, 50])
def test_a_span_that_takes_no_time_keeps_the_path_whole(marker_at):
    """An instant span (a marker, or coarse OTLP timestamps) at the end of one span or in a
    gap: its end used to come before its own start on the thread, a cycle that cut the
    critical path there, and the time before it became host.overhead."""
    s = Spans()
    root = s.add("request", Kind.INTERNAL, 0, 100, "n0")
    s.add("load", Kind.DATA, 0, 40, "n0", root)
    s.add("marker", Kind.INTERNAL, marker_at, marker_at, "n0", root)
    s.add("infer", Kind.COMPUTE, 60, 100, "n0", root)
    table, at, out = analyse(s.spans, {"n0": -1})
    check_tiles(at)
    assert ms(out[0]["attribution"]) == {"data": 40, "compute": 40, "host.overhead": 20}


def test_a_child_with_its_parents_start_and_end_is_inside_it():
    """Equal start and end (OTLP's microseconds): the parent starts first and ends last,
    though the child comes first in the store (it ended, and was exported, first)."""
    s = Spans()
    s.add("inner", Kind.COMPUTE, 0, 10, "n0", parent=2)
    assert s.add("forward", Kind.COMPUTE, 0, 10, "n0") == 2
    s.add("optimizer", Kind.COMPUTE, 10, 15, "n0")
    table, at, out = analyse(s.spans, {"n0": -1})
    check_tiles(at)
    path = out[0]["critical_path"]
    assert path[0]["span"] == "forward" and path[-1]["span"] == "optimizer"
    assert [seg["span"] for seg in path if seg["duration_ns"]] == ["inner", "optimizer"]
    assert ms(out[0]["attribution"]) == {"compute": 15}


def test_an_untyped_span_inside_compute_is_compute():
    """OpenTelemetry's default kind is INTERNAL: `attention` inside `forward` (and a span
    inside that) is forward's compute on the path and per rank, not host.overhead; an
    untyped span on its own stays the gap it was."""
    s = Spans()
    step = s.add("step", Kind.INTERNAL, 0, 100, "n0")
    forward = s.add("forward", Kind.COMPUTE, 0, 60, "n0", step)
    attention = s.add("attention", Kind.INTERNAL, 10, 50, "n0", forward)
    s.add("softmax", Kind.INTERNAL, 20, 30, "n0", attention)
    s.add("log", Kind.INTERNAL, 70, 90, "n0", step)
    table, at, out = analyse(s.spans, {"n0": -1})
    check_tiles(at)
    assert ms(out[0]["attribution"]) == {"compute": 60, "host.overhead": 40}
    assert ms(out[0]["per_rank"]["n0"]["attribution"]) == {"compute": 60, "host.overhead": 40}


def test_a_pipeline_ranks_window_ends_where_its_next_step_begins():
    """Steps overlap across pipeline ranks: stage 1 is 5 ms ahead, so trace 2 begins while
    stage 0 still computes its step 1. A rank's window reaches to its trace's extent (the
    pipeline's fill and drain are bubble) but not into its own neighbouring step: stage 0's
    compute at 15-20 ms is step 1's, and was also step 2's bubble when every rank's window
    was the whole trace."""
    s = Spans()
    attrs = {sc.PP_SCHEDULE: "ScheduleGPipe", sc.PP_NUM_STAGES: 2, sc.PP_NUM_MICROBATCHES: 1, sc.PP_STAGES_PER_RANK: 1}
    for k, t0 in ((1, 0), (2, 20)):
        for stage, begin, busy in ((0, t0, t0 + 10), (1, t0 - 5, t0 - 5)):
            root = s.add("pipeline.step", Kind.INTERNAL, begin, begin + 20, f"stage{stage}", trace=k)
            s.add("forward", Kind.COMPUTE, busy, busy + 10, f"stage{stage}", root, trace=k,
                  **{sc.PP_STAGE: stage, sc.PP_MICROBATCH: 0, sc.PP_ACTION: "F", **attrs})
    table, at, out = analyse(s.spans, {"stage0": 0, "stage1": 1})
    found = {(str(k), node): (per["window_ns"] / MS, ms(per["attribution"]))
             for k, trace in enumerate(out, 1) for node, per in trace["per_rank"].items()}
    assert found == {("1", "stage0"): (25, {"compute": 10, "bubble": 15}),   # the fill: from trace 1's start
                     ("1", "stage1"): (20, {"compute": 10, "bubble": 10}),
                     ("2", "stage0"): (20, {"compute": 10, "bubble": 10}),   # from its step 1's end, not 15
                     ("2", "stage1"): (25, {"compute": 10, "bubble": 15})}   # the drain: to trace 2's end


def test_the_straggler_is_where_the_delay_began_not_who_passed_it_on():
    """A chain r0 -> r1 -> r2: r0 computes 30 ms before it sends; r1, held up that long,
    computes 3 ms and sends on; r2 waits 33 ms. r1 made others wait longest (33 ms), but it
    waited 30 ms itself: the straggler is r0 (a pipeline's slow first stage)."""
    s = Spans()
    for r in range(3):
        s.add("step", Kind.INTERNAL, 0, 40, f"r{r}")
    s.add("work", Kind.COMPUTE, 0, 30, "r0")
    s.add("send", Kind.SEND, 30, 31, "r0", **p2p(0, 1, 0))
    s.add("recv", Kind.RECV, 0, 31, "r1", **p2p(0, 1, 0))
    s.add("work", Kind.COMPUTE, 31, 34, "r1")
    s.add("send", Kind.SEND, 34, 35, "r1", **p2p(1, 2, 0))
    s.add("recv", Kind.RECV, 1, 35, "r2", **p2p(1, 2, 0))
    table, at, out = analyse(s.spans, {"r0": 0, "r1": 1, "r2": 2})
    straggler = out[0]["straggler"]
    assert (straggler["node"], straggler["span"]) == ("r0", "work"), straggler
    assert straggler["by_node"] == {"r0": 30 * MS, "r1": 33 * MS}


def test_work_after_awaiting_other_tasks_waits_for_them():
    """A request awaits two tasks (asyncio.gather; each task is a lane of its own), then
    post-processes in its own task: the post-processing waited for the slower task, where
    the path ran from it straight back to the request's start, the wait as host.overhead."""
    s = Spans()
    request = s.add("request", Kind.INTERNAL, 0, 70, "n", thread=1)
    s.add("a", Kind.COMPUTE, 1, 61, "n", request, thread=2)
    s.add("b", Kind.COMPUTE, 1, 11, "n", request, thread=3)
    s.add("postprocess", Kind.COMPUTE, 62, 67, "n", request, thread=1)
    table, at, out = analyse(s.spans, {"n": -1})
    check_tiles(at)
    assert [seg["span"] for seg in out[0]["critical_path"] if seg["duration_ns"] >= MS] == [
        "request", "a", "request", "postprocess", "request"]
    assert ms(out[0]["attribution"]) == {"compute": 65, "host.overhead": 5}


def test_segment_labels_read_without_a_role():
    assert segment_label("cloud", "infer", "compute") == "cloud infer (compute)"
    assert segment_label("", "infer", "host.overhead") == "infer (host.overhead)"   # no leading space
    assert segment_label("trainer", None, "bubble") == "trainer outside spans (bubble)"   # read "trainer (bubble)"


def test_the_thread_is_not_in_an_async_op_it_posted_and_left():
    """An irecv or isend posted and waited for later does not hold its thread: its start
    to the next span's start was that op's own p2p.transfer (2.6 ms a step in a 1F1B run,
    where the thread did untraced work), and an isend posted during an irecv's wait took
    the wait's time."""
    s = Spans()
    a, b = s.add("step", Kind.INTERNAL, 0, 30, "a"), s.add("step", Kind.INTERNAL, 0, 29.8, "b")
    s.add("isend", Kind.SEND, 0.5, 29.5, "b", b, **p2p(1, 0, 0))
    s.add("irecv", Kind.RECV, 0.6, 13, "b", b, **p2p(0, 1, 0))
    s.add("irecv", Kind.RECV, 1, 20, "a", a, **p2p(1, 0, 0))    # waited for from 12 to 20
    s.add("forward", Kind.COMPUTE, 10, 12, "a", a)              # 1-10: untraced host work
    s.add("isend", Kind.SEND, 12, 28, "a", a, **p2p(0, 1, 0))   # posted, then the irecv's wait
    s.add("backward", Kind.COMPUTE, 20, 28, "a", a)
    table, at, out = analyse(s.spans, {"a": 0, "b": 1})
    check_tiles(at)
    path = [(g["span"], g["category"], g["duration_ns"] / MS) for g in out[0]["critical_path"] if g["duration_ns"]]
    assert ("irecv", "p2p.transfer", 8) in path and not [g for g in path if g[0] == "isend"]
    assert ms(out[0]["attribution"]) == {"host.overhead": 12, "compute": 10, "p2p.transfer": 8}


def test_a_span_holds_its_thread_around_a_child_whose_parent_link_is_lost():
    """A span within another on its thread that names a parent the trace lacks (dropped, or
    outside a report's window) is still inside it: the enclosing span keeps its own time."""
    s = Spans()
    s.add("load", Kind.DATA, 0, 100, "a")
    s.add("decode", Kind.INTERNAL, 40, 60, "a", 999)
    table, at, out = analyse(s.spans, {"a": 0})
    check_tiles(at)
    path = [(g["span"], g["category"], g["duration_ns"] / MS) for g in out[0]["critical_path"] if g["duration_ns"]]
    assert path[0] == ("load", "data", 40) and ms(out[0]["attribution"]) == {"data": 80, "host.overhead": 20}


def test_a_send_that_returns_after_its_data_arrived_is_not_transfer_beyond_that():
    """A blocking send returned 8 ms after its receive had the data (gloo's completion under
    load: 6.8 ms in a 1F1B run): the critical path counted the send's whole time as
    p2p.transfer, where the per-rank breakdown ends its transfer at the receive's end."""
    s = Spans()
    a = s.add("step", Kind.INTERNAL, 0, 30, "a")
    s.add("forward", Kind.COMPUTE, 0, 10, "a", a)
    s.add("send", Kind.SEND, 10, 20, "a", a, **p2p(0, 1, 0))
    s.add("optimizer", Kind.COMPUTE, 20, 30, "a", a)
    b = s.add("step", Kind.INTERNAL, 0, 25, "b")
    s.add("recv", Kind.RECV, 5, 12, "b", b, **p2p(0, 1, 0))
    table, at, out = analyse(s.spans, {"a": 0, "b": 1})
    check_tiles(at)
    assert ms(out[0]["attribution"]) == {"compute": 20, "p2p.transfer": 2, "host.overhead": 8}
    assert ms(out[0]["per_rank"]["a"]["attribution"]) == {"compute": 20, "p2p.transfer": 2, "host.overhead": 8}


@pytest.mark.parametrize("claims,released", [
    ({"r0": {sc.COLL_IS_ROOT: True}, "r1": {sc.COLL_IS_ROOT: False}, "r2": {sc.COLL_IS_ROOT: False}}, True),
    ({"r0": {sc.COLL_ROOT: "0"}, "r1": {sc.COLL_ROOT: "0"}, "r2": {sc.COLL_ROOT: "0"}}, True),   # a root as text
    ({"r0": {sc.COLL_IS_ROOT: True}, "r1": {sc.COLL_IS_ROOT: True}, "r2": {sc.COLL_IS_ROOT: False}}, False),
])
def test_a_broadcast_is_released_by_its_one_root(claims, released):
    """Its root is the one member that says it is (collective.is_root: a node's rank may be
    unknown to the collector, -1 here for r0 in the first case) or whose node has the rank it
    names; where two claim it, the broadcast stays N x N, whatever the rows' order."""
    s = Spans()
    for r in range(3):
        enter = 40 if r == 2 else 10
        s.add("broadcast", Kind.COLLECTIVE, enter, 45, f"r{r}", **coll(1, [0, 1, 2], op="broadcast"), **claims[f"r{r}"])
    nodes = {"r0": -1 if sc.COLL_IS_ROOT in claims["r0"] else 0, "r1": 1, "r2": 2}
    for spans in (s.spans, s.spans[::-1]):
        table, at, out = analyse(spans, nodes)
        check_tiles(at)
        assert round(out[0]["per_rank"]["r1"]["attribution"]["collective.wait"] / MS) == (0 if released else 30)
