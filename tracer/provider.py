"""TracerProvider and Tracer: the OpenTelemetry API, implemented by crosstrace.

Code written against the plain OpenTelemetry API is traced unchanged, either by
`crosstrace.init()` or with OTEL_PYTHON_TRACER_PROVIDER=crosstrace (entry point).
"""
import atexit
import multiprocessing.util as mp_util
import os
import random
import threading
import weakref
from functools import partial

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.context.context import Context
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.status import Status as OtelStatus, StatusCode

from ..proto.semconv import KIND, KIND_BY_NAME
from .clock import Clock
from .config import Config
from .exporter import Exporter, ExportQueue
from .span import OTEL_KIND, THREAD_IDS, Span, SpanExtras

_random_bits = random.getrandbits
_new = object.__new__
_get_ident = threading.get_ident
_intern_thread = THREAD_IDS.setdefault


def _context_var():
    """The ContextVar behind OpenTelemetry's runtime context, so that entering a span
    costs one ContextVar.set; None when a non-default runtime context is configured."""
    runtime = getattr(context_api, "_RUNTIME_CONTEXT", None)
    return getattr(runtime, "_current_context", None)


_CONTEXT_VAR = _context_var()
if _CONTEXT_VAR is not None:
    _get_context, _attach, _detach = _CONTEXT_VAR.get, _CONTEXT_VAR.set, _CONTEXT_VAR.reset
else:  # pragma: no cover - only with OTEL_PYTHON_CONTEXT set to another runtime
    _get_context, _attach, _detach = context_api.get_current, context_api.attach, context_api.detach


def _new_id(bits: int) -> int:
    """A random id; 0 is the invalid id, drawn again (only reached when the first draw was 0)."""
    value = _random_bits(bits)
    while not value:
        value = _random_bits(bits)
    return value


_INTERNAL = trace_api.SpanKind.INTERNAL
# SpanKind members are singletons; keyed by id() they are found without Enum.__hash__,
# which is Python code and costs more than the rest of the lookup.
_OTEL_KIND_BY_ID = {id(kind): code for kind, code in OTEL_KIND.items()}


class Tracer(trace_api.Tracer):
    __slots__ = ("_queue", "_now", "scope")

    def __init__(self, queue: ExportQueue, scope: str):
        self._queue = queue
        self._now = queue.now
        self.scope = scope

    def start_span(self, name, context=None, kind=_INTERNAL, attributes=None, links=None,
                   start_time=None, record_exception=True, set_status_on_exception=True):
        return self._start(Span, name, context, kind, attributes, links, start_time)

    def start_as_current_span(self, name, context=None, kind=_INTERNAL, attributes=None, links=None,
                              start_time=None, record_exception=True, set_status_on_exception=True,
                              end_on_exit=True):
        if context is None and record_exception and set_status_on_exception and end_on_exit:
            return self._start(ScopedSpan, name, None, kind, attributes, links, start_time)
        span = self._start(Span, name, context, kind, attributes, links, start_time)
        return CurrentSpan(self, span, (name, context, kind, attributes, links, start_time),
                           record_exception, set_status_on_exception, end_on_exit)

    def span_starter(self):
        """start(name, context, kind, attributes) -> Span: start_span without the API's
        keyword arguments, for instrumentation on a request's path (one Python call less
        per span: about 1 us there, with cold caches)."""
        return partial(self._start, Span, links=None, start_time=None)

    def _start(self, cls, name, context, kind, attributes, links, start_time):
        parent = (_get_context() if context is None else context).get(_SPAN_KEY)
        extras = None
        if parent is None:
            trace_id, parent_id = _random_bits(128) or _new_id(128), 0
        elif isinstance(parent, Span):
            trace_id, parent_id = parent.trace_id, parent.span_id
            if parent.extras is not None and parent.extras.trace_state:
                extras = SpanExtras(trace_state=parent.extras.trace_state)
        else:
            ctx = parent.get_span_context()
            if not ctx.is_valid:
                trace_id, parent_id = _new_id(128), 0
            elif not ctx.trace_flags.sampled:
                return trace_api.NonRecordingSpan(ctx)
            else:
                trace_id, parent_id = ctx.trace_id, ctx.span_id
                if ctx.trace_state:
                    extras = SpanExtras(trace_state=ctx.trace_state)
        if kind is _INTERNAL:
            code = 0
        else:
            code = _OTEL_KIND_BY_ID.get(id(kind))
            if code is None:
                code = int(kind)
        if attributes:
            attributes = dict(attributes)
            if KIND in attributes:
                code = KIND_BY_NAME.get(str(attributes.pop(KIND)).lower(), code)
        else:
            attributes = None
        if links:
            links = [link for link in links if link.context.is_valid]
            if links:
                extras = SpanExtras(links, extras.trace_state if extras else None)
        span = _new(cls)
        span._sink = self._queue
        span.trace_id = trace_id
        span.span_id = _random_bits(64) or _new_id(64)
        span.parent_id = parent_id
        span.name = name
        span.kind = code
        span.attributes = attributes
        span.extras = extras
        span.end_ns = 0
        thread = _get_ident()
        span.thread = _intern_thread(thread, thread)
        span.start = self._now() if start_time is None else self._queue.clock.from_epoch_ns(start_time)
        return span


current_context, detach = _get_context, _detach   # for instrumentation: one ContextVar call each


def context_with(span, parent: Context) -> Context:
    """The context `parent` with `span` as its current span: one Context, without the
    OpenTelemetry API's copy through set_value(). A parent that holds a span only (most
    do) is not copied at all: `span` replaces it, and a copy costs 60-130 ns more than a
    new Context."""
    ctx = Context() if not parent or (len(parent) == 1 and _SPAN_KEY in parent) else Context(parent)
    dict.__setitem__(ctx, _SPAN_KEY, span)
    return ctx


def attach_span(span, parent: Context) -> object:
    """Make `span` current on top of the context `parent` (what ScopedSpan does inline).
    Returns the token for detach()."""
    return _attach(context_with(span, parent))


attach = _attach   # for instrumentation: one ContextVar.set


class ScopedSpan(Span):
    """What `start_as_current_span` returns in the common case (default flags, current
    context as parent): the span is its own context manager, so entering it costs one
    Context and one ContextVar.set and no wrapper object."""

    __slots__ = ("_token",)

    def __enter__(self) -> "ScopedSpan":
        # context_with(self, parent), inlined: the call costs ~330 instructions per span
        parent = _get_context()
        ctx = Context() if not parent or (len(parent) == 1 and _SPAN_KEY in parent) else Context(parent)
        dict.__setitem__(ctx, _SPAN_KEY, self)
        self._token = _attach(ctx)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and isinstance(exc, Exception) and not self.end_ns:
            self.record_exception(exc, escaped=True)
            self.set_status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}")
        _detach(self._token)
        self._token = None
        self.end()

    def __call__(self, func):
        """Used as a decorator (`@tracer.start_as_current_span(...)`): each call gets a new
        span like this one; this one is never ended nor exported."""
        import functools

        tracer, name, kind = Tracer(self._sink, ""), self.name, self.kind
        attributes = self.attributes
        links = self.extras.links if self.extras is not None else None

        @functools.wraps(func)
        def traced(*args, **kwargs):
            with tracer.start_as_current_span(name, None, kind, attributes, links):
                return func(*args, **kwargs)

        return traced


class CurrentSpan:
    """`start_as_current_span` with a given parent context or non-default flags: a
    wrapper around a plain Span (the common case is ScopedSpan)."""

    __slots__ = ("_tracer", "_span", "_args", "_record", "_set_status", "_end", "_token")

    def __init__(self, tracer, span, args, record_exception, set_status_on_exception, end_on_exit):
        self._tracer = tracer
        self._span = span
        self._args = args
        self._record = record_exception
        self._set_status = set_status_on_exception
        self._end = end_on_exit

    def __enter__(self):
        self._token = attach_span(self._span, _get_context())
        return self._span

    def __exit__(self, exc_type, exc, tb):
        span = self._span
        try:
            if exc is not None and isinstance(exc, Exception) and span.is_recording():
                if self._record:
                    span.record_exception(exc, escaped=True)
                if self._set_status:
                    span.set_status(OtelStatus(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        finally:
            _detach(self._token)
            if self._end:
                span.end()
        return False

    def __call__(self, func):
        """Used as a decorator: one new span per call."""
        import functools

        tracer, args, flags = self._tracer, self._args, (self._record, self._set_status, self._end)

        @functools.wraps(func)
        def traced(*a, **kw):
            with CurrentSpan(tracer, tracer.start_span(*args), args, *flags):
                return func(*a, **kw)

        return traced


class TracerProvider(trace_api.TracerProvider):
    """Records spans on this node's clock and exports them to a crosstrace collector.

    Options are the fields of `Config` (endpoint, node_id, job_id, ...); each falls
    back to its CROSSTRACE_* environment variable, so `TracerProvider()` with no
    arguments (as OpenTelemetry's entry point loader calls it) is configured by the
    environment alone.
    """

    def __init__(self, **options):
        self.config = Config.from_env(**options)
        cfg = self.config
        self.clock = Clock(cfg.sim_clock_offset_ns, cfg.sim_clock_drift_ppm, cfg.sim_clock_epoch_ns)
        self._queue = ExportQueue(self.clock, cfg.max_queue, cfg.batch_size)
        self._exporter = None if cfg.disabled else Exporter(cfg, self.clock, self._queue)
        self._shutdown = False
        self._lock = threading.Lock()
        me = weakref.ref(self)
        atexit.register(_exit_hook, me)
        os.register_at_fork(after_in_child=lambda: _after_fork(me))
        # multiprocessing children (DataLoader workers) leave by os._exit, skipping atexit, and
        # clear finalizers made at fork time; a finalizer made by its after-fork hook does run.
        mp_util.register_after_fork(self, _flush_on_multiprocessing_exit)

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def get_tracer(self, instrumenting_module_name: str = "", instrumenting_library_version=None,
                   schema_url=None, attributes=None) -> trace_api.Tracer:
        if self._shutdown or self.config.disabled:
            return trace_api.NoOpTracer()
        return Tracer(self._queue, instrumenting_module_name)

    @property
    def dropped_spans(self) -> int:
        """Spans that could not be queued or were given up unacked, since start."""
        return self._queue.dropped + (self._exporter.dropped if self._exporter else 0)

    def add_clock_sample(self, sample) -> None:
        """Queue a clock sample for the next batch: a ClockSample (NTP, PTP), or an RPC's raw
        (t1, t4, trailer), which the exporter thread parses off the call path."""
        if self._exporter is not None:   # nothing would take it out of the queue otherwise
            self._queue.samples.append(sample)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once the collector has acked every span that ended before this call."""
        if self._exporter is None:
            return True
        return self._exporter.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: int | None = None) -> bool:
        """Flush what is queued (bounded by `timeout_millis`, default the exit timeout), then stop."""
        with self._lock:
            if self._shutdown:
                return True
            self._shutdown = True
        if self._exporter is None:
            return True
        timeout = self.config.exit_flush_timeout_s if timeout_millis is None else timeout_millis / 1000
        return self._exporter.shutdown(timeout)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._queue.reset_after_fork()
        if self._exporter is not None and not self._shutdown:
            self._exporter = self._exporter.restart_after_fork()


def _exit_hook(ref) -> None:
    provider = ref()
    if provider is not None:
        provider.shutdown()


def _after_fork(ref) -> None:
    provider = ref()
    if provider is not None:
        provider._after_fork_in_child()


def _flush_on_multiprocessing_exit(provider: TracerProvider) -> None:
    mp_util.Finalize(provider, provider.shutdown, exitpriority=100)
