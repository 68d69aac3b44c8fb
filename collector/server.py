"""The collector's gRPC server: span export with acks, clock exchange, and OpenTelemetry's
OTLP TraceService on the same port; optionally TLS, bearer tokens, and relaying upstream.

Requests arrive as raw bytes and are decoded here, so that garbage from a client
becomes a clear INVALID_ARGUMENT for that client instead of an opaque error, and never
touches other clients. One writer thread commits the batches of all streams in
groups (one SQLite transaction per group); a batch is acked only after its commit.
"""
import collections
import concurrent.futures
import contextlib
import logging
import queue
import socket
import sqlite3
import threading
import time

import grpc

from ..proto import MAX_MESSAGE_BYTES, SERVICE, pb
from ..proto.endpoint import split_host_port
from .columns import BadBatch
from .ingest import CheckedBatch, StoreUnavailable, TooLarge, check, decode
from .otlp import OtlpService
from .security import TokenAuth
from .store import Store, WriteResult
from .udp_clock import UdpClockResponder

log = logging.getLogger("crosstrace.collector")

# Streams served at once on one client connection: an OpenTelemetry Collector's OTLP exporter
# sends on 10 at most by default, a tracer on two (its export stream and clock probes).
STREAMS_PER_CONNECTION = 32


class Writer:
    """Single writer thread with group commit: whatever batches are waiting when a
    transaction starts go into it together."""

    def __init__(self, store: Store, max_group: int = 64):
        self.store = store
        self.max_group = max_group
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closing = threading.Lock()
        self._closed = False
        self._failing = Failing("crosstrace collector: store write failed",
                                "crosstrace collector: the store takes batches again")
        self._thread = threading.Thread(target=self._run, name="crosstrace-writer", daemon=True)
        self._thread.start()

    def submit(self, checked) -> concurrent.futures.Future:
        """The batch's WriteResult, once committed; StoreUnavailable once the writer is closed
        (a batch whose check ended during shutdown: its client retries)."""
        future = concurrent.futures.Future()
        with self._closing:
            if self._closed:
                future.set_exception(StoreUnavailable("the collector is shutting down"))
            else:
                self._queue.put((checked, future))
        return future

    def close(self, timeout: float = 10.0) -> None:
        with self._closing:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            while len(group) < self.max_group:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                group.append(item)
            self._commit(group)

    def _commit(self, group: list) -> None:
        """One transaction for the group; should it fail, each batch again on its own, so
        that one client's batch cannot fail the others' (the writer always goes on)."""
        try:
            results = self.store.write([checked for checked, _ in group])
        except Exception as exc:
            if len(group) > 1:
                for item in group:
                    self._commit([item])
                return
            self._failing.failed(exc)
            group[0][1].set_exception(exc)
            return
        self._failing.passed()
        for (_, future), result in zip(group, results):
            future.set_result(result)


class Failing:
    """A failure that repeats for every batch (a full disk), said once a minute at most while
    it fails the same way, with a count, and that it works again once that was said (where
    batches fail and pass by turns, two lines a minute at most): a full disk logged a 12-line
    traceback for every batch. An OSError is known by its errno, not its text, which names
    each batch's file. A traceback only for a failure that is not the system's (OSError,
    SQLite's), which would be crosstrace's bug."""

    def __init__(self, failed: str, passed: str):
        self.failed_line, self.passed_line = failed, passed
        self.kind, self.count, self.said_at, self.passed_at = None, 0, -60.0, -60.0   # monotonic s
        self._lock = threading.Lock()   # (a relay's streams forward on several threads)

    def failed(self, exc: Exception) -> None:
        kind = (type(exc), exc.errno) if isinstance(exc, OSError) else str(exc)
        now = time.monotonic()
        with self._lock:
            new = kind != self.kind
            say = new or now - self.said_at >= 60
            if say:
                self.kind, self.said_at = kind, now
            self.count += 1
            count = self.count
        if say:
            log.warning("%s: %s (%d batches failed so far; their tracers are told to retry)", self.failed_line, exc,
                        count, exc_info=new and not isinstance(exc, (OSError, sqlite3.Error)))

    def passed(self) -> None:
        if not self.count:
            return
        with self._lock:
            if not self.count or self.said_at <= self.passed_at:   # no failure said since it last worked
                return
            count, self.count, self.passed_at = self.count, 0, time.monotonic()
        log.warning("%s, after %d failed (their tracers retried them)", self.passed_line, count)


class InFlight:
    """Bounds the bytes of batches being checked and committed at once: a batch takes about
    ten times its size in memory on its way to the store (35 times when its attributes are
    millions of tiny JSON values: 57 MB took 2 GB), and 256 streams of 64 MB batches
    would take far more than a machine has. A batch waits for room (alone, it always fits),
    and after `wait_s` its client is told to retry; so is it at once where the batches
    waiting already hold `waiting_bytes` (a waiting batch is held as it came: 24 streams of
    40 MB batches, gzipped to 59 KB each on the wire, took 1.8 GB)."""

    def __init__(self, limit_bytes: int, wait_s: float = 30.0, waiting_bytes: int | None = None):
        self.limit, self.wait_s = limit_bytes, wait_s
        self.waiting_limit = 4 * limit_bytes if waiting_bytes is None else waiting_bytes
        self.used = self.waiting = 0
        self._room = threading.Condition()

    @contextlib.contextmanager
    def hold(self, size: int):
        def fits() -> bool:
            return not self.used or self.used + size <= self.limit

        with self._room:
            if not fits():
                if self.waiting and self.waiting + size > self.waiting_limit:
                    raise StoreUnavailable(f"the collector has {self.waiting >> 20} MB of batches waiting; retry")
                self.waiting += size
                try:
                    if not self._room.wait_for(fits, self.wait_s):
                        raise StoreUnavailable(f"the collector is busy with {self.used >> 20} MB of batches; retry")
                finally:
                    self.waiting -= size
            self.used += size
        try:
            yield
        finally:
            with self._room:
                self.used -= size
                self._room.notify_all()


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans = 0
        self.duplicates = 0
        self.rejected: collections.Counter = collections.Counter()
        self.nodes: set[str] = set()


class CollectorService:
    def __init__(self, store: Store, forward=None, now=time.monotonic_ns, in_flight_mb: int = 64):
        self.store = store
        self.writer = Writer(store)
        self.in_flight = InFlight(in_flight_mb << 20)
        self.stats = Stats()
        self.forward = forward      # relay mode: a collector.relay.Relay, which hands batches on upstream
        self.forwarding = Failing("crosstrace relay: could not keep a batch for upstream",
                                  "crosstrace relay: batches are kept for upstream again")
        self.now = now              # the clock clock probes are answered from

    def ingest(self, batch: "pb.SpanBatch", size: int | None = None) -> tuple[CheckedBatch, WriteResult]:
        """Check one batch (`size`: its bytes as they came, where known), commit it (and on a
        relay, hand it on upstream); durable on return. Raises BadBatch for a batch that
        cannot be read, StoreUnavailable when it cannot be kept."""
        checked = check(batch)
        if self.forward is not None:
            if self.forward.came_back(batch):   # a forwarding loop
                return checked, WriteResult(0, checked.batch.count, resent=True)
            self.forward.check_fits(batch, size)
        try:
            result = self.writer.submit(checked).result()
        except Exception as exc:
            raise StoreUnavailable(f"store write failed: {exc}") from exc
        with self.stats.lock:   # stored: counted, whatever forwarding it does
            self.stats.spans += result.accepted
            self.stats.duplicates += result.duplicates
            if not result.resent:
                self.stats.rejected.update(checked.rejected)
            self.stats.nodes.add(checked.node_id)
        if self.forward is not None:
            try:
                self.forward(batch)
            except Exception as exc:   # stored here; the client's resend is forwarded again
                self.forwarding.failed(exc)
                raise StoreUnavailable(f"relay could not keep the batch for upstream: {exc}") from exc
            self.forwarding.passed()
        return checked, result

    def export(self, request_iterator, context):
        for data in request_iterator:
            ack = self._ack(data, context)
            del data   # a stream waiting for its next batch holds nothing of the last one
            yield ack

    def _ack(self, data: bytes, context) -> "pb.ExportAck":
        try:
            with self.in_flight.hold(len(data)):
                checked, result = self.ingest(decode(data), len(data))
        except BadBatch as exc:
            self.refuse(exc, context)
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # A resend's ack says its rejects again: a tracer resends only what it has no ack for.
        return pb.ExportAck(seq=checked.batch.seq, accepted=result.accepted, duplicates=result.duplicates,
                            rejected=dict(checked.rejected))

    def exchange_clock(self, data: bytes, context):
        t2 = self.now()
        try:
            probe = pb.ClockProbe.FromString(data)
        except Exception as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable ClockProbe: {exc}")
        return pb.ClockProbeReply(t1=probe.t1, t2=t2, t3=self.now(), clock=self.store.clock).SerializeToString()

    def refuse(self, exc: BadBatch, context) -> None:
        """End the call over a batch that cannot be read at all, counted by reason."""
        too_large = isinstance(exc, TooLarge)
        self.count_whole_reject("batch_too_large" if too_large else "malformed_batch")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED if too_large else grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def count_whole_reject(self, reason: str) -> None:
        self.count_rejects(collections.Counter({reason: 1}))

    def count_rejects(self, rejected: collections.Counter) -> None:
        """Rejects found before a batch reaches ingest (a whole batch, OTLP's own checks)."""
        with self.stats.lock:
            self.stats.rejected.update(rejected)
        try:
            self.store.record_rejects(rejected)
        except Exception:
            log.exception("could not record rejected spans")

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Export": grpc.stream_stream_rpc_method_handler(
                self.export, request_deserializer=None, response_serializer=pb.ExportAck.SerializeToString),
            "ExchangeClock": grpc.unary_unary_rpc_method_handler(
                self.exchange_clock, request_deserializer=None, response_serializer=None),
        })


def _bind_error(host: str, port: int) -> str | None:
    """Why (host, port) cannot be bound, as the OS says it (gRPC's error does not say):
    found by binding a plain socket there."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC: TIME_WAIT is no obstacle
                sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


class Collector:
    """A running collector: gRPC server + store. `port` is the bound port."""

    def __init__(self, store_path: str, listen: str = "127.0.0.1:4327", max_streams: int = 1024,
                 sync: str = "normal", credentials: grpc.ServerCredentials | None = None,
                 tokens: dict[str, bytes] | None = None, forward=None, now=time.monotonic_ns,
                 clock: str | None = None):
        """`credentials`: TLS (collector.security.server_credentials); `tokens`: bearer token per
        client, required on every call when given; `forward`: relay mode (collector.relay);
        `now`: this collector's clock, which answers clock probes (a relay's, simulated in
        tests), named `clock` (clock_sync.domain; default: this machine's monotonic clock)."""
        host, port = split_host_port(listen)    # before the store: a bad address creates nothing
        if port and (why := _bind_error(host, port)):   # nor a port in use (gRPC's own error is a raw log line)
            raise OSError(f"cannot listen on {listen}: {why}")
        self.store = Store(store_path, sync=sync, now=now, clock=clock)
        self.service = CollectorService(self.store, forward, now)
        self.server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=max_streams + 16, thread_name_prefix="crosstrace-rpc"),
            handlers=[self.service.handler(), OtlpService(self.service).handler()],
            interceptors=[TokenAuth(tokens)] if tokens else None,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.so_reuseport", 0),
                     # Tracers ping every 10 s to find links that died silently (tracer/exporter.py).
                     ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                     ("grpc.keepalive_permit_without_calls", 1),
                     # And the collector pings its clients: a peer that froze or vanished held
                     # its streams' slots among --max-streams for gRPC's default of two hours.
                     ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                     # One connection's streams beyond this wait at their client, rather than
                     # take every slot of --max-streams (a tracer holds one stream).
                     ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION)],
            maximum_concurrent_rpcs=max_streams,
        )
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, credentials)
        except RuntimeError as exc:
            self.store.close()
            raise OSError(f"cannot listen on {listen}: {_bind_error(host, port) or exc}") from None
        self.address = f"{listen.rpartition(':')[0]}:{self.port}"   # as given: [v6] in brackets
        self.udp_clock = UdpClockResponder(host, self.port, now)   # the same clock as the gRPC exchange
        self._stopped = threading.Event()

    def start(self) -> "Collector":
        self.server.start()
        self.udp_clock.start()
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stop taking RPCs, let in-flight commits finish, close the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.udp_clock.stop()
        self.server.stop(grace).wait(grace + 1)
        self.service.writer.close()
        self.store.close()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
