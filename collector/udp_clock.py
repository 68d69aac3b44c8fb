"""The collector's UDP clock responder: answers two-way probes on the gRPC port's number.

gRPC puts tens of microseconds of asymmetric software delay into a clock exchange; a bare
UDP packet whose arrival the kernel stamps (SO_TIMESTAMPNS) measures the path itself.
Where the kernel has no receive timestamps the monotonic clock is read on wake-up.
Anything that is not a probe is ignored. A port that cannot be bound costs only this
channel: the gRPC exchange still works.
"""
import logging
import socket
import threading
import time

from ..clock_sync import udp

log = logging.getLogger("crosstrace.collector")


class UdpClockResponder:
    """Answers on the collector's clock `now` (a relay's own, simulated in tests and demos)."""

    def __init__(self, host: str, port: int, now=time.monotonic_ns):
        self.now = now
        self.ignored = 0            # packets that were not probes
        self.answered = 0
        self.sock = None
        self.port = None
        host = host.strip("[]") or "0.0.0.0"
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM,
                                                          flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, socket.SOCK_DGRAM)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
        except OSError as exc:
            log.warning("crosstrace collector: no UDP clock exchange on %s:%s (%s); tracers use the "
                        "gRPC exchange only", host, port, exc)
            return
        sock.settimeout(0.2)
        self.sock = sock
        self.port = sock.getsockname()[1]
        udp.enable_rx_timestamps(sock)   # else the monotonic clock is read on wake-up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crosstrace-udp-clock", daemon=True)

    def start(self) -> "UdpClockResponder":
        if self.sock is not None:
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        if self.sock is None:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.sock.close()
        self.sock = None

    def _run(self) -> None:
        sock, monotonic = self.sock, self.now
        while not self._stop.is_set():
            try:
                data, address, rx_realtime = udp.recv(sock)
            except (socket.timeout, BlockingIOError, InterruptedError):
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            t2 = udp.since_realtime(rx_realtime, monotonic)
            probe = udp.unpack_request(data)
            if probe is None:
                self.ignored += 1
                continue
            nonce, t1 = probe
            try:
                sock.sendto(udp.pack_reply(nonce, t1, t2, monotonic()), address)
            except OSError:
                continue
            self.answered += 1
