"""The UDP clock exchange: packet format and kernel receive timestamps, shared by the
tracer's prober and the collector's responder.

A probe carries t1 (sender's clock) and a nonce; the reply echoes both and adds t2 and t3
(responder's clock at receive and send). Requests are padded to the reply's size, so the
responder never sends more than it receives (no amplification). Receive times come from
the kernel (SO_TIMESTAMPNS, CLOCK_REALTIME at the moment the packet arrived) where the
OS has it, which removes the scheduler wake-up from the measured delay.
"""
import socket
import struct
import sys
import time

MAGIC = b"CTC1"
_REQUEST = struct.Struct("!4sxxxxQq16x")      # magic, nonce, t1, padding
_REPLY = struct.Struct("!4sxxxxQqqq")         # magic, nonce, t1, t2, t3
assert _REQUEST.size == _REPLY.size

# Linux's SO_TIMESTAMPNS (asm-generic); Python's socket module does not export it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
_TIMESPEC = struct.Struct("@qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)


def pack_request(nonce: int, t1: int) -> bytes:
    return _REQUEST.pack(MAGIC, nonce, t1)


def unpack_request(data: bytes):
    """(nonce, t1), or None for anything that is not a probe."""
    if len(data) != _REQUEST.size or not data.startswith(MAGIC):
        return None
    _, nonce, t1 = _REQUEST.unpack(data)
    return nonce, t1


def pack_reply(nonce: int, t1: int, t2: int, t3: int) -> bytes:
    return _REPLY.pack(MAGIC, nonce, t1, t2, t3)


def unpack_reply(data: bytes):
    """(nonce, t1, t2, t3), or None."""
    if len(data) != _REPLY.size or not data.startswith(MAGIC):
        return None
    _, nonce, t1, t2, t3 = _REPLY.unpack(data)
    return nonce, t1, t2, t3


def enable_rx_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp received packets; False where it cannot."""
    if SO_TIMESTAMPNS is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv(sock: socket.socket, size: int = 64):
    """(data, address, kernel receive time in CLOCK_REALTIME ns or None)."""
    data, ancillary, _, address = sock.recvmsg(size, _ANCILLARY)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(payload[:_TIMESPEC.size])
            return data, address, sec * 1_000_000_000 + nsec
    return data, address, None


# A kernel time older than this is not trusted (the wall clock may have been stepped).
_MAX_AGE_NS = 1_000_000_000


def since_realtime(rx_realtime_ns: int | None, now, realtime_ns=time.time_ns) -> int:
    """The time on clock `now` at which a packet stamped rx_realtime_ns arrived: now()
    minus the packet's age. The wall clock is read first, so the age can only come out
    short and the result late, which keeps a bound built on it on the safe side."""
    wall = realtime_ns()
    local = now()
    if rx_realtime_ns is None or not 0 <= wall - rx_realtime_ns < _MAX_AGE_NS:
        return local
    return local - (wall - rx_realtime_ns)
