"""`crosstrace collector`: run a collector in the foreground until SIGTERM/SIGINT."""
import argparse
import os
import signal
import socket
import sys
import threading
import time

from ..collector import security
from ..collector.relay import Relay
from ..collector.server import Collector
from ..collector.wording import counted
from ..proto.endpoint import split_host_port, target_of
from .report import duration, positive


def register(sub) -> None:
    p = sub.add_parser("collector", help="run a collector: gRPC server + durable store",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Receive spans and clock samples from tracers over gRPC (and from any "
                                   "OpenTelemetry SDK over OTLP/gRPC, on the same port) and store them "
                                   "durably (SQLite, WAL). Runs until SIGTERM or Ctrl-C.",
                       epilog="relay mode: with --forward-to, this collector is an edge gateway: it stores its "
                              "devices' batches,\nacks them once they are also in its spool, and forwards them "
                              "upstream, adding its own clock\nsamples against upstream. TLS and token towards "
                              "upstream come from CROSSTRACE_TLS_CA,\nCROSSTRACE_TLS_CERT, CROSSTRACE_TLS_KEY "
                              "and CROSSTRACE_TOKEN, as for any tracer.")
    p.add_argument("--listen", default="127.0.0.1:4327",
                   help="host:port to listen on (default %(default)s, loopback only; port 0 picks a free one)")
    p.add_argument("--store", required=True,
                   help="path of the store file (created, with its folders, if missing: its first line says \"(new)\")")
    p.add_argument("--sync", choices=("normal", "full"), default="normal",
                   help="normal: an acked batch survives the collector being killed; full: also a "
                        "power loss (an fsync per commit, and per spooled batch in relay mode)")
    p.add_argument("--max-streams", type=positive, default=1024,
                   help="concurrent calls served (default %(default)s); each tracer process holds one export "
                        "stream while it runs, and beyond this clients are told to retry")
    p.add_argument("--retain", type=duration, metavar="DURATION",
                   help="delete spans and clock samples that arrived over DURATION ago (7d, 12h, ...); by "
                        "default the store keeps everything")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (needs --tls-key)")
    sec.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    sec.add_argument("--tls-client-ca", metavar="PEM",
                     help="mutual TLS: clients must present a certificate signed by this CA")
    sec.add_argument("--tokens", metavar="FILE",
                     help="require a bearer token on every call: one client per line, `NAME TOKEN` (or a bare "
                          "`TOKEN`, named after its line), 16 characters or more; `#` begins a comment")
    relay = p.add_argument_group("relay")
    relay.add_argument("--forward-to", metavar="ENDPOINT", help="upstream collector (host:port): relay mode")
    relay.add_argument("--node-id", help="this relay's node id (default CROSSTRACE_NODE_ID, else <host>/relay)")
    relay.add_argument("--spool", metavar="DIR", help="where batches wait for upstream (default STORE.spool)")
    relay.add_argument("--spool-max-mb", type=positive,
                       help="spool size limit (default CROSSTRACE_SPOOL_MAX_MB, else 256)")
    p.set_defaults(func=run_args)


def run_args(args) -> int:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    credentials = security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    tokens = security.load_tokens(args.tokens) if args.tokens else None
    upstream = None
    options = {}
    relay_only = [flag for flag, value in (("--node-id", args.node_id), ("--spool", args.spool),
                                           ("--spool-max-mb", args.spool_max_mb)) if value]
    if relay_only and not args.forward_to:   # (it was taken, and nothing happened)
        raise ValueError(f"{relay_only[0]} goes with --forward-to ENDPOINT (relay mode)")
    if args.forward_to:
        # A clear error now, not retries for ever; http(s)://HOST:PORT as OpenTelemetry writes it
        if split_host_port(target_of(args.forward_to)[0]) == split_host_port(args.listen):
            raise ValueError(f"--forward-to {args.forward_to} is this collector's own --listen address: "
                             "a relay forwards to another collector")
        upstream, relay_clock = _upstream(args)
        clock = relay_clock.domain()
        options = {"forward": Relay(upstream.cfg.node_id, upstream, clock), "now": relay_clock.now, "clock": clock}
    try:
        return run(args.listen, args.store, sync=args.sync, quiet=args.quiet, credentials=credentials,
                   tokens=tokens, max_streams=args.max_streams, retain_ns=args.retain, **options)
    finally:
        if upstream is not None:
            upstream.shutdown(upstream.cfg.exit_flush_timeout_s)


def _upstream(args):
    """The relay's exporter towards upstream (stream, acks, spool, clock probes), configured
    like any tracer: flags, then CROSSTRACE_* variables."""
    from ..tracer.config import Config
    from ..tracer.exporter import Exporter

    node_id = args.node_id or os.environ.get("CROSSTRACE_NODE_ID") or f"{socket.gethostname()}/relay"
    cfg = Config.from_env(endpoint=args.forward_to, node_id=node_id, role="relay",
                          spool_dir=args.spool or f"{args.store}.spool", spool_max_mb=args.spool_max_mb,
                          spool_fsync=args.sync == "full" or None)   # acked batches wait there for upstream
    exporter = Exporter.forwarding(cfg)
    return exporter, exporter.clock


def run(listen: str, store: str, sync: str = "normal", quiet: bool = False,
        progress_interval_s: float = 10.0, retain_ns: int | None = None, **options) -> int:
    """Serve until SIGTERM/SIGINT; `options` go to Collector (credentials, tokens, max_streams,
    forward, now, clock). A warning about exposure is printed once the server is up, with
    the port it bound (--listen may ask for port 0). With
    `retain_ns`, what arrived longer ago is deleted as it ages (checked a few times per
    retention period, at most every 10 s)."""
    new = not os.path.exists(store)   # said: a mistyped --store starts a store of its own
    collector = Collector(store, listen, sync=sync, **options).start()
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    relay = options.get("forward")
    via = f", relaying to {relay.upstream.cfg.endpoint} as {relay.node_id}" if relay else ""
    try:
        warning = security.exposure_warning(collector.address, options.get("credentials") is not None,
                                            options.get("tokens") is not None)
        if warning:
            say(f"crosstrace collector: {warning}", sys.stderr)
        say(f"crosstrace collector listening on {collector.address}, store {store}{' (new)' if new else ''}{via}")
        if collector.store.shift_ns:
            say(f"crosstrace collector: {store} was begun on another clock (this machine rebooted, or the store "
                f"was moved); its timeline goes on through the wall clock, {collector.store.shift_ns / 1e9:+.3f} s "
                "from this machine's clock: spans from before and after are placed relative to each other "
                "within the wall clock's error", sys.stderr)
        stats = collector.service.stats
        last, last_t = 0, time.monotonic()
        tick = progress_interval_s if retain_ns is None else min(progress_interval_s, max(0.5, retain_ns / 4e9))
        while not stop.wait(tick):
            if retain_ns is not None:
                expired = collector.store.expire(retain_ns)
                if expired and not quiet:
                    say(f"deleted {counted(expired, 'span')} that arrived over {retain_ns / 1e9:,.0f} s ago")
            now = time.monotonic()
            if now - last_t < progress_interval_s - tick / 2:
                continue
            with stats.lock:   # the nodes of this interval only: a set of every node id ever grew for good
                spans, nodes, rejected = stats.spans, len(stats.nodes), sum(stats.rejected.values())
                stats.nodes.clear()
            if spans != last and not quiet:
                rate = (spans - last) / (now - last_t)
                say(f"stored {counted(spans, 'span')} ({rate:,.0f}/s from {counted(nodes, 'node')} lately)"
                    + (f", rejected {rejected:,}" if rejected else ""))
            last, last_t = spans, now
        say("crosstrace collector stopping", sys.stderr)
    finally:   # whatever happens to the loop, the server stops: its threads would keep the process up
        collector.stop()
    return 0


def say(line: str, stream=None) -> None:
    """A progress line. Where the output is gone (a pipe into `head` that ended), the
    collector goes on serving silently: a failed print stopped its loop, and SIGTERM then
    set an event nothing waited on, while the server's threads kept the process up."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except (OSError, ValueError):
        pass
