"""The aligned traces as Chrome trace-event JSON, for Perfetto UI and chrome://tracing.

One process per node (named by node id and rank), one thread track per recording
thread; every span a complete ("X") event. Flow arrows follow the DAG's edges between
spans: a send's start to its receive's end (and a receive posted first to the end of its
send, which waited for it), an RPC client's start to its server's start and the server's
end to the client's end, a collective's last entry to every participant's end.

Perfetto draws an arrow from the end of one slice to the start of another, pointing from
the one that began first: bound to the spans themselves, a request's arrow ran from the
client's end back to the server's start. So each arrow joins two zero-length "flow" slices,
on its spans' tracks at the instants the edge joins, bound to them by id (flow v2:
bind_id with flow_out or flow_in binds to the slice itself, not to what encloses a time).
Perfetto draws the arrows of the selected slices, so a user now clicks a marker (or drags
over an area), not the span, to see them.

The critical path of each trace is its own track in a "critical path" process, one slice
per segment named by its category, and every span on it carries `critical_path_ns` in its
args.

Times are microseconds from the earliest span (the reference time of that instant is in
otherData.crosstrace.t0_ns), each 0.1 ns past its instant: Perfetto read a time as
int(us * 1000) (newer releases round it), and 8389376.256 us times 1000 is
8389376255.99..., one ns early, which made back-to-back critical-path segments overlap and
Perfetto drop one of the two.
"""
import numpy as np

from ...proto.semconv import KIND_NAMES
from .. import attribution
from ..columns import dumps
from ..dag import Edge, dense
from ..durations import format_ns
from ..matching import occurrence
from ..report import root_names
from . import PLAIN, aligned_attributes, open_output, outcome

_FLOWS = {Edge.MESSAGE: "p2p", Edge.RENDEZVOUS: "p2p receive posted", Edge.RPC_REQUEST: "rpc request",
          Edge.RPC_RESPONSE: "rpc response", Edge.COMPLETE: "collective"}
_TRUNCATED = 0.0001   # us added to every time and duration (see above)


def _tracks(t, start, end) -> tuple[np.ndarray, list]:
    """A track (tid) per span: its thread's, or where it would overlap a span there without
    nesting (an async op, a concurrent trace), an extra track of that thread, since a
    track's slices must nest. Returns tids (from 1) and, per track, (a row on it, extra index)."""
    lane, _ = dense(t.node, t.thread) if len(t) else (np.empty(0, np.int64), 0)
    order = np.lexsort((-end, start, lane))
    track = np.zeros(len(t), dtype=np.int64)
    stacks: dict = {}              # (lane, k) -> ends of the open slices on that track
    for r, ln, s, e in zip(order.tolist(), lane[order].tolist(), start[order].tolist(), end[order].tolist()):
        k = 0
        while True:
            stack = stacks.setdefault((ln, k), [])
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or e <= stack[-1]:
                stack.append(e)
                break
            k += 1
        track[r] = k
    keys = {}
    tid = np.array([keys.setdefault((ln, k), len(keys) + 1) for ln, k in zip(lane.tolist(), track.tolist())],
                   dtype=np.int64)
    first = {}
    for r, key in enumerate(zip(lane.tolist(), track.tolist())):
        first.setdefault(key, r)
    return tid, [(first[key], key[1]) for key in keys]


def _flow_ends(dag, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each flow edge: the instants of its two markers (2 x n), the rows of their spans,
    and by how much the edge runs backward on the aligned clocks (a causality violation
    left within the error bounds). A span's end is drawn 1 ns inside it: at the end itself,
    Perfetto closes the span first and the marker lands in whatever begins there (where an
    edge joins a span's end to the same instant of another, one marker of the two lies
    outside its span). The arrows leaving one span at one instant (a collective's last
    entry, to every other participant) leave 1 ns apart, within the span: at one instant
    Perfetto nests them, a tower of markers as deep as the group is wide. A marker that
    would come before its source is drawn at the source's instant: Perfetto and
    chrome://tracing drop a flow whose end is read before its start."""
    events = np.stack([dag.src[flows], dag.dst[flows]])
    rows = dag.row_of(events)
    times = dag.time[events]
    is_end = (events < 2 * dag.n_rows) & (events % 2 == 1)
    instants = np.where(is_end, np.maximum(times - 1, dag.starts[rows]), times)
    before = occurrence(dense(rows[0], instants[0])[0])   # arrows that left that span at that instant before
    instants[0] = np.minimum(instants[0] + before, np.maximum(dag.ends[rows[0]] - 1, dag.starts[rows[0]]))
    instants[1] = np.maximum(instants[1], instants[0])
    return instants, rows, np.maximum(times[0] - times[1], 0)


def trace_events(analysed, at: "attribution.Attribution") -> dict:
    t, al = analysed.table, analysed.alignment
    dag, paths = at.dag, at.paths
    n = len(t)
    start, end = dag.starts, dag.ends
    t0 = int(start.min()) if n else 0

    def us(ns, since=t0):
        return (np.round((np.asarray(ns, dtype=np.int64) - since) / 1000.0, 3) + _TRUNCATED).tolist()

    tid, track_rows = _tracks(t, start, end)
    n_lanes = len(track_rows)
    pid = t.node.astype(np.int64) + 1
    rank = [int(r.rank) for r in t.resources]
    events = []
    # Processes grouped by job and role, by rank within one: sorted by rank alone, two jobs'
    # ranks interleaved (trainer-0, stage-0, trainer-1, ...).
    order = sorted(range(len(t.nodes)), key=lambda k: (t.resources[k].job_id, t.resources[k].role, rank[k] < 0,
                                                       rank[k], t.nodes[k]))
    for position, node in enumerate(order):
        node_id = t.nodes[node]
        label = f"{node_id} (rank {rank[node]})" if rank[node] >= 0 else node_id
        events.append({"ph": "M", "name": "process_name", "pid": node + 1, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": node + 1, "args": {"sort_index": position}})
    for i, (r, k) in enumerate(track_rows, 1):
        name = f"thread {int(t.thread[r]):x}" + (f" (overlapping {k})" if k else "")
        events.append({"ph": "M", "name": "thread_name", "pid": int(pid[r]), "tid": i, "args": {"name": name}})

    on_path = np.zeros(n, dtype=np.int64)
    covered = at.segment_row >= 0
    np.add.at(on_path, at.segment_row[covered], (paths.end - paths.start)[covered])
    ts, dur = us(start), us(end, start)
    for i in range(n):
        attrs = aligned_attributes(t, al, i)
        args = {"trace_id": t.trace_ids[t.trace[i]], "span_id": f"{int(t.span_id[i]):016x}",
                "kind": KIND_NAMES.get(int(t.kind[i]), str(t.kind[i])), "error_bound_ns": int(al.error[i])}
        if t.parent_id[i]:
            args["parent_span_id"] = f"{int(t.parent_id[i]):016x}"
        if on_path[i]:
            args["critical_path_ns"] = int(on_path[i])
        if attrs:
            args["attributes"] = attrs
        more = outcome(t, al, i)
        if more is not PLAIN:
            args.update({k: v for k, v in more.items() if v})
        events.append({"ph": "X", "name": t.names[t.name[i]], "cat": args["kind"], "ts": ts[i], "dur": dur[i],
                       "pid": int(pid[i]), "tid": int(tid[i]), "args": args})

    # Flow arrows along the DAG's cross-span edges, between zero-length slices at their ends.
    flows = np.flatnonzero(np.isin(dag.edge, list(_FLOWS)))
    instants, rows, violation = _flow_ends(dag, flows)
    at_us = us(instants)
    for k, e in enumerate(flows.tolist()):
        if rows[0, k] == rows[1, k]:   # a collective's last entry to its own end
            continue
        name = _FLOWS[Edge(int(dag.edge[e]))]
        for side, direction in enumerate(("flow_out", "flow_in")):
            r = int(rows[side, k])
            args = {"span_id": f"{int(t.span_id[r]):016x}"}
            if side and violation[k]:
                args["causality_violation_ns"] = int(violation[k])
            events.append({"ph": "X", "name": name, "cat": "flow", "ts": at_us[side][k], "dur": 0,
                           "pid": int(pid[r]), "tid": int(tid[r]), "bind_id": k + 1, direction: True,
                           "args": args})

    # The critical path: one track per trace.
    cp_pid = len(t.nodes) + 1
    events.append({"ph": "M", "name": "process_name", "pid": cp_pid, "args": {"name": "critical path"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": cp_pid, "args": {"sort_index": -1}})
    name_of = root_names(t, start)
    for tr in np.unique(paths.trace).tolist():   # named so that a slow trace's path is found by its name
        cp_tid = n_lanes + 1 + tr
        duration = format_ns(int(dag.trace_end[tr] - dag.trace_start[tr]))
        events.append({"ph": "M", "name": "thread_name", "pid": cp_pid, "tid": cp_tid,
                       "args": {"name": f"{t.names[name_of[tr]]} {duration} {t.trace_ids[tr][:16]}"}})
    seg_ts, seg_dur = us(paths.start), us(paths.end, paths.start)
    for k in np.flatnonzero(paths.end > paths.start).tolist():
        r, node = int(at.segment_row[k]), int(dag.node[paths.dst[k]])
        category = attribution.NAMES[at.segment_category[k]]
        events.append({"ph": "X", "name": category, "cat": "critical_path", "ts": seg_ts[k], "dur": seg_dur[k],
                       "pid": cp_pid, "tid": n_lanes + 1 + int(paths.trace[k]),
                       "args": {"span": t.names[t.name[r]] if r >= 0 else None, "node": t.nodes[node],
                                "rank": rank[node], "error_ns": int(paths.error[k])}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"crosstrace": {"t0_ns": t0, "epoch_offset_ns": al.epoch_offset_ns}}}


def write(path: str, analysed, attributed: "attribution.Attribution") -> int:
    """Write the JSON file ('-': stdout); returns the number of spans in it."""
    doc = trace_events(analysed, attributed)
    with open_output(path) as out:
        out.write(dumps(doc))
    return len(analysed.table)
