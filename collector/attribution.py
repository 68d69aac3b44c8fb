"""Latency attribution in DESIGN.md's vocabulary, on the critical path and per rank.

On the critical path each segment gets one category (the path's segments tile the trace,
so the categories add up to its duration). Per rank (per node in a trace), each instant
of the node's window counts once, by the PRIORITY table when spans overlap. Collective
and point-to-point waits are split at the partner's entry (Scalasca's "wait at N x N" and
"late sender"), and each wait is charged to the rank that arrived late and the span it
was busy with before (Scalasca's delay cost). Pipeline traces also get their measured
bubble fraction next to the schedule's ideal (p - 1) / (v * m + p - 1).

Everything is vectorised over SpanTable rows (every trace of a batch at once, interval
sweeps as in HTA; large tables go in batches of traces, collector/batches.py); the
judgement calls are the tables right below, and nowhere else.
"""
import dataclasses
import itertools
import operator

import numpy as np

from ..proto import semconv as sc
from ..proto.semconv import Kind
from . import batches, critical_path
from .align import Alignment
from .critical_path import NO_EDGE, Paths
from .dag import Dag, Edge, dense, group_time_order, stitch
from .matching import Matches
from .spantable import SpanTable

CATEGORIES = ("compute", "data", "network.uplink", "network.downlink", "collective.wait",
              "collective.transfer", "p2p.wait", "p2p.transfer", "bubble", "host.overhead",
              "clock.uncertainty")
C = {name: i for i, name in enumerate(CATEGORIES)}
REMOTE = len(CATEGORIES)   # not a category: waiting on a peer whose time is attributed there, or unseen
NAMES = CATEGORIES + ("remote",)   # what the report calls each column of the attribution arrays
GAP = -1                   # resolved per node: bubble on a pipeline rank, else host.overhead

# ---- The judgement calls -------------------------------------------------------------
# Time in a span of this kind that no child, partner or join explains.
SELF_TIME = {
    Kind.COMPUTE: "compute",
    Kind.DATA: "data",
    Kind.INTERNAL: GAP,                      # an untyped span: the program's or framework's own time
    Kind.RPC_SERVER: GAP,                    # server-side queueing and (de)serialisation
    Kind.RPC_CLIENT: REMOTE,                 # a call whose server span is missing: remote and unseen
    Kind.SEND: "p2p.transfer",               # matched sends are split at their receive's start and end
    Kind.RECV: "p2p.transfer",               # an early sender: the whole receive is transfer
    Kind.COLLECTIVE: "collective.transfer",  # a matched collective is split at its join instead
}
# A critical-path step from one span to another.
STEP = {
    Edge.RPC_REQUEST: "network.uplink",
    Edge.RPC_RESPONSE: "network.downlink",
    Edge.MESSAGE: "p2p.transfer",            # the receive waited for a late send
    Edge.RENDEZVOUS: "p2p.transfer",         # the send waited for a late receive
    Edge.DELIVERED: GAP,                     # the send returned after its data arrived: the sender's time
    Edge.JOIN: "collective.transfer",        # zero length: the join is its last participant's entry
    Edge.COMPLETE: "collective.transfer",
}
# Per rank, a span's children on its own thread cover it (the thread is in the child).
# When other things happen at once (other threads, async work), the first of these counts:
# communication hidden behind compute is not exposed (HTA), and a rank waits only when it
# does nothing else.
PRIORITY = ("compute", "data", "collective.transfer", "p2p.transfer", "network.uplink", "network.downlink",
            "collective.wait", "p2p.wait", "bubble", "clock.uncertainty", REMOTE)
# A piece between two nodes that is no longer than their combined clock error bound cannot
# be placed: it counts as clock.uncertainty. On a pipeline rank (a node with pp.* spans in
# the trace) waiting for a neighbour stage and idle time are the pipeline's bubble.
# A rank's waiting for others: per rank, not on the critical path, is where a budget measures
# it; and a straggler's own waiting is taken off the delay it caused.
WAITING = ("collective.wait", "p2p.wait", "bubble")
# The kinds of span a trace needs to have time in a category (bubble needs a pipeline rank;
# host.overhead and clock.uncertainty, none): a category budget samples only such traces,
# since a training step has no uplink, and its 0 says nothing of the link.
SOURCE_KINDS = {
    "compute": (Kind.COMPUTE,), "data": (Kind.DATA,),
    "network.uplink": (Kind.RPC_CLIENT, Kind.RPC_SERVER), "network.downlink": (Kind.RPC_CLIENT, Kind.RPC_SERVER),
    "collective.wait": (Kind.COLLECTIVE,), "collective.transfer": (Kind.COLLECTIVE,),
    "p2p.wait": (Kind.SEND, Kind.RECV), "p2p.transfer": (Kind.SEND, Kind.RECV),
}
OFF_PATH = ("collective.wait", "p2p.wait")   # never on the critical path (bubble is: a stage's idle time)
# The straggler is named where its delay cost less its own waiting is at least this share of
# its trace. Balanced GPipe stages (40 ms per action, 400 ms steps) on a loaded 2-core machine
# came to +0.8 to +11.6 ms (up to 2.8 %) on one stage, by their sleeps' overshoot alone.
STRAGGLER_SHARE = 0.05
# ---------------------------------------------------------------------------------------

_NEG = np.iinfo(np.int64).min


def _code(name) -> int:
    return name if isinstance(name, int) else C[name]


_SELF = np.full(256, GAP, dtype=np.int64)
for _kind, _cat in SELF_TIME.items():
    _SELF[int(_kind)] = _code(_cat)
_STEP = np.full(256, GAP, dtype=np.int64)
for _edge, _cat in STEP.items():
    _STEP[int(_edge)] = _code(_cat)
_RANK = np.empty(REMOTE + 1, dtype=np.int64)
_RANK[[_code(c) for c in PRIORITY]] = np.arange(len(PRIORITY))
_LEVELS = [_code(c) for c in PRIORITY]


@dataclasses.dataclass
class Waits:
    """One row per wait one span caused others (a collective instance and the member that
    released the waiting ones, or a p2p pair)."""
    trace: np.ndarray
    is_collective: np.ndarray   # bool: collective join, else point-to-point
    late_row: np.ndarray        # the span that entered late
    cause_row: np.ndarray       # what its rank was busy with before (_busy_before), -1
    cost_ns: np.ndarray         # total wait it caused (Scalasca's delay cost)
    lateness_ns: np.ndarray     # how much later it entered than the partner before it
    waiting: np.ndarray         # participants that waited
    join: np.ndarray            # join index for a collective, -1


@dataclasses.dataclass
class Attribution:
    dag: Dag
    paths: Paths
    matches: Matches
    segment_category: np.ndarray   # per critical-path segment: index into CATEGORIES, or REMOTE
    segment_row: np.ndarray        # per segment: the span it belongs to, -1 for none
    critical: np.ndarray           # (traces, categories + 1) ns on the critical path; last column REMOTE
    group: np.ndarray              # per row: its (trace, node) group
    group_trace: np.ndarray        # per group
    group_node: np.ndarray
    group_pipeline: np.ndarray     # bool: a pipeline rank in this trace
    window: np.ndarray             # per group: ns the breakdown covers
    per_rank: np.ndarray           # (groups, categories + 1) ns, each instant once; last column REMOTE
    waits: Waits
    ops: list                      # collective op names
    op_of_join: np.ndarray         # per join: index into ops
    join_wait: np.ndarray          # per join: summed wait of its participants
    join_transfer: np.ndarray      # per join: summed transfer
    pipelines: dict                # trace index -> pipeline summary


def _resolve(cat: np.ndarray, pipeline: np.ndarray) -> np.ndarray:
    return np.where(cat == GAP, np.where(pipeline, C["bubble"], C["host.overhead"]), cat)


def rank_categories(cat: np.ndarray, pipeline: np.ndarray) -> np.ndarray:
    """Categories of pieces (or SELF_TIME of spans) as a rank's breakdown names them: on a
    pipeline rank, waiting for a neighbour stage and unexplained time are bubble."""
    return _resolve(np.where(pipeline & (cat == C["p2p.wait"]), GAP, cat), pipeline)


def self_categories(kind: np.ndarray, pipeline: np.ndarray) -> np.ndarray:
    """What a span's own time counts as (SELF_TIME), per rank."""
    return rank_categories(_SELF[np.asarray(kind, dtype=np.int64)], pipeline)


def self_kinds(table: SpanTable, dag: Dag) -> np.ndarray:
    """Per row, the kind whose SELF_TIME its own time is: an untyped (INTERNAL) span's is
    its nearest typed ancestor's on its own thread where that one is COMPUTE or DATA (a
    default-kind `attention` span inside `forward` is forward's compute), else its own."""
    kind = table.kind.astype(np.int64)
    parent = dag.parent
    up = np.where((parent >= 0) & (dag.lane[np.maximum(parent, 0)] == dag.lane), parent, -1)
    found = kind.copy()
    for _ in range(64):   # pointer doubling: log2 of the nesting depth passes (64: a parent cycle)
        going = np.flatnonzero((found == Kind.INTERNAL) & (up >= 0))
        if not len(going):
            break
        above = up[going]
        found[going] = found[above]   # typed: the answer; untyped: look on past it
        up[going] = up[above]
    return np.where((kind == Kind.INTERNAL) & np.isin(found, (Kind.COMPUTE, Kind.DATA)), found, kind)


def _uncertain(cat, length, error):
    return np.where((error > 0) & (length <= error), C["clock.uncertainty"], cat)


def _label_path(dag: Dag, paths: Paths, kind: np.ndarray, pipeline_row: np.ndarray):
    """Category and owning span of every critical-path segment."""
    edge = paths.edge
    dst_row = dag.row_of(paths.dst)
    src_row = dag.row_of(np.maximum(paths.src, 0))
    row = dst_row.copy()
    cat = _STEP[edge]
    own = (edge == Edge.SPAN) | (edge == Edge.CHILD_END)
    cat[own] = _SELF[kind[dst_row[own]]]
    parent_start = edge == Edge.CHILD_START
    cat[parent_start] = _SELF[kind[src_row[parent_start]]]
    row[parent_start] = src_row[parent_start]
    row[edge == Edge.RPC_REQUEST] = src_row[edge == Edge.RPC_REQUEST]
    # Along a thread: after a span's start, that span's own time until its end or its first
    # child's start (or a span within it that names no parent we have); before a span's end,
    # that span's; otherwise (between one span's end and the next one's start, or after an
    # async op was posted and left: an isend whose wait() comes later) the next span's
    # parent's if it is open on this thread, else a gap.
    thread = np.flatnonzero(edge == Edge.THREAD)
    after_start = thread[(paths.src[thread] & 1) == 0]
    nxt, span = dst_row[after_start], src_row[after_start]
    held = ((paths.dst[after_start] == paths.src[after_start] + 1) | (dag.parent[nxt] == span)
            | ((dag.parent[nxt] < 0) & (dag.ends[nxt] <= dag.ends[span])))   # a child whose parent link is lost
    left, after_start = after_start[~held], after_start[held]
    cat[after_start] = _SELF[kind[src_row[after_start]]]
    row[after_start] = src_row[after_start]
    after_end = np.sort(np.concatenate([thread[(paths.src[thread] & 1) == 1], left]))
    before_end = after_end[(paths.dst[after_end] & 1) == 1]
    cat[before_end] = _SELF[kind[dst_row[before_end]]]
    gap = after_end[(paths.dst[after_end] & 1) == 0]
    parent = dag.parent[dst_row[gap]]
    inside = (parent >= 0) & (dag.lane[np.maximum(parent, 0)] == dag.lane[dst_row[gap]])
    cat[gap] = np.where(inside, _SELF[kind[np.maximum(parent, 0)]], GAP)
    row[gap[inside]] = parent[inside]
    # The lead-in, from the trace's first event to the path's, lies before the path's node
    # entered this trace (it was in its previous step, say): not a pipeline rank's bubble,
    # which lies within its step.
    lead = edge == NO_EDGE
    cat[lead] = C["host.overhead"]
    row[lead] = -1
    cat = _resolve(cat, pipeline_row[np.where(row >= 0, row, dst_row)])
    return _uncertain(cat, paths.end - paths.start, paths.error), row


def pieces(table: SpanTable, dag: Dag, kind, start, end, error):
    """Per-rank pieces (row, start, end, category): each span split where its partner or
    join entered; `kind` per row is self_kinds'. Untyped spans add none (their time is the
    gap category), but inside a typed one."""
    rows, s, e, cat, err = [], [], [], [], []

    def add(r, a, b, c, x=0):
        rows.append(r)
        s.append(a)
        e.append(b)
        cat.append(np.broadcast_to(np.asarray(c, dtype=np.int64), r.shape))
        err.append(np.broadcast_to(np.asarray(x, dtype=np.int64), r.shape))

    for k in (Kind.COMPUTE, Kind.DATA):
        r = np.flatnonzero(kind == k)
        add(r, start[r], end[r], _SELF[k])
    node = table.node

    def split(r, at, other, wait_cat, busy_cat, until=None):
        cut = np.clip(at, start[r], end[r])
        stop = end[r] if until is None else np.clip(until, cut, end[r])
        x = np.where(node[r] != node[other], error[r] + error[other], 0)
        add(r, start[r], cut, wait_cat, x)
        add(r, cut, stop, busy_cat, x)

    coll = kind == Kind.COLLECTIVE
    r = np.flatnonzero(coll & (dag.join >= 0))
    split(r, start[dag.released_by[r]], dag.released_by[r], C["collective.wait"], C["collective.transfer"])
    r = np.flatnonzero(coll & (dag.join < 0))
    add(r, start[r], end[r], C["collective.transfer"])
    p2p = (kind == Kind.SEND) | (kind == Kind.RECV)
    r = np.flatnonzero((kind == Kind.RECV) & (dag.partner >= 0))
    split(r, start[dag.partner[r]], dag.partner[r], C["p2p.wait"], C["p2p.transfer"])
    # A send is done once its receive is: an async send's time until its late wait() is not
    # transfer (the thread does other things, or nothing).
    r = np.flatnonzero((kind == Kind.SEND) & (dag.partner >= 0))
    split(r, start[dag.partner[r]], dag.partner[r], C["p2p.wait"], C["p2p.transfer"],
          until=end[dag.partner[r]])
    r = np.flatnonzero(p2p & (dag.partner < 0))
    add(r, start[r], end[r], C["p2p.transfer"])
    client = kind == Kind.RPC_CLIENT
    r = np.flatnonzero(client & (dag.partner >= 0))
    srv = dag.partner[r]
    up = np.clip(start[srv], start[r], end[r])
    down = np.clip(end[srv], up, end[r])
    x = np.where(node[r] != node[srv], error[r] + error[srv], 0)
    add(r, start[r], up, C["network.uplink"], x)
    add(r, up, down, REMOTE)
    add(r, down, end[r], C["network.downlink"], x)
    r = np.flatnonzero(client & (dag.partner < 0))
    add(r, start[r], end[r], REMOTE)
    cols = [np.concatenate(a) if a else np.empty(0, np.int64) for a in (rows, s, e, cat, err)]
    rows, s, e, cat, err = cols
    keep = e > s
    rows, s, e, cat, err = rows[keep], s[keep], e[keep], cat[keep], err[keep]
    return rows, s, e, _uncertain(cat, e - s, err)


def _minus_children(table: SpanTable, dag: Dag, rows, s, e, cat, base, span):
    """Pieces with the time of their span's children on the same (node, thread) cut out."""
    child = np.flatnonzero(dag.parent >= 0)
    child = child[(table.node[child] == table.node[dag.parent[child]])
                  & (table.thread[child] == table.thread[dag.parent[child]])]
    covered = np.zeros(len(table), dtype=bool)
    covered[dag.parent[child]] = True
    cut = covered[rows]
    if not cut.any():
        return rows, s, e, cat
    start, end = dag.starts, dag.ends
    holes = dag.parent[child]
    # Boundary points per row: piece starts/ends and hole starts/ends, in time order.
    pr, ps, pe, pc = rows[cut], s[cut], e[cut], cat[cut]
    k, h = len(pr), len(holes)
    point_row = np.concatenate([pr, pr, holes, holes])
    point_t = np.concatenate([ps, pe, start[child], end[child]])
    depth = np.concatenate([np.zeros(2 * k, np.int64), np.ones(h, np.int64), -np.ones(h, np.int64)])
    piece = np.concatenate([np.arange(k), np.full(k + 2 * h, -1)])
    order = group_time_order(point_row, point_t, base[point_row], span)
    point_row, point_t, depth, piece = point_row[order], point_t[order], depth[order], piece[order]
    inside = np.cumsum(depth)                          # children open after each point
    current = np.maximum.accumulate(np.where(piece >= 0, np.arange(len(piece)), -1))
    active = piece[np.maximum(current, 0)]
    seg = np.flatnonzero((point_row[:-1] == point_row[1:]) & (inside[:-1] == 0) & (current[:-1] >= 0))
    p = active[seg]
    seg_s, seg_e = point_t[seg], point_t[seg + 1]
    ok = (p >= 0) & (seg_e > seg_s) & (seg_s >= ps[np.maximum(p, 0)]) & (seg_e <= pe[np.maximum(p, 0)])
    seg, p = seg[ok], p[ok]
    keep = ~cut
    return (np.concatenate([rows[keep], pr[p]]), np.concatenate([s[keep], point_t[seg]]),
            np.concatenate([e[keep], point_t[seg + 1]]), np.concatenate([cat[keep], pc[p]]))


def newly_covered(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For intervals sorted by start: the length of each that no interval before it covers.
    Summed per group laid out on its own key range, that is the length of each group's union."""
    reach = np.maximum.accumulate(end)
    return np.maximum(end - np.maximum(start, np.r_[_NEG, reach[:-1]]), 0)


def _exclusive(group, s, e, cat, n_groups, base, span):
    """ns per (group, category) with each instant counted once, for the highest-priority
    category covering it (union measures of growing category sets)."""
    out = np.zeros((n_groups, REMOTE + 1), dtype=np.int64)
    if not len(group):
        return out, np.zeros(n_groups, dtype=np.int64)
    offset = group * (span + 1) - base
    ks, ke = s + offset, e + offset          # groups occupy disjoint key ranges
    order = np.argsort(ks, kind="stable")
    ks, ke, g, rank = ks[order], ke[order], group[order], _RANK[cat[order]]
    union = np.zeros(n_groups, dtype=np.int64)
    for level, code in enumerate(_LEVELS):
        if not (rank == level).any():
            continue
        m = rank <= level
        now = np.rint(np.bincount(g[m], weights=newly_covered(ks[m], ke[m]), minlength=n_groups)).astype(np.int64)
        out[:, code] = now - union
        union = now
    return out, union


def _pipeline_rows(table: SpanTable) -> tuple[np.ndarray, dict]:
    """Rows carrying pp.* attributes, and per trace the first such row's attributes."""
    attrs = table.attributes
    has_attributes = np.fromiter(map(operator.is_not, attrs, itertools.repeat(None)), dtype=bool, count=len(attrs))
    cand = np.flatnonzero(has_attributes & np.isin(table.kind, [Kind.COMPUTE, Kind.SEND, Kind.RECV, Kind.INTERNAL]))
    stage = table.attr(sc.PP_STAGE, cand)
    pp = cand[np.fromiter((v is not None for v in stage), dtype=bool, count=len(cand))]
    first = {}
    for r in pp.tolist():
        first.setdefault(int(table.trace[r]), r)
    return pp, first


def pipeline_traces(table: SpanTable) -> np.ndarray:
    """The traces with pipeline-parallel spans (pp.* attributes) in them."""
    return np.unique(table.trace[_pipeline_rows(table)[0]])


def _positive_int(value) -> int | None:
    """A count a span states (stages, microbatches): None unless it is one (a client's 1e400
    is an infinity)."""
    try:
        value = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return value if 0 < value < 1 << 31 else None


def _pipeline_summary(table: SpanTable, first_row: int, pp_rows: np.ndarray, fractions: list) -> dict:
    a = table.attributes[first_row]
    stages = set(map(str, table.attr(sc.PP_STAGE, pp_rows)))
    micro = {str(x) for x in table.attr(sc.PP_MICROBATCH, pp_rows) if x is not None}
    v = _positive_int(a.get(sc.PP_STAGES_PER_RANK)) or max(1, len(stages) // max(len(fractions), 1))
    num_stages = _positive_int(a.get(sc.PP_NUM_STAGES)) or len(stages)
    m = _positive_int(a.get(sc.PP_NUM_MICROBATCHES)) or len(micro)
    p = max(1, num_stages // v)
    ideal = (p - 1) / (v * m + p - 1) if v * m + p - 1 > 0 else 0.0
    return {"schedule": a.get(sc.PP_SCHEDULE), "stages": int(num_stages), "ranks": p,
            "stages_per_rank": int(v), "microbatches": int(m),
            "bubble_fraction": float(np.mean(fractions)) if fractions else 0.0,
            "ideal_bubble_fraction": ideal}


def attribute(table: SpanTable, alignment: Alignment, matches: Matches,
              batch_spans: int = batches.SPANS_PER_BATCH) -> Attribution:
    """Stitch, find the critical paths, and attribute every trace of the table, in batches
    of whole traces of about `batch_spans` spans (collector/batches.py says why)."""
    if len(table) <= batch_spans:
        dag = stitch(table, alignment, matches)
        return attribute_paths(table, alignment, matches, dag, critical_path.find(dag))
    parts = batches.split(table, alignment, matches, batch_spans, together=pipeline_traces(table))
    results = [attribute(b.table, b.alignment, b.matches, max(batch_spans, len(b.table))) for b in parts]
    return _merge(table, matches, parts, results)


def _merge(table: SpanTable, matches: Matches, parts: list, results: list[Attribution]) -> Attribution:
    """One Attribution of the whole table from those of its batches."""
    cat = np.concatenate
    dags = [r.dag for r in results]
    m = batches.Merge(parts, dags, len(table))
    dag = batches.merge_dag(m, dags, matches, table)
    paths = batches.merge_paths(m, [r.paths for r in results], dags, len(table.trace_ids))
    group_offset = np.r_[0, np.cumsum([len(r.group_trace) for r in results])]
    ops = sorted(set(matches.coll_op))
    op_id = {op: i for i, op in enumerate(ops)}
    w = [r.waits for r in results]
    waits = Waits(
        trace=cat([x.trace + b.first_trace for x, b in zip(w, parts)]), is_collective=cat([x.is_collective for x in w]),
        late_row=cat([m.rows(i, x.late_row) for i, x in enumerate(w)]),
        cause_row=cat([m.rows(i, x.cause_row) for i, x in enumerate(w)]), cost_ns=cat([x.cost_ns for x in w]),
        lateness_ns=cat([x.lateness_ns for x in w]), waiting=cat([x.waiting for x in w]),
        join=cat([m.joins(i, x.join) for i, x in enumerate(w)]))
    return Attribution(
        dag, paths, matches, segment_category=cat([r.segment_category for r in results]),
        segment_row=cat([m.rows(i, r.segment_row) for i, r in enumerate(results)]),
        critical=cat([r.critical for r in results]),
        group=m.scatter_rows([r.group + group_offset[i] for i, r in enumerate(results)]),
        group_trace=cat([r.group_trace + b.first_trace for r, b in zip(results, parts)]),
        group_node=cat([r.group_node for r in results]), group_pipeline=cat([r.group_pipeline for r in results]),
        window=cat([r.window for r in results]), per_rank=cat([r.per_rank for r in results]), waits=waits, ops=ops,
        op_of_join=cat([np.array([op_id[op] for op in r.ops] + [0], dtype=np.int64)[r.op_of_join] for r in results]),
        join_wait=cat([r.join_wait for r in results]), join_transfer=cat([r.join_transfer for r in results]),
        pipelines={tr + b.first_trace: v for r, b in zip(results, parts) for tr, v in r.pipelines.items()})


def attribute_paths(table: SpanTable, alignment: Alignment, matches: Matches, dag: Dag, paths: Paths) -> Attribution:
    """Attribute every trace, given its stitched DAG and critical paths."""
    n_traces = len(table.trace_ids)
    start, end = dag.starts, dag.ends

    group, n_groups = dense(table.trace, table.node)
    first = np.unique(group, return_index=True)[1]
    group_trace = table.trace[first].astype(np.int64)
    group_node = table.node[first].astype(np.int64)
    pp_rows, pp_first = _pipeline_rows(table)
    group_pipeline = np.zeros(n_groups, dtype=bool)
    group_pipeline[group[pp_rows]] = True

    kind = self_kinds(table, dag)
    seg_cat, seg_row = _label_path(dag, paths, kind, group_pipeline[group])
    critical = np.zeros((n_traces, REMOTE + 1), dtype=np.int64)
    np.add.at(critical, (paths.trace, seg_cat), paths.end - paths.start)

    lo, hi = _windows(table, dag, start, end, group, n_groups, group_trace, group_node, group_pipeline)
    per_rank = _per_rank(table, dag, kind, alignment.error.astype(np.int64), group, group_trace, group_pipeline,
                         lo, hi)
    window = hi - lo

    waits, join_wait, join_transfer = _waits(table, dag, start, end)
    ops = sorted(set(matches.coll_op))
    op_id = {op: i for i, op in enumerate(ops)}
    op_of_join = np.array([op_id[matches.coll_op[i]] for i in dag.join_instance.tolist()], dtype=np.int64)

    pipelines = {}
    for tr, first_row in pp_first.items():
        groups = np.flatnonzero(group_pipeline & (group_trace == tr))
        fractions = (per_rank[groups, C["bubble"]] / np.maximum(window[groups], 1)).tolist()
        pipelines[tr] = _pipeline_summary(table, first_row, pp_rows[table.trace[pp_rows] == tr], fractions)
    return Attribution(dag, paths, matches, seg_cat, seg_row, critical, group, group_trace, group_node,
                       group_pipeline, window, per_rank, waits, ops, op_of_join, join_wait, join_transfer, pipelines)


def _windows(table: SpanTable, dag: Dag, start, end, group, n_groups, group_trace, group_node, group_pipeline):
    """Per (trace, node) group, the window [lo, hi) its breakdown covers: the extent of the
    node's top-level spans in the trace (those whose parent is on another node, or none),
    so that an async op outliving the span it began in (a send waited on in the next step)
    does not stretch it. A pipeline rank's reaches on to the whole step's extent, where the
    pipeline fills and drains, but not into its own previous or next step: the ranks'
    steps are staggered, and that time is theirs (it counted twice, as their compute and as
    this step's bubble)."""
    parent = dag.parent
    top = np.flatnonzero((parent < 0) | (table.node[np.maximum(parent, 0)] != table.node))
    lo = np.full(n_groups, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(n_groups, _NEG, dtype=np.int64)
    np.minimum.at(lo, group[top], start[top])
    np.maximum.at(hi, group[top], end[top])
    untopped = np.flatnonzero((lo > hi)[group])   # only a parent cycle, in broken input
    np.minimum.at(lo, group[untopped], start[untopped])
    np.maximum.at(hi, group[untopped], end[untopped])
    pp = np.flatnonzero(group_pipeline)
    pp = pp[np.lexsort((lo[pp], group_node[pp]))]   # each node's steps in order
    same = group_node[pp[1:]] == group_node[pp[:-1]]
    before = np.full(len(pp), _NEG, dtype=np.int64)
    after = np.full(len(pp), np.iinfo(np.int64).max, dtype=np.int64)
    before[1:][same], after[:-1][same] = hi[pp[:-1]][same], lo[pp[1:]][same]
    trace_lo, trace_hi = dag.trace_start[group_trace[pp]], dag.trace_end[group_trace[pp]]
    lo[pp] = np.minimum(lo[pp], np.maximum(trace_lo, before))
    hi[pp] = np.maximum(hi[pp], np.minimum(trace_hi, after))
    return lo, hi


def _per_rank(table: SpanTable, dag: Dag, kind, error, group, group_trace, group_pipeline, lo, hi) -> np.ndarray:
    """(groups, categories + 1) ns: every instant of each node's window [lo, hi) once."""
    start, end = dag.starts, dag.ends
    span = int((dag.trace_end - dag.trace_start).max()) if len(dag.trace_start) else 0
    rows, s, e, cat = pieces(table, dag, kind, start, end, error)
    rows, s, e, cat = _minus_children(table, dag, rows, s, e, cat, dag.trace_start[table.trace], span)
    g = group[rows]
    s, e = np.maximum(s, lo[g]), np.minimum(e, hi[g])
    inside = e > s
    rows, s, e, cat, g = rows[inside], s[inside], e[inside], cat[inside], g[inside]
    cat = rank_categories(cat, group_pipeline[g])
    window = hi - lo
    per_rank, covered = _exclusive(g, s, e, cat, len(window), dag.trace_start[group_trace[g]], span)
    gap = np.maximum(window - covered, 0)
    per_rank[np.arange(len(window)), np.where(group_pipeline, C["bubble"], C["host.overhead"])] += gap
    return per_rank


_COMMUNICATION = (Kind.COLLECTIVE, Kind.SEND, Kind.RECV)


def _busy_before(table: SpanTable, dag: Dag, rows: np.ndarray) -> np.ndarray:
    """Per row, what its rank was busy with before it: the span that ended last before it
    on its thread (else its parent), going back past transfers and collectives, which name
    the rank's waiting, not its work (a late stage's send was named as the cause of its
    lateness, and a receive it waited in)."""
    before = np.where(dag.prev >= 0, dag.prev, dag.parent)
    cause = before[rows]
    for _ in range(len(before)):   # each step goes back in time: bounded all the same
        back = np.flatnonzero(cause >= 0)
        back = back[np.isin(table.kind[cause[back]], _COMMUNICATION)]
        if not len(back):
            break
        cause[back] = before[cause[back]]
    return cause


def _waits(table: SpanTable, dag: Dag, start, end):
    """Who made whom wait: per collective join and per point-to-point pair."""
    members = np.flatnonzero(dag.join >= 0)
    j = dag.join[members]
    by = dag.released_by[members]
    n_joins = len(dag.join_time)
    wait = np.clip(start[by], start[members], end[members]) - start[members]
    join_wait = np.bincount(j, weights=wait, minlength=n_joins)
    join_transfer = np.bincount(j, weights=end[members] - start[members], minlength=n_joins) - join_wait
    # One row per join and member that released others (the last to enter; a root for the
    # non-roots of a broadcast, gather or scatter). Lateness: how much later it entered than
    # the one before it among those it released.
    group, n_groups = dense(j, by) if len(members) else (j, 0)
    first = np.unique(group, return_index=True)[1]
    group_join, late = j[first], by[first]
    group_wait = np.bincount(group, weights=wait, minlength=n_groups)
    other = (start[members] <= start[by]) & (members != by)
    second = np.full(n_groups, _NEG, dtype=np.int64)
    np.maximum.at(second, group[other], start[members[other]])
    waiting = np.bincount(group[wait > 0], minlength=n_groups)
    lateness = np.where(second > _NEG, start[late] - second, 0)

    # Point-to-point, each side: a receive waits for a late send, a send for a late receive.
    sides = np.flatnonzero(((table.kind == Kind.SEND) | (table.kind == Kind.RECV)) & (dag.partner >= 0))
    other = dag.partner[sides]
    p2p_wait = np.clip(start[other], start[sides], end[sides]) - start[sides]
    hit = p2p_wait > 0
    sides, other, p2p_wait = sides[hit], other[hit], p2p_wait[hit]

    trace = np.concatenate([dag.join_trace[group_join], table.trace[other].astype(np.int64)])
    late_row = np.concatenate([late, other])
    keep = np.concatenate([group_wait > 0, np.ones(len(other), dtype=bool)])
    waits = Waits(
        trace=trace[keep], is_collective=np.r_[np.ones(n_groups, bool), np.zeros(len(other), bool)][keep],
        late_row=late_row[keep], cause_row=_busy_before(table, dag, late_row[keep]),
        cost_ns=np.rint(np.r_[group_wait, p2p_wait]).astype(np.int64)[keep],
        lateness_ns=np.r_[lateness, p2p_wait].astype(np.int64)[keep],
        waiting=np.r_[waiting, np.ones(len(other), np.int64)][keep],
        join=np.r_[group_join, np.full(len(other), -1)][keep].astype(np.int64))
    return waits, np.rint(join_wait).astype(np.int64), np.rint(join_transfer).astype(np.int64)


__all__ = ["CATEGORIES", "NAMES", "REMOTE", "STRAGGLER_SHARE", "WAITING", "Attribution", "Waits", "attribute",
           "attribute_paths", "pieces", "self_kinds"]
