"""The critical path of every trace: the chain of events that decided when it ended.

Each event's critical predecessor is the DAG predecessor that happened last: the one
it waited for (for a collective's join, the last rank to enter, and for the end of a
host broadcast's, gather's or scatter's non-root, its root's entry; for a receive's end,
a late send). Walking these back from the trace's last event gives the path with zero
slack, which is the longest path through the DAG when edges weigh what their activity
took on the aligned timeline (the critical path method's definition).

Clocks are imperfect, so a predecessor may appear after its successor; such a step is
clamped to zero length (its `violation_ns` says by how much), which keeps the segments
of a path back to back from the trace's first event to its last. A segment between two
nodes carries both nodes' clock error bounds as `error`.
"""
import dataclasses

import numpy as np

from .dag import Dag, Edge

NO_EDGE = 255      # the lead-in: from the trace's first event to the path's first event
_NEG = np.iinfo(np.int64).min


@dataclasses.dataclass
class Paths:
    trace: np.ndarray       # per segment, ordered by trace, then time
    start: np.ndarray       # int64 aligned ns
    end: np.ndarray
    src: np.ndarray         # event where the segment starts (-1 for a lead-in)
    dst: np.ndarray         # event where it ends
    edge: np.ndarray        # uint8 Edge, or NO_EDGE
    error: np.ndarray       # int64: clock error bound of the segment's length (0 on one node)
    violation: np.ndarray   # int64: how far the predecessor lay after its successor (clamped away)
    bounds: np.ndarray      # per trace: its segments are [bounds[t], bounds[t + 1])

    def __len__(self) -> int:
        return len(self.start)


def critical_predecessors(dag: Dag) -> tuple[np.ndarray, np.ndarray]:
    """Per event, the predecessor with the latest time (times above the event's own count
    as the event's time: a clock error, not a later cause); ties go to the higher Edge."""
    n = dag.n_events
    t = dag.time
    key = np.minimum(t[dag.src], t[dag.dst])
    best = np.full(n, _NEG, dtype=np.int64)
    np.maximum.at(best, dag.dst, key)
    cand = np.flatnonzero(key == best[dag.dst])
    priority = np.full(n, -1, dtype=np.int16)
    np.maximum.at(priority, dag.dst[cand], dag.edge[cand].astype(np.int16))
    chosen = cand[dag.edge[cand] == priority[dag.dst[cand]]]
    pred = np.full(n, -1, dtype=np.int64)
    pred[dag.dst[chosen]] = dag.src[chosen]
    pred_edge = np.full(n, NO_EDGE, dtype=np.uint8)
    pred_edge[dag.dst[chosen]] = dag.edge[chosen]
    return pred, pred_edge


def sinks(dag: Dag) -> np.ndarray:
    """Per trace, the end event of its last span (a root span's end on ties)."""
    n_traces = len(dag.trace_start)
    rows = np.arange(dag.n_rows)
    trace = dag.trace[1:2 * dag.n_rows:2].astype(np.int64)
    key = (dag.ends - dag.trace_start[trace]) * 2 + (dag.parent < 0)
    best = np.full(n_traces, _NEG, dtype=np.int64)
    np.maximum.at(best, trace, key)
    top = rows[key == best[trace]]
    _, first = np.unique(trace[top], return_index=True)
    out = np.full(n_traces, -1, dtype=np.int64)
    out[trace[top[first]]] = 2 * top[first] + 1
    return out


def _walk(pred: np.ndarray, sink_events: np.ndarray, n_events: int) -> tuple[np.ndarray, np.ndarray]:
    """Events of each path, first to last, concatenated; and the trace of each entry.
    A repeated event (a cycle, only possible with inconsistent input) ends the walk."""
    visited = bytearray(n_events)
    step = pred.item
    events, traces = [], []
    for tr, v in enumerate(sink_events.tolist()):
        if v < 0:
            continue
        path = [v]
        visited[v] = 1
        p = step(v)
        while p >= 0 and not visited[p]:
            visited[p] = 1
            path.append(p)
            p = step(p)
        path.reverse()
        events.append(path)
        traces.append(np.full(len(path), tr, dtype=np.int64))
    if not events:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.fromiter((v for path in events for v in path), dtype=np.int64), np.concatenate(traces)


def _clamp_backwards(time: np.ndarray, group: np.ndarray, base: np.ndarray, span: int) -> np.ndarray:
    """Running minimum from each path's end back to its start (times may only decrease
    going back along a path)."""
    offset = group * (span + 1)
    if len(group) and int(group.max() + 1) * (span + 1) >= (1 << 62):
        out = time.copy()
        for g in np.unique(group):
            sel = np.flatnonzero(group == g)
            out[sel] = np.minimum.accumulate(time[sel][::-1])[::-1]
        return out
    shifted = time - base + offset
    return np.minimum.accumulate(shifted[::-1])[::-1] - offset + base


def find(dag: Dag) -> Paths:
    pred, pred_edge = critical_predecessors(dag)
    ev, tr = _walk(pred, sinks(dag), dag.n_events)
    span = int((dag.trace_end - dag.trace_start).max()) if len(dag.trace_start) else 0
    raw = dag.time[ev]
    cur = _clamp_backwards(raw, tr, dag.trace_start[tr], span)

    # Steps along each path, and a lead-in from the trace's first event where needed.
    step = np.flatnonzero(tr[:-1] == tr[1:]) if len(tr) else np.empty(0, np.int64)
    first = np.flatnonzero(np.r_[True, tr[1:] != tr[:-1]]) if len(tr) else np.empty(0, np.int64)
    lead = first[cur[first] > dag.trace_start[tr[first]]]
    trace = np.concatenate([tr[lead], tr[step]])
    start = np.concatenate([dag.trace_start[tr[lead]], cur[step]])
    end = np.concatenate([cur[lead], cur[step + 1]])
    src = np.concatenate([np.full(len(lead), -1, np.int64), ev[step]])
    dst = np.concatenate([ev[lead], ev[step + 1]])
    edge = np.concatenate([np.full(len(lead), NO_EDGE, np.uint8), pred_edge[ev[step + 1]]])
    violation = np.concatenate([np.zeros(len(lead), np.int64), np.maximum(raw[step] - cur[step], 0)])
    order = np.argsort(np.concatenate([2 * lead, 2 * step + 1]))   # path order, lead-in first
    trace, start, end, src, dst, edge, violation = (a[order] for a in (trace, start, end, src, dst, edge, violation))

    cross = (src >= 0) & (dag.node[np.maximum(src, 0)] != dag.node[dst])
    error = np.where(cross, dag.error[np.maximum(src, 0)] + dag.error[dst], 0)
    bounds = np.searchsorted(trace, np.arange(len(dag.trace_start) + 1))
    return Paths(trace, start, end, src, dst, edge, error, violation, bounds)


__all__ = ["Edge", "NO_EDGE", "Paths", "critical_predecessors", "find", "sinks"]
