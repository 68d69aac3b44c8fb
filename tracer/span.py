"""The span record: a slotted object that implements the OpenTelemetry Span API.

Its hot path is two clock reads, a thread id, and an append to the export queue on
end(). Nothing is validated or encoded here: the exporter thread does that for whole
batches.

What end() queues is the span's fields and attributes (ExportQueue says why), not the
span itself, which dies at end() unless its caller keeps it.
"""
import collections
import json
import logging
import threading
import traceback

from opentelemetry import trace as trace_api
from opentelemetry.trace.status import Status as OtelStatus, StatusCode

from ..proto.attributes_json import dumps
from ..proto.semconv import OTEL_KINDS, Kind, Status
from .compiled import SpanFields

log = logging.getLogger("crosstrace.tracer")

# As OpenTelemetry's SDK bounds them: a span that lives long (an epoch) and notes an event
# per step would otherwise grow without end, and so would its batch.
MAX_EVENTS = MAX_LINKS = 128

_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
_EXTRAS_MADE = threading.Lock()   # see Span._extras
_DEFAULT_TRACE_STATE = trace_api.DEFAULT_TRACE_STATE

OTEL_KIND = {trace_api.SpanKind.INTERNAL: Kind.INTERNAL,
             **{trace_api.SpanKind[name]: kind for name, kind in OTEL_KINDS.items()}}
_STATUS = {StatusCode.UNSET: Status.UNSET, StatusCode.OK: Status.OK, StatusCode.ERROR: Status.ERROR}
_STATUS.update({code.value: status for code, status in _STATUS.items()})   # set_status(2), Status(2)


class Span(SpanFields):
    """A recording span. Rarely used parts (status, events, links, trace state) live in
    one optional `SpanExtras`, so that the common span sets few slots.

    Registered as a virtual subclass of opentelemetry.trace.Span rather than inheriting
    from it: the API class has no __slots__, and a __dict__ would cost every queued span.
    Only Tracer makes spans, filling the slots itself (an __init__ frame is measurable).
    """

    __slots__ = ()

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns:   # logged, as OpenTelemetry's SDK does: a warning could raise into the caller
            log.warning("crosstrace: span %r ended twice; the second end() is ignored", self.name)
            return
        sink = self._sink   # ScopedSpan._exit and _hotpath.c's queue_span copy what follows: keep them alike
        end = self.end_ns = sink.now() if end_time is None else sink.clock.from_epoch_ns(end_time)
        queue = sink.queue
        if len(queue) < sink.max_entries:
            queue.extend((self.trace_id, self.span_id, self.parent_id, self.name, self.kind, self.start, end,
                          self.thread, self.extras, self.attributes))
            if len(queue) == sink.wake_at:
                sink.wake()
        else:
            sink.dropped += 1

    @property
    def trace_state(self):
        return self.extras.trace_state if self.extras is not None else None

    @property
    def status(self) -> int:
        return self.extras.status if self.extras is not None else 0

    def _extras(self) -> "SpanExtras":
        """Made on first use, under a lock: two threads annotating one span at once (a status
        and an event) each made one, and one's was lost. Spans without extras never lock."""
        extras = self.extras
        if extras is None:
            with _EXTRAS_MADE:
                if self.extras is None:
                    self.extras = SpanExtras()
                extras = self.extras
        return extras

    def get_span_context(self) -> trace_api.SpanContext:
        return trace_api.SpanContext(self.trace_id, self.span_id, False, _SAMPLED,
                                     self.trace_state or _DEFAULT_TRACE_STATE)

    def set_attribute(self, key: str, value) -> None:
        if self.end_ns:
            return
        if value.__class__ not in _AS_IS:   # kept as it is now: the caller may change it
            value = frozen(value)
        if self.attributes is None:
            self.attributes = {key: value}
        else:
            self.attributes[key] = value

    def set_attributes(self, attributes) -> None:
        if self.end_ns or not attributes:
            return
        if self.attributes is None:
            self.attributes = own_attributes(attributes)
        else:
            self.attributes.update(own_attributes(attributes))

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        if self.end_ns:
            return
        clock = self._sink.clock
        t = clock.now() if timestamp is None else clock.from_epoch_ns(timestamp)
        self._extras().events.append((name, t, own_attributes(attributes) if attributes else None))

    def add_link(self, context: trace_api.SpanContext, attributes=None) -> None:
        if self.end_ns or context is None:
            return
        link = trace_api.Link(context, own_attributes(attributes) if attributes else None)
        if recordable(link):
            self._extras().links.append(link)

    def update_name(self, name: str) -> None:
        if not self.end_ns:
            self.name = name

    def is_recording(self) -> bool:
        return not self.end_ns

    def set_status(self, status, description: str | None = None) -> None:
        if self.end_ns:
            return
        if isinstance(status, OtelStatus):
            code, description = status.status_code, status.description
        else:
            code = status
        try:
            status = _STATUS[code]
        except (KeyError, TypeError):   # not a StatusCode: never raised into the caller
            log.debug("crosstrace: set_status(%r) on span %r is not a status; ignored", code, self.name)
            return
        # OpenTelemetry: OK is final, and UNSET never overrides a set status.
        if self.status == Status.OK or status == Status.UNSET:
            return
        extras = self._extras()
        extras.status = status
        extras.status_message = description if status == Status.ERROR and description else None

    def record_exception(self, exception: BaseException, attributes=None, timestamp=None,
                         escaped: bool = False) -> None:
        kind = type(exception)
        module = kind.__module__
        event_attributes = {   # the type fully qualified, as OpenTelemetry's SDK and conventions have it
            "exception.type": f"{module}.{kind.__qualname__}" if module and module != "builtins" else kind.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": escaped,
        }
        if attributes:
            event_attributes.update(attributes)
        self.add_event("exception", event_attributes, timestamp)

    def __enter__(self) -> "Span":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """`with tracer.start_span(...)`: what was raised is recorded, unless start_span was
        told not to; a KeyboardInterrupt too, as OpenTelemetry's SDK records it there (its
        start_as_current_span records Exceptions only: GeneratorExit is no error)."""
        if not self.end_ns:
            if exc is not None:
                self._raised(exc)
            self.end()

    def _raised(self, exc: BaseException) -> None:
        """An exception escaped the span: an exception event and an ERROR status (as far
        as start_span's record_exception and set_status_on_exception allow)."""
        extras = self.extras
        if extras is None or extras.record_exception:
            self.record_exception(exc, escaped=True)
        if extras is None or extras.set_status_on_exception:
            self.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        return (f"Span({self.name!r}, trace_id={self.trace_id:032x}, span_id={self.span_id:016x}, "
                f"kind={Kind(self.kind).name})")


trace_api.Span.register(Span)


class RemoteParent(Span):
    """A caller's span known only by its ids (from a traceparent header): the parent of a
    server span, without building an OpenTelemetry SpanContext on every call. It is never
    current, recorded or exported."""

    __slots__ = ()

    def __init__(self, trace_id: int, span_id: int):
        self.trace_id, self.span_id, self.extras, self.end_ns = trace_id, span_id, None, 1

    def get_span_context(self) -> trace_api.SpanContext:
        return trace_api.SpanContext(self.trace_id, self.span_id, True, _SAMPLED, _DEFAULT_TRACE_STATE)


class UnsampledSpan(trace_api.NonRecordingSpan):
    """The current span of a trace that is not sampled (a step not traced, a request whose
    caller did not sample it), known by its class: a span started under it records
    nothing and leaves the context as it is, without reading the SpanContext's flags or
    making a Context. Each of those Python calls costs microseconds right after a
    training step's compute (cold caches), where an unsampled step's spans start."""

    def __init__(self, trace_id: int, span_id: int, flags: int = 0):   # (NonRecordingSpan's would make the SpanContext)
        self.trace_id, self.span_id, self.flags, self._context = trace_id, span_id, flags, None

    def get_span_context(self) -> trace_api.SpanContext:
        """Made when first asked for (to propagate it, say): crosstrace's own paths never ask.
        Flags beside the sampled one (W3C level 2's random flag) are passed on as they came."""
        if self._context is None:
            self._context = trace_api.SpanContext(self.trace_id, self.span_id, True,
                                                  trace_api.TraceFlags(self.flags & ~trace_api.TraceFlags.SAMPLED))
        return self._context

    def __repr__(self) -> str:
        return f"UnsampledSpan(trace_id={self.trace_id:032x}, span_id={self.span_id:016x})"


class SpanExtras:
    __slots__ = ("status", "status_message", "events", "links", "trace_state", "record_exception",
                 "set_status_on_exception")

    def __init__(self, links=(), trace_state=None):
        self.status = 0
        self.status_message = None
        self.events = collections.deque(maxlen=MAX_EVENTS)   # the newest MAX_EVENTS, as in the SDK
        self.links = collections.deque(links, maxlen=MAX_LINKS)   # the newest MAX_LINKS, likewise
        self.trace_state = trace_state
        self.record_exception = self.set_status_on_exception = True   # start_span's flags


def own_attributes(attributes) -> dict:
    """A copy of `attributes` that the caller cannot change any more, since the values are
    read when the span is exported: lists become tuples (as in OpenTelemetry's SDK), dicts
    are copied, with the lists and dicts in them, and other objects are taken as text now."""
    attributes = dict(attributes)
    if not _AS_IS.issuperset(map(type, attributes.values())):
        for key, value in attributes.items():
            if value.__class__ not in _AS_IS:
                attributes[key] = frozen(value)
    return attributes


_IMMUTABLE = (str, int, float, bytes, tuple)   # kept as they are, subclasses (an IntEnum) too
_AS_IS = frozenset((*_IMMUTABLE, bool, type(None)))   # the classes frozen() need not see


def frozen(value):
    """An attribute value as it is now, for good: a list as a tuple (at C speed: the values
    OpenTelemetry allows in one are plain), a dict copied all the way down (a dict inside
    itself one level only: its span alone then fails to encode, nothing is raised here),
    another immutable value as it is, and any other object as what the exporter will write
    of it (a dataclass's fields, an enum's value, a numpy array's or a tensor's text):
    written at export, it was the object as the program had changed it since, and its
    __str__ ran on the exporter's thread."""
    kind = value.__class__
    if kind is list:
        return tuple(value)
    if kind is dict:
        try:
            return {key: frozen(item) if item.__class__ not in _AS_IS else item for key, item in value.items()}
        except RecursionError:
            return dict(value)
    if isinstance(value, _IMMUTABLE):
        return value
    try:
        return json.loads(dumps({"v": value}))["v"]
    except Exception as exc:   # its __str__ raised: the span is kept, with what went wrong
        return f"<{kind.__qualname__}: str() raised {exc!r}>"


def recordable(link) -> bool:
    """OpenTelemetry keeps a link to an invalid context when it has attributes or a trace state."""
    context = link.context
    return context.is_valid or bool(link.attributes) or bool(context.trace_state)


def own_links(links) -> list:
    """The links to record of those given at a span's start, their attributes copied (None
    among them skipped, as OpenTelemetry's SDK skips it)."""
    return [trace_api.Link(link.context, own_attributes(link.attributes)) if link.attributes else link
            for link in links if link is not None and recordable(link)]
