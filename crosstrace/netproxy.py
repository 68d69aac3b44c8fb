"""A delaying TCP proxy, for tests and demos on machines without `tc netem`.

    with DelayProxy("127.0.0.1:50051", up_ms=30, down_ms=10, jitter_ms=2) as proxy:
        channel = grpc.insecure_channel(proxy.address)

Bytes from the client to the upstream ("up") are delivered `up_ms` after they arrived,
bytes coming back ("down") `down_ms` after; each chunk gets a uniform jitter of
+-`jitter_ms`, but never overtakes the chunk before it (TCP keeps order). Each direction
of a connection is one reader thread (stamps chunks with the kernel's receive time) and
one writer thread (delivers them when due), so delays do not add up across chunks. Every socket operation has a
timeout; stop() closes everything and joins the threads.

    python -m crosstrace.netproxy --upstream HOST:PORT --up-ms 30 --down-ms 10
"""
import argparse
import collections
import random
import signal
import socket
import threading
import time

from .clock_sync import udp
from .proto.endpoint import split_host_port

_POLL_S = 0.1           # how often blocked threads look at the stop flag
_CHUNK = 65536
_MAX_QUEUED = 4 << 20   # bytes held per direction of a connection


def _receive(sock: socket.socket) -> tuple[bytes, float]:
    """A chunk and when it arrived (monotonic s): the kernel's receive timestamp where the
    socket has them on (clock_sync.udp's helpers serve TCP as well), so that a late wake-up
    of this thread does not add delay."""
    data, _, received = udp.recv(sock, _CHUNK)
    return data, udp.since_realtime(received, time.monotonic_ns) / 1e9


class _Pipe:
    """One direction of one connection: read, stamp with a due time, deliver when due."""

    def __init__(self, conn: "_Connection", src: socket.socket, dst: socket.socket, delay_s: float, name: str):
        self.conn, self.src, self.dst, self.delay_s = conn, src, dst, delay_s
        self.queue: collections.deque = collections.deque()
        self.queued = 0                 # bytes in the queue: at most _MAX_QUEUED, then the sender waits
        self.ready = threading.Condition()
        self.threads = [threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
                        threading.Thread(target=self._write, name=f"{name}-write", daemon=True)]

    def _read(self) -> None:
        proxy, last_due = self.conn.proxy, 0.0
        while not proxy._stop.is_set():
            with self.ready:   # a receiver that does not read makes the sender wait, as TCP would
                if self.queued > _MAX_QUEUED and not self.conn.closed:
                    self.ready.wait(_POLL_S)
                    continue
            try:
                data, arrived = _receive(self.src)
            except socket.timeout:
                continue
            except OSError:
                data, arrived = b"", time.monotonic()
            due = max(arrived + proxy._delay(self.delay_s), last_due)
            last_due = due
            with self.ready:
                self.queue.append((due, data))
                self.queued += len(data)
                self.ready.notify_all()
            if not data:
                return

    def _write(self) -> None:
        stop = self.conn.proxy._stop
        try:
            while not stop.is_set():
                with self.ready:
                    if not self.queue:
                        self.ready.wait(_POLL_S)
                        continue
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    # The last stretch in a plain sleep: it wakes closer to the due time.
                    if wait > 0.002:
                        stop.wait(min(wait - 0.001, _POLL_S))
                    else:
                        time.sleep(wait)
                    continue
                with self.ready:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.ready.notify_all()
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)   # the source closed: pass the EOF on, in order
                    return
                self._send(data)
                self.conn.proxy._count(len(data))
        except OSError:
            self.conn.close()                           # a peer went away: end both directions
        finally:
            self.conn.pipe_done()

    def _send(self, data: bytes) -> None:
        """All of `data`, however long the receiver takes to read, up to the proxy's stall_s
        without progress (then the connection ends, as TCP's own timeouts would end it): a send that
        times out (its buffer full for _POLL_S) is tried again. sendall() under the timeout
        took a busy receiver for a lost peer, cut the stream and passed a clean EOF on."""
        view, proxy = memoryview(data), self.conn.proxy
        progress = time.monotonic()
        while view and not proxy._stop.is_set():
            try:
                view = view[self.dst.send(view):]
                progress = time.monotonic()
            except socket.timeout:
                if time.monotonic() - progress > proxy.stall_s:
                    raise OSError(f"the receiver read nothing for {proxy.stall_s:g} s") from None


class _Connection:
    """A client socket, its upstream socket and the two pipes between them."""

    def __init__(self, proxy: "DelayProxy", client: socket.socket, upstream: socket.socket, n: int):
        self.proxy, self.sockets = proxy, (client, upstream)
        self.pipes = (_Pipe(self, client, upstream, proxy.up_s, f"delayproxy-{n}-up"),
                      _Pipe(self, upstream, client, proxy.down_s, f"delayproxy-{n}-down"))
        self._open = 2
        self._lock = threading.Lock()
        self.closed = False

    @property
    def threads(self) -> list[threading.Thread]:
        return [t for pipe in self.pipes for t in pipe.threads]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def pipe_done(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if last:
            self.close()

    def close(self) -> None:
        self.closed = True
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass


class DelayProxy:
    """Listen on `listen`, forward each connection to `upstream` with the given delays."""

    def __init__(self, upstream: str, up_ms: float = 0.0, down_ms: float = 0.0, jitter_ms: float = 0.0,
                 listen: str = "127.0.0.1:0", seed: int | None = None, connect_timeout_s: float = 5.0,
                 stall_s: float = 30.0):
        if min(up_ms, down_ms, jitter_ms) < 0:
            raise ValueError("delays and jitter must not be negative")
        self.upstream = split_host_port(upstream)
        self.up_s, self.down_s, self.jitter_s = up_ms / 1000, down_ms / 1000, jitter_ms / 1000
        self.connect_timeout_s = connect_timeout_s
        self.stall_s = stall_s   # a receiver that reads nothing this long ends its connection
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []    # kept while any of their threads runs: stop() joins them
        self.connections = 0
        self.bytes_forwarded = 0
        host, port = split_host_port(listen)
        self._server = socket.create_server((host, port))
        self._server.settimeout(_POLL_S)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, name="delayproxy-accept", daemon=True)

    def _delay(self, base_s: float) -> float:
        with self._lock:
            jitter = self._random.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        return max(0.0, base_s + jitter)

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_forwarded += n

    def start(self) -> "DelayProxy":
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=self.connect_timeout_s)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                udp.enable_rx_timestamps(sock)
                sock.settimeout(_POLL_S)
            with self._lock:
                conn = _Connection(self, client, upstream, self.connections)
                self._connections = [c for c in self._connections if any(t.is_alive() for t in c.threads)]
                self._connections.append(conn)
                self.connections += 1
            conn.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection; join all threads (bounded by timeout_s)."""
        self._stop.set()
        self._server.close()
        deadline = time.monotonic() + timeout_s
        if self._acceptor.ident is not None:   # first: a connection it takes now must be closed too
            self._acceptor.join(timeout_s)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.close()
        for thread in [t for conn in connections for t in conn.threads]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A TCP proxy that delays each direction (no tc netem needed).")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default %(default)s)")
    parser.add_argument("--up-ms", type=float, default=0.0, help="delay client -> upstream, ms")
    parser.add_argument("--down-ms", type=float, default=0.0, help="delay upstream -> client, ms")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter +- this, ms")
    args = parser.parse_args(argv)
    proxy = DelayProxy(args.upstream, args.up_ms, args.down_ms, args.jitter_ms, args.listen).start()
    print(f"listening on {proxy.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    proxy.stop()


if __name__ == "__main__":
    main()
