"""SpanTable: stored spans as columns, one row per span (HTA's columnar tables).

Everything the analysis does is vectorised over these arrays; per-span Python work is
limited to the attributes of the few span kinds that carry join keys.
"""
import dataclasses

import numpy as np
import orjson

from ..proto import pb
from ..proto.semconv import Kind
from .columns import COLUMNS, loads, view


@dataclasses.dataclass
class SpanTable:
    trace_hi: np.ndarray       # uint64
    trace_lo: np.ndarray       # uint64
    span_id: np.ndarray        # uint64
    parent_id: np.ndarray      # uint64, 0 for roots
    start: np.ndarray          # int64, the node's local clock
    end: np.ndarray            # int64
    kind: np.ndarray           # uint8, proto.semconv.Kind
    status: np.ndarray         # uint8
    name: np.ndarray           # int32 index into `names`
    thread: np.ndarray         # uint64 thread ident
    node: np.ndarray           # int32 index into `nodes`
    trace: np.ndarray          # int32 index into `trace_ids`
    attributes: list           # dict or None per row
    extras: dict               # row -> {"events", "links", "status_message"}
    names: list[str]
    nodes: list[str]           # node_id per node index
    resources: list            # pb.Resource per node index
    trace_ids: list[str]       # 32-hex W3C trace id per trace index

    def __len__(self) -> int:
        return len(self.span_id)

    @property
    def rank_of_node(self) -> np.ndarray:
        return np.array([r.rank for r in self.resources], dtype=np.int32)

    @property
    def rank(self) -> np.ndarray:
        """Rank of each row's node (-1 outside a distributed job)."""
        return self.rank_of_node[self.node] if len(self.resources) else np.full(len(self), -1, np.int32)

    def attr(self, key: str, rows=None, default=None) -> list:
        """One attribute for the given rows (all rows by default), `default` where absent."""
        attrs = self.attributes
        idx = range(len(self)) if rows is None else rows
        return [a.get(key, default) if (a := attrs[i]) is not None else default for i in idx]

    def take(self, rows: np.ndarray) -> "SpanTable":
        """A table of the given rows (indices or boolean mask), same node and name tables."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        cols = {f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}
        extras = {}
        if self.extras:      # the few rows with extras, found by binary search (no map of every row)
            order = np.argsort(rows, kind="stable")
            old = np.fromiter(self.extras, dtype=np.int64, count=len(self.extras))
            at = np.minimum(np.searchsorted(rows[order], old), max(len(rows) - 1, 0))
            kept = (rows[order][at] == old) if len(rows) else np.zeros(len(old), dtype=bool)
            extras = {int(order[a]): self.extras[int(r)] for r, a in zip(old[kept], at[kept])}
        attrs = self.attributes
        return SpanTable(**cols, attributes=[attrs[i] for i in rows.tolist()], extras=extras,
                         names=self.names, nodes=self.nodes, resources=self.resources,
                         trace_ids=self.trace_ids)

    def is_kind(self, *kinds: Kind) -> np.ndarray:
        return np.isin(self.kind, np.array([int(k) for k in kinds], dtype=np.uint8))


def empty() -> SpanTable:
    return build([], {})


def _shared(rows: list, seen: dict) -> list:
    """A segment's attribute dicts, each string and list value replaced by an equal one read
    before (kept in `seen`): a 512-rank job's collective spans each held their own list of
    the 512 ranks, 2.8 KB a span of a report's memory. A list is known by its JSON, which
    tells [1] from [true] and [1.0] (loads reads no NaN as a float); nothing changes them."""
    for attrs in rows:
        if attrs.__class__ is not dict:
            continue
        for key, value in attrs.items():
            kind = value.__class__
            if kind is str:
                attrs[key] = seen.setdefault(value, value)
            elif kind is list:
                try:
                    attrs[key] = seen.setdefault(orjson.dumps(value), value)
                except TypeError:   # an integer beyond 64 bits
                    pass
    return rows


def build(segments: list[tuple[int, "pb.SpanBatch"]], resources: dict[int, "pb.Resource"]) -> SpanTable:
    """A table from (store node id, segment) pairs, as Store.segments() yields them."""
    node_index: dict[int, int] = {}
    names: list[str] = []
    name_index: dict[str, int] = {}
    columns: dict[str, list] = {field: [] for field, _ in COLUMNS}
    node_col, name_col, attributes, extras = [], [], [], {}
    seen: dict = {}   # _shared's
    offset = 0
    for store_node, seg in segments:
        cols = view(seg)
        for field, _ in COLUMNS:
            columns[field].append(cols[field])
        local = np.array([name_index.setdefault(s, len(name_index)) for s in seg.strings], dtype=np.int32)
        name_col.append(local[cols["name"]] if len(local) else np.zeros(seg.count, np.int32))
        node_col.append(np.full(seg.count, node_index.setdefault(store_node, len(node_index)), np.int32))
        attributes.extend(_shared(loads(seg.attributes_json), seen) if seg.attributes_json else [None] * seg.count)
        if seg.extras_json:
            for i, extra in loads(seg.extras_json):
                extras[offset + i] = extra
        offset += seg.count
    names = list(name_index)

    def cat(field, dtype):
        parts = columns[field]
        return np.concatenate(parts) if parts else np.empty(0, dtype)

    dtypes = dict(COLUMNS)
    hi, lo = cat("trace_id_hi", dtypes["trace_id_hi"]), cat("trace_id_lo", dtypes["trace_id_lo"])
    if len(hi):
        keys, trace = np.unique(np.stack([hi, lo], axis=1), axis=0, return_inverse=True)
        trace = trace.reshape(-1).astype(np.int32)
        trace_ids = [f"{h:016x}{l:016x}" for h, l in keys.tolist()]
    else:
        trace, trace_ids = np.empty(0, np.int32), []
    nodes_by_index = sorted(node_index, key=node_index.get)
    return SpanTable(
        trace_hi=hi, trace_lo=lo,
        span_id=cat("span_id", dtypes["span_id"]), parent_id=cat("parent_span_id", dtypes["parent_span_id"]),
        start=cat("start_ns", dtypes["start_ns"]), end=cat("end_ns", dtypes["end_ns"]),
        kind=cat("kind", dtypes["kind"]), status=cat("status", dtypes["status"]),
        name=np.concatenate(name_col) if name_col else np.empty(0, np.int32),
        thread=cat("thread", dtypes["thread"]),
        node=np.concatenate(node_col) if node_col else np.empty(0, np.int32),
        trace=trace, attributes=attributes, extras=extras, names=names,
        nodes=[resources[n].node_id for n in nodes_by_index],
        resources=[resources[n] for n in nodes_by_index], trace_ids=trace_ids)


def load(store, trace_ids: list[str] | None = None) -> SpanTable:
    """Spans of the whole store, or of the traces the given ids name (find)."""
    if trace_ids is None:
        return build(list(store.segments()), store.nodes())
    table = build(list(store.segments(prefixes(trace_ids))), store.nodes())
    # Segments hold other traces too: keep only the named ones, renumbered, so that the
    # table's traces are these.
    keep = find(table, trace_ids)
    renumber = np.full(len(table.trace_ids), -1, dtype=np.int32)
    renumber[keep] = np.arange(len(keep), dtype=np.int32)
    rows = renumber[table.trace] >= 0
    return dataclasses.replace(table.take(rows), trace=renumber[table.trace[rows]],
                               trace_ids=[table.trace_ids[i] for i in keep])


def prefixes(trace_ids: list[str]) -> list[str]:
    """The lowercase hex prefixes the given ids are; one that is not a trace id is a ValueError."""
    return [_prefix(t) for t in trace_ids]


def find(table: SpanTable, trace_ids: list[str]) -> np.ndarray:
    """The indices of the traces the given ids name, sorted: each a hex prefix of one
    trace id, in any case (reports show 16 digits); one that names no trace or more than
    one is a ValueError."""
    wanted = np.zeros(len(table.trace_ids), dtype=bool)
    for text, prefix in zip(trace_ids, prefixes(trace_ids)):
        found = [i for i, t in enumerate(table.trace_ids) if t.startswith(prefix)]
        if not found:
            raise ValueError(f"no trace id starts with {text!r}")
        if len(found) > 1:
            shown = ", ".join(table.trace_ids[i] for i in found[:3]) + (", ..." if len(found) > 3 else "")
            raise ValueError(f"trace id {text!r} is ambiguous: {len(found)} traces start with it ({shown})")
        wanted[found] = True
    return np.flatnonzero(wanted)


def _prefix(text: str) -> str:
    prefix = text.strip().lower()
    if not 0 < len(prefix) <= 32 or any(c not in "0123456789abcdef" for c in prefix):
        raise ValueError(f"{text!r} is not a trace id: expected up to 32 hex digits")
    return prefix
