"""Background export: one thread drains the span queue into columnar batches and sends
them over one gRPC stream; a second thread reads the collector's acks.

The traced program never waits on any of this. The span queue is bounded (a span
that does not fit is dropped and counted). Batches stay until acked and are resent in
order after a reconnect. In memory they are bounded by max_unacked_mb; with a spool
(spool_dir), a batch goes to disk while the collector is out of reach, or when memory is
full, and is replayed from there (also by the next process that spools there, should this
one end first); otherwise the oldest is given up. Either way what is given up is counted as
dropped. Every batch keeps its (session_id, seq), so the collector's batch-level dedup
stores nothing twice, whatever is resent or replayed.

A relay (`crosstrace collector --forward-to`) hands other tracers' batches on through
`forward()`, on the same stream, spool and acks.
"""
import collections
import logging
import os
import socket
import threading
import time

import grpc

try:
    # grpc imports these on its first channel, which here is the exporter thread's. A fork
    # in the middle of that import (a DataLoader worker forked right after init) would leave
    # the child a half-initialised module, and the child could never export.
    from grpc import _channel, _interceptor  # noqa: F401
except ImportError:  # pragma: no cover - another grpc layout: imported on first use then
    pass

from ..proto import EXPORT_METHOD, MAX_MESSAGE_BYTES, pb
from ..proto.semconv import CLOCK_LABEL
from ..proto.endpoint import is_loopback, split_host_port
from . import orphans
from .clock import Clock
from .clock_probe import ClockProber, add_piggyback_samples
from .compiled import QueueFields
from .encode import FIELDS, batches, encode_spans, encoded_size
from .spool import ChildBatches, Spool, child_spool, parent_sends, remove_if_abandoned, tell_parent

log = logging.getLogger("crosstrace.tracer")

MAX_BATCH_BYTES = MAX_MESSAGE_BYTES // 4   # a batch larger than this goes in parts
BATCH_TARGET_BYTES = 1 << 20               # what a batch is sized for (see _part_size)
# The first round (its clock-probe burst) comes soon, so that even a short-lived process has
# clock samples from before its spans; not at once: a process often forks right after init
# (DataLoader workers): with the first round at once, children forked at start-up failed 3
# times in about 65 runs (a half-imported grpc module, a lost flush, a crash in gRPC).
_FIRST_ROUND_S = 0.2
_ACK_WAIT_S = 5.0      # at most, a round, for room among the unacked batches while the stream is up (_await_room)
_HANDOVER_S = 0.5      # of shutdown's time, kept for the exporter thread to hand its last batches over
_EXIT_PROBE_S = 0.5    # at most, for the burst at shutdown: threads that keep the GIL busy slow it
_HANDOVER_POLL_S = 0.05   # how often batches handed over by forked children are looked for, and their acks
_AFTER_FORK_S = 2.0       # a parent polls so long after a fork even where no child has handed over yet
_HANDOVER_LOOK_S = 1.0    # and then looks (one stat) this often: a child that traces later is heard from soon


class ExportQueue(QueueFields):
    """What the hot path touches: a list (extend() is atomic under the GIL, no lock),
    the clock, and a drop counter. Spans are only ever added at the end, so the exporter
    takes all that is queued with one strided slice per field and one slice deletion,
    where popping a deque entry by entry cost 85 ns per span more (and taking less than all
    would move the rest of the list each time).

    A queued span is its FIELDS values, put in by one extend() so that no other thread's
    come between them, not a tuple of them: a tuple is tracked by the garbage collector
    until a collection finds it holds plain values, so a tuple per span started a young
    collection every 700 spans, which traversed the queued tuples. Plain values and an
    attributes dict of plain values are never tracked (a span's SpanExtras is, and so is a
    dict that holds a list). Reading the queue by field needs no pass over tuples.
    """

    __slots__ = ("clock", "samples", "forked_at", "deferred")   # and QueueFields', which the hot path reads

    def __init__(self, clock, max_queue: int, batch_size: int):
        self.clock = clock
        self.now = clock.now
        self.max_entries = FIELDS * max_queue
        self.wake_at = FIELDS * max(1, min(batch_size, max_queue // 2))
        self.wake = _noop
        self.queue, self.samples, self.dropped = [], collections.deque(), 0
        self.deferred = collections.deque()   # work that makes spans, run by the exporter (run_deferred)
        self.forked_at = None

    def take(self) -> list[list]:
        """Pop every queued span, as one list per field (encode_spans' columns)."""
        queue = self.queue
        n = len(queue)   # spans appended meanwhile go after n: they stay for the next take
        columns = [queue[i:n:FIELDS] for i in range(FIELDS)]
        del queue[:n]
        if self.forked_at is not None:
            columns = self._started_here(columns)
        return columns

    def _started_here(self, columns: list[list]) -> list[list]:
        """In a forked child: the spans that started after the fork. Those open at the fork
        are the parent's, which ends and exports them; the child ends its copies too where it
        unwinds through their `with` (sys.exit in a child of os.fork), and the collector,
        which keeps the first copy of a span, would store the child's end. (A span the child
        starts with an explicit start time before the fork is left out alike.)"""
        forked_at, starts = self.forked_at, columns[5]   # (encode.py's order of the fields)
        keep = [i for i, start in enumerate(starts) if start >= forked_at]
        if len(keep) == len(starts):
            return columns
        return [[column[i] for i in keep] for column in columns]

    def run_deferred(self) -> None:
        """Run the work instrumentation handed over (TracerProvider.defer), each once, in order."""
        deferred = self.deferred
        while deferred:
            try:
                work = deferred.popleft()
            except IndexError:   # taken by another thread meanwhile (shutdown's)
                return
            try:
                work()
            except Exception as exc:  # instrumentation's; never stops the export
                log.warning("crosstrace: deferred tracing work %r failed: %r", work, exc)

    def reset_after_fork(self) -> None:
        """The child starts with an empty queue: the parent exports what it recorded."""
        self.queue, self.samples, self.dropped = [], collections.deque(), 0
        self.deferred = collections.deque()
        self.forked_at = self.now()


def _noop() -> None:
    pass


def build_resource(cfg, clock) -> "pb.Resource":
    return pb.Resource(node_id=cfg.node_id, host=socket.gethostname(), rank=cfg.rank,
                       world_size=cfg.world_size, local_rank=cfg.local_rank, role=cfg.role,
                       job_id=cfg.job_id, pid=os.getpid(), service_name=cfg.service_name,
                       labels={**cfg.labels, CLOCK_LABEL: clock.domain()})


class _Pending:
    """A batch sent (or to be sent) and not acked yet: in memory (`data`), on disk
    (`spooled`), or both. `order` counts batches as they were queued, for flushes."""

    __slots__ = ("key", "seq", "order", "spans", "size", "data", "spooled", "gone")

    def __init__(self, key, seq: int, order: int, spans: int, data: bytes | None, spooled=None):
        self.key = key                  # identity in Exporter._unacked
        self.seq = seq                  # within the batch's own session: what its ack says
        self.order = order
        self.spans = spans
        self.size = len(data) if data is not None else spooled.size
        self.data = data
        self.spooled = spooled
        self.gone = False               # acked or given up: not to be sent again


class Exporter:
    def __init__(self, cfg, clock, queue: ExportQueue, forked: bool = False, parent: str | None = None):
        """`forked`: in a forked child (a DataLoader worker), which touches gRPC at the
        earliest once it has spans to send: gRPC skips its fork handlers while a call is
        open (the parent's export stream always is), and a child's own channel then aborted
        in gRPC's poller now and then (2 of 24 children of DDP ranks). `parent`: the folder
        where the process that sends for this one takes its batches (ChildBatches); a child
        hands them over there, never touching gRPC while that process's tracer takes them.
        Its clock is the parent's, which the parent probes."""
        self.cfg = cfg
        self.clock = clock
        self.queue = queue
        self.resource = build_resource(cfg, clock)
        self.session_id = os.urandom(16)
        self.dropped = 0                    # spans given up after they were batched
        self.batched = 0                    # spans put in a batch (or forwarded), ever
        self.rejected: collections.Counter = collections.Counter()
        self._seq = 0
        self._order = 0
        self._span_bytes = 128              # encoded bytes per span, of the last batch
        self._unacked: "collections.OrderedDict[tuple, _Pending]" = collections.OrderedDict()
        self._memory_bytes = 0
        self._waiters: list[tuple[int, threading.Event]] = []
        self._pending_flushes: list[threading.Event] = []
        self._lock = threading.Lock()       # exporter-side state only; never taken by the hot path
        self._wake = threading.Event()
        self._acked = threading.Event()     # set at each ack, when the stream ends, and at shutdown
        self._room_deadline = 0.0           # how long _await_room may wait, this time round
        self._spill_lock = threading.RLock()   # one spill at a time (the exporter's, shutdown's)
        self._closed = False                # shutdown is done: batches made after are counted, not kept
        self._ever_acked = False            # then a closed socket is no sign of a TLS mismatch
        self._outage_since = None           # monotonic time the export stream first failed, until an ack
        self._stopping = False
        self._sent_dropped = 0 if forked else -1   # -1: a first batch at once, which says who this is
        self._channel = None
        self._requests = None
        self._backoff = 0.1
        self._retry_at = None     # a failed stream's backoff: opened again no sooner, by the thread then (_retry_now)
        self._warned: set[str] = set()
        self._parent = parent               # a forked child's, while it hands its batches over
        self._forked_at = 0.0               # monotonic time of this process's last fork (0: none yet)
        self._children = None if forked else ChildBatches(cfg.spool_dir, self.session_id)
        self._spool = None if parent else self._open_spool()   # a child's: at its first batch
        # What children hand over: outside a spool_dir bounded as batches in memory would be.
        self._handover_mb = cfg.spool_max_mb if cfg.spool_dir else cfg.max_unacked_mb
        self._spool_max_mb = self._handover_mb if parent else cfg.spool_max_mb
        self._prober = ClockProber(cfg, clock, queue.samples, self._get_channel, idle=forked)
        queue.wake = self._wake.set
        try:
            # Opened here, before the program goes on: opened at the first full batch, the
            # stream's threads each waited for a GIL switch of a busy loop, which filled the
            # queue meanwhile (9,458 spans lost 70 ms after init).
            if not forked:
                self._ensure_stream()
        except Exception as exc:   # an unreadable TLS file: said once, retried on the exporter thread
            self._warn_once("export", f"crosstrace: export error: {exc!r}")
        self._thread = threading.Thread(target=self._run, name="crosstrace-exporter", daemon=True)
        self._thread.start()

    @classmethod
    def forwarding(cls, cfg, forked: bool = False) -> "Exporter":
        """An exporter of batches made elsewhere, given to forward(): a relay's upstream, an
        orphaned child's sender (`forked`: no batch or clock probe of its own). Its clock
        is the configuration's."""
        clock = Clock(cfg.sim_clock_offset_ns, cfg.sim_clock_drift_ppm, cfg.sim_clock_epoch_ns)
        return cls(cfg, clock, ExportQueue(clock, cfg.max_queue, cfg.batch_size), forked=forked)

    def _open_spool(self) -> Spool | None:
        if not self.cfg.spool_dir:
            return None
        try:
            spool = Spool(self.cfg.spool_dir, self.cfg.node_id, self.session_id, self.cfg.spool_fsync)
            adopted = spool.adopt()
        except OSError as exc:
            log.warning("crosstrace: no spool in %s (%s); unacked batches are kept in memory only",
                        self.cfg.spool_dir, exc)
            return None
        for item in adopted:      # batches of this node's earlier processes: replayed first
            self._order += 1
            key = ("adopted", item.path)
            self._unacked[key] = _Pending(key, item.seq, self._order, item.spans, None, item)
        return spool

    # -- called from the traced program (or a relay's handlers) ---------------------------

    def flush(self, timeout_s: float) -> bool:
        if not self._thread.is_alive():
            return not self._unacked and not self.queue.queue
        done = threading.Event()
        with self._lock:
            self._pending_flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float) -> bool:
        """A last clock-probe burst, the last flush, then stop (within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        if self._parent is not None:
            handed_over = self._hand_over_and_stop(timeout_s)
            if handed_over is not None:
                return handed_over
            timeout_s = max(0.0, deadline - time.monotonic())
        if self._children is not None:
            self._children.stop_taking()   # children that look from now on send themselves
        nothing = not self._ever_acked and self._outage_since is not None and self._recorded_nothing()
        if nothing:   # a collector out of reach all along, for clock samples alone: not worth a wait
            timeout_s, deadline = 0.0, time.monotonic()
        self._prober.probe_now(min(timeout_s / 2, _EXIT_PROBE_S))
        # The flush leaves the thread time to batch what it holds (it may be waiting for acks
        # of a collector that hangs): without it, the spill below missed those spans.
        flushed = self.flush(max(0.0, deadline - time.monotonic() - min(_HANDOVER_S, timeout_s / 4)))
        self._stopping = True
        self._wake.set()
        self._acked.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._prober.close()
        self._close_stream()
        flushed = self._last_spill() and flushed
        if self._children is not None:
            untaken = self._children.close()
            if untaken:
                self.dropped += untaken
                flushed = False
                log.warning("crosstrace: %d spans that forked children handed over as this process's tracer "
                            "shut down were lost", untaken)
        return flushed or nothing

    def _hand_over_and_stop(self, timeout_s: float) -> bool | None:
        """A forked child's shutdown: its last batches on disk for the parent, which sends
        them (a worker's exit does not wait for the collector). True when all is handed
        over. Where the parent's tracer stopped taking batches (checked once they are
        written: its last look comes after), a new process sends them; None where it could
        not run: this process sends them itself then."""
        deadline = time.monotonic() + timeout_s
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():   # its last round is still writing
            return False
        if not self._parent_sends():
            sent = self._send_through_a_new_process(max(0.0, deadline - time.monotonic()))
            if sent is not None:
                self._prober.close()
                return self._last_spill() and sent
            self._send_myself()
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="crosstrace-exporter", daemon=True)
            self._thread.start()
            return None
        self._prober.close()
        self._last_spill()
        with self._lock:
            return not self.queue.queue and all(entry.spooled is not None for entry in self._unacked.values())

    def _send_through_a_new_process(self, timeout_s: float) -> bool | None:
        """A forked child's batches, where its parent's tracer stopped taking them: sent by a
        new process (orphans.py says why not over gRPC here). Whether the collector acked
        them all; None where that process could not run (this one sends them then)."""
        with self._lock:
            entries = list(self._unacked.values())
        batches = [entry.data if entry.data is not None else Spool.read(entry.spooled) for entry in entries]
        batches = [data for data in batches if data is not None]   # (a file gone: the parent sent it)
        sent = orphans.send(self.cfg, batches, timeout_s) if batches else True
        if sent:
            with self._lock:
                self._let_go_unlocked(entries)
        return sent

    def _last_spill(self) -> bool:
        """At shutdown: what is unacked goes to the spool (the next process that spools there
        replays it; a forked child's parent sends it), which then closes; no batch is kept
        after. False where the disk refused."""
        with self._spill_lock:
            try:
                self._spill(everything=True)
                if self._spool is not None:
                    self._spool.close()
                return True
            except OSError as exc:   # never raise into the traced program at its exit
                log.warning("crosstrace: could not keep the unacked batches on disk: %s", exc)
                return False
            finally:
                self._closed = True

    def _parent_sends(self) -> bool:
        parent = self._parent   # (None once this process sends itself, maybe from another thread)
        return parent is not None and parent_sends(parent)

    def _send_myself(self) -> None:
        """A forked child whose parent's tracer no longer takes its batches (shut down, or
        killed), where no new process could send them (_send_through_a_new_process): from
        now on it sends them itself, over a channel of its own."""
        self._reap_handed_over()
        parent, self._parent = self._parent, None
        if parent is not None and self._spool is None:   # (else its spool's close() does this)
            remove_if_abandoned(parent)

    def unacked_spans(self) -> tuple[int, int]:
        """Spans not acked yet: (on disk in the spool, for the next process that spools there;
        the rest, lost). Outside a spool_dir, batches on disk are forked children's handovers,
        which nothing would send later."""
        with self._lock:
            spooled = sum(entry.spans for entry in self._unacked.values() if entry.spooled is not None)
            batched = sum(entry.spans for entry in self._unacked.values())
        if not self.cfg.spool_dir:
            spooled = 0
        return spooled, batched - spooled + len(self.queue.queue) // FIELDS

    def _recorded_nothing(self) -> bool:
        """No span, nor a count of dropped ones, was ever batched here or waits to be, and no
        forked child hands any over: a process that imported a traced module and traced
        nothing (its --help, say), whose exit waited 4.5 s for a collector out of reach. (Its
        clock samples are still sent where the collector answers: a node's samples alone can
        link others' clocks to UTC.)"""
        return (not self.batched and not self.takes_handovers() and self.unacked_spans() == (0, 0)
                and not self.queue.dropped and not self.dropped)

    def takes_handovers(self) -> bool:
        """Whether forked children hand their batches over to this process."""
        return self._children is not None and self._children.dir is not None

    def before_fork(self) -> None:
        """This process forks: from now on its children may hand batches over."""
        if self._children is None or self._stopping:
            return
        first, self._forked_at = not self._forked_at, time.monotonic()
        if not first:
            return
        try:
            self._children.start()
        except OSError as exc:   # its children then export on channels of their own
            log.warning("crosstrace: forked children cannot hand their spans over to this process (%s); "
                        "each exports them itself", exc)

    def forked(self) -> None:
        """In the parent, after a fork: the thread begins looking for the child's handovers
        now, not when its wait ends (up to an export interval away), so a child's flush
        does not wait for the parent's next round."""
        if self._forked_at and not self._stopping:
            self._wake.set()

    def restart_after_fork(self) -> "Exporter":
        """In a forked child (a DataLoader worker): a new session and thread, which hand its
        batches over to the parent (or the parent's parent: whichever process sends). The
        parent's gRPC channel, threads and spool files are not touched."""
        if self._spool is not None:
            self._spool.forget_after_fork()
        parent = self._parent
        if self._children is not None:
            self._children.forget_after_fork()
            parent = self._children.dir
        return Exporter(self.cfg, self.clock, self.queue, forked=True, parent=parent)

    def forward(self, batch: "pb.SpanBatch") -> None:
        """Send another tracer's batch upstream under its own (session_id, seq) (a relay).
        With a spool it is on disk when this returns: durable before the relay acks it (one
        larger than the whole spool waits in memory only)."""
        data = batch.SerializeToString()
        key = (bytes(batch.session_id) or os.urandom(16), batch.seq)
        with self._lock:
            if key in self._unacked:
                return    # a resend of a batch still on its way
        spooled = None
        if self._spool is not None:
            with self._lock:
                fits = self._make_room(len(data))
            if fits:
                spooled = self._spool.write(data, batch.seq, batch.count)
            else:   # refusing it, the relay had its device resend it for ever, and the loss said nowhere
                self._warn_once("spool_too_small", f"crosstrace: a batch of {len(data)} bytes is larger than the "
                                f"whole spool (spool_max_mb={self.cfg.spool_max_mb}): it waits for upstream in "
                                "memory only, and is dropped and counted if upstream is away")
        with self._lock:
            self._order += 1
            self.batched += batch.count
            entry = _Pending(key, batch.seq, self._order, batch.count, data, spooled)
            self._unacked[key] = entry
            self._memory_bytes += entry.size
            requests = self._requests
        if requests is not None:
            requests.append(entry)
        self._wake.set()

    # -- the exporter thread -------------------------------------------------------------

    def _run(self) -> None:
        interval = self.cfg.export_interval_ms / 1000
        next_round = time.monotonic() + min(interval, _FIRST_ROUND_S)
        while True:
            woken = self._wake.wait(self._wait_s(next_round))
            self._wake.clear()
            if not woken and time.monotonic() < next_round:   # between rounds: handovers, a failed stream's retry
                try:
                    if self._retry_now() and self._unacked:
                        self._ensure_stream()   # resends the unacked batches; what is queued waits for its round
                    self._poll_handovers(full=False)
                except Exception as exc:
                    self._warn_once("export", f"crosstrace: export error: {exc!r}")
                continue
            next_round = time.monotonic() + interval
            stopping = self._stopping
            with self._lock:
                flushes, self._pending_flushes = self._pending_flushes, []
            sent = False
            try:
                self._poll_handovers()
                self._send_queued()
                sent = True
                if self._unacked and self._ensure_stream() is None:
                    self._spill(everything=True)     # out of reach: keep it all on disk
                else:
                    self._spill(everything=False)    # within the memory bound
            except Exception as exc:  # never let the exporter thread die
                self._warn_once("export", f"crosstrace: export error: {exc!r}")
            with self._lock:
                if sent:
                    for done in flushes:
                        self._waiters.append((self._order, done))
                else:   # spans may still be queued, not yet batched: these flushes wait for a round that sends
                    self._pending_flushes[:0] = flushes
                self._resolve_waiters()
            if stopping:
                return

    def _wait_s(self, next_round: float) -> float:
        """Until the next round or a failed stream's retry; shorter where handovers are
        polled: a parent's while it has children that hand over (or forked lately), and a
        forked child's while a flush waits for the parent to send. A process that forks only
        to exec polls 2 s, then looks once a second."""
        wait = max(0.0, next_round - time.monotonic())
        if self._retry_at is not None:
            wait = min(wait, max(0.0, self._retry_at - time.monotonic()))
        if self._parent is not None:
            return min(wait, _HANDOVER_POLL_S) if self._waiters else wait
        if not self.takes_handovers():
            return wait
        polls = self._children.has_children or time.monotonic() - self._forked_at < _AFTER_FORK_S
        return min(wait, _HANDOVER_POLL_S if polls else _HANDOVER_LOOK_S)

    def _retry_now(self) -> bool:
        """Whether a stream that failed is due to be opened again (once per failure): at the
        end of its backoff, not at the next round, which may be seconds away."""
        with self._lock:
            due = self._retry_at is not None and time.monotonic() >= self._retry_at
            if due:
                self._retry_at = None
            return due

    def _poll_handovers(self, full: bool = True) -> None:
        """`full`: in a round; between rounds a parent looks only where a child told it of
        batches (137 us a look with 8 children, one stat otherwise)."""
        if self._parent is not None:
            self._reap_handed_over()
            if (full or self._waiters) and not self._stopping and not self._parent_sends():
                # nobody takes them any more (at shutdown, _hand_over_and_stop sends them)
                if self._send_through_a_new_process(self.cfg.exit_flush_timeout_s) is None:
                    self._send_myself()
                    self._ensure_stream()
        elif self.takes_handovers() and (full or self._children.changed()):
            self._take_children(tidy=full)

    def _take_children(self, tidy: bool) -> None:
        """Send the batches forked children handed over, under their own (session_id, seq)."""
        found, vanished = self._children.new(tidy)
        if vanished:   # their child counted them where it dropped them
            with self._lock:
                self._let_go_unlocked([self._unacked[key] for key in (("child", path) for path in vanished)
                                       if key in self._unacked])
        if not found:
            return
        with self._lock:
            entries = []
            for item in found:
                self._order += 1
                entry = _Pending(("child", item.path), item.seq, self._order, item.spans, None, item)
                self._unacked[entry.key] = entry
                entries.append(entry)
            self._bound_children()
            requests = self._requests
            entries = [entry for entry in entries if not entry.gone]   # (the bound's drops)
        if requests is None:
            self._ensure_stream()   # sends every unacked batch, these too (None while out of reach)
            return
        for entry in entries:
            requests.append(entry)

    def _bound_children(self) -> None:
        """Under self._lock, while the collector is out of reach: what children handed over is
        bounded as a whole (children come and go: each one's own bound let what gone ones
        left pile up), by spool_max_mb in a spool_dir, else by max_unacked_mb; the oldest
        beyond it are dropped and counted."""
        if self._requests is not None:   # the stream takes them (a batch sent may be acked yet)
            return
        limit = self._handover_mb << 20
        held = [entry for entry in self._unacked.values() if entry.key[0] == "child"]
        excess = sum(entry.size for entry in held) - limit
        for entry in held:
            if excess <= 0:
                return
            self._forget(entry, dropped=True)
            excess -= entry.size
            self._warn_once("children_full", f"crosstrace: what forked children handed over exceeds "
                            f"{limit >> 20} MB unsent; dropping the oldest")

    def _reap_handed_over(self) -> None:
        """A forked child's: the batches the parent removed, acked by the collector."""
        with self._lock:
            self._let_go_unlocked([entry for entry in self._unacked.values()
                                   if entry.spooled is not None and not os.path.exists(entry.spooled.path)])

    def _handover_spool(self) -> Spool | None:
        """A forked child's spool, in the folder its parent takes batches from."""
        try:
            return child_spool(self._parent, self.session_id, self.cfg.spool_fsync)
        except OSError as exc:
            if not self._parent_sends():   # the parent's tracer is gone, and its folder with it: its
                return None                # batches wait in memory for _poll_handovers or shutdown
            self._warn_once("handover", f"crosstrace: cannot hand batches over to the parent process in "
                            f"{self._parent} ({exc}); they are kept in memory, within max_unacked_mb")
            return None

    def _send_queued(self) -> None:
        queue, samples = self.queue.queue, self.queue.samples
        dropped = self.queue.dropped + self.dropped
        first = True
        while True:
            self.queue.run_deferred()   # each time round: a stream of spans with slow acks starved it
            if not (queue or samples or (first and dropped != self._sent_dropped)):
                return
            first = False
            self._room_deadline = time.monotonic() + _ACK_WAIT_S
            for part in batches(self.queue.take(), self._part_size):
                self._send_spans(part, dropped)

    def _part_size(self) -> int:
        """Spans per batch: batch_size, fewer where spans are large. Encoding a batch holds
        the GIL throughout (about 2 ms per MB): 8192 spans with 2 KB attributes froze the
        program's threads for 20-80 ms at a time."""
        return max(1, min(self.cfg.batch_size, BATCH_TARGET_BYTES // self._span_bytes))

    def _send_spans(self, part: list[list], dropped: int) -> None:
        """One batch of queued spans (their columns), with the clock samples queued; split
        while its encoding is over MAX_BATCH_BYTES (a batch over gRPC's message limit is
        refused whole: 20,000 spans with 9 KB prompts as attributes lost 16,384), or halved
        while it fails, until only the span that cannot be encoded is dropped."""
        batch = pb.SpanBatch(resource=self.resource, session_id=self.session_id, dropped_spans=dropped)
        n = size = len(part[0])
        if n:
            try:
                encode_spans(batch, part)
                size = encoded_size(batch)
                self._span_bytes = max(1, size // n)
                split = n > 1 and size > MAX_BATCH_BYTES
            except Exception as exc:   # a value no encoding takes (its str() raises): halves find its
                if n == 1:             # span, which alone is dropped and counted
                    self._warn_once("encode", f"crosstrace: could not encode span {part[3][0]!r} ({exc!r}); "
                                              "it is dropped")
                    self.dropped += 1
                    return
                split = True
            if split:
                for smaller in batches(part, lambda: min(n // 2, self._part_size())):
                    self._send_spans(smaller, dropped)
                return
        into, samples, trailers = batch.clock_samples, self.queue.samples, []
        while samples:
            sample = samples.popleft()
            if type(sample) is tuple:      # an RPC's raw clock trailer, parsed off the RPC's path
                trailers.append(sample)
            else:
                into.append(sample)
        add_piggyback_samples(into, trailers)
        self._sent_dropped = dropped
        self._send(batch, n, size)

    def _send(self, batch, n_spans: int, size: int) -> None:
        """`size`: about the batch's encoded bytes (encode.encoded_size)."""
        if self._parent is None:
            self._prober.start()   # (a forked child's that sends itself, at its first batch)
        self._await_room(size)
        with self._lock:
            if self._closed:   # this thread outlived shutdown's wait (a hung collector): counted, not kept
                self.dropped += n_spans
                return
            self._seq += 1
            self._order += 1
            self.batched += n_spans
            batch.seq = self._seq
            entry = _Pending((self.session_id, self._seq), self._seq, self._order, n_spans,
                             batch.SerializeToString())
            self._unacked[entry.key] = entry
            self._memory_bytes += entry.size
        requests = self._ensure_stream()
        if requests is not None:
            requests.append(entry)

    def _await_room(self, size: int) -> None:
        """While the stream is up and the unacked batches fill max_unacked_mb, wait for acks
        (at most until _ACK_WAIT_S into the round) before adding a batch: the collector acks
        as it commits, and meanwhile the bounded queue takes the burst, dropping and counting
        what overflows. Sending on gave up the oldest unacked batches though they were on
        their way (345 of 8000 spans with 9 KB attributes, queued at once). The wait does the
        deferred work; shutdown ends it."""
        bound = self.cfg.max_unacked_mb << 20
        while True:
            self._acked.clear()   # before the test: an ack between the two is not missed
            full = self._memory_bytes and self._memory_bytes + size > bound
            if not full or self._requests is None or self._stopping:
                return
            left = self._room_deadline - time.monotonic()
            if left <= 0:
                return
            self.queue.run_deferred()
            self._acked.wait(min(left, 0.1))

    def _spill(self, everything: bool) -> None:
        """Move batches from memory to the spool: all of them, or the oldest until memory is
        within max_unacked_mb. Without a spool the oldest beyond that bound are given up.
        Once shutdown has spilled and closed the spool, nothing (a late exporter thread's)."""
        with self._spill_lock:
            if not self._closed:
                self._spill_unlocked(everything)

    def _spill_unlocked(self, everything: bool) -> None:
        bound = self.cfg.max_unacked_mb << 20
        if self._spool is None and self._parent is not None and self._unacked:
            self._spool = self._handover_spool()
        with self._lock:
            if self._spool is None:
                self._give_up_oldest_in_memory(bound)
                return
            limit = 0 if everything else bound
            todo, excess = [], self._memory_bytes - limit
            for entry in self._unacked.values():
                if excess <= 0:
                    break
                if entry.data is not None:
                    todo.append(entry)
                    excess -= entry.size
        for entry in todo:
            data = entry.data
            if data is None or entry.gone:
                continue
            if entry.spooled is None:
                with self._lock:
                    fits = self._make_room(entry.size)
                    if not fits:   # larger than the whole spool: it cannot be kept (unless acked meanwhile)
                        if not entry.gone:
                            self._forget(entry, dropped=True)
                        continue
                try:
                    spooled = self._spool.write(data, entry.seq, entry.spans)
                except OSError as exc:     # disk full, read-only: keep within the memory bound instead
                    self._warn_once("spool_write", f"crosstrace: cannot write to the spool {self.cfg.spool_dir} "
                                    f"({exc}); unacked batches beyond max_unacked_mb are dropped")
                    with self._lock:
                        self._give_up_oldest_in_memory(bound)
                    return
                with self._lock:
                    if entry.gone:             # acked while it was being written
                        self._spool.remove(spooled)
                        continue
                    entry.spooled = spooled
            with self._lock:
                if entry.data is not None:
                    entry.data = None
                    self._memory_bytes -= entry.size
        if todo and self._parent is not None:
            tell_parent(self._parent)

    def _give_up_oldest_in_memory(self, limit: int) -> None:
        """Under self._lock, without a spool: drop the oldest batches in memory beyond its
        bound (the newest one always stays; children's handovers are on disk, not here)."""
        newest = next(reversed(self._unacked.values()), None)
        for entry in list(self._unacked.values()):
            if self._memory_bytes <= limit or entry is newest:
                return
            if entry.data is not None:
                self._forget(entry, dropped=True)

    def _make_room(self, size: int) -> bool:
        """Under self._lock: drop the oldest spooled batches until `size` more bytes fit in the
        spool; False when they cannot (the batch alone is larger than the spool)."""
        limit = self._spool_max_mb << 20
        if size > limit:
            return False
        excess = self._spool.bytes + size - limit
        if excess <= 0:
            return True
        victims = []
        for entry in self._unacked.values():
            if excess <= 0:
                break
            if entry.spooled is not None and entry.key[0] != "child":   # (children's are not in this spool)
                victims.append(entry)
                excess -= entry.spooled.size
        for entry in victims:
            self._forget(entry, dropped=True)
        self._warn_once("spool_full", f"crosstrace: spool {self._spool.root} is full "
                        f"({self._spool_max_mb} MB); dropping the oldest batches")
        return True

    def _forget(self, entry: _Pending, dropped: bool = False) -> None:
        """Under self._lock: an entry out of _unacked (acked, let go, or given up: `dropped`
        counts its spans), its memory and its file freed."""
        self._unacked.pop(entry.key, None)
        if dropped:
            self.dropped += entry.spans
        entry.gone = True
        if entry.data is not None:
            entry.data = None
            self._memory_bytes -= entry.size
        if entry.spooled is not None:
            (self._children if entry.key[0] == "child" else self._spool).remove(entry.spooled)

    def _ensure_stream(self):
        """The open request stream, or None while the collector is unreachable (backoff), and
        always in a forked child (its parent sends)."""
        if self._requests is not None or self._parent is not None:
            return self._requests
        if self._retry_at is not None and time.monotonic() < self._retry_at:
            return None
        export = self._get_channel().stream_stream(EXPORT_METHOD, request_serializer=None,
                                                   response_deserializer=pb.ExportAck.FromString)
        requests = _RequestStream(self._let_go)
        with self._lock:
            for entry in self._unacked.values():  # resend in order; the collector dedups
                requests.append(entry)
            self._requests = requests
        call = export(iter(requests))
        call.add_done_callback(requests.ended)
        threading.Thread(target=self._read_acks, args=(call, requests), name="crosstrace-acks",
                         daemon=True).start()
        return requests

    def _get_channel(self) -> grpc.Channel:
        """The one channel, opened at first use by the exporter or the clock prober."""
        with self._lock:
            if self._channel is None:
                self._channel = open_channel(self.cfg)
            return self._channel

    def _read_acks(self, call, requests) -> None:
        try:
            while requests.awaits_acks():
                ack = next(call, None)
                if ack is None:   # the collector ended the stream
                    break
                entry = requests.acked(ack.seq)
                with self._lock:
                    if entry is not None and not entry.gone:
                        self._forget(entry)
                    for reason, n in ack.rejected.items():
                        self.rejected[reason] += n
                    self._resolve_waiters()
                self._ever_acked = True
                self._acked.set()
                if ack.rejected:
                    self._warn_once("rejected", f"crosstrace: the collector rejected spans: {dict(ack.rejected)}")
                if entry is not None:   # (an ack of no batch of ours, from a server gone wrong, is no progress)
                    self._backoff = 0.1
                    if self._outage_since is not None:
                        log.warning("crosstrace: export stream to %s works again, after %.0f s", self.cfg.endpoint,
                                    time.monotonic() - self._outage_since)
                        self._outage_since = None
        except grpc.RpcError as err:
            code = err.code()
            refused = code == grpc.StatusCode.INVALID_ARGUMENT or (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" not in (err.details() or ""))
            if refused:
                # Acks come in order, so the refused batch is the oldest one sent and unacked;
                # resending it would be refused again.
                entry = requests.acked(None)
                with self._lock:
                    if entry is not None and not entry.gone:
                        self._forget(entry, dropped=True)
                    self._resolve_waiters()
                log.error("crosstrace: a batch was refused (%s: %s); its spans are dropped",
                          code.name, err.details())
            elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                if f"rpc{code}" not in self._warned:
                    self._warned.add(f"rpc{code}")
                    log.error("crosstrace: the collector at %s refuses this tracer (%s: %s); check "
                              "CROSSTRACE_TOKEN. Spans are kept%s and retried", self.cfg.endpoint, code.name,
                              err.details(), " on disk" if self._spool else "")
            elif not self._stopping:
                details = err.details() or ""
                hint = ""
                if "Socket closed" in details and not self.cfg.uses_tls and not self._ever_acked:
                    hint = " (the collector closed a plaintext connection: if it serves TLS, set CROSSTRACE_TLS_CA)"
                elif "handshake failed" in details.lower() and self.cfg.uses_tls and not self._ever_acked:
                    hint = (" (a TLS handshake failed: if the collector serves plaintext, give the endpoint as "
                            "HOST:PORT or http://, without CROSSTRACE_TLS)")
                if self._outage_since is None:   # said once an outage, and when it is over (above)
                    self._outage_since = time.monotonic()
                    log.warning("crosstrace: export stream to %s failed (%s: %s)%s; will retry", self.cfg.endpoint,
                                code.name, details, hint)
        finally:
            requests.close()
            with self._lock:
                if self._requests is requests:
                    self._requests = None
                    self._retry_at = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, 5.0)
            self._acked.set()
            self._wake.set()

    def _let_go(self, entry: _Pending) -> None:
        with self._lock:
            self._let_go_unlocked([entry])

    def _let_go_unlocked(self, entries: list) -> None:
        """Under self._lock: batches whose files are gone unsent by this process: sent and
        removed by another (a forked child's parent, a process that adopted the folder),
        or dropped by the child that handed them over, which counted them."""
        for entry in entries:
            if not entry.gone and self._unacked.get(entry.key) is entry:
                self._forget(entry)
        self._resolve_waiters()

    def _resolve_waiters(self) -> None:
        """Under self._lock: a flush is done once no batch queued up to it is unacked."""
        oldest = next(iter(self._unacked.values()), None)
        still = []
        for target, done in self._waiters:
            if oldest is None or oldest.order > target:
                done.set()
            else:
                still.append((target, done))
        self._waiters = still

    def _close_stream(self) -> None:
        requests = self._requests
        if requests is not None:
            requests.close()
        if self._channel is not None:
            self._channel.close()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


_CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    # A link that drops silently (no RST) or a collector that hangs is found
                    # within ~30 s, not when TCP gives up minutes later: batches then go to
                    # the spool. A keepalive ping's answer is awaited for gRPC's ping timeout
                    # (60 s by default, whatever keepalive_timeout_ms says: a stopped collector
                    # was found after 70 s); 20 s leave a slow uplink time to carry a ping
                    # queued behind a batch (1 MB at 400 kbit/s).
                    ("grpc.keepalive_time_ms", 10_000),
                    ("grpc.keepalive_timeout_ms", 20_000),
                    ("grpc.http2.ping_timeout_ms", 20_000),
                    ("grpc.http2.max_pings_without_data", 0),
                    # gRPC waits up to 120 s between connection attempts (1 s, growing 1.6x):
                    # after a collector's 2-minute restart a tracer reconnected 71 s after it
                    # was back, its queue filling meanwhile. 5 s, as the stream's own retries.
                    ("grpc.max_reconnect_backoff_ms", 5_000)]


def open_channel(cfg) -> grpc.Channel:
    """A channel to cfg.endpoint: TLS when cfg.tls/tls_ca/tls_cert is set (mutual with a
    client certificate), and the bearer token on every call when cfg.token is set."""
    if cfg.uses_tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(cfg.tls_ca, "CROSSTRACE_TLS_CA"),
            private_key=_read_pem(cfg.tls_key, "CROSSTRACE_TLS_KEY"),
            certificate_chain=_read_pem(cfg.tls_cert, "CROSSTRACE_TLS_CERT"))
        channel = grpc.secure_channel(cfg.endpoint, credentials, options=_CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(cfg.endpoint, options=_CHANNEL_OPTIONS)
        if cfg.token and not _endpoint_is_loopback(cfg.endpoint):
            log.warning("crosstrace: sending the bearer token to %s without TLS: anyone on the path can "
                        "read it (set CROSSTRACE_TLS_CA)", cfg.endpoint)
    if cfg.token:
        channel = grpc.intercept_channel(channel, _BearerToken(cfg.token))
    return channel


def _endpoint_is_loopback(endpoint: str) -> bool:
    try:
        return is_loopback(split_host_port(endpoint)[0])
    except ValueError:
        return False


def _read_pem(path: str, option: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"cannot read {option}={path!r}: {exc.strerror}") from None


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of the channel."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _add(self, continuation, details, request):
        metadata = list(details.metadata or ())
        metadata.append(self._header)
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         getattr(details, "wait_for_ready", None),
                                         getattr(details, "compression", None)), request)

    intercept_unary_unary = _add
    intercept_stream_stream = _add


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _RequestStream:
    """The request side of the Export stream: gRPC's consumer thread blocks in next()
    until the exporter appends a batch or closes the stream. Spooled batches are read
    from disk as they are sent. `sent` lists what went out, in order: acks answer it."""

    def __init__(self, missing):
        self._missing = missing   # called with a spooled batch whose file is gone
        self._items: collections.deque = collections.deque()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)       # a batch to send, or the stream closed
        self._in_flight = threading.Condition(lock)   # a batch went out, or the stream closed or ended
        self._closed = False
        self._sent: collections.deque = collections.deque()
        self._ended = False   # the call ended (refused, the collector gone): its status is to be read

    def append(self, entry: _Pending) -> None:
        with self._ready:
            self._items.append(entry)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
            self._in_flight.notify_all()

    def ended(self, call=None) -> None:
        """The call ended (gRPC's done callback)."""
        with self._in_flight:
            self._ended = True
            self._in_flight.notify_all()

    def awaits_acks(self) -> bool:
        """Wait until the call has something to read: an ack of a batch that went out, or
        its end (True); False where the stream closed with neither. Acks are read from the
        call only then: gRPC's blocking read wakes ten times a second while it waits, which
        was an idle stream's main cost (1.3 ms of CPU a second here)."""
        with self._in_flight:
            while not self._sent and not self._closed and not self._ended:
                self._in_flight.wait()
            return bool(self._sent) or self._ended

    def acked(self, seq: int | None) -> _Pending | None:
        """The sent batch an ack (seq None: a refusal) answers: acks come in order."""
        while self._sent:
            entry = self._sent.popleft()
            if seq is None or entry.seq == seq:
                return entry
            log.debug("crosstrace: ack for seq %s skips batch %s", seq, entry.seq)
        return None

    def __iter__(self):
        while True:
            with self._ready:
                while not self._items and not self._closed:
                    self._ready.wait()
                if not self._items:
                    return
                entry = self._items.popleft()
            if entry.gone:
                continue
            data = entry.data
            if data is None:
                data = Spool.read(entry.spooled) if entry.spooled is not None else None
                if data is None:
                    if entry.spooled is not None:
                        self._missing(entry)
                    continue
            with self._in_flight:
                self._sent.append(entry)
                self._in_flight.notify()
            yield data
