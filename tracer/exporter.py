"""Background export: one thread drains the span queue into columnar batches and sends
them over one gRPC stream; a second thread reads the collector's acks.

The traced program never waits on any of this. The span queue is bounded (a span
that does not fit is dropped and counted); batches stay in memory until acked and
are resent in order after a reconnect, bounded too (the oldest is given up and its
spans counted as dropped). The collector deduplicates by (trace_id, span_id), so a
resend of a batch whose ack was lost stores nothing twice.
"""
import collections
import logging
import os
import socket
import threading
import time

import grpc

from ..proto import pb
from .clock_probe import ClockProber
from .encode import encode_spans
from .span import THREAD_IDS

log = logging.getLogger("crosstrace.tracer")

_EXPORT_METHOD = "/crosstrace.v1.Collector/Export"
_END = object()


class ExportQueue:
    """What the hot path touches: a deque (appends are atomic under the GIL, no lock),
    the clock, and a drop counter."""

    __slots__ = ("clock", "now", "queue", "max_queue", "wake_at", "wake", "dropped", "samples")

    def __init__(self, clock, max_queue: int, batch_size: int):
        self.clock = clock
        self.now = clock.now
        self.max_queue = max_queue
        self.wake_at = max(1, min(batch_size, max_queue // 2))
        self.wake = _noop
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """The child starts with an empty queue: the parent exports what it recorded."""
        self.queue = collections.deque()
        self.samples = collections.deque()
        self.dropped = 0


def _noop() -> None:
    pass


def build_resource(cfg) -> "pb.Resource":
    return pb.Resource(node_id=cfg.node_id, host=socket.gethostname(), rank=cfg.rank,
                       world_size=cfg.world_size, local_rank=cfg.local_rank, role=cfg.role,
                       job_id=cfg.job_id, pid=os.getpid(), service_name=cfg.service_name)


class Exporter:
    def __init__(self, cfg, clock, queue: ExportQueue):
        self.cfg = cfg
        self.clock = clock
        self.queue = queue
        self.resource = build_resource(cfg)
        self.session_id = os.urandom(16)
        self.dropped = 0                    # spans given up after they were batched
        self.rejected: collections.Counter = collections.Counter()
        self._seq = 0
        self._unacked: "collections.OrderedDict[int, tuple[bytes, int]]" = collections.OrderedDict()
        self._unacked_bytes = 0
        self._waiters: list[tuple[int, threading.Event]] = []
        self._pending_flushes: list[threading.Event] = []
        self._lock = threading.Lock()       # exporter-side state only; never taken by the hot path
        self._wake = threading.Event()
        self._stopping = False
        self._sent_dropped = -1
        self._channel = None
        self._prober = ClockProber(cfg, clock, queue.samples, self._get_channel)
        self._requests = None
        self._backoff_until = 0.0
        self._backoff = 0.1
        self._warned: set[str] = set()
        queue.wake = self._wake.set
        self._thread = threading.Thread(target=self._run, name="crosstrace-exporter", daemon=True)
        self._thread.start()

    # -- called from the traced program -------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        if not self._thread.is_alive():
            return not self._unacked and not self.queue.queue
        done = threading.Event()
        with self._lock:
            self._pending_flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        flushed = self.flush(timeout_s)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._close_stream()
        return flushed

    def restart_after_fork(self) -> "Exporter":
        """In a forked child (a DataLoader worker): a new session, stream and thread. The
        parent's gRPC channel and threads do not exist here and must not be touched."""
        return Exporter(self.cfg, self.clock, self.queue)

    # -- the exporter thread -------------------------------------------------------------

    def _run(self) -> None:
        interval = self.cfg.export_interval_ms / 1000
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            stopping = self._stopping
            with self._lock:
                flushes, self._pending_flushes = self._pending_flushes, []
            if len(THREAD_IDS) > 4096:
                THREAD_IDS.clear()
            try:
                if not stopping:
                    self._prober.probe_if_due()
                self._send_queued()
                if self._unacked:
                    self._ensure_stream()  # reconnect and resend after a failure
            except Exception as exc:  # never let the exporter thread die
                self._warn_once("export", f"crosstrace: export error: {exc!r}")
            with self._lock:
                for done in flushes:
                    self._waiters.append((self._seq, done))
                self._resolve_waiters()
            if stopping:
                return

    def _send_queued(self) -> None:
        queue, samples = self.queue.queue, self.queue.samples
        size = self.cfg.batch_size
        dropped = self.queue.dropped + self.dropped
        first = True
        while queue or samples or (first and dropped != self._sent_dropped):
            first = False
            spans = [queue.popleft() for _ in range(min(len(queue), size))]
            batch = pb.SpanBatch(resource=self.resource, session_id=self.session_id,
                                 dropped_spans=dropped)
            if spans:
                encode_spans(batch, spans)
            while samples:
                batch.clock_samples.append(samples.popleft())
            self._sent_dropped = dropped
            self._send(batch, len(spans))

    def _send(self, batch, n_spans: int) -> None:
        with self._lock:
            self._seq += 1
            batch.seq = self._seq
            data = batch.SerializeToString()
            self._unacked[batch.seq] = (data, n_spans)
            self._unacked_bytes += len(data)
            limit = self.cfg.max_unacked_mb << 20
            while self._unacked_bytes > limit and len(self._unacked) > 1:
                _, (old, n) = self._unacked.popitem(last=False)
                self._unacked_bytes -= len(old)
                self.dropped += n
        requests = self._ensure_stream()
        if requests is not None:
            requests.append(data)

    def _ensure_stream(self):
        """The open request stream, or None while the collector is unreachable (backoff)."""
        if self._requests is not None:
            return self._requests
        if time.monotonic() < self._backoff_until:
            return None
        export = self._get_channel().stream_stream(_EXPORT_METHOD, request_serializer=None,
                                             response_deserializer=pb.ExportAck.FromString)
        requests = _RequestStream()
        with self._lock:
            for data, _ in self._unacked.values():  # resend in order; the collector dedups
                requests.append(data)
        call = export(iter(requests))
        self._requests = requests
        threading.Thread(target=self._read_acks, args=(call, requests), name="crosstrace-acks",
                         daemon=True).start()
        return requests

    def _get_channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.cfg.endpoint, options=_CHANNEL_OPTIONS)
        return self._channel

    def _read_acks(self, call, requests) -> None:
        try:
            for ack in call:
                with self._lock:
                    entry = self._unacked.pop(ack.seq, None)
                    if entry is not None:
                        self._unacked_bytes -= len(entry[0])
                    for reason, n in ack.rejected.items():
                        self.rejected[reason] += n
                    self._resolve_waiters()
                if ack.rejected:
                    self._warn_once("rejected", f"crosstrace: the collector rejected spans: {dict(ack.rejected)}")
                self._backoff = 0.1
        except grpc.RpcError as err:
            code = err.code()
            refused = code == grpc.StatusCode.INVALID_ARGUMENT or (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" not in (err.details() or ""))
            if refused:
                # Acks come in order, so the refused batch is the oldest unacked one; resending
                # it would be refused again.
                with self._lock:
                    if self._unacked:
                        _, (data, n) = self._unacked.popitem(last=False)
                        self._unacked_bytes -= len(data)
                        self.dropped += n
                    self._resolve_waiters()
                log.error("crosstrace: the collector refused a batch (%s: %s); its spans are dropped",
                          code.name, err.details())
            elif not self._stopping:
                self._warn_once(f"rpc{code}", f"crosstrace: export stream to {self.cfg.endpoint} "
                                f"failed ({code.name}: {err.details()}); will retry")
        finally:
            requests.close()
            with self._lock:
                if self._requests is requests:
                    self._requests = None
                    self._backoff_until = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, 5.0)
            self._wake.set()

    def _resolve_waiters(self) -> None:
        """Under self._lock: a flush is done once no batch up to its seq is unacked."""
        oldest = next(iter(self._unacked), None)
        still = []
        for target, done in self._waiters:
            if oldest is None or oldest > target:
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


_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                    ("grpc.max_receive_message_length", 64 << 20)]


class _RequestStream:
    """The request side of the Export stream: gRPC's consumer thread blocks in next()
    until the exporter appends a serialized batch or closes the stream."""

    def __init__(self):
        self._items = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._closed = False

    def append(self, data: bytes) -> None:
        with self._ready:
            self._items.append(data)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()

    def __iter__(self):
        while True:
            with self._ready:
                while not self._items and not self._closed:
                    self._ready.wait()
                if not self._items:
                    return
                item = self._items.popleft()
            yield item
