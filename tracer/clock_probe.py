"""Clock samples: two-way probes to the collector, and NTP / PTP readings when configured.

Every clock_probe_interval_s a thread of its own sends a burst of UDP probes (the
collector answers on its gRPC port's number, with kernel receive timestamps) and a burst
over gRPC. Not the exporter's thread: a probe waits for its answer, and while the traced
program keeps the GIL busy each wait ends only at a GIL switch (a burst took 157 ms, 7 ms
idle), which held up the export until the queue was full and spans were dropped. Each
probe waits with a short timeout, so an unreachable collector costs a fraction of a second.
NTP servers and ptp4l are read on another thread (an NTP server may be slow or gone).
Every time comes from the node's Clock, simulated offset and drift included; the samples
travel with the next span batch.
"""
import heapq
import logging
import os
import socket
import threading
import time
from urllib.parse import unquote

import grpc

from ..clock_sync import ntp, ptp, udp
from ..proto import CLOCK_METHOD, pb
from ..proto.endpoint import split_host_port

log = logging.getLogger("crosstrace.tracer")

_PROBE_TIMEOUT_S = 0.2
_FIRST_BURST_S = 0.2         # the first burst, as the exporter's first round: soon after start
_UDP_GIVE_UP_AFTER = 3       # rounds UDP went unanswered where gRPC answered, before UDP is left alone


class ClockProber:
    def __init__(self, cfg, clock, samples, get_channel, idle: bool = False):
        """`idle`: no probe until start() (a forked child that may never export: see
        Exporter.__init__)."""
        self.cfg = cfg
        self.clock = clock
        self.samples = samples          # deque drained into the next batch
        self._get_channel = get_channel
        self._udp = _UdpChannel(cfg.endpoint, clock) if cfg.udp_clock else None
        self._sources = _SourceReader(cfg, clock, samples) if (cfg.ntp_servers or cfg.ptp_uds) else None
        self._wake = threading.Event()
        self._stopping = False
        self._warned = False
        self._bursts = threading.Condition(threading.Lock())
        self._started = self._finished = 0     # bursts, for probe_now()
        self.idle = idle
        self._thread = threading.Thread(target=self._run, name="crosstrace-clock-probe", daemon=True)
        self._thread.start()

    def start(self) -> None:
        """Begin probing (an idle prober), with a burst at once."""
        if self.idle:
            self.idle = False
            self._wake.set()

    def probe_now(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for a burst that starts after this call (at exit: a
        short-lived process then still has samples close to its last spans)."""
        if self.idle:
            return
        with self._bursts:
            target = self._started + 1
            self._wake.set()
            self._bursts.wait_for(lambda: self._finished >= target or self._stopping, timeout_s)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_PROBE_TIMEOUT_S)
        if self._udp is not None:
            self._udp.close()
        if self._sources is not None:
            self._sources.stop()

    def _run(self) -> None:
        wait = None if self.idle else min(self.cfg.clock_probe_interval_s, _FIRST_BURST_S)
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            wait = self.cfg.clock_probe_interval_s
            with self._bursts:
                if self._stopping:
                    self._bursts.notify_all()
                    return
                self._started += 1
            try:
                self._burst()
            except Exception as exc:  # a failed probe costs samples, never spans
                if not self._warned:
                    self._warned = True
                    log.warning("crosstrace: clock probe error: %r", exc)
            with self._bursts:
                self._finished += 1
                self._bursts.notify_all()

    def _burst(self) -> None:
        if self._sources is not None:
            self._sources.start()
        udp_samples = self._udp.burst(self.cfg.clock_probe_burst) if self._udp is not None else []
        answered, clock = self._grpc_burst()
        for sample in udp_samples:   # UDP answers do not name their clock: the gRPC ones of this round do
            sample.peer_clock = clock
        self.samples.extend(udp_samples)
        if self._udp is not None and self._udp.judge(answered):
            log.info("crosstrace: no UDP clock answers from %s; using the gRPC exchange only", self.cfg.endpoint)
            self._udp.close()
            self._udp = None

    def _grpc_burst(self) -> tuple[bool, str]:
        """Probe over gRPC: whether the collector answered, and the name of the clock that
        answered ("" if none did, or the collector did not say): samples name it, so that
        the collector can place one answered before it came back on another clock (a batch
        held while it was away)."""
        exchange = self._get_channel().unary_unary(
            CLOCK_METHOD, request_serializer=pb.ClockProbe.SerializeToString,
            response_deserializer=pb.ClockProbeReply.FromString)
        clock_now, node = self.clock.now, self.cfg.node_id
        answered, clock = False, ""
        for _ in range(self.cfg.clock_probe_burst):
            t1 = clock_now()
            try:
                reply = exchange(pb.ClockProbe(node_id=node, t1=t1), timeout=1.0)
            except grpc.RpcError:
                break
            t4 = clock_now()
            answered, clock = True, reply.clock
            self.samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=t1, t2=reply.t2, t3=reply.t3,
                                               t4=t4, local_ns=t1, peer_clock=clock))
        return answered, clock


# RPC clock samples a batch carries per peer and second: those of least delay, which are
# what the fit keeps of a window anyway. A busy channel samples one call every 10 ms:
# 8.6M rows a day in the store, 6 GB for a day's report to read. Per second, not per
# batch: batches go every few seconds where spans are few.
RPC_SAMPLES_PER_PEER = 4
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def add_piggyback_samples(samples, raw: list) -> None:
    """Add RPCs' clock trailers ("t2 t3 node", tracer/instrument/grpc.py), each with the
    client's send and receive times, to a batch's `samples` as ClockSamples (made in place: a
    copy of a separate message costs as much again): per peer and second of the client's
    clock, the RPC_SAMPLES_PER_PEER of least delay. A malformed trailer gives a debug line."""
    by_peer_second: dict = {}
    for t1, t4, trailer in raw:
        try:
            t2, t3, node = trailer.split(" ", 2)
            t2, t3 = int(t2), int(t3)
            if not (_INT64_MIN <= t2 <= _INT64_MAX and _INT64_MIN <= t3 <= _INT64_MAX):
                raise ValueError("beyond int64")
        except (ValueError, AttributeError, TypeError):
            log.debug("crosstrace: ignoring a malformed clock trailer %r", trailer)
            continue
        by_peer_second.setdefault((node, t1 // 1_000_000_000), []).append(((t4 - t1) - (t3 - t2), t1, t2, t3, t4))
    for (node, _), found in by_peer_second.items():
        peer = unquote(node)
        for _, t1, t2, t3, t4 in heapq.nsmallest(RPC_SAMPLES_PER_PEER, found):
            try:   # nothing a server sent may fail the batch, and its spans with it
                samples.add(source=pb.RPC_PIGGYBACK, peer=peer, t1=t1, t2=t2, t3=t3, t4=t4, local_ns=t1)
            except ValueError:
                log.debug("crosstrace: ignoring a clock trailer from %r", node)


class _UdpChannel:
    """A connected UDP socket to the collector's clock responder."""

    def __init__(self, endpoint: str, clock):
        self.clock = clock
        self.failed_rounds = 0
        self.answered = False
        self.sock = None
        try:
            host, port = split_host_port(endpoint)
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.connect(address)
        except (OSError, ValueError) as exc:
            log.info("crosstrace: no UDP clock probes to %s (%s)", endpoint, exc)
            return
        sock.settimeout(_PROBE_TIMEOUT_S)
        udp.enable_rx_timestamps(sock)
        self.sock = sock

    def burst(self, n: int) -> list:
        self.answered = False
        if self.sock is None:
            return []
        out = []
        now = self.clock.now
        for _ in range(n):
            nonce = int.from_bytes(os.urandom(8), "little")
            t1 = now()
            try:
                self.sock.send(udp.pack_request(nonce, t1))
                t4, reply = self._await(nonce, now)
            except OSError:  # refused (nothing listens) or timed out
                break
            _, _, t2, t3 = reply
            out.append(pb.ClockSample(source=pb.UDP_EXCHANGE, t1=t1, t2=t2, t3=t3, t4=t4, local_ns=t1))
        self.answered = bool(out)
        return out

    def judge(self, collector_answered: bool) -> bool:
        """After a round: True once UDP is worth leaving alone (no socket, or unanswered in
        _UDP_GIVE_UP_AFTER rounds where the collector answered over gRPC). A round with the
        collector down says nothing about UDP: counted, it gave UDP up for good in a
        process started before its collector."""
        if self.sock is None:
            return True
        if self.answered:
            self.failed_rounds = 0
        elif collector_answered:
            self.failed_rounds += 1
        return self.failed_rounds >= _UDP_GIVE_UP_AFTER

    def _await(self, nonce: int, now):
        """(t4, reply) for this nonce; stale answers to earlier probes are skipped."""
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        while True:
            data, _, rx_realtime = udp.recv(self.sock)
            t4 = udp.since_realtime(rx_realtime, now)
            reply = udp.unpack_reply(data)
            if reply is not None and reply[0] == nonce:
                return t4, reply
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("no answer")
            self.sock.settimeout(remaining)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _SourceReader:
    """Reads NTP servers and ptp4l on its own thread; a failing source warns once."""

    def __init__(self, cfg, clock, samples):
        self.cfg = cfg
        self.clock = clock
        self.samples = samples
        self.servers = [s.strip() for s in cfg.ntp_servers.split(",") if s.strip()]
        self._stop = threading.Event()
        self._thread = None
        self._warned: set[str] = set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="crosstrace-clock-sources", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_ntp = next_ptp = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.servers and now >= next_ntp:
                next_ntp = now + self.cfg.ntp_interval_s
                for server in self.servers:
                    self._read(f"ntp {server}", pb.NTP, lambda s=server: ntp.query(s, self.clock.now))
            if self.cfg.ptp_uds and now >= next_ptp:
                next_ptp = now + self.cfg.ptp_interval_s
                self._read(f"ptp {self.cfg.ptp_uds}", pb.PTP, lambda: ptp.query(self.cfg.ptp_uds, self.clock.at))
            wait = min(t for t, on in ((next_ntp, bool(self.servers)), (next_ptp, bool(self.cfg.ptp_uds))) if on)
            self._stop.wait(max(0.05, wait - time.monotonic()))

    def _read(self, what: str, source, query) -> None:
        try:
            s = query()
        except Exception as exc:  # whatever one source does, the thread goes on serving the others
            if what not in self._warned:
                self._warned.add(what)
                log.warning("crosstrace: clock source %s gives no samples yet: %s", what, exc)
            return
        self.samples.append(pb.ClockSample(source=source, local_ns=s.local_ns, offset_ns=s.ref_minus_local_ns,
                                           error_ns=s.error_ns, server=s.server))
