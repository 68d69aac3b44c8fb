"""The report: one JSON-ready dict per run, on the aligned timeline.

Shape (stable; scripts read it):
  {"traces": [{"trace_id", "name", "start_ns", "duration_ns", "spans", "nodes",
               "critical_path": [...], "attribution": {category: ns}, "per_rank": {...}}],
   "clocks": {node_id: {"offset_ns", "drift_ppm", "error_bound_ns", "samples", ...}},
   "dropped_spans": {node_id: n}, "rejected_spans": {reason: n}, ...}
All times are ns on the reference timeline (the collector's clock); add
`epoch_offset_ns` for Unix time. Attribution keys are DESIGN.md's vocabulary.
"""
import dataclasses
import math

import numpy as np

from . import spantable
from .align import Alignment, align, fit_models
from .matching import Matches, match
from .spantable import SpanTable


@dataclasses.dataclass
class Analysed:
    """Everything the views need: the table, its alignment and joins."""
    table: SpanTable
    alignment: Alignment
    matches: Matches


def analyse_store(store, trace_ids: list[str] | None = None, progress=None) -> Analysed:
    say = progress or (lambda message: None)
    say(f"loading spans from {store.path}")
    table = spantable.load(store, trace_ids)
    say(f"loaded {len(table):,} spans in {len(table.trace_ids):,} traces from {len(table.nodes)} nodes; aligning clocks")
    models = fit_models(store)
    epoch = int(store.meta("epoch_offset_ns") or 0)
    alignment = align(table, models, epoch)
    matches = match(table)
    return Analysed(table, alignment, matches)


def trace_summaries(a: Analysed) -> list[dict]:
    """Per trace: name (its root span, else its earliest span), extent, span and node counts."""
    t, al = a.table, a.alignment
    n_traces = len(t.trace_ids)
    if not len(t):
        return []
    start = np.full(n_traces, np.iinfo(np.int64).max, dtype=np.int64)
    end = np.full(n_traces, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(start, t.trace, al.start)
    np.maximum.at(end, t.trace, al.end)
    spans = np.bincount(t.trace, minlength=n_traces)
    # Root name: among each trace's root spans (else all its spans), the earliest.
    is_root = t.parent_id == 0
    order = np.lexsort((al.start, ~is_root, t.trace))
    first = order[np.r_[True, t.trace[order][1:] != t.trace[order][:-1]]]
    name_of = dict(zip(t.trace[first].tolist(), t.name[first].tolist()))
    pairs = np.unique(np.stack([t.trace, t.node], axis=1), axis=0)
    nodes_per_trace = np.bincount(pairs[:, 0], minlength=n_traces)
    out = []
    for i in np.flatnonzero(spans).tolist():
        out.append({"trace_id": t.trace_ids[i], "name": t.names[name_of[i]], "start_ns": int(start[i]),
                    "duration_ns": int(end[i] - start[i]), "spans": int(spans[i]),
                    "nodes": int(nodes_per_trace[i])})
    out.sort(key=lambda tr: tr["start_ns"])
    return out


def clocks_section(models) -> dict:
    out = {}
    for node_id, m in sorted(models.items()):
        out[node_id] = {"offset_ns": round(m.offset_ns), "drift_ppm": round(m.drift_ppm, 4),
                        "at_local_ns": m.at_ns,
                        "error_bound_ns": round(m.error_ns) if math.isfinite(m.error_ns) else None,
                        "samples": m.samples, "sources": list(m.sources), "flags": list(m.flags)}
    return out


def build(store, a: Analysed) -> dict:
    traces = trace_summaries(a)
    for trace in traces:
        trace.update(critical_path=[], attribution={}, per_rank={})
    return {
        "store": store.path,
        "epoch_offset_ns": a.alignment.epoch_offset_ns,
        "traces": traces,
        "clocks": clocks_section(a.alignment.models),
        "dropped_spans": store.dropped_by_node(),
        "rejected_spans": store.rejects(),
        "unmatched": {k: int(len(v)) for k, v in a.matches.unmatched.items()},
    }
