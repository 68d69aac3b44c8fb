"""Stitching: every trace as one DAG over span boundaries, with typed edges.

Events: span row i has a start event 2i and an end event 2i+1; each collective instance
within a trace (a join) has one more event, at the moment its last participant entered.
An edge a -> b says "a happened before b, and b may have waited for it":

  SPAN          a span's start -> its end
  THREAD        program order: each boundary -> the next one on the same (node, thread);
                a thread passes its span starts and ends one after the other, nested or
                not (an async op's end, its wait(), comes after the work done meanwhile).
                In asyncio the tracer's "thread" is the task: tasks interleave on a thread
  CHILD_START   parent start -> child start;   CHILD_END: child end -> parent end
                (for a child on another thread or node; on the same thread, THREAD says it)
  RPC_REQUEST   client start -> server start;  RPC_RESPONSE: server end -> client end
  MESSAGE       send start -> receive end
  RENDEZVOUS    receive start -> send end, where the send ended after it, on the host: a
                send completes once its receive is posted (gloo's did in every pipeline run
                measured), so a late receiver holds up what the sender's thread waits for
                next (1F1B's last stage waits on its gradient's isend, then on the next
                activation's irecv). A send that ended first did not wait (an eager one);
                one on a device ends when it is queued
  DELIVERED     receive end -> send end, where the send ended after it, on the host: the
                send returned only once its data had arrived; what it took longer is the
                sender's, not the network's (the per-rank breakdown ends its transfer there)
  JOIN          a participant's start -> the collective's join (the last entry releases it)
  COMPLETE      the join -> a participant's end

Everyone's entry joins; who waits for whom follows what gloo does. MPI's semantics let a
broadcast's root leave before a late receiver (Scalasca's "late broadcast") or a reduce's
non-roots before a late root, but gloo blocks them. Measured with gloo (3 ranks, one 300
ms late, 4 B and 4 MB): a late root held up everyone in broadcast, reduce, gather and
scatter, and a late non-root held up the root of all four; only reduce held up the other
non-roots too. So a member is released by the last to enter (COMPLETE from the join), but
a non-root of a broadcast, gather or scatter on the host by its root's entry (COMPLETE
from the root's start): N x N, the demo's DDP bucket-order broadcast had two non-roots
end 2.5 ms before a late non-root entered, a causality violation. `released_by` names,
per member, the row whose entry released it.

All of it is built with array operations over the SpanTable (all traces at once).
Edges only join spans of the same trace; a partner that is missing, or recorded under
another trace, is listed in `unmatched` and its span stays in the DAG without the edge.
"""
import dataclasses
from enum import IntEnum

import numpy as np

from ..proto import semconv as sc
from ..proto.semconv import Kind
from .align import Alignment, host_side
from .matching import Matches, released_by_root
from .spantable import SpanTable


class Edge(IntEnum):
    """Edge types; on equal times the critical path prefers the higher value."""
    SPAN = 0
    THREAD = 1
    CHILD_START = 2
    CHILD_END = 3
    RPC_REQUEST = 4
    RPC_RESPONSE = 5
    MESSAGE = 6
    JOIN = 7
    COMPLETE = 8
    RENDEZVOUS = 9
    DELIVERED = 10


@dataclasses.dataclass
class Dag:
    n_rows: int
    time: np.ndarray          # int64 per event, aligned ns
    error: np.ndarray         # int64 per event, clock error bound
    node: np.ndarray          # int32 per event (a join: its last participant's node)
    trace: np.ndarray         # int32 per event
    src: np.ndarray           # int64 per edge
    dst: np.ndarray           # int64 per edge
    edge: np.ndarray          # uint8 per edge (Edge)
    parent: np.ndarray        # per row: parent row in the same trace, -1
    prev: np.ndarray          # per row: the span that ended last before it started on its thread, -1
    lane: np.ndarray          # per row: its (trace, node, thread)
    partner: np.ndarray       # per row: the other side of a send/recv or RPC in the same trace, -1
    join: np.ndarray          # per row: join index of a collective participant, -1
    join_time: np.ndarray     # per join: last entry (aligned ns)
    join_last: np.ndarray     # per join: row of the last participant to enter
    join_instance: np.ndarray  # per join: collective instance in Matches
    join_trace: np.ndarray    # per join
    released_by: np.ndarray   # per row: a collective member's releaser (join_last, or its root), -1
    trace_start: np.ndarray   # per trace: first event (aligned ns)
    trace_end: np.ndarray     # per trace: last event
    unmatched: dict           # name -> rows whose partner is missing from their trace

    @property
    def n_events(self) -> int:
        return len(self.time)

    @property
    def starts(self) -> np.ndarray:
        """Per row: the span's start event's time (a view)."""
        return self.time[0:2 * self.n_rows:2]

    @property
    def ends(self) -> np.ndarray:
        """Per row: the span's end event's time (a view)."""
        return self.time[1:2 * self.n_rows:2]

    def row_of(self, events: np.ndarray) -> np.ndarray:
        """Span row of each event; a join event maps to its last participant."""
        events = np.asarray(events, dtype=np.int64)
        rows = events >> 1
        joins = events >= 2 * self.n_rows
        if joins.any():
            rows[joins] = self.join_last[events[joins] - 2 * self.n_rows]
        return rows


def group_time_order(group: np.ndarray, time: np.ndarray, group_base: np.ndarray, span: int) -> np.ndarray:
    """Stable order by (group, time). `group_base` is each entry's earliest possible time and
    `span` bounds time - group_base, so one int64 key usually does (a lexsort otherwise)."""
    group = np.asarray(group, dtype=np.int64)
    n_groups = int(group.max()) + 1 if len(group) else 0
    if n_groups * (span + 1) < (1 << 62):
        return np.argsort(group * (span + 1) + (time - group_base), kind="stable")
    return np.lexsort((time, group))


def dense(*columns: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids (0..k-1) of the distinct combinations of integer columns, in the columns'
    lexicographic order, and k. Small non-negative columns (row, trace and node indices) are
    combined by counting, in linear time; others are ranked by sorting."""
    n = len(columns[0])
    ids, k = np.zeros(n, dtype=np.int64), 1
    if not n:
        return ids, 0
    for col in columns:
        codes, size = _codes(col, _small(n))
        ids, k = ids * size + codes, k * size
        if k > _small(n):
            ids, k = _compact(ids, k)
    return _compact(ids, k)


def _small(n: int) -> int:
    """Largest key range counted with an array rather than sorted."""
    return 4 * n + 1024


def _codes(col: np.ndarray, small: int) -> tuple[np.ndarray, int]:
    if col.dtype.kind in "iu":
        lo, hi = int(col.min()), int(col.max())
        if lo >= 0 and hi < small:
            return col.astype(np.int64), hi + 1
    values, inverse = np.unique(col, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64), len(values)


def _compact(ids: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Renumber ids in [0, k) to 0..distinct-1, keeping their order."""
    if k > _small(len(ids)):
        return _codes(ids, 0)
    present = np.zeros(k, dtype=bool)
    present[ids] = True
    new = np.cumsum(present) - 1
    return new[ids], int(new[-1]) + 1


def _parents(table: SpanTable) -> np.ndarray:
    """Row of each span's parent within the same trace, -1 if none or missing."""
    n = len(table)
    parent = np.full(n, -1, dtype=np.int64)
    if not n:
        return parent
    ids, rank = np.unique(table.span_id, return_inverse=True)
    trace = table.trace.astype(np.int64)
    key = trace * len(ids) + rank.reshape(-1)
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    pos = np.minimum(np.searchsorted(ids, table.parent_id), len(ids) - 1)
    known = (table.parent_id != 0) & (ids[pos] == table.parent_id)
    query = trace * len(ids) + pos
    at = np.minimum(np.searchsorted(sorted_key, query), n - 1)
    found = known & (sorted_key[at] == query)
    parent[found] = order[at[found]]
    _cut_cycles(parent)
    return parent


def _cut_cycles(parent: np.ndarray) -> None:
    """Cut parent links that loop (a client's broken input: spans that are each other's
    parent) at each loop's lowest row, which becomes a root: every walk up the parents ends,
    where the HTML page's nesting walk went on for ever. Pointer doubling finds the rows
    whose ancestor 2**k > n levels up still exists (in a loop or below one)."""
    parent[parent == np.arange(len(parent))] = -1
    up = parent.copy()
    for _ in range(len(parent).bit_length()):
        up = np.where(up >= 0, up[np.maximum(up, 0)], -1)
    seen: set = set()
    for row in np.flatnonzero(up >= 0).tolist():   # rare: walked in Python, each row once
        walk, r = {}, row
        while r >= 0 and r not in walk and r not in seen:
            walk[r] = len(walk)
            r = int(parent[r])
        if r in walk:   # back at a row of this walk: the loop is the walk from there on
            parent[min(m for m, i in walk.items() if i >= walk[r])] = -1
        seen.update(walk)


def _depth(parent: np.ndarray) -> np.ndarray:
    """How many ancestors each row has (pointer doubling: log2 of the depth passes)."""
    depth = (parent >= 0).astype(np.int64)
    up = parent.copy()
    for _ in range(64):
        going = np.flatnonzero(up >= 0)
        if not len(going):
            break
        above = up[going]
        depth[going] += depth[above]   # the ancestors `above` counted so far: the invariant is that
        up[going] = up[above]          # depth counts those below up (all of them once up is -1)
    return depth


def _on_lane(order, lane, start, end, row_base, span: int, on_lane, at, at_base, before: bool = False):
    """For each query (a lane, a time, the base of its trace's times): the first event of
    `order` (every lane's boundaries in the lane's order, _thread_order) on that lane at or
    after that time (`before`: the last at or before it). Returns (the queries that have
    one, those events); none where one int64 key cannot hold every lane's times (a trace of
    weeks over thousands of lanes)."""
    rows = order >> 1
    if not len(on_lane) or (int(lane.max()) + 1) * (span + 1) >= 1 << 62:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    time = np.where(order & 1, end[rows], start[rows])
    keys = lane[rows] * (span + 1) + (time - row_base[rows])
    query = on_lane * (span + 1) + (at - at_base)
    where = np.searchsorted(keys, query, "right") - 1 if before else np.searchsorted(keys, query, "left")
    found = np.flatnonzero((where >= 0) & (where < len(keys)))
    found = found[lane[rows[where[found]]] == on_lane[found]]
    return found, order[where[found]]


def _thread_order(table: SpanTable, start, end, parent, trace_start, span: int):
    """Every lane's (trace, node, thread) boundaries in the order the thread passed them:
    by time; at one instant, the ends of spans that began earlier, then starts, then the
    ends of spans that took no time (a span's start always comes before its own end); among
    starts an outer span's first, among ends an inner one's (by extent, then nesting depth,
    for spans with one start and end). Returns (events in that order, whether each is
    followed by one of the same lane, lane per row, prev per row: the span that ended last
    at or before the row's start on its lane, -1)."""
    n = len(table)
    lane, _ = dense(table.trace, table.node, table.thread)
    rows = np.arange(n, dtype=np.int64)
    events = np.concatenate([2 * rows + 1, 2 * rows])            # ends, then starts
    lanes = np.concatenate([lane, lane])
    is_start = np.repeat(np.array([0, 1], dtype=np.int64), n)
    moment = np.concatenate([np.where(end > start, 0, 2), np.ones(n, dtype=np.int64)])
    depth = _depth(parent)
    tie = np.lexsort((np.concatenate([-depth, depth]), np.concatenate([-start, -end])))
    key = np.concatenate([end, start]) * 3 + moment
    base = np.concatenate([trace_start[table.trace]] * 2) * 3
    order = tie[group_time_order(lanes[tie], key[tie], base[tie], 3 * span + 2)]
    events, lanes, is_start = events[order], lanes[order], is_start[order]
    same_lane_next = lanes[:-1] == lanes[1:]
    last_end = np.maximum.accumulate(np.where(is_start == 0, np.arange(2 * n), -1))
    starts = np.flatnonzero(is_start == 1)
    cand = last_end[starts]
    ok = cand >= 0
    start_rows, end_rows = events[starts[ok]] >> 1, events[cand[ok]] >> 1
    same = lane[start_rows] == lane[end_rows]
    prev = np.full(n, -1, dtype=np.int64)
    prev[start_rows[same]] = end_rows[same]
    return events, same_lane_next, lane, prev


def stitch(table: SpanTable, alignment: Alignment, matches: Matches) -> Dag:
    n = len(table)
    trace = table.trace.astype(np.int64)
    n_traces = len(table.trace_ids)
    start = alignment.start.astype(np.int64)
    end = np.maximum(alignment.end.astype(np.int64), start)
    trace_start = np.full(n_traces, np.iinfo(np.int64).max, dtype=np.int64)
    trace_end = np.full(n_traces, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(trace_start, trace, start)
    np.maximum.at(trace_end, trace, end)
    span = int((trace_end - trace_start).max()) if n else 0

    parent = _parents(table)
    order, same_lane_next, lane, prev = _thread_order(table, start, end, parent, trace_start, span)
    rows = np.arange(n, dtype=np.int64)
    S, E = 2 * rows, 2 * rows + 1
    src, dst, kinds = [S], [E], [np.full(n, Edge.SPAN, np.uint8)]

    def add(a, b, edge):
        src.append(a)
        dst.append(b)
        kinds.append(np.full(len(a), edge, np.uint8))

    add(order[:-1][same_lane_next], order[1:][same_lane_next], Edge.THREAD)
    # Parent/child across threads and nodes; an RPC server under its client is the
    # request and the response.
    is_rpc = np.zeros(n, dtype=bool)
    is_rpc[matches.rpc[:, 1]] = True
    child = np.flatnonzero((parent >= 0) & ~is_rpc)
    child = child[lane[child] != lane[parent[child]]]
    add(S[parent[child]], S[child], Edge.CHILD_START)
    add(E[child], E[parent[child]], Edge.CHILD_END)
    # A child on another lane of its node (a task the parent awaited, a thread it joined) also
    # comes before what its parent's lane does next: gather, then more work in the same task;
    # and after what that lane did last before it began: the lane started it then (work, then
    # a grpc.aio call, which runs its client span in a task of grpc's own).
    joined = child[table.node[child] == table.node[parent[child]]]
    waiter, resumes = _on_lane(order, lane, start, end, trace_start[trace], span,
                               lane[parent[joined]], end[joined], trace_start[trace[joined]])
    add(E[joined[waiter]], resumes, Edge.THREAD)
    started, after = _on_lane(order, lane, start, end, trace_start[trace], span,
                              lane[parent[joined]], start[joined], trace_start[trace[joined]], before=True)
    add(after, S[joined[started]], Edge.THREAD)
    client, server = matches.rpc[:, 0], matches.rpc[:, 1]
    add(S[client], S[server], Edge.RPC_REQUEST)
    add(E[server], E[client], Edge.RPC_RESPONSE)

    partner = np.full(n, -1, dtype=np.int64)
    partner[client], partner[server] = server, client
    p2p = matches.p2p
    same = trace[p2p[:, 0]] == trace[p2p[:, 1]]
    send, recv = p2p[same, 0], p2p[same, 1]
    partner[send], partner[recv] = recv, send
    add(S[send], E[recv], Edge.MESSAGE)
    on_host = np.array([host_side(table.attributes[r], sc.P2P_DEVICE) for r in send.tolist()], dtype=bool)
    waited = on_host & (start[recv] <= end[send])     # a send that ended first did not wait for its receive
    add(S[recv[waited]], E[send[waited]], Edge.RENDEZVOUS)
    delivered = on_host & (end[recv] < end[send])
    add(E[recv[delivered]], E[send[delivered]], Edge.DELIVERED)

    # Collectives: one join per (instance, trace).
    members, instance = matches.coll_rows, matches.coll_instance
    join_key, n_joins = dense(instance, trace[members]) if len(members) else (members, 0)
    join = np.full(n, -1, dtype=np.int64)
    join[members] = join_key
    join_time = np.full(n_joins, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(join_time, join_key, start[members])
    last = start[members] == join_time[join_key]
    join_last = np.full(n_joins, -1, dtype=np.int64)
    join_last[join_key[last]] = members[last]
    join_instance = np.zeros(n_joins, dtype=np.int64)
    join_instance[join_key] = instance
    join_trace = np.zeros(n_joins, dtype=np.int64)
    join_trace[join_key] = trace[members]
    J = 2 * n + join_key
    add(S[members], J, Edge.JOIN)
    released_by = np.full(n, -1, dtype=np.int64)
    released_by[members] = join_last[join_key]
    root = _roots(table, matches, members, join_key, n_joins)
    star = (root[join_key] >= 0) & (members != root[join_key])
    released_by[members[star]] = root[join_key[star]]
    by_last = released_by[members] == join_last[join_key]     # (a root that entered last releases both ways)
    add(J[by_last], E[members[by_last]], Edge.COMPLETE)
    add(S[released_by[members[~by_last]]], E[members[~by_last]], Edge.COMPLETE)

    time = np.concatenate([np.stack([start, end], axis=1).reshape(-1), join_time])
    error = np.repeat(alignment.error.astype(np.int64), 2)
    node = np.repeat(table.node.astype(np.int32), 2)
    error = np.concatenate([error, alignment.error[join_last].astype(np.int64)])
    node = np.concatenate([node, table.node[join_last].astype(np.int32)])
    trace_ev = np.concatenate([np.repeat(table.trace.astype(np.int32), 2), join_trace.astype(np.int32)])

    unmatched = dict(matches.unmatched)
    split = np.bincount(join_instance, minlength=matches.n_collectives) > 1
    unmatched["cross_trace"] = np.union1d(p2p[~same].reshape(-1), members[split[instance]]).astype(np.int64)
    unmatched["parent"] = np.flatnonzero((table.parent_id != 0) & (parent < 0) & (table.kind != Kind.RPC_SERVER))
    return Dag(n, time, error, node, trace_ev, np.concatenate(src), np.concatenate(dst), np.concatenate(kinds),
               parent, prev, lane, partner, join, join_time, join_last, join_instance,
               join_trace, released_by, trace_start, trace_end, unmatched)


def _roots(table: SpanTable, matches: Matches, members: np.ndarray, join_key: np.ndarray, n_joins: int) -> np.ndarray:
    """Per join: the row of its root where it is a broadcast, gather or scatter on the host
    and exactly one member claims to be the root (collective.is_root, or else its node's
    rank is the collective.root the spans name), else -1: the join stays N x N."""
    root = np.full(n_joins, -1, dtype=np.int64)
    rooted_ops = np.array([released_by_root(op) for op in matches.coll_op], dtype=bool)
    if not rooted_ops.any():
        return root
    candidates = np.flatnonzero(rooted_ops[matches.coll_instance])
    rank = np.array([r.rank for r in table.resources], dtype=np.int64)
    claims = np.array([_claims_root(table.attributes[row], rank[table.node[row]])
                       for row in members[candidates].tolist()], dtype=bool)
    claimed = candidates[claims]
    alone = np.bincount(join_key[claimed], minlength=n_joins)[join_key[claimed]] == 1
    root[join_key[claimed[alone]]] = members[claimed[alone]]
    return root


def _claims_root(attributes: dict | None, node_rank: int) -> bool:
    if not attributes or not host_side(attributes, sc.COLL_DEVICE):
        return False
    if sc.COLL_IS_ROOT in attributes:
        return attributes[sc.COLL_IS_ROOT] is True
    try:
        return node_rank >= 0 and int(attributes.get(sc.COLL_ROOT)) == node_rank
    except (TypeError, ValueError, OverflowError):
        return False
