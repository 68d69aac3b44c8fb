"""Ingest throughput: spans/s from tracer processes through gRPC into the durable store,
acks included, vs. the OpenTelemetry SDK's OTLP exporter pipeline, in the same run.

crosstrace: producer processes record spans as fast as they can and force_flush(),
which returns once the collector has committed (acked) every span; the window runs
from the first span to the last ack, across processes (CLOCK_MONOTONIC is shared).
OpenTelemetry: the same loop with the SDK's BatchSpanProcessor + OTLPSpanExporter
(gRPC) into an OTLP receiver that only counts spans (it stores nothing, which flatters
the peer).

Collector capacity: several producer processes replay batches that a real tracer
encoded beforehand, as fast as the acks come back, so that what is measured is the
collector receiving, checking, deduplicating and committing. On a 2-core machine live
producers eat the CPU the collector would use, which is why both figures are shown.

Targets: >= 200k spans/s end to end from one producer, >= 500k spans/s stored from
several producers, no span lost.

    python bench/ingest.py [--spans N] [--producers P]
"""
import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import grpc

from crosstrace.collector.store import Store
from crosstrace.launch import CollectorProcess

PRODUCER = textwrap.dedent("""
    import sys, time
    n, kind = int(sys.argv[1]), sys.argv[2]
    if kind == "crosstrace":
        import crosstrace
        provider = crosstrace.init(max_queue=1 << 20)
    else:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[3], insecure=True),
                                                       max_queue_size=1 << 20))
    tracer = provider.get_tracer("bench")
    start = time.monotonic_ns()
    for i in range(n):
        with tracer.start_as_current_span("op", attributes={"i": i, "k": "v"}):
            pass
    ok = provider.force_flush(300_000)
    end = time.monotonic_ns()
    dropped = getattr(provider, "dropped_spans", 0)
    print(start, end, ok, dropped, flush=True)
""")


def run_producers(kind: str, n: int, producers: int, env: dict, endpoint: str = "") -> tuple[float, bool, int]:
    """Start `producers` processes of n spans each; returns (spans/s over the whole window, all ok, dropped)."""
    procs = [subprocess.Popen([sys.executable, "-c", PRODUCER, str(n), kind, endpoint], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(producers)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"producer failed: {err}")
        start, end, ok, dropped = out.split()
        results.append((int(start), int(end), ok == "True", int(dropped)))
    window = (max(r[1] for r in results) - min(r[0] for r in results)) / 1e9
    return n * producers / window, all(r[2] for r in results), sum(r[3] for r in results)


class OtlpCounter:
    """A minimal OTLP/gRPC trace receiver that counts spans."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans = 0
        self.lock = threading.Lock()
        outer = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with outer.lock:
                    outer.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(1).wait(5)


REPLAY = textwrap.dedent("""
    import os, sys, time, grpc, crosstrace
    from crosstrace.proto import pb
    from crosstrace.tracer.clock import Clock
    from crosstrace.tracer.encode import batches, encode_spans
    from crosstrace.tracer.exporter import ExportQueue
    from crosstrace.tracer.provider import Tracer
    n, endpoint = int(sys.argv[1]), sys.argv[2]
    queue = ExportQueue(Clock(), max_queue=n + 1, batch_size=n + 1)   # a tracer's queue, no exporter
    tracer = Tracer(queue)
    for i in range(n):
        with tracer.start_as_current_span("op", attributes={"i": i, "k": "v"}):
            pass
    session, messages = os.urandom(16), []
    for seq, part in enumerate(batches(queue.take(), lambda: 8192), 1):
        batch = pb.SpanBatch(resource=pb.Resource(node_id=f"replay-{os.getpid()}"), session_id=session, seq=seq)
        encode_spans(batch, part)
        messages.append(batch.SerializeToString())
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 64 << 20)])
    export = channel.stream_stream("/crosstrace.v1.Collector/Export", request_serializer=None,
                                   response_deserializer=pb.ExportAck.FromString)
    print("ready", flush=True)
    sys.stdin.readline()   # all producers start sending together, once all have encoded
    start = time.monotonic_ns()
    accepted = sum(ack.accepted for ack in export(iter(messages), timeout=600))
    end = time.monotonic_ns()
    print(start, end, accepted == n, n - accepted, flush=True)
""")


def run_replay(n: int, producers: int, endpoint: str) -> tuple[float, bool]:
    procs = [subprocess.Popen([sys.executable, "-c", REPLAY, str(n), endpoint], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(producers)]
    for proc in procs:   # encoding happens before the window: it would take the collector's CPU
        if proc.stdout.readline().strip() != "ready":
            proc.wait(60)
            raise RuntimeError(f"replay producer failed: {proc.stderr.read()}")
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"replay producer failed: {err}")
        start, end, ok, _ = out.split()
        results.append((int(start), int(end), ok == "True"))
    window = (max(r[1] for r in results) - min(r[0] for r in results)) / 1e9
    return n * producers / window, all(r[2] for r in results)


def stored(path: str) -> int:
    with Store(path, readonly=True) as store:
        return store.span_count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=400_000, help="spans per crosstrace producer")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--otel-spans", type=int, default=40_000, help="spans per OpenTelemetry producer")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for producers in (1, args.producers):
            path = f"{tmp}/ingest-{producers}.db"
            with CollectorProcess(path) as collector:
                env = {"CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": "bench"}
                rate, ok, dropped = run_producers("crosstrace", args.spans, producers, env)
            count = stored(path)
            results[("crosstrace", producers)] = (rate, ok and dropped == 0 and count == args.spans * producers)
            print(f"crosstrace, {producers} producer(s): {rate:,.0f} spans/s end to end (acked = durable); "
                  f"stored {count:,} of {args.spans * producers:,}, dropped {dropped}", flush=True)
        counter = OtlpCounter()
        try:
            for producers in (1, args.producers):
                before = counter.spans
                rate, ok, _ = run_producers("otel", args.otel_spans, producers, {}, f"127.0.0.1:{counter.port}")
                received = counter.spans - before
                results[("otel", producers)] = (rate, ok and received == args.otel_spans * producers)
                print(f"opentelemetry-sdk OTLP, {producers} producer(s): {rate:,.0f} spans/s end to end; "
                      f"received {received:,} of {args.otel_spans * producers:,}", flush=True)
        finally:
            counter.stop()
        path = f"{tmp}/replay.db"
        with CollectorProcess(path) as collector:
            rate, ok = run_replay(args.spans, args.producers, collector.address)
        count = stored(path)
        results[("replay", args.producers)] = (rate, ok and count == args.spans * args.producers)
        print(f"crosstrace collector capacity, {args.producers} replaying producers: {rate:,.0f} spans/s stored "
              f"(acked = durable); stored {count:,} of {args.spans * args.producers:,}", flush=True)
    for producers in (1, args.producers):
        ours, theirs = results[("crosstrace", producers)][0], results[("otel", producers)][0]
        print(f"ratio crosstrace/otel-sdk end to end, {producers} producer(s): {ours / theirs:.1f}x")
    ours, theirs = results[("replay", args.producers)][0], results[("otel", args.producers)][0]
    print(f"ratio crosstrace collector capacity / otel-sdk pipeline, {args.producers} producers: {ours / theirs:.1f}x")
    print(f"targets: >= 200,000 spans/s from one producer ({results[('crosstrace', 1)][0]:,.0f}), "
          f">= 500,000 stored from {args.producers} producers (live {results[('crosstrace', args.producers)][0]:,.0f}, "
          f"replayed {results[('replay', args.producers)][0]:,.0f}), no span lost "
          f"({all(v[1] for k, v in results.items() if k[0] in ('crosstrace', 'replay'))})")


if __name__ == "__main__":
    main()
