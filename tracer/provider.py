"""TracerProvider and Tracer: the OpenTelemetry API, implemented by crosstrace.

Code written against the plain OpenTelemetry API is traced unchanged, either by
`crosstrace.init()` or with OTEL_PYTHON_TRACER_PROVIDER=crosstrace (entry point).
"""
import asyncio
import atexit
import functools
import inspect
import multiprocessing.util as mp_util
import os
import random
import threading
import weakref

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.context.context import Context
from opentelemetry.trace.propagation import _SPAN_KEY

from ..proto.semconv import KIND, KIND_BY_NAME, Kind
from .clock import Clock
from .config import Config
from .encode import FIELDS
from .exporter import Exporter, ExportQueue
from . import sigterm
from .compiled import SpanFields, TracerFields, hot_path, why_python
from .span import OTEL_KIND, Span, SpanExtras, UnsampledSpan, log, own_links

# Ids from a generator of the tracer's own, seeded from os.urandom: ML programs seed `random`
# alike on every rank (random.seed(1234)), and ids drawn from it were the same on every rank.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)   # and a forked child draws its own
_random_bits = _ids.getrandbits
_new = object.__new__
_get_ident = threading.get_ident
_running_loop = asyncio._get_running_loop   # None, without raising, outside an event loop
# Into a new Context without that key, which refuses item assignment of its own: dict's
# setdefault, a plain method, 40 ns cheaper than the slot wrapper __setitem__.
_put_new = dict.setdefault


def _task_lane(thread: int) -> int:
    """A span's lane (what its `thread` field names) in asyncio: its task, not the thread.
    Tasks on one thread run interleaved, so the order of their spans' boundaries says
    nothing of who waited for whom, which the collector reads program order as."""
    task = asyncio.current_task()
    return thread if task is None else id(task)


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
_KINDS = frozenset(Kind)


# The compiled hot path (tracer/_hotpath.c) runs the common case of start_as_current_span
# and of ScopedSpan's __enter__ and __exit__, where it is built and the runtime context is
# OpenTelemetry's ContextVar, which it sets directly.
COMPILED = hot_path is not None and _CONTEXT_VAR is not None


def hot_path_status() -> str:
    """Which hot path this process's spans take, and why Python where it is (for
    `crosstrace --version` and the benchmarks)."""
    if COMPILED:
        return "compiled"
    return f"Python ({why_python or 'a runtime context other than OpenTelemetry default'})"


class Tracer(TracerFields, trace_api.Tracer):
    __slots__ = ()

    def __init__(self, queue: ExportQueue):
        self._queue = queue
        self._now = queue.now

    def start_span(self, name, context=None, kind=_INTERNAL, attributes=None, links=None,
                   start_time=None, record_exception=True, set_status_on_exception=True):
        span = self._start(Span, name, context, kind, attributes, links, start_time)
        if not (record_exception and set_status_on_exception) and isinstance(span, Span):
            extras = span._extras()
            extras.record_exception, extras.set_status_on_exception = record_exception, set_status_on_exception
        return span

    def start_as_current_span(self, name, context=None, kind=_INTERNAL, attributes=None, links=None,
                              start_time=None, record_exception=True, set_status_on_exception=True,
                              end_on_exit=True):
        """The span starts when the `with` is entered, under the context current then (as
        with OpenTelemetry's SDK), not when this is called."""
        if not (context is None and start_time is None and record_exception and set_status_on_exception
                and end_on_exit):
            return CurrentSpan(self, (name, context, kind, attributes, links, start_time, record_exception,
                                      set_status_on_exception), end_on_exit)
        # The common case, a ScopedSpan, made here as _start makes a Span, and in C as
        # _hotpath.c's start_scoped makes it (keep the three alike; tests/test_hot_path.py):
        # a Python call less per span. Its parent, thread and start are read when it is entered.
        span = _new(ScopedSpan)
        span._sink = self._queue
        span.trace_id = span.parent_id = span.end_ns = 0
        span.span_id = _random_bits(64) or _new_id(64)
        span.name = name
        span.kind = 0 if kind is _INTERNAL else _kind_code(kind)
        span.extras = None
        if attributes:
            attributes = dict(attributes)
            if KIND in attributes:
                span.kind = KIND_BY_NAME.get(str(attributes.pop(KIND)).lower(), span.kind)
            span.attributes = attributes
        else:
            span.attributes = None
        if links:
            links = own_links(links)
            if links:
                span.extras = SpanExtras(links)
        return span

    _start_as_current_span = start_as_current_span   # what the compiled one hands its other cases to
    if COMPILED:
        start_as_current_span = TracerFields._start_scoped

    def span_starter(self):
        """start(name, context, kind, attributes) -> Span: start_span without the API's
        keyword arguments, for instrumentation on a request's path (one Python call less
        per span: about 1 us there, with cold caches)."""
        return functools.partial(self._start, Span, links=None, start_time=None)

    def _start(self, cls, name, context, kind, attributes, links, start_time):
        """A span under the span current in `context` (None: the current context); a
        NonRecordingSpan where that one is not sampled."""
        extras = None
        parent = (_get_context() if context is None else context).get(_SPAN_KEY)
        if parent is None:
            trace_id, parent_id = _random_bits(128) or _new_id(128), 0
        elif isinstance(parent, Span) and parent.extras is None:   # the common nesting, inline
            trace_id, parent_id = parent.trace_id, parent.span_id
        elif parent.__class__ is UnsampledSpan:   # immutable, and as non-recording as a new one
            return parent
        else:
            under = _under(parent)
            if under is None:
                return trace_api.NonRecordingSpan(parent.get_span_context())
            trace_id, parent_id, trace_state = under
            if trace_state:
                extras = SpanExtras(trace_state=trace_state)
        code = 0 if kind is _INTERNAL else _kind_code(kind)
        if attributes:
            attributes = dict(attributes)
            if KIND in attributes:
                code = KIND_BY_NAME.get(str(attributes.pop(KIND)).lower(), code)
        else:
            attributes = None
        if links:
            links = own_links(links)
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
        if _running_loop() is not None:
            thread = _task_lane(thread)
        span.thread = thread
        span.start = self._now() if start_time is None else self._queue.clock.from_epoch_ns(start_time)
        return span


def _kind_code(kind) -> int:
    """crosstrace's kind of an OpenTelemetry SpanKind (or of a crosstrace Kind given as one);
    INTERNAL for anything else (None, say), as nothing is raised into the caller."""
    code = _OTEL_KIND_BY_ID.get(id(kind))
    if code is None:
        code = int(kind) if isinstance(kind, int) and kind in _KINDS else 0
    return code


def _under(parent) -> tuple[int, int, object] | None:
    """(trace id, parent span id, trace state) of a span started under `parent` (a span),
    None where `parent` is not sampled: the new span records nothing."""
    if isinstance(parent, Span):
        extras = parent.extras
        return parent.trace_id, parent.span_id, extras.trace_state if extras is not None else None
    ctx = parent.get_span_context()
    if not ctx.is_valid:
        return _random_bits(128) or _new_id(128), 0, None
    if not ctx.trace_flags.sampled:
        return None
    return ctx.trace_id, ctx.span_id, ctx.trace_state


current_context, detach = _get_context, _detach   # for instrumentation: one ContextVar call each


def context_with(span, parent: Context) -> Context:
    """The context `parent` with `span` as its current span: one Context, without the
    OpenTelemetry API's copy through set_value(). A parent that holds a span only (most
    do) is not copied at all: `span` replaces it, and a copy costs 60-130 ns more than a
    new Context."""
    ctx = Context() if not parent or (len(parent) == 1 and _SPAN_KEY in parent) else _beside_span(parent)
    _put_new(ctx, _SPAN_KEY, span)
    return ctx


def _beside_span(parent: Context) -> Context:
    """A copy of `parent` without its span (its baggage, say), for the new span's."""
    return Context({key: value for key, value in parent.items() if key != _SPAN_KEY})


def attach_span(span, parent: Context) -> object:
    """Make `span` current on top of the context `parent` (what ScopedSpan does inline).
    Returns the token for detach()."""
    return _attach(context_with(span, parent))


attach = _attach   # for instrumentation: one ContextVar.set


def detach_quietly(token) -> None:
    """Leave a context entered with attach(). Where it is left in another context than the
    one it was entered in (a generator closed elsewhere), OpenTelemetry logs and goes on:
    so does crosstrace, rather than raise into the traced code."""
    try:
        _detach(token)
    except (ValueError, RuntimeError) as exc:
        _could_not_leave(exc)


def _could_not_leave(exc: Exception) -> None:
    log.debug("crosstrace: could not leave a span's context: %s", exc)


class ScopedSpan(Span):
    """What `start_as_current_span` returns in the common case (default flags, current
    context as parent): the span is its own context manager, so entering it costs one
    Context and one ContextVar.set and no wrapper object. Its parent, trace id, thread and
    start are those of where and when it is entered, once (as the SDK's context manager)."""

    __slots__ = ()

    def _enter(self):
        if self.trace_id:
            raise RuntimeError(f"crosstrace: span {self.name!r} from start_as_current_span() was entered already")
        parent = _get_context()
        span = parent.get(_SPAN_KEY)
        if span is None:
            self.trace_id = _random_bits(128) or _new_id(128)
        elif isinstance(span, Span) and span.extras is None:   # the common nesting, inline
            self.trace_id, self.parent_id = span.trace_id, span.span_id
        elif span.__class__ is UnsampledSpan:   # an unsampled step's: nothing recorded, its context stays current
            self.trace_id, self.end_ns = span.trace_id, 1
            self._token = _attach(parent)
            return span
        else:
            under = _under(span)
            if under is None:   # an unsampled parent: nothing is recorded, the parent's context is current
                context = span.get_span_context()
                self.trace_id, self.end_ns = context.trace_id, 1
                span = trace_api.NonRecordingSpan(context)
                self._token = attach_span(span, parent)
                return span
            self.trace_id, self.parent_id, trace_state = under
            if trace_state:
                self._extras().trace_state = trace_state
        # context_with(self, parent), inlined: the call costs ~330 instructions per span
        ctx = Context() if not parent or (len(parent) == 1 and _SPAN_KEY in parent) else _beside_span(parent)
        _put_new(ctx, _SPAN_KEY, self)
        self._token = _attach(ctx)
        thread = _get_ident()
        if _running_loop() is not None:
            thread = _task_lane(thread)
        self.thread = thread
        self.start = self._sink.now()
        return self

    def _exit(self, exc_type, exc, tb) -> None:
        try:
            _detach(self._token)
        except (ValueError, RuntimeError, TypeError) as err:   # left in another context (see
            _could_not_leave(err)                               # detach_quietly), or twice
        except AttributeError:   # never entered: nothing to leave or end
            log.debug("crosstrace: span %r was left without being entered", self.name)
            return
        self._token = None
        if self.end_ns:
            return
        if exc is not None and isinstance(exc, Exception):
            self._raised(exc)
        # Span.end(), inlined (keep it, Span.end and _hotpath.c's queue_span alike): a Python
        # call less per span.
        sink = self._sink
        end = self.end_ns = sink.now()
        queue = sink.queue
        if len(queue) < sink.max_entries:
            queue.extend((self.trace_id, self.span_id, self.parent_id, self.name, self.kind, self.start, end,
                          self.thread, self.extras, self.attributes))
            if len(queue) == sink.wake_at:
                sink.wake()
        else:
            sink.dropped += 1

    __enter__, __exit__ = (SpanFields._scoped_enter, SpanFields._scoped_exit) if COMPILED else (_enter, _exit)

    def __call__(self, func):
        """Used as a decorator (`@tracer.start_as_current_span(...)`): each call gets a new
        span like this one; this one is never entered nor exported."""
        links = self.extras.links if self.extras is not None else None
        return traced_calls(func, functools.partial(Tracer(self._sink).start_as_current_span, self.name, None,
                                          self.kind, self.attributes, links))


if COMPILED:
    hot_path.configure(context_var=_CONTEXT_VAR, span_key=_SPAN_KEY, context_type=Context, scoped_type=ScopedSpan,
                       enter=ScopedSpan._enter, exit=ScopedSpan._exit, start=Tracer._start_as_current_span,
                       task_lane=_task_lane, could_not_leave=_could_not_leave, running_loop=_running_loop,
                       internal_kind=_INTERNAL, kind_key=KIND, kind_by_name=KIND_BY_NAME,
                       kinds=(*OTEL_KIND.items(), *((kind, int(kind)) for kind in Kind)))   # as _kind_code has them


class CurrentSpan:
    """`start_as_current_span` with a given parent context, a start time or non-default
    flags: starts a plain Span when entered (the common case is ScopedSpan)."""

    __slots__ = ("_tracer", "_span", "_args", "_end", "_token")

    def __init__(self, tracer, args, end_on_exit):
        self._tracer = tracer
        self._args = args          # start_span's, its exception flags included
        self._end = end_on_exit
        self._span = None

    def __enter__(self):
        if self._span is not None:
            raise RuntimeError(f"crosstrace: span {self._args[0]!r} from start_as_current_span() was entered already")
        span = self._span = self._tracer.start_span(*self._args)
        self._token = attach_span(span, _get_context())
        return span

    def __exit__(self, exc_type, exc, tb):
        span = self._span
        if span is None:   # never entered: nothing to leave or end
            log.debug("crosstrace: span %r was left without being entered", self._args[0])
            return False
        detach_quietly(self._token)
        if span.is_recording():
            if exc is not None and isinstance(exc, Exception):
                span._raised(exc)
            if self._end:
                span.end()
        return False

    def __call__(self, func):
        """Used as a decorator: one new span per call."""
        tracer, args, end = self._tracer, self._args, self._end
        return traced_calls(func, lambda: CurrentSpan(tracer, args, end))


def traced_calls(func, scope):
    """`func` with each call inside `with scope():`. A coroutine function's span covers its
    whole run, awaits included, not just the call that makes the coroutine."""
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def traced_async(*args, **kwargs):
            with scope():
                return await func(*args, **kwargs)

        return traced_async

    @functools.wraps(func)
    def traced(*args, **kwargs):
        with scope():
            return func(*args, **kwargs)

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
        self._flushed = True
        self._shut_down = threading.Event()   # set once shutdown() is done
        self._lock = threading.Lock()
        _providers.add(self)   # for the process's exit and fork hooks (below)
        # multiprocessing children (DataLoader workers) leave by os._exit, skipping atexit, and
        # clear finalizers made at fork time; a finalizer made by its after-fork hook does run.
        mp_util.register_after_fork(self, _in_multiprocessing_child)

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def get_tracer(self, instrumenting_module_name: str = "", instrumenting_library_version=None,
                   schema_url=None, attributes=None) -> trace_api.Tracer:
        if self._shutdown or self.config.disabled:
            return trace_api.NoOpTracer()
        return Tracer(self._queue)   # the scope is not recorded (README)

    @property
    def dropped_spans(self) -> int:
        """Spans that could not be queued or were given up unacked, since start."""
        return self._queue.dropped + (self._exporter.dropped if self._exporter else 0)

    def add_clock_sample(self, sample) -> None:
        """Queue a clock sample for the next batch: a ClockSample (NTP, PTP), or an RPC's raw
        (t1, t4, trailer), which the exporter thread parses off the call path."""
        if self._exporter is not None and not self._shutdown:   # nothing would take it out otherwise
            self._queue.samples.append(sample)

    def defer(self, work) -> None:
        """Have the exporter's thread call `work()` (which makes spans) before its next batch:
        instrumentation's way to take span building off the traced program's path (DDP's
        buckets, recorded once their pass is over). Inline where nothing exports."""
        if self._exporter is None or self._shutdown:
            work()
        else:
            self._queue.deferred.append(work)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once the collector has acked every span that ended before this call; False
        at the timeout, or where spans were given up meanwhile (a batch refused)."""
        if self._exporter is None:
            return True
        given_up = self._exporter.dropped   # batched spans given up; not spans ended meanwhile
        return self._exporter.flush(timeout_millis / 1000) and self._exporter.dropped == given_up

    def shutdown(self, timeout_millis: int | None = None) -> bool:
        """Flush what is queued (bounded by `timeout_millis`, default the exit timeout), then
        stop. A call while another thread's shutdown runs waits for it (within the exit
        timeout), and returns what it found."""
        with self._lock:
            first, self._shutdown = not self._shutdown, True
        if not first:
            timeout = self.config.exit_flush_timeout_s if timeout_millis is None else timeout_millis / 1000
            return self._shut_down.wait(timeout) and self._flushed
        try:
            self._flushed = self._stop(timeout_millis)
        finally:
            self._shut_down.set()
        return self._flushed

    def _stop(self, timeout_millis: int | None) -> bool:
        if self._exporter is None:
            return True
        self._queue.wake()   # what is queued goes now: settling the instrumentation can outlast a SIGTERM's wait
        for settle in _before_shutdown:
            try:
                settle()
            except Exception as exc:  # instrumentation's; never fails the shutdown
                log.warning("crosstrace: %r before shutdown failed: %r", settle, exc)
        self._queue.run_deferred()
        # Spans ending from now on (threads still running, tracers bound before) are dropped
        # and counted: the last batch would miss them, or nothing would take them out of the
        # queue any more (they were lost uncounted: 340-2000 spans of threads running on).
        queue, dropped_before = self._queue, self._queue.dropped
        queue.max_entries = 0
        timeout = self.config.exit_flush_timeout_s if timeout_millis is None else timeout_millis / 1000
        flushed = self._exporter.shutdown(timeout)
        left = len(queue.queue) // FIELDS   # ended by a thread between its check and its append
        queue.queue.clear()
        queue.dropped += left
        late = queue.dropped - dropped_before
        if late:
            log.warning("crosstrace: %d spans that ended while the tracer shut down were dropped "
                        "(threads still running at shutdown or at exit)", late)
        return flushed

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        done, self._shut_down = self._shut_down.is_set(), threading.Event()   # a waiter's lock may be held
        if done:
            self._shut_down.set()
        self._queue.reset_after_fork()
        if self._exporter is not None and not self._shutdown:
            self._exporter = self._exporter.restart_after_fork()


# The live providers, for one exit hook and one fork hook for them all: a pair per provider
# stayed registered for good (fork() ran every one made so far).
_providers: "weakref.WeakSet[TracerProvider]" = weakref.WeakSet()


# Instrumentation that ends its spans on other threads after the traced call returned (DDP's
# bucket callbacks) settles them here, briefly, before the queue closes to spans.
_before_shutdown: list = []


def before_shutdown(settle) -> None:
    """Have every provider's shutdown call `settle()` first (once registered, for good)."""
    if settle not in _before_shutdown:
        _before_shutdown.append(settle)


def _at_exit() -> None:
    providers = list(_providers)
    try:
        if any(p._exporter is not None and p._exporter.takes_handovers() for p in providers):
            # Forked children (DataLoader workers) that hand over to this process are ended
            # or joined by multiprocessing's exit hook, which was registered first and so
            # would run after this one: run first, it leaves their last handovers to take.
            # (Run from there, a stop of it, Ctrl-C in a join, cost this process's spans.)
            mp_util._exit_function()
    finally:
        for provider in providers:
            _exit_hook(provider)


def _before_fork() -> None:
    for provider in list(_providers):
        if provider._exporter is not None:
            provider._exporter.before_fork()


def _after_fork_in_parent() -> None:
    for provider in list(_providers):
        if provider._exporter is not None:
            provider._exporter.forked()


def _after_fork() -> None:
    for provider in list(_providers):
        provider._after_fork_in_child()
    sigterm.forget_after_fork()


atexit.register(_at_exit)
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork)


def _exit_hook(provider: TracerProvider) -> None:
    """Flush at exit, and say what did not reach the collector: a job that ran without one
    exited quietly, its spans lost."""
    if provider.shutdown() or provider._exporter is None:
        return   # (a shutdown() of the program's own that failed is reported here too)
    spooled, lost = provider._exporter.unacked_spans()
    cfg = provider.config
    if spooled:
        log.warning("crosstrace: exiting with %d %s the collector at %s has not acknowledged, kept in %s "
                    "for the next process there", spooled, _spans(spooled), cfg.endpoint, cfg.spool_dir)
    if lost:
        log.warning("crosstrace: exiting with %d %s the collector at %s has not acknowledged: lost",
                    lost, _spans(lost), cfg.endpoint)


def _spans(n: int) -> str:
    return "span" if n == 1 else "spans"


def _in_multiprocessing_child(provider: TracerProvider) -> None:
    """Its spans are flushed when it exits, and handed over when SIGTERM ends it."""
    mp_util.Finalize(provider, provider.shutdown, exitpriority=100)
    if provider._exporter is not None and not provider._shutdown:
        sigterm.install(_shut_down_all)


def _shut_down_all() -> None:
    for provider in list(_providers):
        provider.shutdown()
