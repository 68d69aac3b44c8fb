"""Analysis in batches of whole traces, merged back into one result.

Traces are independent (every edge, join and critical path stays within one trace), so a
large table is analysed a batch of consecutive traces at a time. A batch's sorts and
gathers work on arrays near the CPU cache's size, so their cost per span stays the same
however many spans there are; one pass over millions of spans at once slows down per
span as its arrays outgrow the cache. A batch's results use its own rows, events, traces
and joins; `Merge` maps them back to the table's, and the results are one Attribution
exactly as one pass would give it (tests/test_analysis_batches.py). Pipeline steps are not
independent (a rank's window in a step ends where its next step begins): they share a batch.
"""
import dataclasses

import numpy as np

from .align import Alignment
from .critical_path import Paths
from .dag import Dag
from .matching import Matches
from .spantable import SpanTable

SPANS_PER_BATCH = 1 << 17


@dataclasses.dataclass
class Batch:
    rows: np.ndarray           # the table's rows in this batch (row i of the batch is rows[i])
    first_trace: int           # the batch's traces are first_trace + its trace indices
    instances: np.ndarray      # the table's collective instance of each batch instance
    table: SpanTable
    alignment: Alignment
    matches: Matches


def split(table: SpanTable, alignment: Alignment, matches: Matches, spans: int = SPANS_PER_BATCH,
          together: np.ndarray | None = None) -> list[Batch]:
    """Batches of consecutive traces of about `spans` spans each (a larger trace is one
    batch). The traces `together` (indices) fall in one batch with those between them:
    pipeline steps, whose ranks' windows end where their neighbouring steps begin."""
    order = np.argsort(table.trace, kind="stable")
    n_traces = len(table.trace_ids)
    counts = np.bincount(table.trace, minlength=n_traces)
    ends = np.cumsum(counts)
    # Cut after the trace whose end first reaches each multiple of `spans`.
    cuts = np.unique(np.searchsorted(ends, np.arange(spans, len(table), spans), side="left") + 1)
    if together is not None and len(together):
        cuts = cuts[(cuts <= together.min()) | (cuts > together.max())]
    trace_bounds = np.unique(np.r_[0, cuts[cuts < n_traces], n_traces])
    row_bounds = np.r_[0, ends][trace_bounds]
    batch_of_row = np.empty(len(table), dtype=np.int64)
    batch_of_row[order] = np.repeat(np.arange(len(trace_bounds) - 1), np.diff(row_bounds))
    local_row = np.empty(len(table), dtype=np.int64)
    local_row[order] = np.arange(len(table)) - np.repeat(row_bounds[:-1], np.diff(row_bounds))

    rpc = _pairs_by_batch(matches.rpc, batch_of_row, local_row)
    p2p = _pairs_by_batch(matches.p2p, batch_of_row, local_row)
    coll_batch = batch_of_row[matches.coll_rows]
    coll_order = np.argsort(coll_batch, kind="stable")
    coll_bounds = np.searchsorted(coll_batch[coll_order], np.arange(len(trace_bounds)))
    out = []
    for b in range(len(trace_bounds) - 1):
        lo, hi = int(trace_bounds[b]), int(trace_bounds[b + 1])
        rows = order[row_bounds[b]:row_bounds[b + 1]]
        sub = dataclasses.replace(table.take(rows), trace=(table.trace[rows] - lo).astype(np.int32),
                                  trace_ids=table.trace_ids[lo:hi])
        sub_alignment = Alignment(alignment.models, alignment.start[rows], alignment.end[rows], alignment.error[rows],
                                  alignment.epoch_offset_ns, alignment.facts, alignment.violations)
        members = coll_order[coll_bounds[b]:coll_bounds[b + 1]]
        instances, local_instance = np.unique(matches.coll_instance[members], return_inverse=True)
        first = instances.tolist()
        sub_matches = Matches(
            rpc=rpc[b], p2p=p2p[b], coll_rows=local_row[matches.coll_rows[members]],
            coll_instance=local_instance.reshape(-1).astype(np.int64), coll_expected=matches.coll_expected[instances],
            coll_op=[matches.coll_op[i] for i in first], unmatched={},
            coll_group=[matches.coll_group[i] for i in first] if matches.coll_group else [],
            coll_seq=[matches.coll_seq[i] for i in first] if matches.coll_seq else [])
        out.append(Batch(rows, lo, instances, sub, sub_alignment, sub_matches))
    return out


def _pairs_by_batch(pairs: np.ndarray, batch_of_row: np.ndarray, local_row: np.ndarray) -> dict:
    """Per batch, the (k, 2) pairs with both rows in it, in batch rows."""
    n_batches = int(batch_of_row.max()) + 1 if len(batch_of_row) else 0
    batch = batch_of_row[pairs[:, 0]] if len(pairs) else np.empty(0, np.int64)
    inside = batch == (batch_of_row[pairs[:, 1]] if len(pairs) else batch)
    pairs, batch = pairs[inside], batch[inside]
    order = np.argsort(batch, kind="stable")
    bounds = np.searchsorted(batch[order], np.arange(n_batches + 1))
    local = local_row[pairs[order]].reshape(-1, 2)
    return {b: local[bounds[b]:bounds[b + 1]] for b in range(n_batches)}


class Merge:
    """Index maps from each batch's rows, events, traces and joins to the whole table's."""

    def __init__(self, batches: list[Batch], dags: list[Dag], n_rows: int):
        self.batches, self.n_rows = batches, n_rows
        self.join_offset = np.r_[0, np.cumsum([len(d.join_time) for d in dags])]

    def rows(self, b: int, rows: np.ndarray) -> np.ndarray:
        """Batch rows to table rows; -1 stays -1."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.where(rows >= 0, self.batches[b].rows[np.maximum(rows, 0)], -1) if len(rows) else rows

    def events(self, b: int, events: np.ndarray, n_batch_rows: int) -> np.ndarray:
        """Batch events to table events (2 row + 0/1 for a span's start/end, then the joins); -1 stays."""
        events = np.asarray(events, dtype=np.int64)
        is_join = events >= 2 * n_batch_rows
        row_event = 2 * self.batches[b].rows[np.clip(events >> 1, 0, max(n_batch_rows - 1, 0))] + (events & 1) \
            if n_batch_rows else events
        out = np.where(is_join, 2 * self.n_rows + self.join_offset[b] + events - 2 * n_batch_rows, row_event)
        return np.where(events >= 0, out, -1)

    def joins(self, b: int, joins: np.ndarray) -> np.ndarray:
        joins = np.asarray(joins, dtype=np.int64)
        return np.where(joins >= 0, joins + self.join_offset[b], -1)

    def scatter_rows(self, parts: list[np.ndarray], dtype=None) -> np.ndarray:
        """Per-row arrays of the batches as one array in table row order."""
        out = np.empty(self.n_rows, dtype=dtype or parts[0].dtype)
        for batch, part in zip(self.batches, parts):
            out[batch.rows] = part
        return out

    def scatter_events(self, row_parts: list[np.ndarray], join_parts: list[np.ndarray]) -> np.ndarray:
        """Per-event arrays (row events, then joins) in table event order."""
        out = np.empty(2 * self.n_rows + int(self.join_offset[-1]), dtype=row_parts[0].dtype)
        for batch, part in zip(self.batches, row_parts):
            out[2 * batch.rows] = part[0::2]
            out[2 * batch.rows + 1] = part[1::2]
        out[2 * self.n_rows:] = np.concatenate(join_parts) if join_parts else out[:0]
        return out


def merge_dag(m: Merge, dags: list[Dag], matches: Matches, table: SpanTable) -> Dag:
    def events_of(name):
        return m.scatter_events([getattr(d, name)[:2 * d.n_rows] for d in dags],
                                [getattr(d, name)[2 * d.n_rows:] for d in dags])

    lane_offset = np.r_[0, np.cumsum([int(d.lane.max()) + 1 if len(d.lane) else 0 for d in dags])]
    trace = m.scatter_events([d.trace[:2 * d.n_rows] + bt.first_trace for d, bt in zip(dags, m.batches)],
                             [d.trace[2 * d.n_rows:] + bt.first_trace for d, bt in zip(dags, m.batches)])
    parent_rows = [m.rows(b, d.unmatched["parent"]) for b, d in enumerate(dags)]
    unmatched = dict(matches.unmatched)
    unmatched["cross_trace"] = cross_trace(table, matches)
    unmatched["parent"] = np.sort(np.concatenate(parent_rows)) if parent_rows else np.empty(0, np.int64)
    cat = np.concatenate
    return Dag(
        n_rows=m.n_rows, time=events_of("time"), error=events_of("error"), node=events_of("node"), trace=trace,
        src=cat([m.events(b, d.src, d.n_rows) for b, d in enumerate(dags)]),
        dst=cat([m.events(b, d.dst, d.n_rows) for b, d in enumerate(dags)]),
        edge=cat([d.edge for d in dags]),
        parent=m.scatter_rows([m.rows(b, d.parent) for b, d in enumerate(dags)]),
        prev=m.scatter_rows([m.rows(b, d.prev) for b, d in enumerate(dags)]),
        lane=m.scatter_rows([d.lane + lane_offset[b] for b, d in enumerate(dags)]),
        partner=m.scatter_rows([m.rows(b, d.partner) for b, d in enumerate(dags)]),
        join=m.scatter_rows([m.joins(b, d.join) for b, d in enumerate(dags)]),
        join_time=cat([d.join_time for d in dags]),
        join_last=cat([m.rows(b, d.join_last) for b, d in enumerate(dags)]),
        join_instance=cat([bt.instances[d.join_instance] for d, bt in zip(dags, m.batches)]).astype(np.int64),
        join_trace=cat([d.join_trace + bt.first_trace for d, bt in zip(dags, m.batches)]),
        released_by=m.scatter_rows([m.rows(b, d.released_by) for b, d in enumerate(dags)]),
        trace_start=cat([d.trace_start for d in dags]), trace_end=cat([d.trace_end for d in dags]),
        unmatched=unmatched)


def cross_trace(table: SpanTable, matches: Matches) -> np.ndarray:
    """Rows joined to a partner in another trace: such joins give no edge (stitch's rule)."""
    p2p = matches.p2p
    split_pairs = p2p[table.trace[p2p[:, 0]] != table.trace[p2p[:, 1]]].reshape(-1)
    members, instance = matches.coll_rows, matches.coll_instance
    trace = table.trace[members].astype(np.int64)
    lo = np.full(matches.n_collectives, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(matches.n_collectives, -1, dtype=np.int64)
    np.minimum.at(lo, instance, trace)
    np.maximum.at(hi, instance, trace)
    split_members = members[(lo != hi)[instance]] if len(members) else members
    return np.union1d(split_pairs, split_members).astype(np.int64)


def merge_paths(m: Merge, paths: list[Paths], dags: list[Dag], n_traces: int) -> Paths:
    cat = np.concatenate
    trace = cat([p.trace + bt.first_trace for p, bt in zip(paths, m.batches)])
    return Paths(
        trace=trace, start=cat([p.start for p in paths]),
        end=cat([p.end for p in paths]),
        src=cat([m.events(b, p.src, d.n_rows) for b, (p, d) in enumerate(zip(paths, dags))]),
        dst=cat([m.events(b, p.dst, d.n_rows) for b, (p, d) in enumerate(zip(paths, dags))]),
        edge=cat([p.edge for p in paths]), error=cat([p.error for p in paths]),
        violation=cat([p.violation for p in paths]),
        bounds=np.searchsorted(trace, np.arange(n_traces + 1)))
