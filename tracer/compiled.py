"""The tracer's compiled hot path (tracer/_hotpath.c), and the field layouts it reads.

The C module runs the common case of `with tracer.start_as_current_span(...)` and hands
every other case to the Python implementation (provider.py). It defines the types that
hold the fields it reads and writes: a span's, a tracer's and the export queue's. Where
it was not built (no compiler at install) or CROSSTRACE_PURE_PYTHON is set, these layouts
are plain slotted classes and the tracer runs in Python alone, the same way.
"""
import importlib
import os
import warnings

from .config import flag_from_env


def _load():
    """(the module, None), or (None, why the tracer runs in Python)."""
    if flag_from_env("CROSSTRACE_PURE_PYTHON"):
        return None, "CROSSTRACE_PURE_PYTHON set"
    name = f"{__package__}._hotpath"
    try:
        _hotpath = importlib.import_module(name)
    except ImportError as exc:   # not there; or built, and broken: said, as the tracer then runs slower
        if isinstance(exc, ModuleNotFoundError) and exc.name == name:
            return None, "not built: no C compiler?"
        warnings.warn(f"crosstrace: the tracer's compiled hot path did not load ({exc}); it runs in Python",
                      RuntimeWarning, stacklevel=2)
        return None, f"the extension did not load: {exc}"
    _hotpath.seed(os.urandom(32))   # span ids; a forked child draws its own, as `random` does
    os.register_at_fork(after_in_child=lambda: _hotpath.seed(os.urandom(32)))
    return _hotpath, None


hot_path, why_python = _load()

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
