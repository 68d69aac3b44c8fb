"""NTP source: ask NTP servers for UTC and turn each answer into a bounded sample of this
node's offset to UTC.

ntplib encodes and decodes the packets; the exchange itself is timed here with the
node's own clock (`now`), not the wall clock ntplib would use, so that the sample
relates the clock that stamps spans to UTC. The answer bounds the offset like any
two-way exchange (t1 - t2 <= local - UTC <= t4 - t3), widened by the server's own
distance to true UTC (root delay / 2 + root dispersion, RFC 5905).
"""
import socket
import struct
import time

import ntplib

from .exchange import OffsetSample

NTP_PORT = 123
_NTP_TO_UNIX_S = ntplib.NTP.NTP_DELTA


class NtpError(Exception):
    """No usable answer from the server; the message says why."""


def parse_server(spec: str) -> tuple[str, int]:
    """"host", "host:port" or "[v6addr]:port"."""
    spec = spec.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else NTP_PORT
    host, sep, port = spec.rpartition(":")
    if sep and host and ":" not in host:
        return host, int(port)
    return spec, NTP_PORT


def query(server: str, now, timeout_s: float = 0.5) -> OffsetSample:
    """One exchange with `server`; `now()` is the node's clock in ns."""
    host, port = parse_server(server)
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise NtpError(f"cannot resolve NTP server {server!r}: {exc}") from None
    request = ntplib.NTPPacket(version=4, mode=3, tx_timestamp=ntplib.system_to_ntp_time(time.time()))
    data = request.to_data()
    sent = ntplib.NTPPacket()
    sent.from_data(data)
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            t1 = now()
            sock.sendto(data, address)
            while True:
                reply, source = sock.recvfrom(512)
                t4 = now()
                answer = _answer(reply)
                if answer is not None and answer.orig_timestamp == sent.tx_timestamp:
                    break
                sock.settimeout(max(0.001, deadline - time.monotonic()))
        except OSError as exc:  # socket.timeout is an OSError
            raise NtpError(f"no answer from NTP server {server!r}: {exc or 'timed out'}") from None
    if answer.leap == 3 or answer.stratum == 0 or answer.stratum > 15:
        raise NtpError(f"NTP server {server!r} is not synchronised (leap={answer.leap}, stratum={answer.stratum})")
    t2, t3 = _unix_ns(reply, 32), _unix_ns(reply, 40)   # the receive and transmit timestamps
    lo, hi = t1 - t2, t4 - t3
    if hi < lo:
        raise NtpError(f"NTP server {server!r} answered with a negative round trip")
    root_distance = int((answer.root_delay / 2 + answer.root_dispersion) * 1e9)
    return OffsetSample(local_ns=t1 + (t4 - t1) // 2, ref_minus_local_ns=-(lo + hi) // 2,
                        error_ns=(hi - lo + 1) // 2 + root_distance, server=server)


def _answer(data: bytes):
    packet = ntplib.NTPPacket()
    try:
        packet.from_data(data)
    except ntplib.NTPException:
        return None
    return packet if packet.mode == 4 else None


def _unix_ns(packet: bytes, at: int) -> int:
    """The 64-bit NTP timestamp at byte `at`, as Unix ns. Read from the bytes: ntplib's
    float seconds (~3.9e9) keep only ~477 ns, and lost up to 365 ns of each time."""
    seconds, fraction = struct.unpack_from("!II", packet, at)
    return (seconds - _NTP_TO_UNIX_S) * 1_000_000_000 + (fraction * 1_000_000_000 >> 32)
