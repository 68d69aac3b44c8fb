"""The delaying TCP proxy: delays, order under jitter, integrity, EOF, failures, shutdown."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from crosstrace.launch import wait_until
from crosstrace.netproxy import DelayProxy

from .conftest import first_line


class EchoServer:
    """A real TCP echo server on loopback (one thread per connection)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        conn.settimeout(10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self):
        self.stop.set()
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def connect(proxy: DelayProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed early"
        out += chunk
    return bytes(out)


def round_trips(sock: socket.socket, n: int, size: int = 100) -> list[float]:
    times = []
    for i in range(n):
        payload = bytes([i % 256]) * size
        t0 = time.monotonic()
        sock.sendall(payload)
        assert recv_exactly(sock, size) == payload
        times.append((time.monotonic() - t0) * 1000)
    return times


def test_each_direction_is_delayed(echo):
    with DelayProxy(echo.address, up_ms=30, down_ms=10) as proxy, connect(proxy) as sock:
        rtt = round_trips(sock, 8)
    # Delays are lower bounds (nothing is delivered early); scheduling only adds.
    assert min(rtt) >= 40 - 0.2, rtt
    assert min(rtt) <= 40 + 3, rtt
    assert proxy.connections == 1 and proxy.bytes_forwarded == 2 * 8 * 100


def test_jitter_keeps_order_and_bounds(echo):
    with DelayProxy(echo.address, up_ms=20, down_ms=5, jitter_ms=8, seed=1) as proxy, connect(proxy) as sock:
        # Many small writes in a burst: with jitter each would be delivered at a random time,
        # but a chunk never overtakes the one before it.
        payload = b"".join(i.to_bytes(4, "big") for i in range(2000))
        t0 = time.monotonic()
        for i in range(0, len(payload), 40):
            sock.sendall(payload[i:i + 40])
        assert recv_exactly(sock, len(payload)) == payload
        elapsed = (time.monotonic() - t0) * 1000
        rtt = round_trips(sock, 10)
    assert elapsed >= 25 - 16 - 0.2
    assert all(25 - 16 - 0.2 <= r for r in rtt) and min(rtt) <= 25 + 16 + 3, rtt


def test_large_transfer_and_half_close(echo):
    data = os.urandom(3 * 1024 * 1024)
    with DelayProxy(echo.address, up_ms=5, down_ms=5) as proxy, connect(proxy) as sock:
        received = bytearray()
        reader = threading.Thread(target=lambda: received.extend(b"".join(iter_recv(sock))), daemon=True)
        reader.start()
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)          # EOF travels through the proxy to the echo server ...
        reader.join(20)
        assert not reader.is_alive()
    assert bytes(received) == data             # ... which closes, and the EOF comes back


def test_a_receiver_that_pauses_gets_every_byte():
    """The upstream reads nothing for 1 s while 16 MB come: the proxy's send timed out
    after 0.1 s, it closed both sides, and the upstream saw a clean EOF after 2.9 MB."""
    server = socket.create_server(("127.0.0.1", 0))
    got = {}

    def slow_reader():
        conn, _ = server.accept()
        conn.settimeout(20)
        time.sleep(1.0)
        got["data"] = b"".join(iter_recv(conn))
        conn.close()

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    data = os.urandom(1 << 20) * 16
    with DelayProxy(f"127.0.0.1:{server.getsockname()[1]}", up_ms=5) as proxy:
        client = connect(proxy)
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        reader.join(30)
        client.close()
    server.close()
    assert len(got["data"]) == len(data) and got["data"] == data


def test_a_receiver_that_never_reads_ends_its_connection():
    """After stall_s without progress the connection ends, and its threads with it (they
    stayed until the proxy stopped)."""
    server = socket.create_server(("127.0.0.1", 0))
    with DelayProxy(f"127.0.0.1:{server.getsockname()[1]}", stall_s=1.0) as proxy:
        client = connect(proxy)
        upstream, _ = server.accept()      # never reads
        def send():
            try:
                client.sendall(os.urandom(1 << 20) * 32)
            except OSError:   # the proxy ended the connection: what this test waits for
                pass

        threading.Thread(target=send, daemon=True).start()
        assert wait_until(lambda: not any(t.name.startswith("delayproxy-0") for t in threading.enumerate()), 20)
        client.close()
        upstream.close()
    server.close()


def iter_recv(sock):
    while chunk := sock.recv(65536):
        yield chunk


def test_upstream_down_closes_the_client_and_the_proxy_carries_on(echo):
    dead = socket.create_server(("127.0.0.1", 0))
    dead_address = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()                                  # nothing listens there any more
    with DelayProxy(dead_address, up_ms=1, down_ms=1, connect_timeout_s=1) as proxy:
        with connect(proxy) as sock:
            sock.settimeout(5)
            assert sock.recv(10) == b""
        assert proxy.connections == 0


def test_stop_ends_every_thread_with_connections_open(echo):
    before = {t.ident for t in threading.enumerate()}
    proxy = DelayProxy(echo.address, up_ms=50, down_ms=50).start()
    socks = [connect(proxy) for _ in range(3)]
    for s in socks:
        s.sendall(b"in flight")                   # still queued in the proxy when it stops
    t0 = time.monotonic()
    proxy.stop(timeout_s=5)
    assert time.monotonic() - t0 < 2
    left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("delayproxy")]
    assert left == []
    for s in socks:
        s.settimeout(5)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
        s.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="HOST:PORT"):
        DelayProxy("nowhere")
    with pytest.raises(ValueError, match="negative"):
        DelayProxy("127.0.0.1:1", up_ms=-1)


def test_command_line(echo):
    proc = subprocess.Popen([sys.executable, "-m", "crosstrace.netproxy", "--upstream", echo.address,
                             "--up-ms", "5", "--down-ms", "5"], stdout=subprocess.PIPE, text=True)
    try:
        line = first_line(proc)
        assert line.startswith("listening on 127.0.0.1:")
        host, port = line.split()[-1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert min(round_trips(sock, 3)) >= 10 - 0.2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
