"""Cost of tracing one unary gRPC call on loopback: no tracing, crosstrace's channel and
server interceptor, and opentelemetry-instrumentation-grpc with the OpenTelemetry SDK, in
the same run.

Client and server are instrumented alike in each configuration, all in this process.
crosstrace exports for real, in the background, to a collector process, and piggybacks a
clock sample on one call per channel every 10 ms (its default); the SDK runs a
BatchSpanProcessor with a no-op exporter (its cheapest configuration). Short rounds cycle through the three, each first in turn, so
that machine noise hits them alike, in blocks with a fresh server and channel per
configuration. The added cost of each is the median over rounds of (its time - the
untraced time of the same round), in wall time and in this process's CPU time (client,
server and crosstrace's exporter threads; steadier than wall time on a shared machine).
Target (issue 6): crosstrace adds <= 1/3 of what the OpenTelemetry instrumentation adds.

    python bench/grpc_overhead.py [--calls N] [--rounds R] [--blocks B]
"""
import argparse
import concurrent.futures
import contextlib
import statistics
import tempfile
import time

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor as otel_client_interceptor
from opentelemetry.instrumentation.grpc import server_interceptor as otel_server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel as otel_intercept_channel
from opentelemetry.sdk.trace import TracerProvider as SdkProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from peers import NoopExporter

import crosstrace
from crosstrace.launch import CollectorProcess

METHOD = "/bench.Echo/Call"


def echo(request, context):
    return request


@contextlib.contextmanager
def connect(interceptors, instrument):
    """A server and channel for one configuration in one block of rounds (a server's
    threads land where they land: two instances of one configuration can differ by tens of
    us per call; fresh ones per block spread that over the run)."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), interceptors=interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = instrument(grpc.insecure_channel(f"127.0.0.1:{port}"))
    try:
        yield channel.unary_unary(METHOD)
    finally:
        channel.close()
        server.stop(0)


def per_call_us(call, n: int) -> tuple[float, float]:
    """(wall, CPU of this process) per call, in us."""
    payload = b"x" * 64
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        call(payload, timeout=10)
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def metadata_bytes(provider) -> int:
    """Bytes crosstrace adds to a call that samples the clock (a channel's first): request
    metadata and the clock trailer, as key+value. Other calls carry the traceparent alone."""
    from crosstrace.tracer.instrument import grpc as ct_grpc

    seen = {}

    def capture(request, context):
        seen["request"] = [(k, v) for k, v in context.invocation_metadata()
                           if k in ("traceparent", "tracestate", ct_grpc.T1_KEY)]
        return request

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1),
                         interceptors=[crosstrace.server_interceptor(provider)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(capture)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = crosstrace.instrument_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), provider)
    _, call = channel.unary_unary(METHOD).with_call(b"x", timeout=10)
    trailer = [(k, v) for k, v in call.trailing_metadata() if k == ct_grpc.CLOCK_KEY]
    channel.close()
    server.stop(0)
    return sum(len(k) + len(v) for k, v in seen["request"] + trailer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="calls per configuration per round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per block")
    parser.add_argument("--blocks", type=int, default=5, help="fresh servers and channels for each block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(f"{tmp}/bench.db") as collector:
        ours = crosstrace.TracerProvider(endpoint=collector.address, node_id="bench")
        sdk = SdkProvider()
        sdk.add_span_processor(BatchSpanProcessor(NoopExporter()))
        setups = {
            "none": lambda: connect([], lambda channel: channel),
            "crosstrace": lambda: connect([crosstrace.server_interceptor(ours)],
                                          lambda channel: crosstrace.instrument_channel(channel, ours)),
            "opentelemetry": lambda: connect([otel_server_interceptor(tracer_provider=sdk)],
                                             lambda channel: otel_intercept_channel(
                                                 channel, otel_client_interceptor(tracer_provider=sdk))),
        }
        names = list(setups)
        times = {name: [] for name in names}
        for _ in range(args.blocks):
            with contextlib.ExitStack() as stack:
                calls = {name: stack.enter_context(setup()) for name, setup in setups.items()}
                for call in calls.values():
                    per_call_us(call, 300)   # warm up: connections, caches
                for k in range(args.rounds):
                    first = k % len(names)   # each configuration first in turn
                    for name in names[first:] + names[:first]:
                        times[name].append(per_call_us(calls[name], args.calls))
        flushed = ours.force_flush(60_000)
        wire = metadata_bytes(ours)
        samples_dropped = ours.dropped_spans
        ours.shutdown()
        sdk.shutdown()
    added = {(name, k): statistics.median(t[k] - base[k] for t, base in zip(times[name], times["none"]))
             for name in ("crosstrace", "opentelemetry") for k in (0, 1)}
    print(f"unary calls per round: {args.calls}, rounds: {args.blocks} x {args.rounds}, client and server in one process")
    for name, label in (("none", "no tracing"), ("crosstrace", "crosstrace"),
                        ("opentelemetry", "opentelemetry-instrumentation-grpc + SDK")):
        wall, cpu = (statistics.median(t[k] for t in times[name]) for k in (0, 1))
        extra = f"   adds {added[name, 0]:6.1f} us (CPU {added[name, 1]:6.1f} us)" if name != "none" else ""
        quartiles = statistics.quantiles([t[0] for t in times[name]], n=4)
        print(f"{label:41s} {wall:7.1f} us/call (CPU {cpu:6.1f}){extra}   (rounds' middle half: "
              f"{quartiles[0]:.0f}-{quartiles[2]:.0f} us)")
    for k, what in ((0, "wall"), (1, "CPU")):
        ratio = added["crosstrace", k] / added["opentelemetry", k]
        print(f"added {what} time crosstrace / opentelemetry: {ratio:.3f}   (target <= 0.333)")
    print(f"bytes crosstrace adds to a call that samples the clock (traceparent, t1, trailer): {wire}")
    print(f"all spans and clock samples acked by the collector: {flushed}, dropped spans: {samples_dropped}")


if __name__ == "__main__":
    main()
