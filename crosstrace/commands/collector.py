"""`crosstrace collector`: run a collector in the foreground until SIGTERM/SIGINT."""
import signal
import sys
import threading
import time

from ..collector.server import Collector


def register(sub) -> None:
    p = sub.add_parser("collector", help="run a collector: gRPC server + durable store",
                       description="Receive spans and clock samples from tracers over gRPC and store them "
                                   "durably (SQLite, WAL). Runs until SIGTERM or Ctrl-C.")
    p.add_argument("--listen", default="127.0.0.1:4327",
                   help="host:port to listen on (default %(default)s; port 0 picks a free one)")
    p.add_argument("--store", required=True, help="path of the store file (created if missing)")
    p.add_argument("--sync", choices=("normal", "full"), default="normal",
                   help="normal: an acked batch survives the collector being killed; full: also a "
                        "power loss (an fsync per commit)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=lambda args: run(args.listen, args.store, sync=args.sync, quiet=args.quiet))


def run(listen: str, store: str, sync: str = "normal", quiet: bool = False,
        progress_interval_s: float = 10.0) -> int:
    collector = Collector(store, listen, sync=sync).start()
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"crosstrace collector listening on {collector.address}, store {store}", flush=True)
    stats = collector.service.stats
    last, last_t = 0, time.monotonic()
    while not stop.wait(progress_interval_s):
        if quiet:
            continue
        now = time.monotonic()
        with stats.lock:
            spans, nodes, rejected = stats.spans, len(stats.nodes), sum(stats.rejected.values())
        if spans != last:
            rate = (spans - last) / (now - last_t)
            print(f"stored {spans:,} spans from {nodes} node(s) ({rate:,.0f}/s)"
                  + (f", rejected {rejected:,}" if rejected else ""), flush=True)
        last, last_t = spans, now
    print("crosstrace collector stopping", file=sys.stderr, flush=True)
    collector.stop()
    return 0
