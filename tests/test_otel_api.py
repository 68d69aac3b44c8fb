"""Code written against the plain OpenTelemetry API is traced by crosstrace unchanged:
nesting, attributes, events, links, status, exceptions, W3C ids, decorators, the entry
point. Spans go through a real collector and are read back from its store."""
import json

import pytest
from opentelemetry import trace

import crosstrace
from crosstrace.proto.semconv import Kind, Status

from .conftest import load_table, run_python, tracer_env


def by_name(table):
    return {table.names[table.name[i]]: i for i in range(len(table))}


@pytest.fixture
def provider(collector):
    p = crosstrace.TracerProvider(endpoint=collector.address, node_id="api-test", job_id="t")
    yield p
    p.shutdown()


def test_nesting_attributes_events_links_status(provider, collector):
    tracer = provider.get_tracer("test")
    other = trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=trace.TraceFlags(1))
    with tracer.start_as_current_span("outer", attributes={"a": 1, "list": [1, 2]}) as outer:
        outer.set_attribute("b", "x")
        outer.add_event("checkpoint", {"step": 3})
        with tracer.start_as_current_span("inner", kind=trace.SpanKind.CLIENT, links=[trace.Link(other)]) as inner:
            assert trace.get_current_span() is inner
            inner.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
        child = tracer.start_span("manual", attributes={"crosstrace.kind": "compute"})
        child.end()
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert provider.force_flush(10_000)

    t = load_table(collector.store)
    rows = by_name(t)
    o, i, m = rows["outer"], rows["inner"], rows["manual"]
    assert t.parent_id[o] == 0 and t.parent_id[i] == t.span_id[o] and t.parent_id[m] == t.span_id[o]
    assert t.trace[o] == t.trace[i] == t.trace[m]
    assert len(t.trace_ids[t.trace[o]]) == 32
    assert t.attributes[o] == {"a": 1, "list": [1, 2], "b": "x"}
    assert t.extras[o]["events"][0][0] == "checkpoint"
    assert t.kind[i] == Kind.RPC_CLIENT and t.kind[m] == Kind.COMPUTE and t.kind[o] == Kind.INTERNAL
    assert t.status[i] == Status.ERROR and t.extras[i]["status_message"] == "boom"
    assert t.extras[i]["links"][0][:2] == [f"{0xABC:032x}", f"{0xDEF:016x}"]
    assert t.start[o] <= t.start[i] <= t.end[i] <= t.end[o]


def test_context_values_survive_nested_spans(provider):
    """A span's context is its parent's with the span replaced: values beside it (baggage)
    stay, and leaving the spans restores each context."""
    from opentelemetry import baggage, context

    tracer = provider.get_tracer("test")
    token = context.attach(baggage.set_baggage("user", "u1"))
    with tracer.start_as_current_span("outer") as outer:
        with tracer.start_as_current_span("inner") as inner:
            assert baggage.get_baggage("user") == "u1" and trace.get_current_span() is inner
            assert inner.parent_id == outer.span_id
        assert baggage.get_baggage("user") == "u1" and trace.get_current_span() is outer
        # with a context given, through the instrumentation's shared path (context_with)
        with tracer.start_as_current_span("given", context=context.get_current()) as given:
            assert baggage.get_baggage("user") == "u1" and trace.get_current_span() is given
            assert given.parent_id == outer.span_id
        assert trace.get_current_span() is outer
    context.detach(token)
    with tracer.start_as_current_span("plain"):
        assert baggage.get_baggage("user") is None
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_exception_is_recorded_and_reraised(provider, collector):
    tracer = provider.get_tracer("test")
    with pytest.raises(ZeroDivisionError):
        with tracer.start_as_current_span("fails"):
            1 / 0
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    row = by_name(t)["fails"]
    assert t.status[row] == Status.ERROR
    event = t.extras[row]["events"][0]
    assert event[0] == "exception" and event[2]["exception.type"] == "ZeroDivisionError"


def test_decorator_starts_one_span_per_call(provider, collector):
    tracer = provider.get_tracer("test")

    @tracer.start_as_current_span("work")
    def work(x):
        return trace.get_current_span().get_span_context().span_id

    ids = {work(i) for i in range(3)}
    assert len(ids) == 3
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    assert sorted(t.span_id[t.name == t.names.index("work")].tolist()) == sorted(ids)


def test_w3c_propagation_roundtrip(provider):
    from opentelemetry import propagate

    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("client") as span:
        carrier = {}
        propagate.inject(carrier)
    ctx = span.get_span_context()
    assert carrier["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    with tracer.start_as_current_span("server", context=propagate.extract(carrier)) as server:
        assert server.trace_id == ctx.trace_id and server.parent_id == ctx.span_id


def test_unsampled_parent_records_nothing(provider):
    tracer = provider.get_tracer("test")
    parent = trace.NonRecordingSpan(trace.SpanContext(5, 6, is_remote=True, trace_flags=trace.TraceFlags(0)))
    span = tracer.start_span("child", context=trace.set_span_in_context(parent))
    assert not span.is_recording()


def test_entry_point_traces_plain_otel_code_without_changes(collector):
    env = tracer_env(collector, "entry-point")
    env["OTEL_PYTHON_TRACER_PROVIDER"] = "crosstrace"
    out = run_python("""
        from opentelemetry import trace
        tracer = trace.get_tracer("plain")
        with tracer.start_as_current_span("plain-otel"):
            with tracer.start_as_current_span("nested"):
                pass
        print(type(trace.get_tracer_provider()).__module__, trace.get_tracer_provider().force_flush())
    """, env=env)
    assert out.stdout.split() == ["crosstrace.tracer.provider", "True"]
    t = load_table(collector.store)
    assert sorted(t.names[i] for i in t.name) == ["nested", "plain-otel"]
    assert t.nodes == ["entry-point"]


def test_spans_are_flushed_at_interpreter_exit(collector):
    run_python("""
        import crosstrace
        tracer = crosstrace.init().get_tracer("exit")
        for i in range(500):
            with tracer.start_as_current_span("at-exit", attributes={"i": i}):
                pass
        # no shutdown(), no flush: the atexit hook must deliver them
    """, env=tracer_env(collector, "exit-node"))
    assert len(load_table(collector.store)) == 500


def test_force_flush_reports_failure_when_collector_is_unreachable():
    p = crosstrace.TracerProvider(endpoint="127.0.0.1:9", node_id="nowhere")
    with p.get_tracer("t").start_as_current_span("lost"):
        pass
    assert p.force_flush(500) is False
    assert p.shutdown(timeout_millis=200) is False


def test_json_unfriendly_attribute_values_survive(provider, collector):
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("odd", attributes={"bytes": b"\x01\x02", "big": 1 << 70, "obj": object()}):
        pass
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    attrs = t.attributes[by_name(t)["odd"]]
    assert attrs["bytes"] == "0102" and attrs["big"] == 1 << 70 and attrs["obj"].startswith("<object")
    json.dumps(attrs)
