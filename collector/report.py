"""The report: one JSON-ready dict per run, on the aligned timeline.

Shape (stable; scripts read it):
  {"traces": [{"trace_id", "name", "start_ns", "duration_ns", "spans", "nodes", "errors",
               "critical_path": [...], "attribution": {category: ns}, "per_rank": {...},
               "straggler", "collectives": {op: {...}}, "pipeline", "unmatched",
               "segments": {segment: ns}}],
   "summary": {trace name: {"traces", "duration": {p50_ns, p95_ns, p99_ns, mean_ns, max_ns},
                            "attribution": {category: {...}}, "segments": [{"segment", ...}]}},
   "clocks": {node_id: {"offset_ns", "drift_ppm", "error_bound_ns", "samples", ...}},
   "dropped_spans": {node_id: n}, "rejected_spans": {reason: n}, "unmatched", "budgets",
   "collector_clocks": [{"clock", "shift_ns", "first_used_unix_ns"}]}
All times are ns on the reference timeline (the collector's clock: the first one that
wrote the store, continued through the wall clock by any later one, Store._timeline);
add `epoch_offset_ns` for Unix time. Attribution keys are DESIGN.md's vocabulary.
"""
import dataclasses
import functools
import math

import numpy as np

from . import attribution, budgets, spantable
from .align import Alignment, align, fit_models
from .dag import dense
from .matching import Matches, match
from .spantable import SpanTable
from .store import Store
from .wording import counted
from ..proto.semconv import Kind, Status


@dataclasses.dataclass
class Analysed:
    """Everything the views need: the table, its alignment and joins."""
    table: SpanTable
    alignment: Alignment
    matches: Matches
    shown: np.ndarray | None = None   # the traces asked for (indices in the table); None: all

    def shown_rows(self) -> np.ndarray:
        """Whether each span is in a trace asked for."""
        if self.shown is None:
            return np.ones(len(self.table), dtype=bool)
        return np.isin(self.table.trace, self.shown)


def analyse_store(store, trace_ids: list[str] | None = None, progress=None) -> Analysed:
    """The spans of the whole store, or of the traces the ids name (spantable.load)."""
    say = progress or (lambda message: None)
    say(f"loading spans from {store.path}")
    table = spantable.load(store, trace_ids)
    say(f"loaded {counted(len(table), 'span')} in {counted(len(table.trace_ids), 'trace')} from "
        f"{counted(len(table.nodes), 'node')}; aligning clocks")
    models = fit_models(store)
    epoch = int(store.meta("epoch_offset_ns") or 0)
    matches = match(table)
    return Analysed(table, align(table, models, epoch, matches), matches)


def analyse_for_report(store, trace_ids: list[str] | None = None, progress=None) -> Analysed:
    """As analyse_store, but the traces asked for are analysed among all the store's (or
    its window's) and then shown alone, with the numbers the whole report gives them: a
    pipeline rank's window in a step ends where its neighbouring steps begin (read alone,
    every step of a demo's pipeline had others: stage-1's bubble 79.9 against 59.5 ms in
    one), and clock refinement uses every trace's causality (align.py)."""
    if trace_ids is not None:
        spantable.prefixes(trace_ids)   # refused before the store is read
    whole = analyse_store(store, None, progress)
    if trace_ids is None:
        return whole
    shown = spantable.find(whole.table, trace_ids)
    if progress:
        progress(f"{counted(len(shown), 'trace')} asked for, analysed among all {len(whole.table.trace_ids):,}")
    return dataclasses.replace(whole, shown=shown)


def trace_summaries(a: Analysed) -> list[dict]:
    """Per trace: name (its root span, else its earliest span), extent, span and node counts,
    and how many of its spans ended with an ERROR status."""
    t, al = a.table, a.alignment
    n_traces = len(t.trace_ids)
    if not len(t):
        return []
    start = np.full(n_traces, np.iinfo(np.int64).max, dtype=np.int64)
    end = np.full(n_traces, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(start, t.trace, al.start)
    np.maximum.at(end, t.trace, al.end)
    spans = np.bincount(t.trace, minlength=n_traces)
    errors = np.bincount(t.trace[t.status == Status.ERROR], minlength=n_traces)
    name_of = root_names(t, al.start)
    pairs = np.unique(np.stack([t.trace, t.node], axis=1), axis=0)
    nodes_per_trace = np.bincount(pairs[:, 0], minlength=n_traces)
    listed = np.flatnonzero(spans) if a.shown is None else a.shown[spans[a.shown] > 0]
    out = []
    for i in listed.tolist():
        out.append({"trace_id": t.trace_ids[i], "name": t.names[name_of[i]], "start_ns": int(start[i]),
                    "duration_ns": int(end[i] - start[i]), "spans": int(spans[i]),
                    "nodes": int(nodes_per_trace[i]), "errors": int(errors[i])})
    out.sort(key=lambda tr: tr["start_ns"])
    return out


def root_names(t: SpanTable, start: np.ndarray) -> dict[int, int]:
    """Per trace (index), the name (index) it goes by: its earliest root span's, else its
    earliest span's."""
    if not len(t):
        return {}
    is_root = t.parent_id == 0
    order = np.lexsort((start, ~is_root, t.trace))
    first = order[np.r_[True, t.trace[order][1:] != t.trace[order][:-1]]]
    return dict(zip(t.trace[first].tolist(), t.name[first].tolist()))


def clocks_section(models) -> dict:
    """Per node: the current offset and drift (last segment), the largest error bound over
    the sampled range, the drift's bound, the sources the estimate rests on, and flags
    (rejected sources, outliers, clock steps, causality conflicts or violations)."""
    def bound(x):
        return round(x) if math.isfinite(x) else None

    out = {}
    for node_id, m in sorted(models.items()):
        first, last = m.span_ns
        out[node_id] = {"offset_ns": round(m.offset_ns), "drift_ppm": round(m.drift_ppm, 4),
                        "at_local_ns": m.at_ns, "error_bound_ns": bound(m.error_ns),
                        "drift_bound_ppm": round(m.drift_error_ppm, 4) if math.isfinite(m.drift_error_ppm) else None,
                        "segments": len(m.segments), "sampled_local_ns": [first, last],
                        "samples": m.samples, "sources": list(m.sources), "flags": list(m.flags)}
    return out


def _shown_models(a: Analysed) -> dict:
    """The clocks a report lists: every node's, or, for the traces asked for, their nodes'
    (all are fitted, since a node's clock can be known through a peer's)."""
    if a.shown is None:
        return a.alignment.models
    traced = {a.table.nodes[i] for i in np.unique(a.table.node[a.shown_rows()]).tolist()}
    return {node: model for node, model in a.alignment.models.items() if node in traced}


def open_store(path: str, last: int | None = None) -> Store:
    """The store to read, restricted to its last `last` ns of data when given."""
    store = Store(path, readonly=True)
    if last is not None:
        store.keep_last(last)
    return store


def analyse_report(store_path: str, trace_ids=None, progress=None, budget_file: str | None = None,
                   last: int | None = None):
    """(report dict, Analysed, Attribution) of a store (its last `last` ns of data); budgets
    from `budget_file` if given; `progress(message)` hears of each stage."""
    budget_list = budgets.load(budget_file) if budget_file else None
    store = open_store(store_path, last)
    try:
        analysed = analyse_for_report(store, trace_ids, progress=progress)
        if progress:
            progress("stitching traces, finding critical paths, attributing latency")
        attributed = attribution.attribute(analysed.table, analysed.alignment, analysed.matches)
        return build(store, analysed, attributed, budget_list), analysed, attributed
    finally:
        store.close()


def traces_with_details(a: Analysed, at: "attribution.Attribution") -> list[dict]:
    """Each trace's summary with its critical path, attribution, ranks and straggler."""
    traces = trace_summaries(a)
    index = {trace_id: i for i, trace_id in enumerate(a.table.trace_ids)}
    details = trace_details(a.table, at, a.shown)
    for trace in traces:
        trace.update(details[index[trace["trace_id"]]])
    return traces


def build(store, a: Analysed, at: "attribution.Attribution", budget_list=None) -> dict:
    """The report dict of spans analysed and attributed; `budget_list` (budgets.load) adds
    the budgets section."""
    traces = traces_with_details(a, at)
    shown = a.shown_rows()
    return {
        "store": store.path,
        "epoch_offset_ns": a.alignment.epoch_offset_ns,
        "traces": traces,
        "summary": kind_summaries(a.table, at, traces),
        "clocks": clocks_section(_shown_models(a)),
        "dropped_spans": store.dropped_by_node(),
        "rejected_spans": store.rejects(),
        "unmatched": {k: int(np.count_nonzero(shown[v])) for k, v in at.dag.unmatched.items()},
        "budgets": budgets.evaluate(budget_list, traces, a.table, at) if budget_list else [],
        "collector_clocks": store.collector_clocks(),
    }


def _by_trace(trace: np.ndarray, n_traces: int) -> tuple[np.ndarray, np.ndarray]:
    """Order that groups entries by trace (or any group index, index order within one), and
    each group's [bounds[t], bounds[t + 1]) in it."""
    order = np.argsort(trace, kind="stable")
    return order, np.searchsorted(trace[order], np.arange(n_traces + 1))


def _ns(values) -> dict:
    return {name: int(v) for name, v in zip(attribution.CATEGORIES, values)}


def _plain(value):
    """A JSON-ready attribute value (numpy scalars and tuples are not)."""
    return value.item() if isinstance(value, np.generic) else value


class _Labels:
    """Names of spans and nodes of one table, for the report."""

    def __init__(self, t: SpanTable):
        self.t = t
        self.names = t.names
        self.nodes = t.nodes
        self.rank = [int(r.rank) for r in t.resources]

    def span(self, row: int, prefix: str = "") -> dict:
        span, span_id = _keys(prefix, "span", "span_id")
        if row < 0:
            return {span: None, span_id: None}
        t = self.t
        return {span: self.names[t.name[row]], span_id: f"{int(t.span_id[row]):016x}"}

    def node(self, node: int, prefix: str = "") -> dict:
        key, rank = _keys(prefix, "node", "rank")
        return {key: self.nodes[node], rank: self.rank[node]}


@functools.cache
def _keys(prefix: str, *names: str) -> tuple[str, ...]:
    """One string per key: an f-string makes a new one per dict (400 B a span of a report)."""
    return tuple(prefix + name for name in names)


def trace_details(t: SpanTable, at: "attribution.Attribution", traces: np.ndarray | None = None) -> list:
    """Per trace index: critical_path, attribution (on the critical path), remote_ns, per_rank,
    straggler, collectives, pipeline and unmatched, as the report shows them; None for a
    trace not among `traces` (indices; None: all), whose details a report of some traces,
    which analyses them all, would build only to drop."""
    n_traces = len(t.trace_ids)
    wanted = np.ones(n_traces, dtype=bool)
    if traces is not None:
        wanted[:] = False
        wanted[traces] = True
    labels = _Labels(t)
    out = [{"critical_path": [], "attribution": _ns(at.critical[tr]),
            "remote_ns": int(at.critical[tr, attribution.REMOTE]), "per_rank": {}, "straggler": None,
            "collectives": {}, "pipeline": at.pipelines.get(tr), "unmatched": {}} if wanted[tr] else None
           for tr in range(n_traces)]
    _critical_paths(at, labels, out, wanted)
    _per_rank(at, labels, out, wanted)
    _stragglers(at, labels, out, wanted)
    _collectives(at, out, wanted)
    for name, rows in at.dag.unmatched.items():
        counts = np.bincount(t.trace[rows], minlength=n_traces) if len(rows) else np.zeros(n_traces, np.int64)
        for tr in np.flatnonzero((counts > 0) & wanted).tolist():
            out[tr]["unmatched"][name] = int(counts[tr])
    return out


def _critical_paths(at, labels: _Labels, out: list, wanted: np.ndarray) -> None:
    """Segments of each path, merged where consecutive ones belong to the same span and category."""
    p, dag = at.paths, at.dag
    if not len(p):
        return
    cat, row = at.segment_category, at.segment_row
    node = dag.node[p.dst]
    new = np.r_[True, (p.trace[1:] != p.trace[:-1]) | (cat[1:] != cat[:-1]) | (row[1:] != row[:-1])
                | (node[1:] != node[:-1])]
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(p)] - 1
    error = np.maximum.reduceat(p.error, first)
    src_node = np.where(p.src[first] >= 0, dag.node[np.maximum(p.src[first], 0)], node[first])
    keep = wanted[p.trace[first]]
    first, last, error, src_node = first[keep], last[keep], error[keep], src_node[keep]
    for f, l, e, sn in zip(first.tolist(), last.tolist(), error.tolist(), src_node.tolist()):
        start, end, n = int(p.start[f]), int(p.end[l]), int(node[f])
        duration = end - start
        segment = {"start_ns": start, "duration_ns": duration, "category": attribution.NAMES[cat[f]],
                   **labels.node(n), **labels.span(int(row[f])), "error_ns": e,
                   "confidence": round(1.0 - min(1.0, e / duration), 4) if e and duration else float(not e)}
        if sn != n:
            segment["from_node"] = labels.nodes[sn]
        out[int(p.trace[f])]["critical_path"].append(segment)


def _per_rank(at, labels: _Labels, out: list, wanted: np.ndarray) -> None:
    for g in np.flatnonzero(wanted[at.group_trace]).tolist():
        node = int(at.group_node[g])
        out[int(at.group_trace[g])]["per_rank"][labels.nodes[node]] = {
            "rank": labels.rank[node], "window_ns": int(at.window[g]), "pipeline": bool(at.group_pipeline[g]),
            "attribution": _ns(at.per_rank[g]), "remote_ns": int(at.per_rank[g, attribution.REMOTE])}


def _stragglers(at, labels: _Labels, out: list, wanted: np.ndarray, top: int = 5) -> None:
    """Per trace: the straggler, the span it was busy with, the cost per node, and the worst
    single waits. The straggler is the node whose late entries made others wait longest (its
    delay cost) less the time it waited itself: in a chain (a pipeline, a ring) a rank held
    up by a slow one holds up the next one in turn, and its own cost is passed on to it;
    the rank that waited for nobody is where the delay began. Where no rank held others up
    longer than it waited itself by STRAGGLER_SHARE (attribution.py) of the trace, none is named: the stages
    of a pipeline wait for each other by its schedule (its fill and drain, counted as
    bubble), and naming the one a few percent ahead showed a stage waiting in irecv as
    the straggler."""
    w, t, m = at.waits, labels.t, at.matches
    delay = _delay_costs(at.dag, t, len(out), len(labels.nodes))
    waited = np.zeros_like(delay)
    waiting = [attribution.C[c] for c in attribution.WAITING]
    waited[at.group_trace, at.group_node] = at.per_rank[:, waiting].sum(axis=1)
    order, bounds = _by_trace(w.trace, len(out))
    for tr in np.flatnonzero(wanted).tolist():
        sel = order[bounds[tr]:bounds[tr + 1]]
        if not len(sel):
            continue
        sel = sel[np.argsort(-w.cost_ns[sel], kind="stable")]
        late_node = t.node[w.late_row[sel]]
        cost = delay[tr]
        if not cost.any():
            continue
        net = np.where(cost > 0, cost - waited[tr], np.iinfo(np.int64).min)
        worst = int(np.argmax(net))
        if net[worst] < attribution.STRAGGLER_SHARE * (at.dag.trace_end[tr] - at.dag.trace_start[tr]) \
                or not (late_node == worst).any():
            continue   # each rank waited about as long as it held others up: a pipeline's fill and drain
        own = sel[late_node == worst][0]     # its costliest wait
        waits = []
        for i in sel[:top].tolist():
            late, j = int(w.late_row[i]), int(w.join[i])
            entry = {"kind": "collective" if w.is_collective[i] else "p2p", **labels.node(int(t.node[late]), "late_"),
                     **labels.span(late, "late_"), **labels.span(int(w.cause_row[i]), "cause_"),
                     "wait_caused_ns": int(w.cost_ns[i]), "lateness_ns": int(w.lateness_ns[i]),
                     "waiting": int(w.waiting[i])}
            if j >= 0:
                inst = int(at.dag.join_instance[j])
                entry.update(op=m.coll_op[inst], group=_plain(m.coll_group[inst]), seq=_plain(m.coll_seq[inst]))
            waits.append(entry)
        cause = int(w.cause_row[own])
        out[tr]["straggler"] = {
            **labels.node(worst), **labels.span(cause if cause >= 0 else int(w.late_row[own])),
            "delay_cost_ns": int(cost[worst]),
            "by_node": {labels.nodes[n]: int(c) for n, c in enumerate(cost.tolist()) if c > 0}, "waits": waits}


def _delay_costs(dag, t, n_traces: int, n_nodes: int) -> np.ndarray:
    """(traces, nodes): the waiting each node caused others, Scalasca's delay cost, with each
    waiting rank's instants counted once. A late rank holds up several collectives at once
    (DDP's bucket all-reduces are all in flight together): summing their waits would count
    the same wall time once per bucket. So per (trace, late node, waiting node) the union of
    the wait intervals (the same waits as attribution's), summed over the waiting nodes.
    This is the time the others spent in collectives held up by the late node, including
    any they overlapped with compute of their own (DDP's buckets wait while backward goes
    on), so it can exceed their per-rank collective.wait, which counts each instant once."""
    start, end = dag.starts, dag.ends
    members = np.flatnonzero(dag.join >= 0)
    p2p = np.flatnonzero(dag.partner >= 0)
    p2p = p2p[np.isin(t.kind[p2p], (Kind.SEND, Kind.RECV))]
    waiter = np.concatenate([members, p2p])
    by = dag.released_by[members]
    late = np.concatenate([by, dag.partner[p2p]])
    wait_end = np.concatenate([np.minimum(start[by], end[members]), np.minimum(start[dag.partner[p2p]], end[p2p])])
    wait_start = start[waiter]
    keep = wait_end > wait_start
    waiter, late, wait_start, wait_end = waiter[keep], late[keep], wait_start[keep], wait_end[keep]
    out = np.zeros(n_traces * n_nodes, dtype=np.int64)
    if not len(waiter):
        return out.reshape(n_traces, n_nodes)
    trace = t.trace[waiter].astype(np.int64)
    keys, group = np.unique((trace * n_nodes + t.node[late]) * n_nodes + t.node[waiter], return_inverse=True)
    group = group.reshape(-1)
    base = dag.trace_start[trace]                   # each group on its own key range, as attribution lays them
    span = int((wait_end - base).max()) + 1
    order = np.lexsort((wait_start, group))
    key_start, key_end = (group * span + wait_start - base)[order], (group * span + wait_end - base)[order]
    union = np.bincount(group[order], weights=attribution.newly_covered(key_start, key_end), minlength=len(keys))
    np.add.at(out, keys // n_nodes, np.rint(union).astype(np.int64))
    return out.reshape(n_traces, n_nodes)


def _collectives(at, out: list, wanted: np.ndarray) -> None:
    """Per trace and op: instances, summed wait and transfer over participants, and the time
    the op's spans lie on the critical path."""
    dag, p = at.dag, at.paths
    on_path = np.zeros(len(dag.join_time), dtype=np.int64)
    row = at.segment_row
    coll = (row >= 0) & np.isin(at.segment_category, [attribution.C["collective.wait"],
                                                      attribution.C["collective.transfer"]])
    coll &= dag.join[np.maximum(row, 0)] >= 0
    np.add.at(on_path, dag.join[row[coll]], (p.end - p.start)[coll])
    for j in np.flatnonzero(wanted[dag.join_trace]).tolist():
        op = at.ops[int(at.op_of_join[j])]
        entry = out[int(dag.join_trace[j])]["collectives"].setdefault(
            op, {"count": 0, "wait_ns": 0, "transfer_ns": 0, "critical_path_ns": 0})
        entry["count"] += 1
        entry["wait_ns"] += int(at.join_wait[j])
        entry["transfer_ns"] += int(at.join_transfer[j])
        entry["critical_path_ns"] += int(on_path[j])


# -- traces of one kind -------------------------------------------------------------------------

PERCENTILES = (50, 95, 99)


def _stats(values: np.ndarray) -> dict:
    """p50/p95/p99 (each an actual sample, as budgets measure them), mean and max, per column."""
    q = budgets.nearest_rank(values, PERCENTILES)
    out = {f"p{p}_ns": q[i] for i, p in enumerate(PERCENTILES)}
    out.update(mean_ns=values.mean(axis=0), max_ns=values.max(axis=0))
    return out


def _where(t: SpanTable) -> list[str]:
    """Per node, the name its segments are summed under across traces: its role or service
    (ranks of a job and a fleet's devices collapse into one), else its node id; ranks
    without a role collapse into none."""
    return [r.role or r.service_name or ("" if r.rank >= 0 else r.node_id) for r in t.resources]


def segment_label(where: str, span: str | None, category: str) -> str:
    """"cloud inference (compute)": where, which span (none: the path crossed time outside
    the node's spans there, between them or before its first), and what the time was."""
    return " ".join(x for x in (where, span or "outside spans", f"({category})") if x)


def kind_summaries(t: SpanTable, at: "attribution.Attribution", traces: list[dict]) -> dict:
    """Per trace name (traces of one kind, e.g. every "request"): the duration, each critical-path
    category and each segment at p50/p95/p99 across its traces. A segment is the critical-path
    time of one span in one category on one kind of node ("edge preprocess (compute)", "edge
    infer (network.uplink)", "cloud queue (host.overhead)"), summed within a trace and 0 in the
    traces whose path does not pass it (zero-length steps are no segment); segments are
    listed in path order. Adds each trace's
    segments (ns, in that order) to its entry in `traces` as "segments"."""
    p, dag = at.paths, at.dag
    if not traces:
        return {}
    index = {trace_id: i for i, trace_id in enumerate(t.trace_ids)}
    by_index = {index[entry["trace_id"]]: entry for entry in traces}
    kind_names = list(dict.fromkeys(entry["name"] for entry in traces))
    kind_of = {name: k for k, name in enumerate(kind_names)}
    kind = np.full(len(t.trace_ids), -1, dtype=np.int64)
    kind[list(by_index)] = [kind_of[entry["name"]] for entry in by_index.values()]
    trace_order, trace_bounds = _by_trace(kind, len(kind_names))     # kind -1 (no spans) sorts first
    grouped = trace_order[trace_bounds[0]:]
    position = np.full(len(kind), -1, dtype=np.int64)
    position[grouped] = np.arange(trace_bounds[0], len(trace_order)) - trace_bounds[kind[grouped]]
    seg_order, seg_bounds = _by_trace(kind[p.trace], len(kind_names))

    where = _where(t)
    row = at.segment_row
    node = np.where(row >= 0, t.node[np.maximum(row, 0)], dag.node[p.dst]).astype(np.int64)
    where_id = np.unique(where, return_inverse=True)[1].reshape(-1) if where else np.empty(0, np.int64)
    span = np.where(row >= 0, t.name[np.maximum(row, 0)], -1).astype(np.int64)
    key, _ = dense(where_id[node], span, at.segment_category)
    length = p.end - p.start
    offset = p.start - dag.trace_start[p.trace]
    out = {}
    for k, name in enumerate(kind_names):
        members = trace_order[trace_bounds[k]:trace_bounds[k + 1]]
        sel = seg_order[seg_bounds[k]:seg_bounds[k + 1]]
        sel = sel[length[sel] > 0]
        keys, local = np.unique(key[sel], return_inverse=True)
        n, m = len(members), len(keys)
        cell = position[p.trace[sel]] * m + local.reshape(-1)
        per_trace = np.bincount(cell, weights=length[sel], minlength=n * m).reshape(n, m).astype(np.int64)
        first = np.full(n * m, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, cell, offset[sel])
        present = (first < np.iinfo(np.int64).max).reshape(n, m)
        mean_offset = np.where(present, first.reshape(n, m), 0).sum(axis=0) / np.maximum(present.sum(axis=0), 1)
        order = np.argsort(mean_offset, kind="stable")       # path order
        per_trace, present = per_trace[:, order], present[:, order]
        example = sel[np.unique(local, return_index=True)[1]][order]     # one segment of each key
        durations = dag.trace_end[members] - dag.trace_start[members]
        stats = _stats(per_trace)
        share = (per_trace / np.maximum(durations, 1)[:, None]).mean(axis=0)
        segments = []
        for j, s in enumerate(example.tolist()):
            r = int(row[s])
            w, category = where[node[s]], attribution.NAMES[at.segment_category[s]]
            span_name = t.names[t.name[r]] if r >= 0 else None
            segments.append({"segment": segment_label(w, span_name, category), "node": w, "span": span_name,
                             "category": category, "traces": int(present[:, j].sum()),
                             **{stat: int(round(v[j])) for stat, v in stats.items()},
                             "share": round(float(share[j]), 4)})
        critical = at.critical[members]
        by_category = _stats(critical)
        out[name] = {
            "traces": int(n),
            "duration": {stat: int(round(v)) for stat, v in _stats(durations).items()},
            "attribution": {c: {stat: int(round(v[i])) for stat, v in by_category.items()}
                            for i, c in enumerate(attribution.NAMES) if critical[:, i].any()},
            "segments": segments}
        labels = [segment["segment"] for segment in segments]
        for i, tr in enumerate(members.tolist()):
            by_index[tr]["segments"] = {label: v for label, v in zip(labels, per_trace[i].tolist()) if v}
    return out

