"""OTLP interop, both ways, with real parts: the OpenTelemetry SDK's OTLP/gRPC exporter
reporting into a crosstrace collector (same port as crosstrace's own service), and
`crosstrace export --otlp` sending a store to a real OTLP/gRPC receiver."""
import concurrent.futures
import contextlib
import subprocess
import sys
import textwrap

import grpc
import pytest
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SdkProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from crosstrace.collector import report as report_mod
from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.collector.report import analyse_report
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind

from .conftest import run_python, tracer_env

_OTLP_KIND = {SpanKind.SERVER: trace_pb2.Span.SPAN_KIND_SERVER, SpanKind.CLIENT: trace_pb2.Span.SPAN_KIND_CLIENT,
              SpanKind.INTERNAL: trace_pb2.Span.SPAN_KIND_INTERNAL, SpanKind.PRODUCER: trace_pb2.Span.SPAN_KIND_PRODUCER,
              SpanKind.CONSUMER: trace_pb2.Span.SPAN_KIND_CONSUMER}

MS = 1_000_000


def sdk_spans(endpoint: str, headers=None) -> list:
    """Spans made with the OpenTelemetry SDK and sent over OTLP/gRPC; returns the SDK's own
    copies (the truth: ids, times, attributes)."""
    memory = InMemorySpanExporter()
    provider = SdkProvider(resource=Resource.create({"service.name": "shop", "host.name": "till-1",
                                                     "process.pid": 4242, "deployment.environment": "test",
                                                     "source": "till-app", "replicas": 3, "note": "n" * 300}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True, headers=headers,
                                                                    timeout=10)))
    tracer = provider.get_tracer("shop")
    upstream = propagate.extract({"traceparent": f"00-{0xFEED:032x}-{0xBEEF:016x}-01", "tracestate": "shop=1"})
    with tracer.start_as_current_span("checkout", context=upstream, kind=SpanKind.SERVER,
                                      attributes={"order": 17, "express": True, "weight": 2.5,
                                                  "items": ["a", "b"]}) as root:
        with tracer.start_as_current_span("price", attributes={sc.KIND: "compute"}) as price:
            price.add_event("discount", {"percent": 10, "margin": float("nan")})   # JSON has no NaN
        with tracer.start_as_current_span("pay", kind=SpanKind.CLIENT,
                                          links=[Link(root.get_span_context(), {"why": "test"})]) as pay:
            pay.set_status(Status(StatusCode.ERROR, "card declined"))
    assert provider.force_flush(10_000)
    provider.shutdown()
    return memory.get_finished_spans()


def test_opentelemetry_sdk_reports_into_the_collector(collector):
    truth = {s.name: s for s in sdk_spans(collector.address)}
    store = Store(collector.store, readonly=True)
    try:
        table = spantable.load(store)
        resources = list(store.nodes().values())
    finally:
        store.close()
    assert len(table) == 3
    [res] = resources
    assert res.node_id == "till-1/4242" and res.service_name == "shop" and res.pid == 4242
    assert res.labels[sc.CLOCK_LABEL] == sc.CLOCK_UNIX_EPOCH and res.labels[sc.SOURCE_LABEL] == "otlp"
    assert res.labels["deployment.environment"] == "test"
    rows = {table.names[table.name[i]]: i for i in range(len(table))}
    kinds = {name: Kind(int(table.kind[i])) for name, i in rows.items()}
    assert kinds == {"checkout": Kind.RPC_SERVER, "price": Kind.COMPUTE, "pay": Kind.RPC_CLIENT}
    for name, i in rows.items():
        s = truth[name]
        assert table.trace_ids[table.trace[i]] == f"{s.context.trace_id:032x}"
        assert int(table.span_id[i]) == s.context.span_id
        assert int(table.parent_id[i]) == (s.parent.span_id if s.parent else 0)
        # Kept raw: Unix-epoch ns of the sender's wall clock.
        assert (int(table.start[i]), int(table.end[i])) == (s.start_time, s.end_time)
    assert table.attributes[rows["checkout"]] == {"order": 17, "express": True, "weight": 2.5, "items": ["a", "b"]}
    assert table.attributes[rows["price"]] is None           # crosstrace.kind became the kind
    assert int(table.status[rows["pay"]]) == 2
    pay_extra = table.extras[rows["pay"]]
    assert pay_extra["status_message"] == "card declined"
    assert pay_extra["links"] == [[f"{truth['checkout'].context.trace_id:032x}",
                                   f"{truth['checkout'].context.span_id:016x}", {"why": "test"}]]
    assert {table.extras[i]["trace_state"] for i in rows.values()} == {"shop=1"}
    [(event, when, attrs)] = table.extras[rows["price"]]["events"]
    assert (event, when) == ("discount", truth["price"].events[0].timestamp)
    assert attrs == {"percent": 10, "margin": "NaN"}


def raw_span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start=10**18, end=10**18 + 5000, name="op"):
    return trace_pb2.Span(trace_id=trace_id, span_id=span_id, name=name, start_time_unix_nano=start,
                          end_time_unix_nano=end)


def test_bad_otlp_spans_are_rejected_one_by_one(collector):
    request = otlp.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(scope_spans=[
        trace_pb2.ScopeSpans(spans=[
            raw_span(),
            raw_span(trace_id=b"\x01" * 8, span_id=b"\x03" * 8),          # a trace id of 8 bytes
            raw_span(span_id=b"\x04" * 8, start=10**18, end=10**18 - 1),  # ends before it starts
            trace_pb2.Span(trace_id=b"\x01" * 16, span_id=b"\x05" * 8, name="op", start_time_unix_nano=10**18,
                           end_time_unix_nano=10**18 + 1, status=trace_pb2.Status(code=-1)),  # no such code
            trace_pb2.Span(trace_id=b"\x01" * 16, span_id=b"\x06" * 8, parent_span_id=b"\x07" * 3, name="op",
                           start_time_unix_nano=10**18, end_time_unix_nano=10**18 + 1),   # was stored as a root
        ])]),
        # A bool where an integer belongs: a Resource field refused it, and the whole request
        # failed after the resources before it were stored.
        trace_pb2.ResourceSpans(resource=resource_pb2.Resource(attributes=[
            common_pb2.KeyValue(key="process.pid", value=common_pb2.AnyValue(bool_value=True)),
            common_pb2.KeyValue(key="host.name", value=common_pb2.AnyValue(string_value="cam")),
            common_pb2.KeyValue(key="service.name", value=common_pb2.AnyValue(string_value="camera"))]),
            scope_spans=[trace_pb2.ScopeSpans(spans=[raw_span(span_id=b"\x08" * 8)])])])
    with grpc.insecure_channel(collector.address) as channel:
        response = otlp_grpc.TraceServiceStub(channel).Export(request, timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                request_serializer=None, response_deserializer=None)(b"\xff\xff garbage", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ExportTraceServiceRequest" in err.value.details()
    assert response.partial_success.rejected_spans == 4
    assert "invalid_trace_id" in response.partial_success.error_message
    assert "1 invalid_parent_span_id" in response.partial_success.error_message
    store = Store(collector.store, readonly=True)
    try:
        assert store.span_count() == 2
        assert store.rejects() == {"end_before_start": 1, "invalid_trace_id": 1, "malformed_batch": 1,
                                   "unknown_status": 1, "invalid_parent_span_id": 1}
        assert sorted(r.node_id for r in store.nodes().values()) == ["otlp/camera", "otlp/unknown"]
    finally:
        store.close()


class Receiver(otlp_grpc.TraceServiceServicer):
    """A real OTLP/gRPC backend, as far as the protocol goes: keeps what it is sent."""

    def __init__(self):
        self.requests: list = []
        self.metadata: list = []

    def Export(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        return otlp.ExportTraceServiceResponse()


@contextlib.contextmanager
def receiving():
    """(Receiver, its port) served on loopback for the block."""
    receiver = Receiver()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(0)


TRACED = """
import time, crosstrace
provider = crosstrace.init()
tracer = provider.get_tracer("t")
for i in range(5):
    wall = time.time_ns()
    with tracer.start_as_current_span("work", attributes={"i": i, "wall_ns": wall}):
        with tracer.start_as_current_span("inner", kind=crosstrace.Kind.COMPUTE) as inner:
            inner.set_attribute("ddp.ready_ns", provider.clock.now())   # a time on this node's clock
            time.sleep(0.002)
    time.sleep(0.02)
assert provider.force_flush(20000)
"""


def test_export_otlp_sends_aligned_unix_times(collector):
    # A crosstrace node whose clock is 2.5 s ahead, and an OpenTelemetry SDK node.
    run_python(TRACED, tracer_env(collector, "ahead", sim_clock_offset_ns=2_500_000_000,
                                  clock_probe_interval_s=0.1), timeout=60)
    sdk_truth = {s.context.span_id: s for s in sdk_spans(collector.address)}
    with receiving() as (receiver, port):
        out = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", collector.store,
                              "--otlp", f"127.0.0.1:{port}", "--otlp-header", "authorization=Bearer backend-token"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sent 13 spans" in out.stderr
    assert {m.get("authorization") for m in receiver.metadata} == {"Bearer backend-token"}

    exported = {}
    for request in receiver.requests:
        for rs in request.resource_spans:
            res = {kv.key: kv.value for kv in rs.resource.attributes}
            for scope in rs.scope_spans:
                for span in scope.spans:
                    exported[int.from_bytes(span.span_id, "big")] = (res, span)
    assert len(exported) == 13
    store = Store(collector.store, readonly=True)
    try:
        analysed = report_mod.analyse_store(store)
    finally:
        store.close()
    t, al = analysed.table, analysed.alignment
    for i in range(len(t)):
        res, span = exported[int(t.span_id[i])]
        assert span.trace_id.hex() == t.trace_ids[t.trace[i]]
        assert int.from_bytes(span.parent_span_id or b"\0", "big") == int(t.parent_id[i])
        node = t.nodes[t.node[i]]
        assert res[sc.NODE_ID].string_value == node
        if node == "ahead":
            # Aligned, then put on the Unix epoch.
            assert span.start_time_unix_nano == al.start[i] + al.epoch_offset_ns
            attrs = {kv.key: kv.value for kv in span.attributes}
            assert attrs[sc.ERROR_BOUND_NS].int_value == al.error[i] < 1 * MS
            if span.name == "work":   # the wall clock when the span started, despite the 2.5 s offset
                assert abs(span.start_time_unix_nano - attrs["wall_ns"].int_value) < 20 * MS
            else:
                assert attrs[sc.KIND].string_value == "compute"
                # a node-clock time among its attributes goes onto the Unix epoch with it
                assert abs(attrs[sc.DDP_READY_NS].int_value - span.start_time_unix_nano) < 1 * MS
        else:   # its resource as sent: types, its own `source` (crosstrace's label hid it), long values
            assert (res["source"].string_value, res["replicas"].int_value, res["process.pid"].int_value,
                    res["note"].string_value) == ("till-app", 3, 4242, "n" * 300)
            truth = sdk_truth[int(t.span_id[i])]
            assert abs(span.start_time_unix_nano - truth.start_time) < 1 * MS
            assert span.kind == _OTLP_KIND[truth.kind]   # the kind the SDK gave it, through the store and back
            assert span.trace_state == truth.context.trace_state.to_header() == "shop=1"


def test_export_otlp_to_nowhere_fails_clearly(collector):
    run_python(TRACED, tracer_env(collector, "n"), timeout=60)
    out = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", collector.store,
                          "--otlp", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "OTLP export to 127.0.0.1:1 failed: UNAVAILABLE" in out.stderr


def test_export_otlp_fits_each_request_within_what_receivers_take(collector):
    """Large spans (prompts in their attributes) went 2000 to a request: 9 MB, refused by a
    receiver's 4 MiB limit, and the whole export with it. Requests now stay within 3 MB,
    and a span larger than that alone is left out and said so."""
    run_python("""
        import crosstrace
        provider = crosstrace.init()
        tracer = provider.get_tracer("t")
        for i in range(1000):
            with tracer.start_as_current_span("generate", attributes={"prompt": "p" * 9000}):
                pass
        with tracer.start_as_current_span("huge", attributes={"document": "d" * (5 << 20)}):
            pass
        assert provider.force_flush(20000)
    """, tracer_env(collector, "llm", clock_probe_interval_s=0.1), timeout=60)
    with receiving() as (receiver, port):   # gRPC's default limit: 4 MiB a message
        out = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", collector.store,
                              "--otlp", f"HTTP://127.0.0.1:{port}/"],   # a URL as people write one
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sent 1,000 spans" in out.stderr and "1 span larger than 3 MB left out" in out.stderr
    assert len(receiver.requests) >= 3 and all(r.ByteSize() <= 3 << 20 for r in receiver.requests)
    assert sum(len(s.spans) for r in receiver.requests for rs in r.resource_spans for s in rs.scope_spans) == 1000


MIXED_CLIENT = """
import json, subprocess, sys
from opentelemetry import propagate, trace
import crosstrace
provider = crosstrace.init()
tracer = trace.get_tracer("edge")
with tracer.start_as_current_span("request"):
    with tracer.start_as_current_span("call", kind=crosstrace.Kind.RPC_CLIENT):
        carrier = {}
        propagate.inject(carrier)
        subprocess.run([sys.executable, "-c", sys.argv[1], json.dumps(carrier), sys.argv[2]], check=True, timeout=60)
assert provider.force_flush(20000)
provider.shutdown()
"""

OTEL_SERVICE = """
import json, sys, time
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
provider = TracerProvider(resource=Resource.create({"service.name": "svc", "host.name": "otelhost", "process.pid": 7}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[2], insecure=True, timeout=10)))
with provider.get_tracer("svc").start_as_current_span("handle", context=propagate.extract(json.loads(sys.argv[1])),
                                                       kind=SpanKind.SERVER):
    time.sleep(0.01)
provider.shutdown()
"""


def test_a_trace_through_an_otlp_service_is_on_one_timeline(collector):
    """A crosstrace client calls a service traced by OpenTelemetry's SDK, which reports over
    OTLP. The service's spans are on its wall clock and it sends no clock samples: its
    clock is the UTC link. Left unmodelled, its Unix times sat beside the client's
    monotonic ones, and the trace lasted 57 years."""
    run_python(MIXED_CLIENT, tracer_env(collector, "edge"), timeout=90,
               args=(textwrap.dedent(OTEL_SERVICE), collector.address))
    report, _, _ = analyse_report(collector.store)
    (trace,) = [t for t in report["traces"] if t["name"] == "request"]
    assert trace["nodes"] == 2 and 10 * MS <= trace["duration_ns"] < 60 * 10**9
    clock = report["clocks"]["otelhost/7"]
    assert "wall_clock" in clock["flags"] and clock["error_bound_ns"] is not None
    handle = [s for s in trace["critical_path"] if s["span"] == "handle"]
    assert handle and all(s["node"] == "otelhost/7" for s in handle)
