"""`crosstrace export --perfetto`: Chrome trace-event JSON as Perfetto and chrome://tracing
read it. Perfetto draws a flow arrow from the end of its first slice to the start of its
second, and points it from the slice that began first; so each arrow must join two
zero-length slices at the instants the DAG's edge joins, on the tracks of its two spans."""
import json
import os
import subprocess
import sys

from crosstrace.collector.attribution import attribute
from crosstrace.collector.durations import format_ns
from crosstrace.collector.matching import match
from crosstrace.collector.report import Analysed
from crosstrace.collector.views import perfetto
from crosstrace.proto.semconv import Kind

from .test_analysis_units import MS, Spans, build, p2p, straggler_step


def mixed_table():
    """Trace 1: a 3-rank all_reduce with a straggler; trace 2: an async send overlapping the
    next compute on its thread, and its receive; trace 3: an RPC."""
    spans, nodes = straggler_step()
    s = Spans(trace=2)
    s._next = 100
    s.add("send", Kind.SEND, 105, 112, "rank0", **p2p(0, 1, 0))     # waited for only at 112
    s.add("fwd", Kind.COMPUTE, 106, 114, "rank0")                    # overlaps it without nesting
    s.add("recv", Kind.RECV, 100, 106.5, "rank1", **p2p(0, 1, 0))
    call = s.add("infer", Kind.RPC_CLIENT, 210, 250, "rank0", trace=3)
    server = s.add("infer", Kind.RPC_SERVER, 220, 240, "rank1", call, trace=3)
    s.add("model", Kind.COMPUTE, 225, 240, "rank1", server, trace=3)   # the server's last child ends with it
    return build(spans + s.spans, nodes)


def perfetto_import(events) -> tuple[dict, dict]:
    """What Perfetto's JSON importer makes of the events: per track, the slices it keeps
    (it drops a complete slice that begins inside the slice on top and ends after it, and
    pops ended slices only when a later slice begins), and per flow (bind_id), the slices
    its flow_out and flow_in events bind to: each binds to itself, the top of its track's
    stack once it is pushed; a flow_in read before its flow_out is dropped. Events are
    sorted by time, the longer first among equal times, then in file order (trace_sorter);
    times are read as int(us * 1000) (older releases truncate, newer round: the same here).
    Each bound marker also gets "_under": the slices open beneath it."""
    ns = {id(e): int(e["ts"] * 1000.0) for e in events if e["ph"] == "X"}
    kept, bound, stacks = {}, {}, {}     # stacks: per track, (end ns, event) of the open slices
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: (ns[id(e)], -int(e["dur"] * 1000.0))):
        track = (e["pid"], e["tid"])
        stack = stacks.setdefault(track, [])
        begin = ns[id(e)]
        end = begin + int(e["dur"] * 1000.0)
        while stack and (stack[-1][0] < begin or stack[-1][0] == begin and not (
                end == begin == ns[id(stack[-1][1])])):   # zero-length slices at one instant nest
            stack.pop()
        if stack and end > stack[-1][0]:
            continue    # dropped: slice_drop_overlapping_complete_event
        under = [u for _, u in stack]
        stack.append((end, e))
        kept.setdefault(track, []).append(e)
        if "bind_id" in e:
            pair = bound.setdefault(e["bind_id"], {})
            if e.get("flow_out") or "out" in pair:   # else flow_end_without_start
                pair["out" if e.get("flow_out") else "in"] = {**e, "_under": under}
    return kept, bound


def check(doc: dict, table) -> dict:
    """Structural checks, and every slice and flow as Perfetto imports them; returns
    {flow name: [(from span, to span)]}. Each arrow, as Perfetto draws it, runs forward
    in time from an instant of its first span to one of its second, each marker inside its
    span (a start, an end drawn 1 ns before it, arrows leaving at one instant 1 ns apart)."""
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {n for _, n in names} >= {"critical path"}
    assert len(names) == len(table.nodes) + 1
    spans = [e for e in events if e["ph"] == "X" and e["cat"] not in ("critical_path", "flow")]
    assert len(spans) == len(table)
    assert min(int(e["ts"] * 1000.0) for e in spans) == 0
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    assert not any(e["ph"] in "stf" for e in events)
    kept, bound = perfetto_import(events)
    assert sum(map(len, kept.values())) == sum(e["ph"] == "X" for e in events)   # Perfetto drops none
    by_id = {e["args"]["span_id"]: e for e in spans}
    out: dict = {}
    for flow_id, pair in bound.items():
        assert set(pair) == {"out", "in"}
        a, b = pair["out"], pair["in"]
        assert a["name"] == b["name"] and a["cat"] == b["cat"] == "flow" and a["dur"] == b["dur"] == 0
        assert int(a["ts"] * 1000.0) <= int(b["ts"] * 1000.0)        # forward in time
        ends = []
        for marker in (a, b):
            span = by_id[marker["args"]["span_id"]]
            assert span in marker["_under"]                           # inside its span
            begin, at = int(span["ts"] * 1000.0), int(marker["ts"] * 1000.0)
            assert begin <= at <= max(begin, begin + int(span["dur"] * 1000.0) - 1)
            ends.append(span["name"])
        out.setdefault(a["name"], []).append(tuple(ends))
    return out


def test_processes_flows_and_critical_path(tmp_path):
    table, alignment = mixed_table()
    analysed = Analysed(table, alignment, match(table))
    path = tmp_path / "trace.json"
    assert perfetto.write(str(path), analysed, attribute(table, alignment, analysed.matches)) == len(table)
    doc = json.loads(path.read_text())
    flows = check(doc, table)
    assert sorted(flows["p2p"]) == [("send", "recv")]
    assert flows["p2p receive posted"] == [("recv", "send")]   # posted first: the send's end waited for it
    assert flows["rpc request"] == [("infer", "infer")]
    assert flows["rpc response"] == [("infer", "infer")]   # from the server span, not its last child
    assert sorted(flows["collective"]) == [("all_reduce", "all_reduce")] * 2    # last entry -> the two who waited
    threads = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sum("(overlapping 1)" in name for name in threads) == 1

    # The critical path: one track per trace whose slices tile the trace.
    at = attribute(table, alignment, analysed.matches)
    cp = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "critical_path"]
    for tr, name in enumerate(("step", None, "infer")):   # named by its trace's name, duration and id
        duration = format_ns(int(at.dag.trace_end[tr] - at.dag.trace_start[tr]))
        tid = {e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
               and e["args"]["name"].endswith(f" {duration} {table.trace_ids[tr][:16]}")
               and (name is None or e["args"]["name"].startswith(name + " "))}
        assert len(tid) == 1
        total = sum(e["dur"] for e in cp if e["tid"] in tid)
        assert abs(total - (at.dag.trace_end[tr] - at.dag.trace_start[tr]) / 1000) < 0.01
    backward = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "backward"
                and e["args"].get("critical_path_ns")]
    assert len(backward) == 1 and backward[0]["args"]["critical_path_ns"] == 60 * MS
    assert {e["name"] for e in cp} >= {"compute", "collective.transfer"}


def test_processes_are_grouped_by_job_and_role_then_rank(tmp_path):
    """Sorted by rank alone, two roles' ranks were interleaved: trainer-0, stage-0, trainer-1."""
    spans, nodes = straggler_step()
    names = {"rank0": "trainer-0", "rank1": "stage-0", "rank2": "trainer-1"}
    for s in spans:
        s["node"] = names[s["node"]]
    table, alignment = build(spans, {"trainer-0": 0, "stage-0": 0, "trainer-1": 1})
    for resource in table.resources:
        resource.role = resource.node_id.split("-")[0]
    analysed = Analysed(table, alignment, match(table))
    doc = perfetto.trace_events(analysed, attribute(table, alignment, analysed.matches))
    names_of = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    order = sorted((e["args"]["sort_index"], names_of[e["pid"]]) for e in doc["traceEvents"]
                   if e["name"] == "process_sort_index" and names_of[e["pid"]] != "critical path")
    assert [name for _, name in order] == ["stage-0 (rank 0)", "trainer-0 (rank 0)", "trainer-1 (rank 1)"]


def test_an_edge_that_runs_backward_keeps_its_arrow(tmp_path):
    """Where the aligned clocks leave a receive ending before its send began (a causality
    violation within the error bounds), the arrow's end marker is drawn at its start, with
    the violation in its args: Perfetto and chrome://tracing drop a flow whose end they read
    before its start."""
    s = Spans()
    s.add("send", Kind.SEND, 105, 112, "rank0", **p2p(0, 1, 0))
    s.add("recv", Kind.RECV, 100, 104, "rank1", **p2p(0, 1, 0))
    table, alignment = build(s.spans, {"rank0": 0, "rank1": 0})
    analysed = Analysed(table, alignment, match(table))
    doc = perfetto.trace_events(analysed, attribute(table, alignment, analysed.matches))
    _, bound = perfetto_import(doc["traceEvents"])
    [pair] = [pair for pair in bound.values() if pair["out"]["name"] == "p2p"]
    assert set(pair) == {"out", "in"} and pair["out"]["ts"] == pair["in"]["ts"]
    assert pair["in"]["args"]["causality_violation_ns"] == 1 * MS


def test_a_wide_collectives_arrows_leave_side_by_side(tmp_path):
    """A 16-rank all_reduce: the last to enter has 15 arrows leaving at its entry. At one
    instant Perfetto nests their markers, a tower 15 deep on its track; they leave 1 ns apart."""
    from .test_analysis_units import coll

    s = Spans()
    for r in range(16):
        root = s.add("step", Kind.INTERNAL, 0, 100, f"rank{r}")
        s.add("all_reduce", Kind.COLLECTIVE, 70 if r == 15 else 10 + r, 80, f"rank{r}", root, **coll(1, list(range(16))))
    table, alignment = build(s.spans, {f"rank{r}": r for r in range(16)})
    analysed = Analysed(table, alignment, match(table))
    doc = perfetto.trace_events(analysed, attribute(table, alignment, analysed.matches))
    flows = check(doc, table)
    assert len(flows["collective"]) == 15
    _, bound = perfetto_import(doc["traceEvents"])
    for pair in bound.values():
        assert not [e for e in pair["out"]["_under"] if e["cat"] == "flow"]


def test_export_command_on_a_real_store(rpc_store, tmp_path):
    out = tmp_path / "rpc.json"
    result = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", rpc_store, "--perfetto", str(out)],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"frontend", "gateway", "model", "critical path"}
    _, flows = perfetto_import(doc["traceEvents"])
    assert len(flows) == 8 * 2 * 2     # 8 requests, two hops, request and response each
    for pair in flows.values():        # forward in time, on the aligned clocks of three nodes
        assert pair["out"]["pid"] != pair["in"]["pid"] and pair["out"]["ts"] <= pair["in"]["ts"]
    result = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", rpc_store],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "nothing to export" in result.stderr


def test_times_survive_perfettos_truncation(tmp_path):
    """Perfetto reads 8389376.256 us as 8389376255 ns (int(us * 1000)): written so, the
    second of two back-to-back slices began inside the first and was dropped."""
    s = Spans()
    step = s.add("step", Kind.COMPUTE, 0, 8450, "rank0")
    s.add("load", Kind.DATA, 0, 8389.376256, "rank0", step)
    s.add("forward", Kind.COMPUTE, 8389.376256, 8419.354592, "rank0", step)
    s.add("backward", Kind.COMPUTE, 8419.354592, 8450, "rank0", step)
    table, alignment = build(s.spans, {"rank0": 0})
    analysed = Analysed(table, alignment, match(table))
    doc = perfetto.trace_events(analysed, attribute(table, alignment, analysed.matches))
    check(doc, table)
    cp = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "critical_path"]
    assert len(cp) == 3
    assert sorted(int(e["ts"] * 1000.0) for e in cp) == [0, 8389376256, 8419354592]
    assert sum(int(e["dur"] * 1000.0) for e in cp) == 8450 * MS
