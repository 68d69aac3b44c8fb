"""gRPC interceptors against real servers and clients on loopback: trace context across
sync and asyncio, unary and streaming calls and two hops; RPC spans with rpc.* attributes
and status codes; a clock sample from every call, whose bounds hold the injected truth.

Each tier has its own TracerProvider (its own node id and simulated clock) exporting to a
real collector process; the checks read what the collector stored."""
import asyncio
import collections
import concurrent.futures
import contextlib
import gc
import threading
import time

import grpc
import pytest

import crosstrace
from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.launch import wait_until
from crosstrace.proto import pb
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind
from crosstrace.tracer.instrument import grpc as ct_grpc

from .conftest import run_python, tracer_env

OFFSETS = {"client": 300_000_000, "middle": -200_000_000, "back": 50_000_000}


def providers(collector) -> dict:
    """One provider per tier, each asking for a clock sample on every call (so that every
    kind of call is checked for one)."""
    return {node: crosstrace.TracerProvider(endpoint=collector.address, node_id=node, sim_clock_offset_ns=offset,
                                            udp_clock=False, rpc_clock_interval_ms=0)
            for node, offset in OFFSETS.items()}


def flush_all(tiers: dict) -> None:
    for provider in tiers.values():
        assert provider.force_flush(20_000)
        provider.shutdown()


def load(collector):
    store = Store(collector.store, readonly=True)
    try:
        table = spantable.load(store)
        nodes = {k: r.node_id for k, r in store.nodes().items()}
        samples = [(nodes[row[0]], *row[1:]) for row in store.clock_samples() if row[1] == pb.RPC_PIGGYBACK]
    finally:
        store.close()
    spans = []
    for i in range(len(table)):
        spans.append({"node": table.nodes[table.node[i]], "name": table.names[table.name[i]],
                      "kind": int(table.kind[i]), "status": int(table.status[i]),
                      "trace": table.trace_ids[table.trace[i]], "id": int(table.span_id[i]),
                      "parent": int(table.parent_id[i]), "start": int(table.start[i]), "end": int(table.end[i]),
                      "attributes": table.attributes[i] or {}, "extras": table.extras.get(i, {})})
    return spans, samples


def check_tree(spans, root_name: str, methods: list[str]) -> None:
    """One trace: the root on the client, a client span per call under it, each answered by a
    server span whose parent is that client span, on the server's node."""
    root = next(s for s in spans if s["name"] == root_name)
    by_id = {s["id"]: s for s in spans}
    clients = [s for s in spans if s["kind"] == Kind.RPC_CLIENT and s["parent"] == root["id"]]
    assert sorted(s["name"] for s in clients) == sorted(methods)
    for client in clients:
        assert client["node"] == "client" and client["trace"] == root["trace"]
        service, _, method = client["name"].partition("/")
        assert client["attributes"][sc.RPC_SYSTEM] == "grpc"
        assert (client["attributes"][sc.RPC_SERVICE], client["attributes"][sc.RPC_METHOD]) == (service, method)
        servers = [s for s in spans if s["kind"] == Kind.RPC_SERVER and s["parent"] == client["id"]]
        assert len(servers) == 1, client["name"]
        assert servers[0]["node"] == "middle" and servers[0]["trace"] == root["trace"]
        assert servers[0]["name"] == client["name"]
    # Second hop: middle's handler calls back, under its server span.
    hop = next(s for s in spans if s["node"] == "middle" and s["kind"] == Kind.RPC_CLIENT)
    assert by_id[hop["parent"]]["kind"] == Kind.RPC_SERVER
    back = [s for s in spans if s["node"] == "back" and s["parent"] == hop["id"]]
    assert [s["kind"] for s in back] == [Kind.RPC_SERVER]
    assert back[0]["trace"] == root["trace"]
    work = [s for s in spans if s["node"] == "back" and s["parent"] == back[0]["id"]]
    assert [s["name"] for s in work] == ["work"]


def check_samples(samples, pairs: set) -> None:
    """Every call gave a sample naming the server's node, and its bounds hold the truth."""
    assert {(node, peer) for node, _, peer, *_ in samples} == pairs
    for node, _, peer, t1, t2, t3, t4, local_ns, *_ in samples:
        truth = OFFSETS[node] - OFFSETS[peer]            # node clock - peer clock
        assert t1 - t2 <= truth <= t4 - t3
        assert local_ns == t1 and t1 <= t4 and t2 <= t3


def check_sample_counts(samples, calls: dict) -> None:
    """As many samples per (node, peer) as calls gave, but RPC_SAMPLES_PER_PEER a batch and
    second at most (the calls of a test go in one, or cross a second or an export round)."""
    from crosstrace.tracer.clock_probe import RPC_SAMPLES_PER_PEER

    counts = collections.Counter((node, peer) for node, _, peer, *_ in samples)
    for pair, n in calls.items():
        assert min(n, RPC_SAMPLES_PER_PEER) <= counts[pair] <= min(n, 3 * RPC_SAMPLES_PER_PEER), (pair, counts)


def check_statuses(spans) -> None:
    failed = [s for s in spans if s["name"].endswith("/Fail")]
    client = next(s for s in failed if s["kind"] == Kind.RPC_CLIENT)
    server = next(s for s in failed if s["kind"] == Kind.RPC_SERVER)
    for s in (client, server):
        assert s["attributes"][sc.RPC_GRPC_STATUS] == grpc.StatusCode.NOT_FOUND.value[0]
    assert client["status"] == 2      # any code but OK fails a client span
    assert server["status"] == 0      # NOT_FOUND is the caller's problem (OpenTelemetry's convention)
    crashed = [s for s in spans if s["name"].endswith("/Crash")]
    assert {s["status"] for s in crashed} == {2}
    assert {s["attributes"][sc.RPC_GRPC_STATUS] for s in crashed} == {grpc.StatusCode.UNKNOWN.value[0]}
    crash = next(s for s in crashed if s["kind"] == Kind.RPC_SERVER)
    assert [e[0] for e in crash["extras"]["events"]] == ["exception"]
    # An abort with UNKNOWN (an upstream's status passed on) is no crash: its details, no exception.
    passed_on = next(s for s in spans if s["name"].endswith("/PassOn") and s["kind"] == Kind.RPC_SERVER)
    assert passed_on["status"] == 2 and passed_on["extras"]["status_message"] == "UNKNOWN: upstream said no"
    assert "events" not in passed_on["extras"]


# -- sync -------------------------------------------------------------------------------------

def sync_server(provider, handlers: dict) -> tuple[grpc.Server, str]:
    """A server traced by `provider`; a plain one for None."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4),
                         interceptors=[crosstrace.server_interceptor(provider)] if provider else [])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def metadata_echo() -> tuple[list[dict], grpc.RpcMethodHandler]:
    """A unary echo handler, and the list it keeps each call's invocation metadata in."""
    seen = []

    def echo(request, context):
        seen.append(dict(context.invocation_metadata()))
        return request

    return seen, grpc.unary_unary_rpc_method_handler(echo)


@contextlib.contextmanager
def traced_echo(provider):
    """(the metadata each call brought, the server's address, a channel to it), all traced
    by `provider`: a metadata_echo server for the length of the `with`."""
    seen, echo = metadata_echo()
    server, address = sync_server(provider, {"Echo": echo})
    try:
        yield seen, address, crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
    finally:
        server.stop(0)


def test_sync_unary_and_streaming_across_two_hops(collector):
    tiers = providers(collector)
    work = tiers["back"].get_tracer("test")

    def back_work(request, context):
        with work.start_as_current_span("work"):
            return request

    back, back_address = sync_server(tiers["back"], {"Work": grpc.unary_unary_rpc_method_handler(back_work)})
    to_back = crosstrace.instrument_channel(grpc.insecure_channel(back_address), tiers["middle"])
    call_back = to_back.unary_unary("/test.Svc/Work")

    def fail(request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    def crash(request, context):
        raise RuntimeError("boom")

    def pass_on(request, context):
        context.abort(grpc.StatusCode.UNKNOWN, "upstream said no")

    middle, middle_address = sync_server(tiers["middle"], {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: call_back(request, timeout=10)),
        "ServerStream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request] * 3)),
        "ClientStream": grpc.stream_unary_rpc_method_handler(lambda requests, context: b"".join(requests)),
        "BidiStream": grpc.stream_stream_rpc_method_handler(lambda requests, context: (r for r in requests)),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Crash": grpc.unary_unary_rpc_method_handler(crash),
        "PassOn": grpc.unary_unary_rpc_method_handler(pass_on),
    })
    channel = crosstrace.instrument_channel(grpc.insecure_channel(middle_address), tiers["client"])
    tracer = tiers["client"].get_tracer("test")
    with tracer.start_as_current_span("root"):
        assert channel.unary_unary("/test.Svc/Unary")(b"a", timeout=10) == b"a"
        assert list(channel.unary_stream("/test.Svc/ServerStream")(b"b", timeout=10)) == [b"b"] * 3
        assert channel.stream_unary("/test.Svc/ClientStream")(iter([b"c", b"d"]), timeout=10) == b"cd"
        assert list(channel.stream_stream("/test.Svc/BidiStream")(iter([b"e", b"f"]), timeout=10)) == [b"e", b"f"]
        assert channel.unary_unary("/test.Svc/Unary").future(b"g", timeout=10).result() == b"g"
        for method, code in (("Fail", grpc.StatusCode.NOT_FOUND), ("Crash", grpc.StatusCode.UNKNOWN),
                             ("PassOn", grpc.StatusCode.UNKNOWN)):
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(f"/test.Svc/{method}")(b"x", timeout=10)
            assert err.value.code() == code
    channel.close()
    to_back.close()
    middle.stop(1).wait(5)
    back.stop(1).wait(5)
    flush_all(tiers)

    spans, samples = load(collector)
    check_tree(spans, "root", ["test.Svc/Unary", "test.Svc/ServerStream", "test.Svc/ClientStream",
                               "test.Svc/BidiStream", "test.Svc/Unary", "test.Svc/Fail", "test.Svc/Crash",
                               "test.Svc/PassOn"])
    check_statuses(spans)
    check_samples(samples, {("client", "middle"), ("middle", "back")})
    check_sample_counts(samples, {("client", "middle"): 8, ("middle", "back"): 2})   # every call gave one


# -- asyncio ----------------------------------------------------------------------------------

async def aio_chain(tiers) -> None:
    work = tiers["back"].get_tracer("test")

    async def back_work(request, context):
        with work.start_as_current_span("work"):
            await asyncio.sleep(0.001)
        return request

    back = grpc.aio.server(interceptors=[crosstrace.aio_server_interceptor(tiers["back"])])
    back.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Svc", {"Work": grpc.unary_unary_rpc_method_handler(back_work)})])
    back_port = back.add_insecure_port("127.0.0.1:0")
    await back.start()
    to_back = grpc.aio.insecure_channel(f"127.0.0.1:{back_port}",
                                        interceptors=crosstrace.aio_client_interceptors(tiers["middle"]))

    async def unary(request, context):
        return await to_back.unary_unary("/test.Svc/Work")(request, timeout=10)

    async def server_stream(request, context):
        for _ in range(3):
            yield request

    async def client_stream(requests, context):
        return b"".join([r async for r in requests])

    async def bidi(requests, context):          # the write() style of streaming handler
        async for r in requests:
            await context.write(r)

    async def fail(request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    async def crash(request, context):
        raise RuntimeError("boom")

    async def pass_on(request, context):
        await context.abort(grpc.StatusCode.UNKNOWN, "upstream said no")

    def blocking(request, context):   # a plain function: grpc.aio runs it in its thread pool
        time.sleep(0.01)
        return request

    def blocking_not_found(request, context):
        context.set_code(grpc.StatusCode.NOT_FOUND)
        return b""

    def blocking_abort(request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")

    middle = grpc.aio.server(interceptors=[crosstrace.aio_server_interceptor(tiers["middle"])])
    middle.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "BidiStream": grpc.stream_stream_rpc_method_handler(bidi),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Crash": grpc.unary_unary_rpc_method_handler(crash),
        "PassOn": grpc.unary_unary_rpc_method_handler(pass_on),
        "Blocking": grpc.unary_unary_rpc_method_handler(blocking),
        "BlockingNotFound": grpc.unary_unary_rpc_method_handler(blocking_not_found),
        "BlockingAbort": grpc.unary_unary_rpc_method_handler(blocking_abort),
    })])
    middle_port = middle.add_insecure_port("127.0.0.1:0")
    await middle.start()

    async def requests():
        yield b"c"
        yield b"d"

    tracer = tiers["client"].get_tracer("test")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{middle_port}",
                                         interceptors=crosstrace.aio_client_interceptors(tiers["client"])) as channel:
        with tracer.start_as_current_span("aio-root"):
            assert await channel.unary_unary("/test.Svc/Unary")(b"a", timeout=10) == b"a"
            assert [r async for r in channel.unary_stream("/test.Svc/ServerStream")(b"b", timeout=10)] == [b"b"] * 3
            assert await channel.stream_unary("/test.Svc/ClientStream")(requests(), timeout=10) == b"cd"
            assert [r async for r in channel.stream_stream("/test.Svc/BidiStream")(requests(), timeout=10)] == [b"c", b"d"]
            blocking = channel.unary_unary("/test.Svc/Blocking")(b"h", timeout=10)
            assert await blocking == b"h"
            assert any(k == ct_grpc.CLOCK_KEY for k, _ in await blocking.trailing_metadata())   # a clock sample
            for method, code in (("BlockingNotFound", grpc.StatusCode.NOT_FOUND),
                                 ("BlockingAbort", grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(f"/test.Svc/{method}")(b"x", timeout=10)
                assert err.value.code() == code
            for method, code in (("Fail", grpc.StatusCode.NOT_FOUND), ("Crash", grpc.StatusCode.UNKNOWN),
                                 ("PassOn", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(f"/test.Svc/{method}")(b"x", timeout=10)
                assert err.value.code() == code
        await asyncio.sleep(0.05)   # done-callbacks finish the last client spans
    await to_back.close()
    await middle.stop(1)
    await back.stop(1)


def test_asyncio_unary_and_streaming_across_two_hops(collector):
    tiers = providers(collector)
    asyncio.run(asyncio.wait_for(aio_chain(tiers), 60))
    flush_all(tiers)
    spans, samples = load(collector)
    check_tree(spans, "aio-root", ["test.Svc/Unary", "test.Svc/ServerStream", "test.Svc/ClientStream",
                                   "test.Svc/BidiStream", "test.Svc/Blocking", "test.Svc/BlockingNotFound",
                                   "test.Svc/BlockingAbort", "test.Svc/Fail", "test.Svc/Crash", "test.Svc/PassOn"])
    check_statuses(spans)
    plain = {s["name"]: s for s in spans if s["kind"] == Kind.RPC_SERVER and "/Blocking" in s["name"]}
    assert {name: s["attributes"][sc.RPC_GRPC_STATUS] for name, s in plain.items()} == {
        "test.Svc/Blocking": 0, "test.Svc/BlockingNotFound": grpc.StatusCode.NOT_FOUND.value[0],
        "test.Svc/BlockingAbort": grpc.StatusCode.PERMISSION_DENIED.value[0]}
    check_samples(samples, {("client", "middle"), ("middle", "back")})
    # grpc.aio sends an abort's status at once, before the interceptor could add its trailer:
    # the aborted calls are the ones without a sample.
    check_sample_counts(samples, {("client", "middle"): 7, ("middle", "back"): 1})


# -- binding, strangers, wire cost --------------------------------------------------------------

LATE_INIT = """
import concurrent.futures, grpc, crosstrace
from opentelemetry import trace
server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), interceptors=[crosstrace.server_interceptor()])
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "test.Svc", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = crosstrace.instrument_channel(grpc.insecure_channel(f"127.0.0.1:{port}"))
provider = crosstrace.init()            # after the channel and the server were instrumented
with trace.get_tracer("t").start_as_current_span("root"):
    assert channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10) == b"x"
assert provider.force_flush(20000)
server.stop(1)
"""


def test_interceptors_built_before_init_bind_on_first_call(collector):
    run_python(LATE_INIT, tracer_env(collector, "late", udp_clock=0), timeout=60)
    spans, samples = load(collector)
    assert sorted((s["name"], s["kind"]) for s in spans) == [
        ("root", Kind.INTERNAL), ("test.Svc/Echo", Kind.RPC_CLIENT), ("test.Svc/Echo", Kind.RPC_SERVER)]
    assert [(node, peer) for node, _, peer, *_ in samples] == [("late", "late")]


def test_plain_peers_get_no_extra_metadata(collector):
    """A crosstrace client and a plain server (or the reverse) work as before: the plain
    server ignores t1, a crosstrace server answers no clock trailer to a call that sent
    none, and no sample is made."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="solo", udp_clock=False)
    seen, echo = metadata_echo()
    plain, plain_address = sync_server(None, {"Echo": echo})
    traced, traced_address = sync_server(provider, {"Echo": echo})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(plain_address), provider)
        _, call = channel.unary_unary("/test.Svc/Echo").with_call(b"x", timeout=10)
        assert "traceparent" in seen[-1] and ct_grpc.T1_KEY in seen[-1]
        assert not any(k == ct_grpc.CLOCK_KEY for k, _ in call.trailing_metadata())
        with grpc.insecure_channel(traced_address) as bare:
            _, call = bare.unary_unary("/test.Svc/Echo").with_call(b"x", timeout=10)
        assert not any(k == ct_grpc.CLOCK_KEY for k, _ in call.trailing_metadata())
    finally:
        plain.stop(0)
        traced.stop(0)
    assert provider.force_flush(20_000)
    provider.shutdown()
    spans, samples = load(collector)
    assert sorted(s["kind"] for s in spans) == [Kind.RPC_CLIENT, Kind.RPC_SERVER]
    assert samples == []


class _TagInterceptor(grpc.UnaryUnaryClientInterceptor):
    """A user's own client interceptor: adds a header."""

    def intercept_unary_unary(self, continuation, details, request):
        details = details._replace(metadata=[*(details.metadata or ()), ("user-tag", "7")])
        return continuation(details, request)


def test_an_instrumented_channel_composes_with_the_users_interceptors(collector):
    """instrument_channel over grpc.intercept_channel (and the reverse): both see the call,
    the trace context and the clock sample come through either way."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="solo", udp_clock=False)
    seen, echo = metadata_echo()
    server, address = sync_server(provider, {"Echo": echo})
    try:
        outer = crosstrace.instrument_channel(grpc.intercept_channel(grpc.insecure_channel(address),
                                                                     _TagInterceptor()), provider)
        inner = grpc.intercept_channel(crosstrace.instrument_channel(grpc.insecure_channel(address), provider),
                                       _TagInterceptor())
        for channel in (outer, inner):
            assert channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10) == b"x"
    finally:
        server.stop(0)
    assert provider.force_flush(20_000)
    provider.shutdown()
    assert all(m["user-tag"] == "7" and "traceparent" in m for m in seen) and len(seen) == 2
    spans, samples = load(collector)
    assert sorted(s["kind"] for s in spans) == [Kind.RPC_CLIENT, Kind.RPC_CLIENT, Kind.RPC_SERVER, Kind.RPC_SERVER]
    assert [peer for _, _, peer, *_ in samples] == ["solo", "solo"]


def test_a_garbled_clock_trailer_costs_the_sample_only(collector):
    """A server answering nonsense in the clock trailer (every shape of it) neither fails the
    call nor loses its span: the bad samples are dropped on the exporter thread, the good
    one is kept."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="solo", udp_clock=False,
                                         rpc_clock_interval_ms=0)
    trailers = iter(["", "12 x", "1 2", "99999999999999999999999 2 peer", "7 8 peer"])

    def echo(request, context):
        context.set_trailing_metadata(((ct_grpc.CLOCK_KEY, next(trailers)),))
        return request

    plain, address = sync_server(None, {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        assert [channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10) for _ in range(5)] == [b"x"] * 5
    finally:
        plain.stop(0)
    assert provider.force_flush(20_000)
    provider.shutdown()
    spans, samples = load(collector)
    assert [(s["kind"], s["status"]) for s in spans] == [(Kind.RPC_CLIENT, 0)] * 5
    assert [(peer, t2, t3) for _, _, peer, _, t2, t3, *_ in samples] == [("peer", 7, 8)]


def test_wire_cost_is_a_few_hundred_bytes(collector):
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="edge-node-with-a-long-name/12345",
                                         udp_clock=False)
    with traced_echo(provider) as (seen, _, channel):
        _, call = channel.unary_unary("/test.Svc/Echo").with_call(b"x", timeout=10)
    trailer = [(k, v) for k, v in call.trailing_metadata() if k == ct_grpc.CLOCK_KEY]
    provider.shutdown()
    assert len(trailer) == 1 and trailer[0][1].endswith("edge-node-with-a-long-name%2F12345")
    sent = [(k, v) for k, v in seen[0].items() if k in ("traceparent", "tracestate", ct_grpc.T1_KEY)]
    added = sum(len(k) + len(v) for k, v in sent + trailer)
    assert 100 < added < 300, added


def test_trace_state_and_baggage_cross_the_call(collector):
    """Beyond a bare traceparent (which the interceptors write and read directly), the
    OpenTelemetry propagator carries tracestate and baggage as configured."""
    from opentelemetry import baggage, context, trace

    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="solo", udp_clock=False)
    seen = {}

    def echo(request, context_):
        current = trace.get_current_span().get_span_context()
        seen[request] = (current.trace_id, current.trace_state.to_header(), baggage.get_baggage("tenant"))
        return request

    server, address = sync_server(provider, {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
    call = channel.unary_unary("/test.Svc/Echo")
    upstream = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(1),
                                 trace_state=trace.TraceState([("vendor", "v1")]))
    token = context.attach(baggage.set_baggage("tenant", "acme", trace.set_span_in_context(
        trace.NonRecordingSpan(upstream))))
    try:
        call(b"both", timeout=10)
    finally:
        context.detach(token)
    with provider.get_tracer("t").start_as_current_span("plain") as plain:
        call(b"plain", timeout=10)
    server.stop(0)
    provider.shutdown()
    assert seen[b"both"] == (0x1234, "vendor=v1", "acme")
    assert seen[b"plain"] == (plain.trace_id, "", None)


def test_with_another_opentelemetry_provider_the_calls_are_still_traced():
    """Bound to the OpenTelemetry SDK's provider, the channel and the server interceptor make
    SDK spans through the OpenTelemetry API (no clock samples): the server span is the client
    span's child, across the call, the status code is set, and a failing call is an error."""
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    exported = InMemorySpanExporter()
    sdk = SdkProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exported))

    def fail(request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    seen, echo = metadata_echo()
    server, address = sync_server(sdk, {"Echo": echo, "Fail": grpc.unary_unary_rpc_method_handler(fail)})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), sdk)
        assert channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10) == b"x"
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/test.Svc/Fail")(b"x", timeout=10)
    finally:
        server.stop(0)
    sdk.shutdown()
    assert ct_grpc.T1_KEY not in seen[0]        # no crosstrace clock: no sample asked for
    spans = {(s.name, s.kind): s for s in exported.get_finished_spans()}
    client, server_span = spans["test.Svc/Echo", SpanKind.CLIENT], spans["test.Svc/Echo", SpanKind.SERVER]
    assert server_span.parent.span_id == client.context.span_id
    assert server_span.context.trace_id == client.context.trace_id
    assert client.attributes[sc.RPC_GRPC_STATUS] == 0 and client.attributes[sc.RPC_SERVICE] == "test.Svc"
    assert spans["test.Svc/Fail", SpanKind.CLIENT].status.status_code == StatusCode.ERROR
    assert spans["test.Svc/Fail", SpanKind.SERVER].attributes[sc.RPC_GRPC_STATUS] == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("state", ["disabled", "shut down"])
def test_a_disabled_or_shut_down_provider_leaves_the_calls_alone(collector, state):
    """CROSSTRACE_DISABLED (or a provider already shut down) gives no-op tracers: the
    service's calls go on, unary and streaming, traced by nothing."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="off", udp_clock=False,
                                         disabled=state == "disabled")
    if state == "shut down":
        provider.shutdown()
    seen, echo = metadata_echo()
    server, address = sync_server(provider, {
        "Echo": echo,
        "Stream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request] * 2))})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        response, call = channel.unary_unary("/test.Svc/Echo").with_call(b"x", timeout=10)
        assert response == b"x"
        assert list(channel.unary_stream("/test.Svc/Stream")(b"y", timeout=10)) == [b"y", b"y"]
    finally:
        server.stop(0)
    provider.shutdown()
    assert load(collector) == ([], [])
    if state == "disabled":   # nor does it ask for clock samples, or answer them
        assert not any(ct_grpc.T1_KEY in m for m in seen)
        assert not any(k == ct_grpc.CLOCK_KEY for k, _ in call.trailing_metadata())


def test_a_channel_asks_for_one_clock_sample_per_interval(collector):
    """Within rpc_clock_interval_ms a channel asks on its first call only; the others carry
    the traceparent alone and get no trailer. Each channel keeps its own interval."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="solo", udp_clock=False,
                                         rpc_clock_interval_ms=60_000)
    with traced_echo(provider) as (seen, address, channel):
        trailers = [call.trailing_metadata() for _, call in
                    (channel.unary_unary("/test.Svc/Echo").with_call(b"x", timeout=10) for _ in range(5))]
        assert [channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10) for _ in range(3)] == [b"x"] * 3
        other = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        assert other.unary_unary("/test.Svc/Echo")(b"x", timeout=10) == b"x"
    assert provider.force_flush(20_000)
    provider.shutdown()
    asked = [ct_grpc.T1_KEY in m for m in seen]
    assert asked == [True] + [False] * 7 + [True] and all("traceparent" in m for m in seen)
    answered = [any(k == ct_grpc.CLOCK_KEY for k, _ in t) for t in trailers]
    assert answered == [True] + [False] * 4
    spans, samples = load(collector)
    assert len(spans) == 2 * 9 and len(samples) == 2


def test_a_batch_carries_the_fastest_rpc_samples_of_each_peer(collector):
    """A busy channel samples one call every 10 ms: 8.6M rows a day in the store, which a
    day's report had to read, while the fit keeps the fastest exchanges of a window. A batch
    now carries the RPC_SAMPLES_PER_PEER of least delay, of those its calls gave in each
    second (the calls here may cross a second)."""
    from crosstrace.tracer.clock_probe import RPC_SAMPLES_PER_PEER

    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="busy", udp_clock=False,
                                         rpc_clock_interval_ms=0, export_interval_ms=60_000,
                                         clock_probe_interval_s=3600)
    assert provider.force_flush(20_000)   # a round now, the next in 60 s: the calls' samples all go in one batch
    with traced_echo(provider) as (seen, address, channel):
        echo = channel.unary_unary("/test.Svc/Echo")
        trailers = [call.trailing_metadata() for _, call in (echo.with_call(b"x", timeout=10) for _ in range(50))]
    assert all(any(k == ct_grpc.CLOCK_KEY for k, _ in t) for t in trailers)   # every call answered
    raw = [sample for sample in provider._queue.samples if type(sample) is tuple]   # not the probes' samples
    per_second = collections.defaultdict(list)
    for t1, t4, trailer in raw:
        t2, t3 = map(int, trailer.split()[:2])
        per_second[t1 // 10**9].append((t4 - t1) - (t3 - t2))
    assert provider.force_flush(20_000)
    provider.shutdown()
    _, samples = load(collector)
    rpc = [s for s in samples if s[1] == pb.RPC_PIGGYBACK]
    fastest = sorted(d for delays in per_second.values() for d in sorted(delays)[:RPC_SAMPLES_PER_PEER])
    assert len(rpc) == len(fastest) < len(raw)
    assert sorted((t4 - t1) - (t3 - t2) for _, _, _, t1, t2, t3, t4, *_ in rpc) == fastest


def test_a_dropped_stream_is_cancelled_and_its_span_ends(collector):
    """grpc cancels a call whose caller drops it (a loop left with `break`). The span's
    completion callback held the call from grpc's own state: the server went on streaming
    until the deadline, for good without one, and the client span never ended."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="client", udp_clock=False)
    closed = threading.Event()

    def forever(request, context):
        try:
            while context.is_active():
                time.sleep(0.005)
                yield b"x"
        finally:
            closed.set()

    server, address = sync_server(None, {"Forever": grpc.unary_stream_rpc_method_handler(forever)})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        for i, _ in enumerate(channel.unary_stream("/test.Svc/Forever")(b"r")):   # no deadline
            if i == 2:
                break
        gc.collect()
        assert closed.wait(5), "the server still streams to a client that left"
    finally:
        server.stop(0)
    flush_all({"client": provider})
    spans, _ = load(collector)
    (span,) = spans
    assert span["status"] == 2 and span["attributes"][sc.RPC_GRPC_STATUS] == grpc.StatusCode.CANCELLED.value[0]


class _CachedStream(grpc.Call):
    """What a user's interceptor may answer with (from a cache): a grpc.Call and an
    iterator, no Future; already over, so add_callback() declines."""

    def __init__(self, items):
        self._items = iter(items)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def code(self):
        return grpc.StatusCode.OK

    def details(self):
        return ""


class _Cache(grpc.UnaryStreamClientInterceptor):
    def intercept_unary_stream(self, continuation, client_call_details, request):
        return _CachedStream([b"c1", b"c2"])


def test_a_users_interceptor_may_answer_a_stream_itself(collector):
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="client", udp_clock=False)
    channel = crosstrace.instrument_channel(grpc.intercept_channel(grpc.insecure_channel("127.0.0.1:1"), _Cache()),
                                            provider)
    assert list(channel.unary_stream("/test.Svc/Gen")(b"r", timeout=5)) == [b"c1", b"c2"]
    flush_all({"client": provider})
    spans, _ = load(collector)
    assert [(s["name"], s["attributes"][sc.RPC_GRPC_STATUS]) for s in spans] == [("test.Svc/Gen", 0)]


def test_a_server_span_past_its_deadline_says_so(collector):
    """The client got DEADLINE_EXCEEDED; the handler returned later, and its span said OK."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="server", udp_clock=False)

    def slow(request, context):
        time.sleep(0.4)
        return b"late"

    server, address = sync_server(provider, {"Slow": grpc.unary_unary_rpc_method_handler(slow)})
    try:
        with pytest.raises(grpc.RpcError) as raised:
            grpc.insecure_channel(address).unary_unary("/test.Svc/Slow")(b"r", timeout=0.1)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the span ends as the handler returns, after the call is over for gRPC
        assert wait_until(lambda: provider.force_flush(5000) and load(collector)[0], 15)
    finally:
        server.stop(0)
    flush_all({"server": provider})
    spans, _ = load(collector)
    (span,) = spans
    assert span["status"] == 2
    assert span["attributes"][sc.RPC_GRPC_STATUS] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


AIO_OUTLIVES_LOOP = """
import asyncio, gc, sys
import grpc
import crosstrace
provider = crosstrace.init(udp_clock=False)

async def main():
    channel = grpc.aio.insecure_channel(sys.argv[1], interceptors=crosstrace.aio_client_interceptors())
    async for _ in channel.unary_stream("/test.Svc/Forever")(b"r", timeout=30):
        break   # the loop ends with the stream still open: grpc cancels it when it is freed

asyncio.run(main())
gc.collect()
assert provider.force_flush(20000)
provider.shutdown()
"""


def test_an_aio_call_that_outlives_its_loop_still_ends_its_span(collector):
    """Its completion callback ran with no event loop: a traceback, and the span was lost."""
    def forever(request, context):
        while context.is_active():
            time.sleep(0.005)
            yield b"x"

    server, address = sync_server(None, {"Forever": grpc.unary_stream_rpc_method_handler(forever)})
    try:
        result = run_python(AIO_OUTLIVES_LOOP, tracer_env(collector, "client"), timeout=60, args=(address,))
    finally:
        server.stop(0)
    assert "no running event loop" not in result.stderr
    spans, _ = load(collector)
    assert [(s["name"], s["attributes"][sc.RPC_GRPC_STATUS]) for s in spans] == [
        ("test.Svc/Forever", grpc.StatusCode.CANCELLED.value[0])]


def test_after_shutdown_nothing_piles_up(collector):
    """Channels and servers bound before shutdown() keep ending spans and clock samples:
    nothing takes them out of the queue any more, so they are dropped, not kept."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="both", udp_clock=False,
                                         rpc_clock_interval_ms=0)
    with traced_echo(provider) as (seen, _, channel):
        channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10)   # binds both sides
        provider.shutdown()
        for _ in range(50):
            channel.unary_unary("/test.Svc/Echo")(b"x", timeout=10)
    assert len(seen) == 51
    assert not provider._queue.queue and not provider._queue.samples


def test_a_traced_streaming_handler_fails_as_an_untraced_one(collector):
    """A handler that returns a list, or raises before its first response, fails with
    grpc's own code and details, traced or not (traced, the list was iterated, and the
    early error was reported as one while iterating)."""
    def as_list(request, context):
        return [b"a"]

    def raise_early(request, context):
        raise KeyError("early")

    handlers = {"List": grpc.unary_stream_rpc_method_handler(as_list),
                "Early": grpc.unary_stream_rpc_method_handler(raise_early)}
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="server", udp_clock=False)
    outcomes = []
    for traced_by in (None, provider):
        server, address = sync_server(traced_by, handlers)
        try:
            channel = grpc.insecure_channel(address)
            for method in ("List", "Early"):
                with pytest.raises(grpc.RpcError) as raised:
                    list(channel.unary_stream(f"/test.Svc/{method}")(b"r", timeout=10))
                outcomes.append((method, raised.value.code(), raised.value.details()))
        finally:
            server.stop(0)
    assert outcomes[:2] == outcomes[2:]
    flush_all({"server": provider})
    spans, _ = load(collector)
    assert sorted((s["name"], s["status"]) for s in spans) == [("test.Svc/Early", 2), ("test.Svc/List", 2)]


def test_a_future_kept_only_by_its_callback_completes(collector):
    """Untraced, grpc keeps a future alive through the callbacks added to it; traced, the
    handle a caller held was dropped, and its finalizer cancelled a call still wanted."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="client", udp_clock=False)

    def slow(request, context):
        time.sleep(0.3)
        return request

    done = []
    finished = threading.Event()
    server, address = sync_server(None, {"Slow": grpc.unary_unary_rpc_method_handler(slow)})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        channel.unary_unary("/test.Svc/Slow").future(b"x", timeout=10).add_done_callback(
            lambda future: (done.append(future.code()), finished.set()))
        gc.collect()
        assert finished.wait(10)
    finally:
        server.stop(0)
    assert done == [grpc.StatusCode.OK]
    flush_all({"client": provider})


def test_a_future_asked_for_its_result_at_once_completes(collector):
    """`stub.Method.future(request).result()`: the handle was dropped as soon as its result
    method was looked up (a method of the call's own), and its finalizer cancelled the call
    under result(): FutureCancelledError on nearly every call not done by then."""
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="client", udp_clock=False)

    def slow(request, context):
        time.sleep(0.01)
        return request

    server, address = sync_server(None, {"Slow": grpc.unary_unary_rpc_method_handler(slow)})
    try:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), provider)
        method = channel.unary_unary("/test.Svc/Slow")
        assert [method.future(b"x", timeout=10).result() for _ in range(5)] == [b"x"] * 5
        assert method.future(b"y", timeout=10).code() is not grpc.StatusCode.CANCELLED
        channel.close()
    finally:
        server.stop(0)
    flush_all({"client": provider})


def test_an_unsampled_step_passes_its_trace_on_and_nothing_is_recorded(collector):
    """Inside a step that is not sampled, spans and calls record nothing on either side, the
    step's span stays current, and the calls carry its trace id, unsampled, so that no
    server starts a trace of its own. A sampled call through the same channel is recorded."""
    from opentelemetry import propagate, trace

    from crosstrace.tracer.step import step_trace_id

    tiers = providers(collector)
    tracer = tiers["client"].get_tracer("test")
    with traced_echo(tiers["middle"]) as (seen, address, _):
        channel = crosstrace.instrument_channel(grpc.insecure_channel(address), tiers["client"])
        echo = channel.unary_unary("/test.Svc/Echo")
        with crosstrace.step(1, every=2, job_id="unsampled-job") as step_span:
            with tracer.start_as_current_span("inner") as inner:
                assert inner is step_span and trace.get_current_span() is step_span
                assert not inner.is_recording() and tracer.start_span("other") is step_span
                assert echo(b"x", timeout=10) == b"x"
            assert trace.get_current_span() is step_span
        with tracer.start_as_current_span("sampled"):
            assert echo(b"y", timeout=10) == b"y"
        channel.close()
    trace_id = step_trace_id("unsampled-job", 1)
    assert seen[0]["traceparent"] == f"00-{trace_id:032x}-{trace_id & (1 << 64) - 1:016x}-00"
    assert step_span.get_span_context().trace_id == trace_id and not step_span.get_span_context().trace_flags.sampled
    flush_all(tiers)
    spans, _ = load(collector)
    assert sorted((s["node"], s["name"]) for s in spans) == [
        ("client", "sampled"), ("client", "test.Svc/Echo"), ("middle", "test.Svc/Echo")]
    assert f"{trace_id:032x}" not in {s["trace"] for s in spans}
    # Flags beside the sampled one (W3C level 2's random flag) are passed on as they came.
    carrier = {}
    parent = ct_grpc._extract({"traceparent": f"00-{trace_id:032x}-{1234:016x}-02"})
    propagate.inject(carrier, context=parent)
    assert carrier["traceparent"] == f"00-{trace_id:032x}-{1234:016x}-02"
