"""gRPC tracing, sync and asyncio, unary and streaming: RPC_CLIENT / RPC_SERVER spans
with the rpc.* semantic-convention attributes, W3C trace context in metadata through the
OpenTelemetry propagator, and clock samples piggybacked on calls.

    channel = crosstrace.instrument_channel(grpc.insecure_channel(addr))
    server = grpc.server(pool, interceptors=[crosstrace.server_interceptor()])
    channel = grpc.aio.insecure_channel(addr, interceptors=crosstrace.aio_client_interceptors())
    server = grpc.aio.server(interceptors=[crosstrace.aio_server_interceptor()])

Calls are also two-way clock exchanges: on one call per channel in each
`rpc_clock_interval_ms` (10 ms; 0: every call, inf: the first only) the client sends its
send time t1 (`crosstrace-t1`); a crosstrace server answers in trailing metadata with its
receive and send times t2, t3 and its node id (`crosstrace-clock: "t2 t3 node"`); the
client adds its receive time t4 and hands (t1, t4, trailer) to its provider, on the
provider's clock; the exporter thread makes it a ClockSample(RPC_PIGGYBACK, peer=<server
node>). The estimator keeps the lowest-delay exchanges of each window, so more samples
add little, while the exchange is about a fifth of what tracing adds to a call. A server
that is not crosstrace ignores t1, and a crosstrace server answers nothing to a call that
sent none. About 100 bytes per sampled call. The interval is kept per sync channel, and
per interceptor for grpc.aio: give each aio channel its own aio_client_interceptors().
(grpc.aio sends an aborting handler's status at once: such a call gives no sample.)

The sync client is a channel wrapper, not an interceptor: grpc.intercept_channel's path
costs about as much per call as all of the tracing. Channels and interceptors bind to
their provider (given, or OpenTelemetry's global one) on first use, so `crosstrace.init()`
may run after the channel or server was built. With a provider that
is not crosstrace's, spans are still made through the OpenTelemetry API, without clock samples.
"""
import asyncio
import inspect
import logging
import math
import re
from functools import partial
from urllib.parse import quote

import grpc
from opentelemetry.baggage import _BAGGAGE_KEY
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.status import StatusCode

from ...proto import semconv as sc
from ..provider import attach_span, current_context, detach, detach_quietly
from ..span import RemoteParent, Span, UnsampledSpan

log = logging.getLogger("crosstrace.tracer")

T1_KEY = "crosstrace-t1"
CLOCK_KEY = "crosstrace-clock"

_CLIENT = trace_api.SpanKind.CLIENT
_SERVER = trace_api.SpanKind.SERVER
_OK = grpc.StatusCode.OK
# OpenTelemetry's gRPC conventions: these codes mark a server span as an error (a client span
# is an error on any code but OK).
_SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


# -- binding to a provider ------------------------------------------------------------------

class _Binding:
    """The tracer, clock and node id an interceptor uses. `now` is None when the provider
    is not crosstrace's (no clock to piggyback). start_span(name, context, kind,
    attributes) starts an RPC span: with crosstrace's tracer, without the API's wrapper
    call (each Python call costs about 1 us with the cold caches of an RPC's path)."""

    __slots__ = ("tracer", "start_span", "now", "add_sample", "node", "final", "sample_every_ns", "next_sample")

    def __init__(self, provider):
        from ..provider import TracerProvider

        tracer = self.tracer = provider.get_tracer(__name__)
        self.final = not isinstance(provider, trace_api.ProxyTracerProvider)
        starter = getattr(tracer, "span_starter", None)   # crosstrace's (not a no-op) tracer
        self.start_span = starter() if starter is not None else (
            lambda name, context, kind, attributes: tracer.start_span(name, context, kind, attributes))
        self.next_sample = -1 << 63   # the first call asks (a simulated clock may read below 0)
        if isinstance(provider, TracerProvider) and not provider.config.disabled:   # disabled: no clock samples either
            self.now = provider.clock.now
            self.add_sample = provider.add_clock_sample
            self.node = quote(provider.node_id, safe="")  # metadata values are printable ASCII
            interval = provider.config.rpc_clock_interval_ms
            self.sample_every_ns = int(interval * 1_000_000) if math.isfinite(interval) else 1 << 62
        else:
            self.now = self.add_sample = self.node = self.sample_every_ns = None


class _Bound:
    """Base of all interceptors: binds on first use, for good once a real provider exists."""

    def __init__(self, tracer_provider=None):
        self._provider = tracer_provider
        self._binding = None

    def _bind(self) -> _Binding:
        binding = self._binding
        if binding is None:
            binding = _Binding(self._provider or trace_api.get_tracer_provider())
            if binding.final:
                self._binding = binding
        return binding


_method_cache: dict[str, tuple[str, dict]] = {}


def _method_info(full_method) -> tuple[str, dict]:
    """(span name, rpc.* attributes) of "/package.Service/Method", cached per method."""
    info = _method_cache.get(full_method)
    if info is None:
        name = full_method.decode() if isinstance(full_method, bytes) else str(full_method)
        name = name.lstrip("/")
        service, _, method = name.partition("/")
        info = (name, {sc.RPC_SYSTEM: "grpc", sc.RPC_SERVICE: service, sc.RPC_METHOD: method})
        if len(_method_cache) < 4096:
            _method_cache[full_method] = info
    return info


# -- trace context in metadata --------------------------------------------------------------
# With OpenTelemetry's default propagator (W3C trace context + baggage) and nothing but a
# traceparent to carry, the header is written and read here directly: the generic
# propagator costs several times the rest of the interceptor. Anything else (tracestate,
# baggage, another configured propagator, an unusual header) goes through the propagator.

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_DEFAULT_PROPAGATORS = (TraceContextTextMapPropagator, W3CBaggagePropagator)
_textmap_seen: tuple = (None, False)     # (the global propagator last seen, whether it is the default)


def _default_textmap() -> bool:
    global _textmap_seen
    textmap = propagate.get_global_textmap()
    seen, default = _textmap_seen
    if textmap is not seen:
        default = isinstance(textmap, CompositePropagator) and tuple(
            type(p) for p in getattr(textmap, "_propagators", ())) == _DEFAULT_PROPAGATORS
        _textmap_seen = (textmap, default)
    return default


def _inject(span, metadata: list) -> None:
    if (isinstance(span, Span) and span.extras is None and _default_textmap()
            and not current_context().get(_BAGGAGE_KEY)):
        metadata.append(("traceparent", f"00-{span.trace_id:032x}-{span.span_id:016x}-01"))
        return
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace_api.set_span_in_context(span))
    metadata.extend(carrier.items())


def _traceparent(carrier: dict) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a lone, valid traceparent under the default propagator;
    None when there is none or the generic propagator has to read the carrier."""
    if not _default_textmap() or "tracestate" in carrier or "baggage" in carrier:
        return None
    header = carrier.get("traceparent")
    match = _TRACEPARENT.fullmatch(header) if isinstance(header, str) else None
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    return (trace_id, span_id, int(match[3], 16)) if trace_id and span_id else None


def _extract(carrier: dict) -> Context:
    ids = _traceparent(carrier)
    if ids is not None:
        trace_id, span_id, flags = ids
        if not flags & trace_api.TraceFlags.SAMPLED:
            return Context({_SPAN_KEY: UnsampledSpan(trace_id, span_id, flags)})
        parent = trace_api.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace_api.TraceFlags(flags))
        return Context({_SPAN_KEY: trace_api.NonRecordingSpan(parent)})
    if "traceparent" not in carrier and _default_textmap() and "baggage" not in carrier:
        return Context()
    return propagate.extract(carrier)


# -- client side ----------------------------------------------------------------------------

def _client_start(b: _Binding, info: tuple[str, dict], metadata):
    """Start the client span of a method (its _method_info); returns (span, metadata to
    send, t1)."""
    name, attributes = info
    span = b.start_span(name, None, _CLIENT, attributes)
    metadata = list(metadata or ())
    _inject(span, metadata)
    if b.now is not None:
        t1 = b.now()
        if t1 >= b.next_sample:   # racy across threads at worst by a sample more
            b.next_sample = t1 + b.sample_every_ns
            metadata.append((T1_KEY, str(t1)))
            return span, metadata, t1
    return span, metadata, None


def _client_finish(b: _Binding, span, t1, t4, code, trailing, details) -> None:
    """Record the clock sample (when the server answered one) and end the span."""
    if t1 is not None and trailing:
        for key, value in trailing:
            if key == CLOCK_KEY:
                b.add_sample((t1, t4, value))   # parsed by the exporter thread (clock_probe.add_piggyback_samples)
                break
    if code is _OK:
        span.set_attribute(sc.RPC_GRPC_STATUS, 0)
    else:
        code = code or grpc.StatusCode.UNKNOWN
        span.set_attribute(sc.RPC_GRPC_STATUS, code.value[0])
        span.set_status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name)
    span.end()


def _call_finished(b: _Binding, span, t1, call) -> None:
    """Finish the client span from a completed call (or the RpcError that ended it)."""
    t4 = b.now() if b.now is not None else None
    try:
        code, trailing = call.code(), call.trailing_metadata()
        details = call.details() if code is not _OK else None   # read only for an error
    except Exception:  # an error that is not a call: it failed before reaching the server
        code, trailing, details = grpc.StatusCode.UNKNOWN, None, None
    _client_finish(b, span, t1, t4, code, trailing, details)


def _trailing_of_ok_call(call):
    """The trailing metadata of a call with_call returned (so: done, and OK). grpc's
    trailing_metadata() and code() wait on the call's condition, which costs as much as
    the rest of the client span; a done call's state is read directly where grpc has it."""
    state = getattr(call, "_state", None)
    trailing = getattr(state, "trailing_metadata", _UNREAD)
    return call.trailing_metadata() if trailing is _UNREAD else trailing


_UNREAD = object()


def _failed(span, exc: BaseException) -> None:
    span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
    span.end()


class _Traced:
    """One method of an instrumented channel: the channel's own callable, made once, with
    the span around it. (Not grpc.intercept_channel: its interceptor path makes a new
    callable and two outcome objects per call, which cost about as much as all of the
    tracing here.)"""

    __slots__ = ("_call", "_info", "_bound")

    def __init__(self, call, method, bound: _Bound):
        self._call, self._info, self._bound = call, _method_info(method), bound

    def _start(self, metadata):
        bound = self._bound
        b = bound._binding or bound._bind()
        return (b, *_client_start(b, self._info, metadata))

    def _ended_on_completion(self, invoke, request, timeout, metadata, credentials, wait_for_ready,
                             compression):
        """Start the call with `invoke`; its span ends when the call completes."""
        b, span, metadata, t1 = self._start(metadata)
        try:
            call = invoke(request, timeout, metadata, credentials, wait_for_ready, compression)
        except BaseException as exc:
            _failed(span, exc)
            raise
        if hasattr(call, "add_done_callback"):
            call.add_done_callback(lambda done: _call_finished(b, span, t1, done))
        elif not call.add_callback(lambda: _call_finished(b, span, t1, call)):
            _call_finished(b, span, t1, call)   # an inner interceptor's own grpc.Call, over already
        return _CallHandle(call)


class _CallHandle:
    """What a traced streaming call or future() returns: the call itself in every respect
    but one. grpc cancels a call its caller drops (a loop left with `break`); the span's
    completion callback holds the call from grpc's own state, so the call is never
    dropped, and the stream would run on (for good, without a deadline). The caller holds
    this instead, and dropping it cancels the call, which ends the span as CANCELLED."""

    __slots__ = ("_call",)

    def __init__(self, call):
        self._call = call

    def __getattr__(self, name):
        return getattr(self._call, name)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._call)

    def add_done_callback(self, fn) -> None:
        """As grpc's: `fn` gets this handle, and holds it until the call is done (a future
        kept only by its callback is not dropped, so not cancelled, as untraced)."""
        self._call.add_done_callback(lambda _: fn(self))

    def __del__(self):
        try:
            self._call.cancel()   # nothing, on a call that is done
        except Exception:   # never raise from a finalizer
            pass


def _bound_to_handle(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._call, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


# grpc.Future's and grpc.Call's methods, bound to the handle rather than to the call (as
# __getattr__ would): `stub.Method.future(request).result()` drops the handle as soon as it
# has the method, and that cancelled the call before result() could return.
for _name in ("result", "exception", "traceback", "done", "running", "cancelled", "cancel", "code", "details",
              "initial_metadata", "trailing_metadata", "is_active", "time_remaining", "add_callback"):
    setattr(_CallHandle, _name, _bound_to_handle(_name))
grpc.Call.register(_CallHandle)
grpc.Future.register(_CallHandle)


class _UnaryResponse(_Traced):
    __slots__ = ()

    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        return self._invoke(True, *self._start(metadata), request, timeout, credentials, wait_for_ready,
                            compression)

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        return self._invoke(False, *self._start(metadata), request, timeout, credentials, wait_for_ready,
                            compression)[0]

    def _invoke(self, want_call, b, span, metadata, t1, request, timeout, credentials, wait_for_ready,
                compression):
        """(response, call): through with_call where the call is wanted or the call samples the
        clock (its trailer), else the plain call (with_call and its outcome object cost about
        16k instructions more); the span ends with the outcome."""
        try:
            if want_call or t1 is not None:
                response, call = self._call.with_call(request, timeout, metadata, credentials, wait_for_ready,
                                                      compression)
            else:
                response, call = self._call(request, timeout, metadata, credentials, wait_for_ready,
                                            compression), None
        except grpc.RpcError as error:
            _call_finished(b, span, t1, error)
            raise
        except BaseException as exc:
            _failed(span, exc)
            raise
        trailing = t4 = None
        if t1 is not None:
            t4 = b.now()
            try:
                trailing = _trailing_of_ok_call(call)
            except Exception:   # an inner interceptor's outcome without one: no clock sample
                pass
        _client_finish(b, span, t1, t4, _OK, trailing, None)
        return response, call

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
               compression=None):
        return self._ended_on_completion(self._call.future, request, timeout, metadata, credentials,
                                         wait_for_ready, compression)


class _StreamingResponse(_Traced):
    __slots__ = ()

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        return self._ended_on_completion(self._call, request, timeout, metadata, credentials, wait_for_ready,
                                         compression)


class _TracedUnaryUnary(_UnaryResponse, grpc.UnaryUnaryMultiCallable):
    pass


class _TracedStreamUnary(_UnaryResponse, grpc.StreamUnaryMultiCallable):
    pass


class _TracedUnaryStream(_StreamingResponse, grpc.UnaryStreamMultiCallable):
    pass


class _TracedStreamStream(_StreamingResponse, grpc.StreamStreamMultiCallable):
    pass


class _TracedChannel(grpc.Channel):
    """A channel whose calls are traced: every method's callable is wrapped once."""

    def __init__(self, channel: grpc.Channel, tracer_provider):
        self._channel = channel
        self._bound = _Bound(tracer_provider)

    def unary_unary(self, method, *args, **kwargs):
        return _TracedUnaryUnary(self._channel.unary_unary(method, *args, **kwargs), method, self._bound)

    def unary_stream(self, method, *args, **kwargs):
        return _TracedUnaryStream(self._channel.unary_stream(method, *args, **kwargs), method, self._bound)

    def stream_unary(self, method, *args, **kwargs):
        return _TracedStreamUnary(self._channel.stream_unary(method, *args, **kwargs), method, self._bound)

    def stream_stream(self, method, *args, **kwargs):
        return _TracedStreamStream(self._channel.stream_stream(method, *args, **kwargs), method, self._bound)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._channel.close()
        return False


def instrument_channel(channel: grpc.Channel, tracer_provider=None) -> grpc.Channel:
    """A channel whose calls are traced as RPC_CLIENT spans and carry the trace context."""
    return _TracedChannel(channel, tracer_provider)


class _AioClient(_Bound):
    """asyncio client: the call is returned untouched; a done-callback finishes the span."""

    _pending: set = set()   # tasks reading a finished call's status (kept from the collector)

    async def _intercept(self, continuation, details, request):
        b = self._bind()
        span, metadata, t1 = _client_start(b, _method_info(details.method), details.metadata)
        try:
            call = await continuation(grpc.aio.ClientCallDetails(
                details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials,
                details.wait_for_ready), request)
        except BaseException as exc:
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            span.end()
            raise
        now = b.now

        def done(finished) -> None:
            t4 = now() if now is not None else None
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:   # cancelled as it was freed, its loop gone (asyncio.run returned)
                _client_finish(b, span, t1, t4, grpc.StatusCode.CANCELLED, None, None)
                return
            task = loop.create_task(self._finish(b, span, t1, t4, finished))
            self._pending.add(task)

            def settled(task) -> None:
                self._pending.discard(task)
                if task.cancelled():   # before it ran: the loop is closing
                    _client_finish(b, span, t1, t4, grpc.StatusCode.CANCELLED, None, None)

            task.add_done_callback(settled)

        call.add_done_callback(done)
        return call

    @staticmethod
    async def _finish(b, span, t1, t4, call) -> None:
        try:
            code, trailing, details = await call.code(), await call.trailing_metadata(), await call.details()
        except (Exception, asyncio.CancelledError):
            code, trailing, details = grpc.StatusCode.CANCELLED, None, None
        _client_finish(b, span, t1, t4, code, trailing, details)


class AioUnaryUnaryClientInterceptor(_AioClient, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioClient._intercept


class AioUnaryStreamClientInterceptor(_AioClient, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioClient._intercept


class AioStreamUnaryClientInterceptor(_AioClient, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioClient._intercept


class AioStreamStreamClientInterceptor(_AioClient, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioClient._intercept


def aio_client_interceptors(tracer_provider=None) -> list:
    """Pass to grpc.aio.insecure_channel(..., interceptors=...) (or secure_channel): every
    call becomes an RPC_CLIENT span carrying the trace context."""
    return [cls(tracer_provider) for cls in (AioUnaryUnaryClientInterceptor, AioUnaryStreamClientInterceptor,
                                             AioStreamUnaryClientInterceptor, AioStreamStreamClientInterceptor)]


# -- server side ----------------------------------------------------------------------------

class _ServerCall:
    """One traced server call: its span is current while the handler runs."""

    __slots__ = ("b", "span", "t2", "parent", "context", "_token")

    def __init__(self, b: _Binding, method, invocation_metadata, t2, context):
        self.b = b
        self.context = context
        carrier = dict(invocation_metadata or ())
        self.t2 = t2 if carrier.pop(T1_KEY, None) is not None else None   # asked for a clock sample
        ids = _traceparent(carrier) if b.now is not None else None   # b.now: crosstrace's own tracer
        if ids is not None and ids[2] & 1:
            self.parent = Context({_SPAN_KEY: RemoteParent(ids[0], ids[1])})
        else:
            self.parent = _extract(carrier)
        name, attributes = _method_cache.get(method) or _method_info(method)
        self.span = b.start_span(name, self.parent, _SERVER, attributes)
        if t2 is not None and isinstance(self.span, Span):
            self.span.start = t2   # the call arrived at t2; the handler may start later

    def enter(self):
        """Make the call's span current; returns the token for detach()."""
        return attach_span(self.span, self.parent)

    def __enter__(self) -> "_ServerCall":
        """`with` around an asyncio handler (its own task and context): its span is current
        inside, and ends with the call's outcome, exception included."""
        self._token = attach_span(self.span, self.parent)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exc)
        detach_quietly(self._token)   # an async generator handler may be closed in another context

    def finish(self, exc: BaseException | None) -> None:
        """Answer the clock trailer, set the status code and end the span."""
        span, context = self.span, self.context
        if self.t2 is not None:
            t3 = self.b.now()
            try:
                trailing = tuple(context.trailing_metadata() or ())
                context.set_trailing_metadata(trailing + ((CLOCK_KEY, f"{self.t2} {t3} {self.b.node}"),))
            except Exception as err:  # never fail the call over a clock sample
                log.debug("crosstrace: could not set the clock trailer: %r", err)
        try:
            code = context.code()
        except Exception:
            code = None
        if not isinstance(code, grpc.StatusCode):
            code = _OK if exc is None else _code_of(exc)
            if code is _OK or code is grpc.StatusCode.CANCELLED:
                code = _past_deadline(context, code)
        if code is _OK:   # the common case, without the enum's (Python-level) hash and value
            span.set_attribute(sc.RPC_GRPC_STATUS, 0)
        else:
            span.set_attribute(sc.RPC_GRPC_STATUS, code.value[0])
            crashed = exc is not None and code is grpc.StatusCode.UNKNOWN and not _aborted(exc, context)
            if crashed:
                span.record_exception(exc)
            if code in _SERVER_ERRORS:
                details = f"{type(exc).__name__}: {exc}" if crashed else _details(context)
                span.set_status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name)
        span.end()


def _aborted(exc: BaseException, context) -> bool:
    """Whether the handler ended by context.abort() (with UNKNOWN, say, to pass an upstream's
    on), not by an exception of its own: grpc.aio raises AbortError for it, grpc a bare
    Exception(), having noted the abort in the call's state."""
    return isinstance(exc, grpc.aio.AbortError) or getattr(getattr(context, "_state", None), "aborted", False) is True


def _code_of(exc: BaseException) -> grpc.StatusCode:
    """The status of a call whose handler raised without setting one."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _past_deadline(context, code: grpc.StatusCode) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call whose handler ran past the client's deadline (the client
    got that, whatever the handler went on to return, and grpc.aio cancels the handler);
    else `code`."""
    try:
        remaining = context.time_remaining()
    except Exception:
        return code
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else code


def _details(context) -> str:
    try:
        details = context.details()
    except Exception:
        return ""
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    return details or ""


def _wrap_sync(b: _Binding, method, metadata, t2, behavior, streaming_response: bool):
    if streaming_response:
        def traced_stream(request, context):
            """The handler is called at once, as grpc calls it (an error there is grpc's
            "Exception calling application"); its responses are read as grpc reads them."""
            call = _ServerCall(b, method, metadata, t2, context)
            token = call.enter()
            try:
                responses = behavior(request, context)
            except BaseException as exc:
                call.finish(exc)
                raise
            finally:
                detach(token)
            return _traced_responses(call, responses)
        return traced_stream

    return partial(_traced_once, b, method, metadata, t2, behavior)


def _traced_responses(call: _ServerCall, responses):
    """A streaming handler's responses, its span current while each is made; the span ends
    with the stream (next(), not iter(): a handler that returns a list fails as untraced)."""
    exc = None
    try:
        while True:
            token = call.enter()   # current for the handler's code between yields only
            try:
                item = next(responses)
            except StopIteration:
                return
            finally:
                detach(token)
            yield item
    except BaseException as e:
        exc = e
        raise
    finally:
        call.finish(exc)


def _traced_once(b: _Binding, method, metadata, t2, behavior, request, context):
    """A sync handler that answers once, with its server span current: what `with
    _ServerCall(...)` does, without the with-statement's two calls (each Python call costs
    about 1 us with an RPC's cold caches, and this runs on every call)."""
    call = _ServerCall(b, method, metadata, t2, context)
    token = attach_span(call.span, call.parent)
    try:
        try:
            response = behavior(request, context)
        except BaseException as exc:
            call.finish(exc)
            raise
        call.finish(None)
        return response
    finally:
        detach(token)


_FACTORIES = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


# grpc's RpcMethodHandler (a namedtuple), made directly: grpc's factory imports per call.
_RpcMethodHandler = type(grpc.unary_unary_rpc_method_handler(None))
_new_tuple = tuple.__new__
_HANDLER_FIELDS = ("request_streaming", "response_streaming", "request_deserializer", "response_serializer",
                   "unary_unary", "unary_stream", "stream_unary", "stream_stream")
_DIRECT_HANDLER = getattr(_RpcMethodHandler, "_fields", None) == _HANDLER_FIELDS   # else grpc's factory


def _rewrap(handler, wrap):
    """The same handler with its behavior replaced by wrap(behavior, streaming_response)."""
    for attr, factory, streaming in _FACTORIES:
        behavior = getattr(handler, attr)
        if behavior is not None:
            traced = wrap(behavior, streaming)
            return factory(traced, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    return handler


class ServerInterceptor(_Bound, grpc.ServerInterceptor):
    """Sync server: every call becomes an RPC_SERVER span under the caller's context,
    starting when the call arrives."""

    def intercept_service(self, continuation, handler_call_details):
        b = self._binding or self._bind()
        t2 = b.now() if b.now is not None else None
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method, metadata = handler_call_details.method, handler_call_details.invocation_metadata
        behavior = handler.unary_unary
        if behavior is not None and _DIRECT_HANDLER:   # the common case, without the general rewrap
            return _new_tuple(_RpcMethodHandler, (False, False, handler.request_deserializer,
                                                  handler.response_serializer,
                                                  partial(_traced_once, b, method, metadata, t2, behavior),
                                                  None, None, None))
        return _rewrap(handler, lambda behavior, streaming: _wrap_sync(b, method, metadata, t2, behavior, streaming))


def server_interceptor(tracer_provider=None) -> grpc.ServerInterceptor:
    """Pass to grpc.server(..., interceptors=[...]): every call becomes an RPC_SERVER span
    under the caller's trace context."""
    return ServerInterceptor(tracer_provider)


def _wrap_aio(b: _Binding, method, metadata, t2, behavior, streaming_response: bool):
    if inspect.isasyncgenfunction(behavior):
        async def traced_gen(request, context):
            with _ServerCall(b, method, metadata, t2, context):   # an aio call runs in its own task and context
                async for item in behavior(request, context):
                    yield item
        return traced_gen
    if inspect.iscoroutinefunction(behavior):
        async def traced(request, context):
            with _ServerCall(b, method, metadata, t2, context):
                return await behavior(request, context)
        return traced
    traced = _wrap_sync(b, method, metadata, t2, behavior, streaming_response)   # run in its thread pool
    return lambda request, context: traced(request, _RecordingContext(context))


class _RecordingContext:
    """A plain handler's context on a grpc.aio server: grpc's _SyncServicerContext takes a
    code, details and trailing metadata but cannot say them back, which the server span's
    end reads (its status, and the clock trailer added to the handler's own)."""

    def __init__(self, context):
        self._context = context
        self._code = self._details = None
        self._trailing = ()

    def __getattr__(self, name):
        return getattr(self._context, name)

    def set_code(self, code) -> None:
        self._code = code
        self._context.set_code(code)

    def set_details(self, details) -> None:
        self._details = details
        self._context.set_details(details)

    def set_trailing_metadata(self, metadata) -> None:
        self._trailing = tuple(metadata)
        self._context.set_trailing_metadata(metadata)

    def abort(self, code, details="", *more):
        self._code, self._details = code, details
        return self._context.abort(code, details, *more)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


class AioServerInterceptor(_Bound, grpc.aio.ServerInterceptor):
    """asyncio server: every call becomes an RPC_SERVER span under the caller's context."""

    async def intercept_service(self, continuation, handler_call_details):
        b = self._bind()
        t2 = b.now() if b.now is not None else None
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method, metadata = handler_call_details.method, handler_call_details.invocation_metadata
        return _rewrap(handler, lambda behavior, streaming: _wrap_aio(b, method, metadata, t2, behavior, streaming))


def aio_server_interceptor(tracer_provider=None) -> grpc.aio.ServerInterceptor:
    """Pass to grpc.aio.server(interceptors=[...])."""
    return AioServerInterceptor(tracer_provider)
