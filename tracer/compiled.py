"""The tracer's compiled hot path (tracer/_hotpath.c), and the field layouts it reads.

The C module runs the common case of `with tracer.start_as_current_span(...)` and hands
every other case to the Python implementation (provider.py). It defines the types that
hold the fields it reads and writes: a span's, a tracer's and the export queue's. Where
it was not built (no compiler at install) or CROSSTRACE_PURE_PYTHON is set, these layouts
are plain slotted classes and the tracer runs in Python alone, the same way.
"""
import os


def _load():
    if os.environ.get("CROSSTRACE_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from . import _hotpath
    except ImportError:
        return None
    _hotpath.seed(os.urandom(32))   # span ids; a forked child draws its own, as `random` does
    os.register_at_fork(after_in_child=lambda: _hotpath.seed(os.urandom(32)))
    return _hotpath


hot_path = _load()

if hot_path is not None:
    SpanFields, TracerFields, QueueFields = hot_path.SpanFields, hot_path.TracerFields, hot_path.QueueFields
else:
    class SpanFields:
        __slots__ = ("trace_id", "span_id", "parent_id", "name", "kind", "start", "end_ns", "thread",
                     "attributes", "extras", "_sink", "_token",
                     "__weakref__")   # (weakly referenced, as the SDK's spans can be)

    class TracerFields:
        __slots__ = ("_queue", "_now")

    class QueueFields:
        __slots__ = ("now", "queue", "max_entries", "wake_at", "wake", "dropped")
