"""Code written against the plain OpenTelemetry API is traced by crosstrace unchanged:
nesting, attributes, events, links, status, exceptions, W3C ids, decorators, the entry
point. Spans go through a real collector and are read back from its store."""
import functools
import json
import subprocess
import sys

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


def test_providers_made_and_shut_down_leave_no_hooks_behind(collector):
    """Each provider registered an exit hook, a fork hook and a multiprocessing one for good
    (tests and notebooks make many); the live ones now share one of each. Those still open at
    exit are flushed."""
    out = run_python("""
        import atexit, crosstrace
        before = atexit._ncallbacks()
        for i in range(50):
            p = crosstrace.TracerProvider(node_id=f"p{i}", exit_flush_timeout_s=5)
            with p.get_tracer("t").start_as_current_span("made", attributes={"i": i}):
                pass
            if i < 49:
                p.shutdown()
        print(atexit._ncallbacks() - before)   # the last one is left open: the exit hook flushes it
    """, env=tracer_env(collector, "many"))
    assert out.stdout.split() == ["0"]
    assert sorted(a["i"] for a in load_table(collector.store).attributes) == list(range(50))


def test_force_flush_reports_failure_when_collector_is_unreachable():
    p = crosstrace.TracerProvider(endpoint="127.0.0.1:9", node_id="nowhere")
    with p.get_tracer("t").start_as_current_span("lost"):
        pass
    assert p.force_flush(500) is False
    assert p.shutdown(timeout_millis=200) is False


def test_json_unfriendly_attribute_values_survive(provider, collector, tmp_path):
    """Values JSON has no type for travel as text; a NaN or an infinity (a loss gone NaN) as
    the strings of proto3's JSON mapping, not as null, and exports stay strict JSON."""
    tracer = provider.get_tracer("test")
    wide = {"uuid": 24197857161011715162171839636988778105, "low": -(1 << 63) - 1, "u64": (1 << 64) - 1}
    with tracer.start_as_current_span("odd", attributes={"bytes": b"\x01\x02", "big": 1 << 70, "obj": object(),
                                                         **wide}):
        pass
    assert provider.force_flush(10_000)   # a batch of its own: orjson reads it (json reads one with a NaN)
    with tracer.start_as_current_span("diverged", attributes={"loss": float("nan"), "step": 7}) as span:
        span.set_attribute("grad_norm", float("inf"))
        span.set_attribute("losses", [0.5, float("nan")])
        span.set_attribute("note", '{"said": null} é')     # text with a null in it: not a NaN
        span.add_event("clip", {"scale": -float("inf")})
    with tracer.start_as_current_span("fine", attributes={"loss": 0.5}):
        pass
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    rows = by_name(t)
    attrs = t.attributes[rows["odd"]]
    assert attrs["bytes"] == "0102" and attrs["big"] == 1 << 70 and attrs["obj"].startswith("<object")
    assert {k: attrs[k] for k in wide} == wide and all(type(attrs[k]) is int for k in wide)   # not rounded floats
    assert t.attributes[rows["diverged"]] == {"loss": "NaN", "step": 7, "grad_norm": "Infinity",
                                              "losses": [0.5, "NaN"], "note": '{"said": null} é'}
    assert t.extras[rows["diverged"]]["events"][0][2] == {"scale": "-Infinity"}
    assert t.attributes[rows["fine"]] == {"loss": 0.5}
    out = tmp_path / "spans.jsonl"
    result = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--store", collector.store,
                             "--jsonl", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    def strict(constant):
        raise AssertionError(f"not strict JSON: {constant}")
    exported = {s["name"]: s["attributes"] for s in map(functools.partial(json.loads, parse_constant=strict),
                                                          out.read_text().splitlines())}
    assert exported["diverged"] == t.attributes[rows["diverged"]]
    assert {k: exported["odd"][k] for k in wide} == wide


class Boom(Exception):
    pass


def test_a_span_starts_where_and_when_it_is_entered(provider):
    """start_as_current_span() only makes the context manager, as in OpenTelemetry's SDK:
    parent, trace and start time are those of the `with`."""
    tracer = provider.get_tracer("test")
    for lazy in (tracer.start_as_current_span("lazy"),                        # the common case
                 tracer.start_as_current_span("lazy", end_on_exit=False)):    # a wrapper around a span
        made_at = provider.clock.now()
        with tracer.start_as_current_span("parent") as parent:
            entered_at = provider.clock.now()
            with lazy as span:
                assert trace.get_current_span() is span
        assert span.parent_id == parent.span_id and span.trace_id == parent.trace_id
        assert made_at < entered_at <= span.start
        with pytest.raises(RuntimeError, match="entered already"):   # once, as the SDK's context manager
            with lazy:
                pass


def test_a_span_is_on_the_thread_that_enters_it(provider):
    import threading

    lazy = provider.get_tracer("test").start_as_current_span("elsewhere")
    entered = []

    def enter():
        with lazy as span:
            entered.append((span, threading.get_ident()))

    worker = threading.Thread(target=enter)
    worker.start()
    worker.join(10)
    [(span, thread)] = entered
    assert span.thread == thread != threading.get_ident()


def test_a_span_left_in_another_context_still_ends(provider, collector):
    """A generator closed under another context (an async generator closed by asyncio, say)
    cannot restore the context it entered; the SDK logs that and goes on, so must crosstrace."""
    import contextvars

    tracer = provider.get_tracer("test")

    def numbers():
        with tracer.start_as_current_span("in-generator"):
            yield 1

    gen = numbers()
    contextvars.copy_context().run(next, gen)      # entered in one context (not the test's own:
    contextvars.copy_context().run(gen.close)      # it would stay current for the tests after)
    assert provider.force_flush(10_000)
    assert "in-generator" in load_table(collector.store).names


def test_a_decorated_coroutine_is_traced_over_its_awaits(provider, collector):
    import asyncio

    tracer = provider.get_tracer("test")

    @tracer.start_as_current_span("handler")
    async def handler(fail):
        await asyncio.sleep(0.01)
        with tracer.start_as_current_span("inside"):
            await asyncio.sleep(0)
        if fail:
            raise Boom("no")

    asyncio.run(handler(False))
    with pytest.raises(Boom):
        asyncio.run(handler(True))
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    handlers = [i for i in range(len(t)) if t.names[t.name[i]] == "handler"]
    inside = [i for i in range(len(t)) if t.names[t.name[i]] == "inside"]
    assert len(handlers) == len(inside) == 2
    for h in handlers:
        assert t.end[h] - t.start[h] >= 10_000_000                       # the span covers the awaits
        assert sum(t.parent_id[i] == t.span_id[h] for i in inside) == 1    # and is current inside
    assert sorted(int(t.status[h]) for h in handlers) == [Status.UNSET, Status.ERROR]


def test_start_span_as_context_manager_records_what_raises(provider, collector):
    tracer = provider.get_tracer("test")
    with pytest.raises(Boom):
        with tracer.start_span("recorded"):
            raise Boom("loud")
    with pytest.raises(Boom):
        with tracer.start_span("status-only", record_exception=False):
            raise Boom("quiet")
    with pytest.raises(Boom):   # start_as_current_span's flags, and a span it does not end
        with tracer.start_as_current_span("current", record_exception=False, end_on_exit=False) as span:
            raise Boom("quiet")
    span.end()
    with pytest.raises(KeyboardInterrupt):   # recorded too, as the SDK's span records it
        with tracer.start_span("interrupted"):
            raise KeyboardInterrupt
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    rows = by_name(t)
    loud, quiet = rows["recorded"], rows["status-only"]
    assert t.status[loud] == t.status[quiet] == t.status[rows["current"]] == Status.ERROR
    assert "events" not in t.extras[rows["current"]]
    event = t.extras[loud]["events"][0]
    assert event[0] == "exception" and event[2]["exception.type"] == f"{__name__}.Boom"
    assert "events" not in t.extras[quiet] and t.extras[quiet]["status_message"] == "Boom: quiet"
    interrupted = rows["interrupted"]
    assert t.status[interrupted] == Status.ERROR
    assert t.extras[interrupted]["events"][0][2]["exception.type"] == "KeyboardInterrupt"


def test_status_list_attributes_links_and_trace_state_as_the_sdk_keeps_them(provider, collector):
    from opentelemetry import propagate

    tracer = provider.get_tracer("test")
    values = [1, 2]
    upstream = propagate.extract({"traceparent": f"00-{0xAB:032x}-{0xCD:016x}-01", "tracestate": "vendor=abc"})
    invalid_with_attributes = trace.Link(trace.INVALID_SPAN_CONTEXT, {"why": "no parent"})
    with tracer.start_as_current_span("child", context=upstream, links=[invalid_with_attributes]) as span:
        span.set_status(trace.StatusCode.ERROR, "first")
        span.set_status(trace.StatusCode.OK)              # OK replaces ERROR, and its message goes
        span.set_attribute("values", values)
        values.append(3)                                  # after set_attribute: not recorded
        span.add_link(trace.INVALID_SPAN_CONTEXT)         # no attributes: dropped
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    row = by_name(t)["child"]
    assert t.status[row] == Status.OK and "status_message" not in t.extras[row]
    assert t.attributes[row] == {"values": [1, 2]}
    assert t.extras[row]["trace_state"] == "vendor=abc"
    assert t.extras[row]["links"] == [["0" * 32, "0" * 16, {"why": "no parent"}]]


def test_ending_twice_logs_and_never_raises(provider, caplog):
    import warnings

    span = provider.get_tracer("test").start_span("twice")
    span.end()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning would raise into the traced code
        span.end()
    assert "ended twice" in caplog.text


def test_an_unsampled_parent_stays_current_and_nothing_is_recorded(provider):
    from opentelemetry import context

    tracer = provider.get_tracer("test")
    parent = trace.NonRecordingSpan(trace.SpanContext(5, 6, is_remote=True, trace_flags=trace.TraceFlags(0)))
    token = context.attach(trace.set_span_in_context(parent))
    with tracer.start_as_current_span("child") as child:
        assert not child.is_recording() and trace.get_current_span() is child
        assert child.get_span_context().trace_id == 5
    assert trace.get_current_span() is parent
    context.detach(token)


def test_opentelemetry_settings_are_followed(collector, monkeypatch):
    from crosstrace.collector.store import Store
    from crosstrace.tracer.config import Config

    env = tracer_env(collector, "otel-settings")
    env.update(OTEL_PYTHON_TRACER_PROVIDER="crosstrace",
               OTEL_RESOURCE_ATTRIBUTES="service.name=shop,deployment.environment=prod,team=ml%20infra")
    run_python("""
        from opentelemetry import trace
        with trace.get_tracer("plain").start_as_current_span("labelled"):
            pass
        assert trace.get_tracer_provider().force_flush()
    """, env=env)
    with Store(collector.store, readonly=True) as store:
        [resource] = store.nodes().values()
    assert resource.service_name == "shop"
    labels = dict(resource.labels)
    assert labels.pop("clock").startswith("monotonic:")   # the tracer names its clock (tracer/clock.py)
    assert labels == {"service.name": "shop", "deployment.environment": "prod", "team": "ml infra"}

    for name, value in (("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_SAMPLER", "always_off")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.warns(RuntimeWarning, match=f"tracing is off, as {name}"):
                assert Config.from_env().disabled is True
            assert Config.from_env(disabled=False).disabled is False   # an argument wins
            m.setenv("CROSSTRACE_DISABLED", "false")                    # and so does crosstrace's own variable
            assert Config.from_env().disabled is False
    with monkeypatch.context() as m:
        m.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        assert Config.from_env().disabled is False
        m.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-env")
        given = Config.from_env(labels={"gpu": 0, "team": "ml"})       # given labels replace the variable's
        assert given.labels == {"gpu": "0", "team": "ml"} and given.service_name == ""
    with monkeypatch.context() as m, pytest.warns(RuntimeWarning, match="traceidratio is not followed"):
        m.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
        Config.from_env()


def test_malformed_settings_are_reported_and_urls_are_taken(monkeypatch):
    """A boolean typo was read as false (CROSSTRACE_DISABLED=ture traced on, silently), and
    an endpoint written as OpenTelemetry writes it (http://host:4317) failed only once the
    exporter connected."""
    from crosstrace.tracer.config import Config

    monkeypatch.setenv("CROSSTRACE_DISABLED", "ture")
    with pytest.warns(RuntimeWarning, match="CROSSTRACE_DISABLED='ture': expected true/false"):
        assert Config.from_env().disabled is False
    monkeypatch.setenv("CROSSTRACE_DISABLED", "Yes")
    assert Config.from_env().disabled is True
    monkeypatch.delenv("CROSSTRACE_DISABLED")
    assert Config.from_env(endpoint="http://collector.local:4327/").endpoint == "collector.local:4327"
    secure = Config.from_env(endpoint="https://collector.local:4327")
    assert (secure.endpoint, secure.uses_tls) == ("collector.local:4327", True)
    assert Config.from_env(endpoint="unix:///run/crosstrace.sock").endpoint == "unix:///run/crosstrace.sock"
    monkeypatch.setenv("CROSSTRACE_ENDPOINT", "collector.local")               # no port
    with pytest.warns(RuntimeWarning, match="ignoring endpoint 'collector.local'.*using 127.0.0.1:4327"):
        assert Config.from_env().endpoint == "127.0.0.1:4327"
    for bad in ("http://collector.local", "grpc://collector.local:4327"):     # no port; not a scheme gRPC takes
        with pytest.warns(RuntimeWarning, match="ignoring endpoint"):
            fallback = Config.from_env(endpoint=bad)
        assert (fallback.endpoint, fallback.uses_tls) == ("127.0.0.1:4327", False)
    hosted = Config.from_env(endpoint="https://collector.example")   # TLS's port, as OpenTelemetry's exporters take it
    assert (hosted.endpoint, hosted.uses_tls) == ("collector.example:443", True)


def test_counts_given_as_other_numbers_are_whole_numbers_or_reported():
    """max_queue=1e6 went on as a float into the export queue's bounds; a count that is no
    whole number (2.5, "3") was taken as it was, and rank="3" failed at its first comparison."""
    from crosstrace.tracer.config import Config

    taken = Config.from_env(max_queue=1e6)
    assert taken.max_queue == 1_000_000 and type(taken.max_queue) is int
    for name, bad in (("batch_size", 2.5), ("rank", "3")):
        with pytest.warns(RuntimeWarning, match=f"ignoring {name}={bad!r}: expected a whole number"):
            assert getattr(Config.from_env(**{name: bad}), name) == getattr(Config(), name)


def test_a_configuration_warning_points_at_the_callers_line():
    """It pointed into crosstrace (provider.py, where the options are read), not at the
    init() or TracerProvider() that gave them."""
    with pytest.warns(RuntimeWarning, match="batch_size=0 is below its minimum") as warned:
        crosstrace.init(batch_size=0, set_global=False, disabled=True)
    with pytest.warns(RuntimeWarning, match="ignoring endpoint 'nohost'") as warned_too:
        crosstrace.TracerProvider(endpoint="nohost", disabled=True)
    assert [w.filename for w in (*warned, *warned_too)] == [__file__, __file__]
    out = run_python("""
        from opentelemetry import trace
        trace.get_tracer("t")   # line 3: OpenTelemetry makes crosstrace's provider here
    """, env={"OTEL_PYTHON_TRACER_PROVIDER": "crosstrace", "CROSSTRACE_BATCH_SIZE": "0",
              "CROSSTRACE_ENDPOINT": "127.0.0.1:9", "CROSSTRACE_EXIT_FLUSH_TIMEOUT_S": "0"})
    assert "<string>:3: RuntimeWarning: crosstrace: batch_size=0 is below its minimum" in out.stderr, out.stderr


def test_init_called_again_returns_the_tracer_it_started_and_says_so():
    """A second init() started a second tracer beside the first, which OpenTelemetry kept as
    the global one, and only OpenTelemetry's own log line said anything."""
    out = run_python("""
        import warnings, crosstrace
        from opentelemetry import trace
        first = crosstrace.init(endpoint="127.0.0.1:9", exit_flush_timeout_s=0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            again = crosstrace.init(job_id="b")
        print(again is first is trace.get_tracer_provider(), *[str(w.message) for w in said], sep="|")
    """)
    assert out.stdout.strip() == ("True|crosstrace: init() was called already; its tracer goes on, and these "
                                  "options are not taken: job_id='b'"), out.stdout
    assert "Overriding of current TracerProvider" not in out.stderr
    # With OTEL_PYTHON_TRACER_PROVIDER=crosstrace the first init() is the first (OpenTelemetry
    # made a provider of the environment's as init() looked for one: its options were not taken).
    out = run_python("""
        import warnings, crosstrace
        warnings.simplefilter("error")
        print(crosstrace.init(endpoint="127.0.0.1:9", job_id="a", exit_flush_timeout_s=0).config.job_id)
    """, env={"OTEL_PYTHON_TRACER_PROVIDER": "crosstrace"})
    assert out.stdout.strip() == "a", out.stdout + out.stderr


def test_events_and_links_are_bounded_as_the_sdk_bounds_them(provider, collector):
    tracer = provider.get_tracer("test")
    other = trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=trace.TraceFlags(1))
    with tracer.start_as_current_span("epoch", links=[trace.Link(other)] * 100) as span:
        for i in range(200):
            span.add_event(f"step {i}")
            span.add_link(trace.SpanContext(0xABC, i + 1, is_remote=True, trace_flags=trace.TraceFlags(1)))
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    extras = t.extras[by_name(t)["epoch"]]
    assert [e[0] for e in extras["events"]] == [f"step {i}" for i in range(72, 200)]   # the newest 128
    assert [int(link[1], 16) for link in extras["links"]] == list(range(73, 201))    # so are links


def test_values_are_recorded_as_they_were_at_the_call(provider, collector):
    """What the caller changes afterwards (a list it reuses, a nested dict, a link's
    attributes) is not what was recorded, as with OpenTelemetry's SDK."""
    tracer = provider.get_tracer("test")
    other = trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=trace.TraceFlags(1))
    losses, config, at_start, later = [0.5], {"layers": [1, 2], "opt": {"lr": [0.1]}}, {"why": "retry"}, {"n": [1]}
    span = tracer.start_span("step", links=[trace.Link(other, at_start)])
    span.add_event("losses", {"losses": losses})
    span.set_attribute("config", config)
    span.set_attributes({"nested": [[1], (2, [3])]})
    span.add_link(other, later)
    # Objects JSON has no type for travel as text: the text they had at the call, not what
    # the program made of them before the export (a running loss in a numpy array, a buffer).
    import collections

    import numpy as np
    running, buffer = np.array([1.0, 2.0]), bytearray(b"\x01")
    span.set_attribute("running", running)
    span.set_attribute("ordered", collections.OrderedDict(lr=[0.1]))   # still JSON, as the exporter writes it
    span.add_event("read", {"buffer": buffer})
    running *= 100
    buffer[0] = 2
    losses.append(0.4)
    config["layers"].append(3), config["opt"]["lr"].append(0.2)
    config["new"] = 1
    at_start["why"] = later["n"][0] = "changed"
    span.end()
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    row = by_name(t)["step"]
    assert t.attributes[row] == {"config": {"layers": [1, 2], "opt": {"lr": [0.1]}}, "nested": [[1], [2, [3]]],
                                 "running": "[1. 2.]", "ordered": {"lr": [0.1]}}
    assert t.extras[row]["events"][0][2] == {"losses": [0.5]}
    assert t.extras[row]["events"][1][2] == {"buffer": "01"}
    assert [link[2] for link in t.extras[row]["links"]] == [{"why": "retry"}, {"n": [1]}]


def test_two_threads_annotating_one_span_lose_nothing(provider):
    """A span's status, events and links live in one object made on first use: two threads
    each made one at once, and one's status or event was lost (863-1,100 of 30,000 spans here)."""
    import threading

    tracer = provider.get_tracer("test")
    spans = [tracer.start_span("shared") for _ in range(30_000)]
    start = threading.Barrier(2)

    def annotate(one):
        start.wait()
        for span in spans:
            one(span)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # threads take turns often, as on a busy machine
    try:
        threads = [threading.Thread(target=annotate, args=(one,)) for one in (
            lambda span: span.set_status(trace.StatusCode.ERROR, "failed"), lambda span: span.add_event("retry"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(switch)
    assert sum(span.status != Status.ERROR or len(span.extras.events) != 1 for span in spans) == 0


def test_off_type_kinds_and_statuses_are_taken_or_ignored_never_raised(provider, collector):
    tracer = provider.get_tracer("test")
    tracer.start_span("no kind", kind=None).end()
    with tracer.start_as_current_span("odd kind", kind="client"):
        pass
    for name, status in (("two", 2), ("status two", trace.Status(2)), ("none", None), ("list", [])):
        span = tracer.start_span(name)
        span.set_status(status)
        span.end()
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    rows = by_name(t)
    assert t.kind[rows["no kind"]] == t.kind[rows["odd kind"]] == Kind.INTERNAL
    assert [t.status[rows[name]] for name in ("two", "status two", "none", "list")] == [Status.ERROR] * 2 + [
        Status.UNSET] * 2


def test_inputs_the_sdk_takes_are_taken_never_raised_nor_dropped(provider, collector):
    """Each of these raised into the caller (a None among links, a context manager left
    twice or never entered), or had its span dropped at export (a name not given as text, a
    tuple as an attribute's key), or its event left out of every export (a float timestamp,
    as time.time() * 1e9 gives)."""
    import time
    import weakref

    tracer = provider.get_tracer("test")
    good = trace.Link(trace.SpanContext(0xABC, 0xDEF, True, trace.TraceFlags(1)))
    tracer.start_span("links", links=[None, good]).end()
    with tracer.start_as_current_span("current links", links=[None]):
        pass
    twice = tracer.start_as_current_span("left twice")
    twice.__enter__()
    twice.__exit__(None, None, None)
    twice.__exit__(None, None, None)
    tracer.start_as_current_span("never entered").__exit__(None, None, None)
    tracer.start_as_current_span("never entered either", start_time=1).__exit__(None, None, None)
    tracer.start_span(123).end()
    tracer.start_span("tuple key", attributes={("a", 1): "v"}).end()   # its span was dropped at encode
    span = tracer.start_span("float time")
    assert weakref.ref(span)() is span
    span.add_event("checkpoint", timestamp=time.time() * 1e9)
    span.end()
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert provider.force_flush(10_000) and provider.dropped_spans == 0
    t = load_table(collector.store)
    rows = by_name(t)
    assert sorted(rows) == ["123", "current links", "float time", "left twice", "links", "tuple key"]
    assert t.attributes[rows["tuple key"]] == {"('a', 1)": "v"}
    assert len(t.extras[rows["links"]]["links"]) == 1
    (name, when, _), = t.extras[rows["float time"]]["events"]
    assert name == "checkpoint" and type(when) is int   # exports leave out an event whose time is not


def test_explicit_times_keep_their_differences_exactly(provider, collector):
    """Times given by the caller (Unix ns, as OpenTelemetry takes them) land on the node's
    clock with their differences kept to the nanosecond: a span's duration, an event's place."""
    import time

    tracer = provider.get_tracer("test")
    t0 = time.time_ns() - 5_000_000
    span = tracer.start_span("given", start_time=t0)
    span.add_event("mid", timestamp=t0 + 1_234_567)
    span.end(end_time=t0 + 2_345_678)
    with tracer.start_as_current_span("given-current", start_time=t0 + 7) as current:
        current.end(end_time=t0 + 1_007)
    assert provider.force_flush(10_000)
    t = load_table(collector.store)
    rows = by_name(t)
    given, current = rows["given"], rows["given-current"]
    assert t.end[given] - t.start[given] == 2_345_678
    assert t.extras[given]["events"][0][1] - t.start[given] == 1_234_567
    assert t.end[current] - t.start[current] == 1_000 and t.start[current] - t.start[given] == 7
    assert abs(t.start[given] - (time.monotonic_ns() - 5_000_000)) < 1_000_000_000   # on the monotonic clock


def test_both_ways_to_start_a_span_queue_the_same_record():
    """start_as_current_span's common case builds and ends its span inline (a Python call
    less each way); its queued record must be start_span's + end()'s, field for field, and
    a full queue must count both alike."""
    from opentelemetry.trace import Link, SpanKind

    from crosstrace.tracer.clock import Clock
    from crosstrace.tracer.exporter import ExportQueue
    from crosstrace.tracer.provider import Tracer

    queue = ExportQueue(Clock(), max_queue=4, batch_size=100)
    tracer = Tracer(queue)
    link = Link(trace.SpanContext(5, 6, False))
    for kind, attributes, links in ((SpanKind.INTERNAL, None, None),
                                    (SpanKind.SERVER, {"x": [1, 2], "crosstrace.kind": "compute"}, [link])):
        with tracer.start_as_current_span("op", kind=kind, attributes=attributes, links=links):
            pass
        tracer.start_span("op", kind=kind, attributes=attributes, links=links).end()
        columns = queue.take()
        trace_ids, span_ids, parents, names, kinds, starts, ends, threads, extras, attrs = columns
        assert len(names) == 2 and names[0] == names[1] and kinds[0] == kinds[1] and threads[0] == threads[1]
        assert parents == [0, 0] and attrs[0] == attrs[1] and all(s <= e for s, e in zip(starts, ends))
        assert (extras[0] is None) == (extras[1] is None)
        assert extras[0] is None or list(extras[0].links) == list(extras[1].links)
    for _ in range(3):
        with tracer.start_as_current_span("op"):
            pass
        tracer.start_span("op").end()
    assert len(queue.take()[0]) == 4 and queue.dropped == 2


def test_a_list_inside_itself_is_never_raised_into_the_caller(provider, collector):
    tracer = provider.get_tracer("test")
    loop = [1]
    loop.append(loop)
    with tracer.start_as_current_span("looped") as span:
        span.set_attribute("loop", loop)
        span.set_attribute("nested", {"loop": {"again": loop}})
        span.add_event("looped", {"loop": loop})
    with tracer.start_as_current_span("fine"):
        pass
    provider.force_flush(10_000)   # False: the looped span cannot be encoded, and it alone is dropped
    assert list(by_name(load_table(collector.store))) == ["fine"]
