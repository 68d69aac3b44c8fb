"""The collector's embedded durable store: one SQLite file in WAL mode.

Spans are kept as columnar segments (one SpanBatch blob per accepted batch) rather
than a row per span: a row per span measured 250-340k spans/s here (README, "Choosing
the store"). SQLite rather than DuckDB because `crosstrace report` must read a store
while the collector writes it, which SQLite's WAL allows and DuckDB's single-writer
lock does not.

A write commits before its batches are acked. Duplicates are dropped twice over: a
batch seen before (same session and seq: a resend after a lost ack, a spool replay)
is answered from the `batches` table without storing anything, and every span is
checked against the window of recently stored spans (collector/dedup.py).
"""
import collections
import contextlib
import dataclasses
import fcntl
import itertools
import logging
import os
import re
import sqlite3
import threading
import time
import urllib.parse

import numpy as np

from ..clock_sync.domain import clock_domain
from ..proto import pb
from ..proto.semconv import CLOCK_LABEL
from .columns import take, view
from .dedup import RecentKeys, span_keys
from .ingest import CheckedBatch

SCHEMA_VERSION = 1
# Clock samples read before a report's window (Store.keep_last): the fits of the spans at its
# start see samples on both sides (a fit's window is 300 s).
CLOCK_CONTEXT_NS = 600 * 10**9

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY, node_id TEXT NOT NULL UNIQUE, resource BLOB NOT NULL,
    first_seen_ns INTEGER NOT NULL, last_seen_ns INTEGER NOT NULL);
-- the node id a row's tracers send and the clock its spans are on, set by the first batch that
-- names a clock (Store._node_row); rows named "<node id>#2", ... hold a node id back on another clock
CREATE TABLE IF NOT EXISTS node_clocks (node INTEGER PRIMARY KEY, base TEXT NOT NULL, clock TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS node_clocks_base ON node_clocks (base);
CREATE TABLE IF NOT EXISTS sessions (
    session_id BLOB PRIMARY KEY, node INTEGER NOT NULL, pid INTEGER NOT NULL,
    dropped INTEGER NOT NULL, last_seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, node INTEGER NOT NULL, received_ns INTEGER NOT NULL,
    n INTEGER NOT NULL, data BLOB NOT NULL,
    traces BLOB NOT NULL);  -- sorted distinct trace_id_hi values: finds a trace's segments
CREATE INDEX IF NOT EXISTS segments_received ON segments (received_ns);
-- batches with spans, for resends (one of clock samples only is not kept: a resend adds samples
-- again, which Store.clock_samples reads once)
CREATE TABLE IF NOT EXISTS batches (
    session_id BLOB NOT NULL, seq INTEGER NOT NULL, accepted INTEGER NOT NULL, duplicates INTEGER NOT NULL,
    received_ns INTEGER NOT NULL DEFAULT 0,   -- added to stores begun without it (Store._open)
    PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batches_received ON batches (received_ns);
CREATE TABLE IF NOT EXISTS clock_samples (
    node INTEGER NOT NULL, source INTEGER NOT NULL, peer TEXT NOT NULL,
    t1 INTEGER, t2 INTEGER, t3 INTEGER, t4 INTEGER, local_ns INTEGER,
    offset_ns INTEGER, error_ns INTEGER, server TEXT, received_ns INTEGER NOT NULL,
    peer_clock TEXT);   -- added to stores begun without it (Store._open)
CREATE INDEX IF NOT EXISTS clock_samples_node ON clock_samples (node, local_ns);
CREATE INDEX IF NOT EXISTS clock_samples_received ON clock_samples (received_ns);
CREATE TABLE IF NOT EXISTS rejects (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
-- the clocks collectors wrote this store on, and what each is shifted by onto its timeline
CREATE TABLE IF NOT EXISTS collector_clocks (
    clock TEXT PRIMARY KEY, shift_ns INTEGER NOT NULL, first_used_unix_ns INTEGER NOT NULL);
"""
_TABLES = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", _SCHEMA))
_NODE_CACHE = 65536   # node ids whose rows a writer keeps at hand
# The rows of a node id (Store._node_row), by two indexed lookups: one query with `OR` scanned
# every node, 25 ms per new node id at 100k nodes (default node ids are one per process).
_NODE_ROWS = ("SELECT n.id, n.node_id, c.clock FROM node_clocks c JOIN nodes n ON n.id = c.node WHERE c.base = ? "
              "UNION ALL SELECT n.id, n.node_id, NULL FROM nodes n WHERE n.node_id = ? "
              "AND NOT EXISTS (SELECT 1 FROM node_clocks c WHERE c.node = n.id) ORDER BY 1")
log = logging.getLogger("crosstrace.collector")


@dataclasses.dataclass
class WriteResult:
    accepted: int
    duplicates: int
    resent: bool = False   # a batch stored before (its session and seq): its rejects were counted then


def take_writer_lock(path: str):
    """One writer per store: two collectors on one store each kept their own window of
    recent spans, and stored a span that came to both twice (and two creating a store at
    once failed on SQLite's lock). The lock is an flock on `<store>.lock` (of the store's
    real path), held by a file object, so that it goes with the Store or the process
    however either ends; readers take none. A filesystem without flock (NFS without lockd)
    goes unlocked, with a warning."""
    lock_path = os.path.realpath(path) + ".lock"
    try:
        f = open(os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644), "rb")
    except OSError as exc:
        folder = os.path.dirname(lock_path)
        why = f"{folder} is not writable" if not os.access(folder, os.W_OK) else exc.strerror
        raise ValueError(f"cannot open the store {path}: no lock file {lock_path} ({why})") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"the store {path} is in use by another collector ({lock_path} is held)") from None
    except OSError as exc:
        log.warning("crosstrace: %s cannot be locked (%s); make sure one collector writes %s", lock_path,
                    exc.strerror, path)
    return f


def _readonly_uri(path: str) -> str:
    """A read-only connection's URI. A store in a directory this process cannot write (a
    read-only copy) cannot get the -shm file that WAL readers share: it is read as immutable,
    which misses nothing as long as no -wal file holds commits."""
    path = os.path.abspath(path)
    wal = f"{path}-wal"
    immutable = (not os.access(os.path.dirname(path), os.W_OK) and not os.path.exists(f"{path}-shm")
                 and not (os.path.exists(wal) and os.path.getsize(wal)))
    return f"file:{urllib.parse.quote(path)}?mode=ro" + ("&immutable=1" if immutable else "")


# Clock samples of these sources with no peer were measured against the collector's clock
MEASURED_HERE = (pb.GRPC_EXCHANGE, pb.UDP_EXCHANGE)


class Store:
    """Opened by the collector for writing, and by the CLI (`readonly=True`) for reports.

    A writer is given its collector's clock, `now`, named `clock` (clock_sync.domain;
    default: this machine's monotonic clock), and puts what it measured on the store's
    reference timeline (_timeline)."""

    def __init__(self, path: str, readonly: bool = False, sync: str = "normal", window: int = 8_000_000,
                 now=time.monotonic_ns, clock: str | None = None):
        self.path = path
        self.readonly = readonly
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a directory, not a crosstrace store")
        if readonly and not os.path.exists(path):
            raise FileNotFoundError(f"no crosstrace store at {path}")
        if not readonly:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._writer_lock = None
        self._node_ids: dict[tuple[str, str], tuple[int, str]] = {}   # (node id, clock) -> (row, name)
        self.recent = RecentKeys(window)
        self.since_ns = None   # keep_last: what is read
        self.now = now
        self.clock = clock or clock_domain()   # a writer's: the clock its collector answers probes on
        self.shift_ns = 0
        self._shifts: dict[str, int] = {}      # collector clock -> its shift onto the timeline
        try:
            try:
                self._open(sync)
                if not readonly:
                    self.now = self._timeline(now, self.clock)
                    # records of a store begun before they had a time count as received now, so
                    # that the first --retain keeps them for a while (resends are told by them)
                    self.db.execute("UPDATE batches SET received_ns = ? WHERE received_ns = -1", (self.now(),))
                    self._load_recent_keys()
            except sqlite3.DatabaseError as exc:    # OperationalError too (a full disk, say)
                raise ValueError(self._cannot_open(exc)) from None
        except BaseException:
            if self._writer_lock is not None:
                self._writer_lock.close()
            raise

    def _open(self, sync: str) -> None:
        if self.readonly:
            self.db = sqlite3.connect(_readonly_uri(self.path), uri=True, check_same_thread=False,
                                      isolation_level=None)
            self._check_kind()
        else:
            self._writer_lock = take_writer_lock(self.path)
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._check_kind()
            # Large pages for a store of large segment blobs: a 660 KB segment commits in 1.2 ms
            # instead of 2.7 (a new store only; an existing one keeps its page size).
            self.db.execute("PRAGMA page_size=65536")
            self.db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit survives the collector being killed; FULL: also a power loss.
            self.db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            if "batches" in self._tables() and "received_ns" not in self._columns("batches"):   # begun before it
                self.db.execute("ALTER TABLE batches ADD COLUMN received_ns INTEGER NOT NULL DEFAULT -1")
            self.db.executescript(_SCHEMA)
            if "peer_clock" not in self._columns("clock_samples"):   # a store begun before it
                self.db.execute("ALTER TABLE clock_samples ADD COLUMN peer_clock TEXT")
            # The writer's page cache; a reader reads each segment once, and a large cache
            # only held copies of what it had read (128 MB of a report's peak).
            self.db.execute("PRAGMA cache_size=-131072")

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}

    def _tables(self) -> set[str]:
        return {name for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def _check_kind(self) -> None:
        """Refuse what is not a store of this version before anything is written to it:
        another program's SQLite database, or (to read) an empty one."""
        tables = self._tables()
        if "meta" not in tables:
            if tables:
                raise ValueError(f"{self.path} is an SQLite database but not a crosstrace store")
            if self.readonly:
                raise ValueError(f"{self.path} is empty, not a crosstrace store")
            return
        version = self.meta("schema_version")
        if version is None and not self.readonly and self._cut_short(tables):
            return   # made by a collector that died before writing its first row: begun again
        if version != str(SCHEMA_VERSION):
            raise ValueError(f"store {self.path} has schema version {version}; this crosstrace "
                             f"reads version {SCHEMA_VERSION}")

    def _cut_short(self, tables: set[str]) -> bool:
        """Whether this is a store whose making stopped before its first row (a collector
        killed then): its tables some of ours, all empty. Another program's database, with
        a `meta` table of its own, is not."""
        return tables <= _TABLES and not any(self.db.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() for t in tables)

    def _cannot_open(self, exc: sqlite3.DatabaseError) -> str:
        """One line on what is wrong with the path: SQLite's reason, and a directory or
        file that cannot be written where that is the likely cause."""
        folder = os.path.dirname(os.path.abspath(self.path))
        for p in (folder,) if self.readonly else (folder, self.path):
            if isinstance(exc, sqlite3.OperationalError) and os.path.exists(p) and not os.access(p, os.W_OK):
                return f"cannot open the store {self.path}: {exc} ({p} is not writable)"
        return f"cannot read {self.path} as a crosstrace store: {exc}"

    def close(self) -> None:
        self.db.close()
        if self._writer_lock is not None:
            self._writer_lock.close()
            self._writer_lock = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeline(self, now, clock: str):
        """The store's reference timeline, read through `now`. The first collector to write
        a store sets it: its clock, and the offset that puts it on the Unix epoch for exports.
        A collector on another clock (its machine rebooted, the store moved to another
        machine) continues the timeline through the wall clock: what was measured against
        its clock is shifted by the difference of the two clocks' offsets to the wall clock,
        kept per clock so that every restart on one clock shifts alike. Spans from before and
        after such a hand-over are then placed relative to each other within the wall clock's
        own error (NTP: about a millisecond), where they were an uptime apart; alignment among
        the spans of either side stays as exact as it was. The collector still answers clock
        probes on its own clock: a relay's answers go upstream, which knows that clock."""
        wall_offset = time.time_ns() - now()
        meta = {"schema_version": str(SCHEMA_VERSION), "epoch_offset_ns": str(wall_offset),
                "created_ns": str(time.time_ns())}
        self.db.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", meta.items())   # a new store
        row = self.db.execute("SELECT shift_ns FROM collector_clocks WHERE clock = ?", (clock,)).fetchone()
        if row is not None:
            self.shift_ns = row[0]
        else:
            # The first clock named in a store is its timeline's: a store written before clocks
            # were named was on it too, as far as anything tells.
            if self.db.execute("SELECT 1 FROM collector_clocks LIMIT 1").fetchone() is not None:
                self.shift_ns = wall_offset - int(self.meta("epoch_offset_ns"))
            self.db.execute("INSERT INTO collector_clocks VALUES (?, ?, ?)", (clock, self.shift_ns, time.time_ns()))
        self._shifts = dict(self.db.execute("SELECT clock, shift_ns FROM collector_clocks"))
        shift = self.shift_ns
        return now if not shift else (lambda: now() + shift)

    def collector_clocks(self) -> list[dict]:
        """The clocks collectors wrote this store on, oldest first: name, shift, first use."""
        try:
            rows = self.db.execute("SELECT clock, shift_ns, first_used_unix_ns FROM collector_clocks ORDER BY rowid")
        except sqlite3.OperationalError:   # an older store, read only
            return []
        return [{"clock": clock, "shift_ns": shift, "first_used_unix_ns": first} for clock, shift, first in rows]

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    # -- writing ---------------------------------------------------------------------------

    def write(self, batches: list[CheckedBatch], rejected_whole: collections.Counter | None = None) -> list[WriteResult]:
        """Commit a group of checked batches in one transaction; returns one result per batch."""
        now = self.now()
        with self._lock:
            self._pending = RecentKeys(capacity=1 << 62)   # keys written in this transaction
            try:
                with self._transaction() as db:
                    results = [self._write_one(b, now) for b in batches]
                    rejects = collections.Counter(rejected_whole or {})
                    for b, result in zip(batches, results):
                        if not result.resent:
                            rejects.update(b.rejected)
                    if rejects:
                        db.executemany("INSERT INTO rejects VALUES (?, ?) ON CONFLICT(reason) "
                                       "DO UPDATE SET count = count + excluded.count", rejects.items())
            except BaseException:
                self._node_ids.clear()   # ids cached in the transaction may be rolled back with it
                raise
            for keys in self._pending.runs:  # only committed spans enter the window
                self.recent.add(keys)
        return results

    @contextlib.contextmanager
    def _transaction(self):
        """One write transaction (the caller holds self._lock), rolled back where it fails."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:   # SQLite ends it itself on some errors (a full disk)
                db.execute("ROLLBACK")
            raise

    def record_rejects(self, rejects: collections.Counter) -> None:
        """Count batches rejected whole (they never reach write())."""
        self.write([], rejects)

    def _node(self, resource: "pb.Resource", now: int) -> int:
        """The node row of a batch's resource. A node is one clock: a node id that comes back
        on another clock (Resource label `clock`: a rebooted machine, a pod rescheduled under
        its name) is stored as "<node id>#2" (#3, ...), so that the two clocks get two
        models rather than one that fits neither."""
        key = (resource.node_id, resource.labels.get(CLOCK_LABEL, ""))
        known = self._node_ids.get(key)
        if known is None:
            if len(self._node_ids) >= _NODE_CACHE:   # one node id per process by default: bounded
                self._node_ids.clear()
            known = self._node_ids[key] = self._node_row(*key, now)
        node, name = known
        if name != resource.node_id:
            resource = pb.Resource.FromString(resource.SerializeToString())
            resource.node_id = name
        self.db.execute("UPDATE nodes SET resource = ?, last_seen_ns = ? WHERE id = ?",
                        (resource.SerializeToString(), now, node))
        return node

    def _node_row(self, node_id: str, clock: str, now: int) -> tuple[int, str]:
        """(row, name) of the node id on this clock, made if new. A batch that names no clock
        (an older tracer's) takes the node id's first row; a row no such batch has claimed
        yet is claimed by the first clock that comes."""
        db = self.db
        rows = db.execute(_NODE_ROWS, (node_id, node_id)).fetchall()
        for row, name, theirs in rows:
            if theirs == clock or not clock:
                return row, name
        for row, name, theirs in rows:
            if theirs is None:
                db.execute("INSERT INTO node_clocks VALUES (?, ?, ?)", (row, node_id, clock))
                return row, name
        # The next suffix after the node id's rows, looked up (one lookup, unless another node
        # took that name): probing from #2 up cost one lookup per clock the node id had, on
        # the store's one writer thread, and a client that named a new clock in every batch
        # made every batch slower (17 ms a batch at 8,000 clocks).
        for k in itertools.count(len(rows) + 1):
            name = f"{node_id}#{k}" if k > 1 else node_id
            if not db.execute("SELECT 1 FROM nodes WHERE node_id = ?", (name,)).fetchone():
                break
        row = db.execute("INSERT INTO nodes (node_id, resource, first_seen_ns, last_seen_ns) VALUES (?, ?, ?, ?)",
                         (name, b"", now, now)).lastrowid
        if clock:
            db.execute("INSERT INTO node_clocks VALUES (?, ?, ?)", (row, node_id, clock))
        return row, name

    def _write_one(self, checked: CheckedBatch, now: int) -> WriteResult:
        batch, cols = checked.batch, checked.cols
        db = self.db
        if batch.session_id:
            seen = db.execute("SELECT accepted, duplicates FROM batches WHERE session_id = ? AND seq = ?",
                              (batch.session_id, batch.seq)).fetchone()
            if seen is not None:  # a resend: everything in it is stored already
                return WriteResult(0, seen[0] + seen[1], resent=True)
        node = self._node(batch.resource, now)
        if batch.session_id:
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET "
                       "dropped = max(dropped, excluded.dropped), last_seq = max(last_seq, excluded.last_seq)",
                       (batch.session_id, node, batch.resource.pid, batch.dropped_spans, batch.seq))
        if checked.samples:
            db.executemany("INSERT INTO clock_samples (node, source, peer, t1, t2, t3, t4, local_ns, offset_ns, "
                           "error_ns, server, received_ns, peer_clock) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           [row for row in (self._sample_row(node, s, now) for s in checked.samples) if row])
        keep = checked.keep.copy()
        keys = span_keys(cols["trace_id_hi"], cols["trace_id_lo"], cols["span_id"])
        duplicates = self._mark_duplicates(keys, keep)
        accepted = int(keep.sum())
        if accepted:
            self._write_segment(checked, keep, node, now)
            self._pending.add(keys[keep])
        if batch.session_id and batch.count:
            db.execute("INSERT INTO batches (session_id, seq, accepted, duplicates, received_ns) VALUES (?, ?, ?, ?, ?)",
                       (batch.session_id, batch.seq, accepted, duplicates, now))
        return WriteResult(accepted, duplicates)

    def _sample_row(self, node: int, s: "pb.ClockSample", now: int) -> tuple | None:
        """A clock_samples row; what was measured against a collector's clock, on the timeline:
        shifted as the clock that answered it (a batch probed before a reboot can arrive
        after it), the current one's where the tracer did not say; None for a clock this
        store never had."""
        t2, t3 = s.t2, s.t3
        if not s.peer and s.source in MEASURED_HERE:
            shift = self._shifts.get(s.peer_clock) if s.peer_clock else self.shift_ns
            if shift is None:
                return None
            t2, t3 = t2 + shift, t3 + shift
        return (node, s.source, s.peer, s.t1, t2, t3, s.t4, s.local_ns, s.offset_ns, s.error_ns, s.server, now,
                s.peer_clock or None)

    def _mark_duplicates(self, keys: np.ndarray, keep: np.ndarray) -> int:
        """Clear `keep` for spans stored before or repeated within the batch; returns their count."""
        idx = np.flatnonzero(keep)
        k = keys[idx]
        order = np.argsort(k, kind="stable")
        ordered = k[order]
        dup = np.zeros(len(idx), dtype=bool)
        dup[order[1:][ordered[1:] == ordered[:-1]]] = True  # repeats within the batch: keep the first
        dup[order] |= self.recent.contains(ordered) | self._pending.contains(ordered)  # sorted needles search faster
        keep[idx[dup]] = False
        return int(dup.sum())

    def _write_segment(self, checked: CheckedBatch, keep: np.ndarray, node: int, now: int) -> None:
        batch, cols = checked.batch, checked.cols
        if keep.all():
            segment = pb.SpanBatch()
            segment.CopyFrom(batch)
            segment.ClearField("resource")
            segment.ClearField("clock_samples")
        else:
            segment = take(batch, cols, keep, checked.attributes, checked.extras)
        hi = np.sort(cols["trace_id_hi"][keep])   # unique by hand: numpy 2's hashing np.unique is 8x slower here
        traces = hi[np.r_[True, hi[1:] != hi[:-1]]].tobytes()
        self.db.execute("INSERT INTO segments (node, received_ns, n, data, traces) VALUES (?, ?, ?, ?, ?)",
                        (node, now, segment.count, segment.SerializeToString(), traces))

    def _load_recent_keys(self) -> None:
        """Refill the dedup window from the newest segments, so it survives a restart."""
        wanted = self.recent.capacity // 2
        parts, total = [], 0
        for (data,) in self.db.execute("SELECT data FROM segments ORDER BY id DESC"):
            cols = view(pb.SpanBatch.FromString(data))
            parts.append(span_keys(cols["trace_id_hi"], cols["trace_id_lo"], cols["span_id"]))
            total += len(parts[-1])
            if total >= wanted:
                break
        for keys in reversed(parts):
            self.recent.add(keys)

    # -- reading ---------------------------------------------------------------------------

    def nodes(self) -> dict[int, "pb.Resource"]:
        return {row[0]: pb.Resource.FromString(row[1]) for row in self.db.execute("SELECT id, resource FROM nodes")}

    def reused_node_ids(self) -> set[str]:
        """Node ids that came back on another clock (rows "<node id>#2", ...); none in a
        store written before clocks were told apart."""
        try:
            rows = self.db.execute("SELECT base FROM node_clocks GROUP BY base HAVING count(*) > 1").fetchall()
        except sqlite3.OperationalError:   # no node_clocks table: an older store, read only
            return set()
        return {base for (base,) in rows}

    def keep_last(self, duration_ns: int) -> None:
        """Read only the spans that arrived within `duration_ns` of the last to arrive, and the
        clock samples from CLOCK_CONTEXT_NS before those on (what the clock fits around them
        need): a report of a store written for weeks costs what its window holds."""
        newest = self.db.execute("SELECT max(received_ns) FROM segments").fetchone()[0]
        if newest is not None:
            self.since_ns = newest - duration_ns

    @property
    def _since(self) -> int:
        """Segments are read from those received then on (keep_last's window; all of them)."""
        return np.iinfo(np.int64).min if self.since_ns is None else self.since_ns

    def nodes_with_spans(self) -> set[int]:
        """The nodes (rows) with spans in what this store reads."""
        return {node for (node,) in self.db.execute("SELECT DISTINCT node FROM segments WHERE received_ns >= ?",
                                                     (self._since,))}

    def segments(self, trace_prefixes: list[str] | None = None):
        """Yield (node, SpanBatch) for every stored segment (since keep_last's window), or
        those that may hold a trace whose id starts with one of these lowercase hex prefixes
        (a segment lists the high halves of its trace ids only)."""
        since = (self._since,)
        if trace_prefixes is None:
            for node, data in self.db.execute("SELECT node, data FROM segments WHERE received_ns >= ? ORDER BY id",
                                              since):
                yield node, pb.SpanBatch.FromString(data)
            return
        # The prefix's first 16 digits, as a value of the high half shifted right.
        heads = [(np.uint64(4 * (16 - len(p[:16]))), np.uint64(int(p[:16], 16))) for p in trace_prefixes]
        for seg_id, traces in self.db.execute("SELECT id, traces FROM segments WHERE received_ns >= ? ORDER BY id",
                                              since).fetchall():
            his = np.frombuffer(traces, "<u8")
            if any(np.any((his >> shift) == value) for shift, value in heads):
                node, data = self.db.execute("SELECT node, data FROM segments WHERE id = ?", (seg_id,)).fetchone()
                yield node, pb.SpanBatch.FromString(data)

    def clock_samples(self) -> list[tuple]:
        """(node, source, peer, t1, t2, t3, t4, local_ns, offset_ns, error_ns, server) rows.
        A peer is named by its row: where the node id came back on another clock, a sample
        that says which clock its peer was on (peer_clock: a relay's exchanges) names that
        clock's row ("<node id>#2", ...), and one that does not (an RPC's) cannot say which
        clock it met and is left out."""
        peer_clock = "peer_clock" if "peer_clock" in self._columns("clock_samples") else "NULL"
        since = np.iinfo(np.int64).min if self.since_ns is None else self.since_ns - CLOCK_CONTEXT_NS
        # DISTINCT: a batch of clock samples only is not recorded as a batch, so its resend
        # (after a lost ack) stores its samples again; they weighed twice in the fits.
        rows = self.db.execute("SELECT DISTINCT node, source, peer, t1, t2, t3, t4, local_ns, offset_ns, error_ns, "
                               f"server, {peer_clock} FROM clock_samples WHERE received_ns >= ? ORDER BY node, "
                               "local_ns", (since,)).fetchall()
        reused = self.reused_node_ids()
        if not reused:
            return [row[:11] for row in rows]
        names = dict(((base, clock), name) for base, clock, name in self.db.execute(
            "SELECT c.base, c.clock, n.node_id FROM node_clocks c JOIN nodes n ON n.id = c.node"))
        out = []
        for row in rows:
            peer = row[2]
            if peer in reused:
                peer = names.get((peer, row[11]))
                if peer is None:
                    continue
                row = (*row[:2], peer, *row[3:])
            out.append(row[:11])
        return out

    def expire(self, older_than_ns: int) -> int:
        """Delete what arrived over `older_than_ns` ago (the collector's --retain): spans, clock
        samples and the records of batches with spans. Returns the spans deleted."""
        cutoff = self.now() - older_than_ns
        with self._lock, self._transaction() as db:
            spans = db.execute("SELECT coalesce(sum(n), 0) FROM segments WHERE received_ns < ?", (cutoff,)).fetchone()[0]
            for table in ("segments", "clock_samples", "batches"):
                db.execute(f"DELETE FROM {table} WHERE received_ns < ?", (cutoff,))
        return spans

    def dropped_by_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for node, count in self.db.execute("SELECT n.node_id, s.dropped FROM sessions s JOIN nodes n ON n.id = s.node"):
            out[node] = out.get(node, 0) + count   # in Python: SQLite's sum() fails beyond int64, which clients reach
        return out

    def rejects(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT reason, count FROM rejects ORDER BY reason"))

    def span_count(self) -> int:
        return self.db.execute("SELECT coalesce(sum(n), 0) FROM segments").fetchone()[0]

