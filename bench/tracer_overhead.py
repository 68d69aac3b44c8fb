"""Cost of one span: crosstrace vs. the OpenTelemetry SDK, measured in the same run.

Each span is `with tracer.start_as_current_span("op", attributes={"a": i, "b": "x"})`.
crosstrace exports for real, in the background, to a collector process; the SDK runs
a BatchSpanProcessor with a no-op exporter (its cheapest configuration). Rounds
alternate between the two so that machine noise hits both alike; the medians are
compared. Target: ratio <= 0.10, and <= 500 bytes per queued span.

crosstrace runs its compiled hot path (tracer/_hotpath.c) where it was built; with
CROSSTRACE_PURE_PYTHON=1 this measures its Python implementation instead. The output says which.

A third tracer shows the floor of the API itself: OpenTelemetry's no-op tracer (what
`trace.get_tracer()` gives where no SDK is installed), which records nothing.

    python bench/tracer_overhead.py [--spans N] [--rounds R]
"""
import argparse
import gc
import statistics
import tempfile
import time
import tracemalloc

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SdkProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from peers import NoopExporter

import crosstrace
from crosstrace.launch import CollectorProcess
from crosstrace.tracer.clock import Clock
from crosstrace.tracer.exporter import ExportQueue
from crosstrace.tracer.provider import Tracer, hot_path_status


def per_span_us(tracer, n: int) -> tuple[float, float]:
    """(wall, CPU) per span in us. CPU time is this process's, all threads: the traced
    code plus the tracer's own background work (crosstrace's exporter, the SDK's batch
    processor); steadier than wall time on a shared machine."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        with tracer.start_as_current_span("op", attributes={"a": i, "b": "x"}):
            pass
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def queued_bytes_per_span(n: int = 20000) -> tuple[float, float]:
    """Memory held per span while it waits to be exported: (crosstrace, SDK). crosstrace's
    queue has no exporter here; the SDK's BatchSpanProcessor is held back by a long delay."""
    queue = ExportQueue(Clock(), max_queue=n + 1, batch_size=n + 1)   # a tracer's queue, no exporter
    sdk = SdkProvider()
    sdk.add_span_processor(BatchSpanProcessor(NoopExporter(), max_queue_size=n + 1, max_export_batch_size=n + 1,
                                              schedule_delay_millis=3_600_000))
    out = []
    for tracer in (Tracer(queue), sdk.get_tracer("bench")):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            with tracer.start_as_current_span("op", attributes={"a": i, "b": "x"}):
                pass
        out.append((tracemalloc.get_traced_memory()[0] - before) / n)
        tracemalloc.stop()
    assert len(queue.take()[0]) == n
    sdk.shutdown()
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=50000, help="spans per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(f"{tmp}/bench.db") as collector:
        ours = crosstrace.TracerProvider(endpoint=collector.address, node_id="bench")
        sdk = SdkProvider()
        sdk.add_span_processor(BatchSpanProcessor(NoopExporter()))
        tracers = {"crosstrace": ours.get_tracer("bench"), "otel-sdk": sdk.get_tracer("bench"),
                   "otel-api-noop": trace.NoOpTracer()}
        for tracer in tracers.values():
            per_span_us(tracer, 2000)  # warm up
        times = {name: [] for name in tracers}
        for _ in range(args.rounds):
            for name, tracer in tracers.items():
                times[name].append(per_span_us(tracer, args.spans))
        flushed = ours.force_flush(60_000)
        ours.shutdown()
        sdk.shutdown()
    print(f"spans per round: {args.spans}, rounds: {args.rounds}; crosstrace's hot path: {hot_path_status()}")
    ratios = []
    for i, clock in enumerate(("wall", "CPU")):
        ct = statistics.median(t[i] for t in times["crosstrace"])
        otel = statistics.median(t[i] for t in times["otel-sdk"])
        ratios.append(ct / otel)
        print(f"{clock:>4}: crosstrace (exporting to a collector) {ct:5.2f} us/span, opentelemetry-sdk (no-op "
              f"exporter) {otel:5.2f} us/span, ratio {ct / otel:.3f}   (rounds: crosstrace "
              + " ".join(f"{t[i]:.2f}" for t in times["crosstrace"]) + "; sdk "
              + " ".join(f"{t[i]:.1f}" for t in times["otel-sdk"]) + ")")
    print(f"ratio crosstrace/sdk: wall {ratios[0]:.3f}, CPU {ratios[1]:.3f}   (target <= 0.10)")
    noop = statistics.median(t[0] for t in times["otel-api-noop"])
    print(f"OpenTelemetry's no-op tracer, recording nothing: {noop:.2f} us/span (wall); crosstrace, recording "
          f"and exporting, takes {statistics.median(t[0] for t in times['crosstrace']) / noop:.2f} of it")
    print(f"all spans acked by the collector: {flushed}, dropped: {ours.dropped_spans}")
    ours_b, sdk_b = queued_bytes_per_span()
    print(f"memory per queued span: crosstrace {ours_b:.0f} bytes (target <= 500), opentelemetry-sdk {sdk_b:.0f} "
          f"bytes, ratio {ours_b / sdk_b:.3f}")


if __name__ == "__main__":
    main()
