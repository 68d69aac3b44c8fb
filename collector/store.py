"""The collector's embedded durable store: one SQLite file in WAL mode.

Spans are kept as columnar segments (a SpanBatch blob per accepted batch) plus a
trace index, rather than a row per span: a row per span measured 250-340k spans/s
here, a segment per batch well over 1M/s (README, "Choosing the store"). SQLite
rather than DuckDB because `crosstrace report` must read a store while the collector
is writing to it, which SQLite's WAL allows and DuckDB's single-writer lock does not.

A write commits before its batches are acked. Spans are deduplicated by
(trace_id, span_id): each trace's known span ids are looked up (from a bounded
in-memory cache, else from the trace index) before a segment is written.
"""
import collections
import dataclasses
import os
import sqlite3
import threading
import time

import numpy as np

from ..proto import pb
from .columns import take
from .ingest import CheckedBatch

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY, node_id TEXT NOT NULL UNIQUE, resource BLOB NOT NULL,
    first_seen_ns INTEGER NOT NULL, last_seen_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id BLOB PRIMARY KEY, node INTEGER NOT NULL, pid INTEGER NOT NULL,
    dropped INTEGER NOT NULL, last_seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, node INTEGER NOT NULL, received_ns INTEGER NOT NULL,
    n INTEGER NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS trace_index (
    trace_hi INTEGER NOT NULL, trace_lo INTEGER NOT NULL, segment INTEGER NOT NULL,
    span_ids BLOB NOT NULL, PRIMARY KEY (trace_hi, trace_lo, segment)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS clock_samples (
    node INTEGER NOT NULL, source INTEGER NOT NULL, peer TEXT NOT NULL,
    t1 INTEGER, t2 INTEGER, t3 INTEGER, t4 INTEGER, local_ns INTEGER,
    offset_ns INTEGER, error_ns INTEGER, server TEXT, received_ns INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS clock_samples_node ON clock_samples (node, local_ns);
CREATE TABLE IF NOT EXISTS rejects (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
"""


@dataclasses.dataclass
class WriteResult:
    accepted: int
    duplicates: int


class KnownSpans:
    """Sorted span ids per recently written trace, bounded by the total number of ids."""

    def __init__(self, max_ids: int = 4_000_000, max_traces: int = 100_000):
        self.max_ids = max_ids
        self.max_traces = max_traces
        self._ids: "collections.OrderedDict[tuple[int, int], np.ndarray]" = collections.OrderedDict()
        self._total = 0

    def get(self, key):
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
        return ids

    def put(self, key, ids: np.ndarray) -> None:
        old = self._ids.pop(key, None)
        if old is not None:
            self._total -= len(old)
        self._ids[key] = ids
        self._total += len(ids)
        while (self._total > self.max_ids or len(self._ids) > self.max_traces) and len(self._ids) > 1:
            _, dropped = self._ids.popitem(last=False)
            self._total -= len(dropped)


_U64 = (1 << 64) - 1


def _signed(u: np.ndarray) -> list[int]:
    """uint64 ids as SQLite's signed INTEGER."""
    return u.view(np.int64).tolist()


def _s64(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


class Store:
    """Opened by the collector for writing, and by the CLI (`readonly=True`) for reports."""

    def __init__(self, path: str, readonly: bool = False, sync: str = "normal"):
        self.path = path
        self.readonly = readonly
        if readonly:
            if not os.path.exists(path):
                raise FileNotFoundError(f"no crosstrace store at {path}")
            self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False,
                                      isolation_level=None)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit survives the collector being killed; FULL: also a power loss.
            self.db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            self.db.executescript(_SCHEMA)
            self._init_meta()
        self.db.execute("PRAGMA cache_size=-131072")
        self._lock = threading.Lock()
        self._known = KnownSpans()
        self._node_ids: dict[str, int] = {}

    def close(self) -> None:
        self.db.close()

    def _init_meta(self) -> None:
        # The reference timeline is the collector's monotonic clock; this offset puts it on
        # the Unix epoch for exports. Set once, when the store is created.
        meta = {"schema_version": str(SCHEMA_VERSION),
                "epoch_offset_ns": str(time.time_ns() - time.monotonic_ns()),
                "created_ns": str(time.time_ns())}
        self.db.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", meta.items())
        version = int(self.meta("schema_version"))
        if version != SCHEMA_VERSION:
            raise RuntimeError(f"store {self.path} has schema version {version}; this crosstrace "
                               f"reads version {SCHEMA_VERSION}")

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    # -- writing ---------------------------------------------------------------------------

    def write(self, batches: list[CheckedBatch], rejected_whole: collections.Counter | None = None) -> list[WriteResult]:
        """Commit a group of checked batches in one transaction; returns one result per batch."""
        now = time.monotonic_ns()
        with self._lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                results = [self._write_one(b, now) for b in batches]
                rejects = collections.Counter(rejected_whole or {})
                for b in batches:
                    rejects.update(b.rejected)
                if rejects:
                    db.executemany("INSERT INTO rejects VALUES (?, ?) ON CONFLICT(reason) "
                                   "DO UPDATE SET count = count + excluded.count", rejects.items())
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                self._known = KnownSpans(self._known.max_ids, self._known.max_traces)  # the cache may hold uncommitted ids
                raise
        return results

    def record_rejects(self, rejects: collections.Counter) -> None:
        """Count batches rejected whole (they never reach write())."""
        self.write([], rejects)

    def _node(self, resource: "pb.Resource", now: int) -> int:
        node_id = resource.node_id
        data = resource.SerializeToString()
        self.db.execute("INSERT INTO nodes (node_id, resource, first_seen_ns, last_seen_ns) VALUES (?, ?, ?, ?) "
                        "ON CONFLICT(node_id) DO UPDATE SET resource = excluded.resource, "
                        "last_seen_ns = excluded.last_seen_ns", (node_id, data, now, now))
        node = self._node_ids.get(node_id)
        if node is None:
            node = self.db.execute("SELECT id FROM nodes WHERE node_id = ?", (node_id,)).fetchone()[0]
            self._node_ids[node_id] = node
        return node

    def _write_one(self, checked: CheckedBatch, now: int) -> WriteResult:
        batch, cols, keep = checked.batch, checked.cols, checked.keep.copy()
        db = self.db
        node = self._node(batch.resource, now)
        if batch.session_id:
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET "
                       "dropped = max(dropped, excluded.dropped), last_seq = max(last_seq, excluded.last_seq)",
                       (batch.session_id, node, batch.resource.pid, batch.dropped_spans, batch.seq))
        if batch.clock_samples:
            db.executemany("INSERT INTO clock_samples VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                           [(node, s.source, s.peer, s.t1, s.t2, s.t3, s.t4, s.local_ns, s.offset_ns,
                             s.error_ns, s.server, now) for s in batch.clock_samples])
        duplicates, known = self._mark_duplicates(cols, keep)
        accepted = int(keep.sum())
        if accepted:
            self._write_segment(checked, keep, node, now, known)
        return WriteResult(accepted, duplicates)

    def _mark_duplicates(self, cols, keep: np.ndarray) -> tuple[int, dict]:
        """Clear `keep` for spans already stored or repeated within the batch. Returns their
        count and the stored span ids of this batch's traces."""
        idx = np.flatnonzero(keep)
        if not len(idx):
            return 0, {}
        hi, lo, sid = cols["trace_id_hi"][idx], cols["trace_id_lo"][idx], cols["span_id"][idx]
        # Repeats within the batch: keep the first of each (trace, span).
        order = np.lexsort((sid, lo, hi))
        h, l, s = hi[order], lo[order], sid[order]
        dup = np.zeros(len(idx), dtype=bool)
        dup[order[1:][(h[1:] == h[:-1]) & (l[1:] == l[:-1]) & (s[1:] == s[:-1])]] = True
        # Spans stored before. Span ids are random 64-bit numbers, so a span id seen in any
        # known trace of this batch is a rare candidate, then checked against its own trace.
        known = self._known_ids(hi, lo)
        if known:
            candidates = np.flatnonzero(np.isin(sid, np.concatenate(list(known.values()))))
            for row, key, span in zip(candidates.tolist(), zip(hi[candidates].tolist(), lo[candidates].tolist()),
                                      sid[candidates].tolist()):
                ids = known.get(key)
                if ids is not None:
                    pos = np.searchsorted(ids, span)
                    dup[row] |= bool(pos < len(ids) and ids[pos] == span)
        keep[idx[dup]] = False
        return int(dup.sum()), known

    def _known_ids(self, hi: np.ndarray, lo: np.ndarray) -> dict:
        """Stored span ids (sorted) of the traces in this batch that have any."""
        keys = np.unique(np.stack([hi, lo], axis=1), axis=0)
        found, missing = {}, []
        for key in map(tuple, keys.tolist()):
            ids = self._known.get(key)
            if ids is None:
                missing.append(key)
            else:
                found[key] = ids
        for start in range(0, len(missing), 400):
            chunk = missing[start:start + 400]
            rows = self.db.execute(
                "SELECT trace_hi, trace_lo, span_ids FROM trace_index WHERE (trace_hi, trace_lo) IN "
                f"(VALUES {','.join(['(?,?)'] * len(chunk))})", [_s64(v) for key in chunk for v in key]).fetchall()
            stored = collections.defaultdict(list)
            for h, l, blob in rows:
                stored[(h & _U64, l & _U64)].append(np.frombuffer(blob, "<u8"))
            for key, parts in stored.items():
                found[key] = np.sort(np.concatenate(parts))
                self._known.put(key, found[key])
        return found

    def _write_segment(self, checked: CheckedBatch, keep: np.ndarray, node: int, now: int, known: dict) -> None:
        batch, cols = checked.batch, checked.cols
        if keep.all():
            segment = pb.SpanBatch()
            segment.CopyFrom(batch)
            segment.ClearField("resource")
            segment.ClearField("clock_samples")
        else:
            segment = take(batch, cols, keep, checked.attributes, checked.extras)
        cur = self.db.execute("INSERT INTO segments (node, received_ns, n, data) VALUES (?, ?, ?, ?)",
                              (node, now, segment.count, segment.SerializeToString()))
        seg_id = cur.lastrowid
        hi, lo, sid = cols["trace_id_hi"][keep], cols["trace_id_lo"][keep], cols["span_id"][keep]
        order = np.lexsort((lo, hi))
        hi, lo, sid = hi[order], lo[order], sid[order]
        bounds = np.flatnonzero((hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])) + 1
        starts = np.concatenate([[0], bounds]).tolist()
        ends = np.concatenate([bounds, [len(sid)]]).tolist()
        rows = []
        his, los = hi[starts].tolist(), lo[starts].tolist()
        shi, slo = _signed(hi[starts]), _signed(lo[starts])
        for i, (a, b) in enumerate(zip(starts, ends)):
            ids = sid[a:b]
            rows.append((shi[i], slo[i], seg_id, ids.tobytes()))
            key = (his[i], los[i])
            stored = known.get(key)
            self._known.put(key, np.sort(ids) if stored is None else np.union1d(stored, ids))
        self.db.executemany("INSERT INTO trace_index VALUES (?, ?, ?, ?)", rows)

    # -- reading ---------------------------------------------------------------------------

    def nodes(self) -> dict[int, "pb.Resource"]:
        return {row[0]: pb.Resource.FromString(row[1]) for row in self.db.execute("SELECT id, resource FROM nodes")}

    def segments(self, trace_keys: list[tuple[int, int]] | None = None):
        """Yield (node, SpanBatch) for every stored segment, or those holding the given traces."""
        if trace_keys is None:
            query = self.db.execute("SELECT node, data FROM segments ORDER BY id")
        else:
            ids = set()
            for h, l in trace_keys:
                ids.update(r[0] for r in self.db.execute(
                    "SELECT segment FROM trace_index WHERE trace_hi = ? AND trace_lo = ?", (_s64(h), _s64(l))))
            query = (self.db.execute("SELECT node, data FROM segments WHERE id = ?", (i,)).fetchone()
                     for i in sorted(ids))
        for node, data in query:
            yield node, pb.SpanBatch.FromString(data)

    def clock_samples(self) -> list[tuple]:
        """(node, source, peer, t1, t2, t3, t4, local_ns, offset_ns, error_ns, server) rows."""
        return self.db.execute("SELECT node, source, peer, t1, t2, t3, t4, local_ns, offset_ns, error_ns, "
                               "server FROM clock_samples ORDER BY node, local_ns").fetchall()

    def dropped_by_node(self) -> dict[str, int]:
        rows = self.db.execute("SELECT n.node_id, sum(s.dropped) FROM sessions s JOIN nodes n ON n.id = s.node "
                               "GROUP BY n.node_id")
        return {node: int(count) for node, count in rows}

    def rejects(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT reason, count FROM rejects ORDER BY reason"))

    def span_count(self) -> int:
        return self.db.execute("SELECT coalesce(sum(n), 0) FROM segments").fetchone()[0]

