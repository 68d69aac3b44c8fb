"""The compiled hot path (tracer/_hotpath.c) against the Python implementation it stands in for.

Both record the same spans the same way, whichever case a call is (the C code runs the
common ones and hands the rest to Python); the Python implementation alone passes the
API tests; a forked child draws ids of its own; and an install without a compiler still
works, in Python.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from crosstrace.tracer import compiled, provider

from .conftest import REPO, run_python

PURE = {"CROSSTRACE_PURE_PYTHON": "1"}

# Every kind of call start_as_current_span and a ScopedSpan's with-block get: what each
# queues is printed by its fields, the ids as which span is whose parent, and the run is
# repeated to see that nothing it makes is left behind.
SCENARIO = r"""
import asyncio, gc, json, logging, sys
from opentelemetry import baggage, context, trace
from crosstrace.tracer.clock import Clock
from crosstrace.tracer.exporter import ExportQueue
from crosstrace.tracer.provider import Tracer, COMPILED
from crosstrace.proto.semconv import Kind

logging.disable(logging.CRITICAL)
queue = ExportQueue(Clock(), max_queue=40, batch_size=8)
wakes = []
queue.wake = lambda: wakes.append(len(queue.queue))
tracer = Tracer(queue)
taken = []

def calls(i):
    with tracer.start_as_current_span("root", attributes={"i": i, "b": "x"}) as root:
        with tracer.start_as_current_span("server", kind=trace.SpanKind.SERVER):
            pass
        with tracer.start_as_current_span("typed", None, attributes={"crosstrace.kind": "compute"}):
            pass
        with tracer.start_as_current_span("typed beside", kind=trace.SpanKind.CLIENT,
                                          attributes={"crosstrace.kind": "data", "b": 1}):
            pass
        with tracer.start_as_current_span("typed in capitals", attributes={"crosstrace.kind": "COMPUTE"}):
            pass
        with tracer.start_as_current_span("typed wrongly", attributes={"crosstrace.kind": 3}):
            pass
        with tracer.start_as_current_span("crosstrace kind", kind=Kind.COLLECTIVE):
            pass
        with tracer.start_as_current_span("kind none", kind=None, attributes={"x": 1}):
            pass
        with tracer.start_as_current_span(name="keywords", attributes={}, end_on_exit=True) as span:
            span.set_attribute("late", [1, 2])
        with tracer.start_as_current_span("linked", links=[trace.Link(root.get_span_context())]):
            pass
    try:
        with tracer.start_as_current_span("raises"):
            raise ValueError("boom")
    except ValueError:
        pass
    token = context.attach(baggage.set_baggage("k", "v"))
    with tracer.start_as_current_span("beside baggage"):
        pass
    context.detach(token)
    span = tracer.start_as_current_span("entered twice")
    with span:
        try:
            with span:
                pass
        except RuntimeError:
            pass
    span.__exit__(None, None, None)
    tracer.start_as_current_span("never entered").__exit__(None, None, None)
    try:
        tracer.start_as_current_span("bad", bogus=1)
    except TypeError:
        pass
    with trace.use_span(trace.NonRecordingSpan(trace.SpanContext(1, 2, False))):
        with tracer.start_as_current_span("unsampled"):
            pass
    decorated = tracer.start_as_current_span("decorated")(lambda: None)
    decorated()
    if i % 10 == 0:
        async def task():
            with tracer.start_as_current_span("in a task") as span:
                await asyncio.sleep(0)
                return span.thread != __import__("threading").get_ident()
        assert asyncio.run(task())
    if i % 5 == 4:
        taken.append(queue.take())

def described(columns):
    trace_ids, span_ids, parents, names, kinds, starts, ends, threads, extras, attributes = columns
    name_of = dict(zip(span_ids, names))
    trace_of = dict(zip(span_ids, trace_ids))
    rows = []
    for k in range(len(names)):
        assert 0 < starts[k] <= ends[k] and span_ids[k] and trace_ids[k]
        rows.append([names[k], kinds[k], name_of.get(parents[k], parents[k] and "?"),
                     parents[k] == 0 or trace_of.get(parents[k], trace_ids[k]) == trace_ids[k],
                     attributes[k], extras[k] and [extras[k].status, len(extras[k].events), len(extras[k].links)]])
    return rows

def objects_after(runs):
    for i in range(runs):
        calls(i)
    taken.clear()
    gc.collect()
    return len(gc.get_objects())

before = objects_after(int(sys.argv[1]))
grown = objects_after(int(sys.argv[1])) - before
for i in range(8):
    calls(i)
print(json.dumps({"compiled": COMPILED, "grown": grown, "wakes": wakes[:50], "dropped": queue.dropped,
                  "spans": [described(columns) for columns in taken]}))
"""


# What the compiled path must not crash on, and answer as Python does: objects it holds
# changed or freed by Python code that runs inside it (a clock, a finalizer, a log filter),
# unset fields, limits that are not plain ints, a queue that is not a list, odd calls.
ODD_CASES = r"""
import collections, contextvars, gc, logging, sys
from crosstrace.tracer.clock import Clock
from crosstrace.tracer.exporter import ExportQueue
from crosstrace.tracer.provider import Tracer

def made(max_queue=100, batch_size=10):
    queue = ExportQueue(Clock(), max_queue, batch_size)
    return queue, Tracer(queue)

def outcome(case, run):
    try:
        result = run()
        print(case, "ok", result)
    except Exception as exc:
        print(case, type(exc).__name__)
    sys.stdout.flush()

def no_queue():
    queue, tracer = made()
    del tracer._queue
    tracer.start_as_current_span("x")
outcome("tracer without a queue", no_queue)

def trace_id_deleted():
    queue, tracer = made()
    with tracer.start_as_current_span("x") as span:
        del span.trace_id
outcome("trace id deleted inside", trace_id_deleted)

class Once:
    raised = False
    def __bool__(self):
        if not Once.raised:
            Once.raised = True
            raise KeyError("first")
        return False
def trace_id_raises():
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    span.trace_id = Once()
    span.__enter__()
outcome("trace id whose truth raises", trace_id_raises)

def sink_swapped_by_its_clock():
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    span.__enter__()
    other = ExportQueue(Clock(), 100, 10)
    def now():
        span._sink = queue   # the last reference to `other`
        [[i] for i in range(2000)]
        return 5
    other.now = now
    span._sink = other
    del other
    span.__exit__(None, None, None)
    return len(queue.queue)
outcome("queue freed by its own clock", sink_swapped_by_its_clock)

class DeletesWhenCollected:   # deletes obj.<name> in a finalizer a collection runs (a cycle: only one frees it)
    def __init__(self, obj, name):
        self.obj, self.name, self.me = obj, name, self
    def __del__(self):
        try:
            delattr(self.obj, self.name)
        except AttributeError:
            pass
def sink_deleted_by_a_collection(threshold):
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    gc.collect()
    DeletesWhenCollected(span, "_sink")
    gc.set_threshold(threshold)
    try:
        with span:
            pass
    finally:
        gc.set_threshold(700)
for threshold in range(1, 8):
    outcome(f"queue deleted by a collection ({threshold})", lambda: sink_deleted_by_a_collection(threshold))

def sink_replaced_by_a_log_filter():
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    contextvars.copy_context().run(span.__enter__)
    class Replace(logging.Filter):
        def filter(self, record):
            span._sink = "elsewhere"
            return False
    log = logging.getLogger("crosstrace.tracer")
    log.setLevel(logging.DEBUG)
    log.addFilter(Replace())
    try:
        span.__exit__(None, None, None)
    finally:
        log.filters.clear()
outcome("queue replaced while leaving another context", sink_replaced_by_a_log_filter)

def limits(max_entries, wake_at, queue_list=None):
    queue, tracer = made(1e6, 8.0)
    if max_entries is not None:
        queue.max_entries = max_entries
    queue.wake_at = wake_at
    queue.wake = lambda: woken.append(1)
    if queue_list is not None:
        queue.queue = queue_list
    woken = []
    for _ in range(12):
        with tracer.start_as_current_span("x"):
            pass
    return len(queue.queue), len(woken), queue.dropped
outcome("float limits", lambda: limits(None, 40.0))
outcome("limits beyond 64 bits", lambda: limits(2 ** 70, None))
outcome("a deque for a queue", lambda: limits(60, 30, collections.deque()))

def queue_deleted_while_starting(threshold):
    queue, tracer = made()
    gc.collect()
    DeletesWhenCollected(tracer, "_queue")
    gc.set_threshold(threshold)
    try:
        for _ in range(5):
            tracer.start_as_current_span("x", attributes={"a": 1})
    finally:
        gc.set_threshold(700)
for threshold in (1, 2, 3):
    outcome(f"tracer's queue deleted by a collection ({threshold})", lambda: queue_deleted_while_starting(threshold))

def trace_id_deletes_itself():
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    class Deletes:
        def __bool__(self):
            del span.trace_id
            return False
    span.trace_id = Deletes()
    with span:
        pass
    return len(queue.queue)
outcome("trace id deleted by its own truth", trace_id_deletes_itself)

def fields_changed_by_getattr():
    from crosstrace.tracer.provider import ScopedSpan
    queue, tracer = made()
    class Changes(ScopedSpan):
        __slots__ = ()
        def __getattr__(self, name):
            self.thread = 2 ** 200 + 1
            self.attributes = {"new": 1}
    span = tracer.start_as_current_span("x", attributes={"a": [1]})
    span.__class__ = Changes
    span.__enter__()
    span.thread = 2 ** 200
    del span.trace_id
    span.__exit__(None, None, None)
    return [queue.queue[i] for i in (0, 7, 9)]
outcome("fields changed while the span is queued", fields_changed_by_getattr)

def copies():
    import copy, inspect
    queue, tracer = made()
    span = tracer.start_as_current_span("x", attributes={"a": 1})
    copied = copy.copy(span)
    return (copied.name, copied.attributes, type(copy.copy(tracer)).__name__, copy.copy(queue).max_entries,
            span.__weakref__, list(inspect.signature(tracer.start_as_current_span).parameters)[:4])
outcome("copies and signatures", copies)

def exit_called(*args, **kwargs):
    queue, tracer = made()
    span = tracer.start_as_current_span("x")
    span.__enter__()
    span.__exit__(*args, **kwargs)
    return len(queue.queue)
outcome("exit with no arguments", lambda: exit_called())
outcome("exit with four", lambda: exit_called(None, None, None, None))
outcome("exit with keywords", lambda: exit_called(exc_type=None, exc=None, tb=None))
"""


def _scenario(env=None) -> dict:
    return json.loads(run_python(SCENARIO, env=env, args=("300",), timeout=120).stdout)


def _compiler() -> str | None:
    return shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])


@pytest.mark.skipif(compiled.why_python == "CROSSTRACE_PURE_PYTHON set" or not _compiler(),
                    reason="no compiled hot path here")
def test_the_compiled_hot_path_is_built_and_used():
    assert compiled.hot_path is not None, "tracer/_hotpath.c was not built: pip install -e . with a C compiler"
    assert provider.COMPILED
    assert provider.Tracer.start_as_current_span is compiled.TracerFields._start_scoped
    assert provider.ScopedSpan.__enter__ is compiled.SpanFields._scoped_enter

    def version(value: str) -> subprocess.CompletedProcess:
        return subprocess.run(["crosstrace", "--version"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "CROSSTRACE_PURE_PYTHON": value})

    for value in ("", "0", "false", "Off"):
        assert version(value).stdout.strip() == "crosstrace 0.1.0 (tracer hot path: compiled)", value
    for value in ("1", "true", " yes "):
        assert version(value).stdout.strip() == \
            "crosstrace 0.1.0 (tracer hot path: Python (CROSSTRACE_PURE_PYTHON set))", value
    typo = version("ture")   # reported, and read as off, as the other on/off settings are
    assert "(tracer hot path: compiled)" in typo.stdout and "CROSSTRACE_PURE_PYTHON='ture'" in typo.stderr


@pytest.mark.skipif(compiled.hot_path is None, reason="no compiled hot path here")
def test_compiled_and_python_record_every_case_alike():
    ours, python = _scenario(), _scenario(PURE)
    assert ours["compiled"] and not python["compiled"]
    assert ours["grown"] == 0, "the compiled path left objects behind"
    assert ours["dropped"] > 0 and ours["wakes"]   # the queue filled up, and woke the exporter on the way
    for key in ("spans", "wakes", "dropped"):
        assert ours[key] == python[key], key
    names = {row[0] for columns in ours["spans"] for row in columns}
    assert {"root", "server", "typed", "typed beside", "typed in capitals", "crosstrace kind", "keywords", "linked", "raises", "beside baggage", "entered twice",
            "decorated", "in a task"} <= names


@pytest.mark.skipif(compiled.hot_path is None, reason="no compiled hot path here")
def test_compiled_and_python_answer_odd_cases_alike():
    ours, python = (run_python(ODD_CASES, env=env, timeout=120).stdout.splitlines() for env in ({}, PURE))
    assert len(ours) == 24
    assert ours == python


def test_the_python_implementation_alone_passes_the_api_tests():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             os.path.join("tests", "test_otel_api.py")], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env={**os.environ, **PURE})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.skipif(compiled.hot_path is None, reason="no compiled hot path here")
def test_compiled_columns_are_numpys():
    """The exporter's columns: the same bytes as numpy makes, and an error where numpy's
    (or int.to_bytes's) raises, so that the exporter finds the span that cannot be encoded."""
    import numpy as np
    hot = compiled.hot_path
    u64 = [0, 1, 2 ** 63, 2 ** 64 - 1, True, 12345678901234567]
    i64 = [0, -1, -2 ** 63, 2 ** 63 - 1, 1_700_000_000_000_000_000]
    u128 = [1, 2 ** 64, 2 ** 128 - 1, 0xDEADBEEF << 70]
    assert hot.pack_u64(u64) == np.fromiter(u64, "<u8").tobytes()
    assert hot.pack_i64(i64) == np.fromiter(i64, "<i8").tobytes()
    pairs = np.frombuffer(b"".join(t.to_bytes(16, "little") for t in u128), "<u8")
    assert hot.pack_u128(u128) == (pairs[1::2].tobytes(), pairs[0::2].tobytes())
    assert hot.pack_u64([]) == b"" and hot.pack_u128([]) == (b"", b"")
    class Shrinks:
        def __index__(self):
            column.clear()
            return 1
    column = [Shrinks()] + [2 ** 62 + i for i in range(1000)]
    with pytest.raises(RuntimeError):
        hot.pack_i64(column)
    assert hot.pack_u64([np.uint64(7), np.int64(8)]) == np.fromiter([7, 8], "<u8").tobytes()
    for pack, bad in ((hot.pack_u64, -1), (hot.pack_u64, 2 ** 64), (hot.pack_i64, 2 ** 63), (hot.pack_u64, None),
                      (hot.pack_u128, -1), (hot.pack_u128, 2 ** 128), (hot.pack_u128, "1")):
        with pytest.raises((OverflowError, TypeError)):
            pack([1, bad])


@pytest.mark.parametrize("env", [{}, PURE], ids=["as installed", "python"])
def test_processes_that_seed_random_alike_draw_ids_of_their_own(env):
    """ML programs seed `random` alike on every rank (random.seed(1234)): the ids drawn from
    it were the same on every rank, in the traces that start outside a training step."""
    code = """
    import random
    from crosstrace.tracer.clock import Clock
    from crosstrace.tracer.exporter import ExportQueue
    from crosstrace.tracer.provider import Tracer
    random.seed(1234)
    tracer = Tracer(ExportQueue(Clock(), 100, 10))
    with tracer.start_as_current_span("scoped") as scoped:
        pass
    started = tracer.start_span("started")
    print(scoped.trace_id, scoped.span_id, started.trace_id, started.span_id)
    """
    first, second = (run_python(code, env=env).stdout.split() for _ in range(2))
    assert not set(first) & set(second)


@pytest.mark.parametrize("env", [{}, PURE], ids=["as installed", "python"])
def test_a_forked_child_draws_ids_of_its_own(env):
    code = """
    import os
    from crosstrace.tracer.clock import Clock
    from crosstrace.tracer.exporter import ExportQueue
    from crosstrace.tracer.provider import Tracer
    tracer = Tracer(ExportQueue(Clock(), 100, 10))
    read, write = os.pipe()
    pid = os.fork()
    with tracer.start_as_current_span("after the fork") as span:
        ids = f"{span.trace_id} {span.span_id}"
    if pid == 0:
        os.write(write, ids.encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(ids, os.read(read, 100).decode())
    """
    parent_trace, parent_span, child_trace, child_span = run_python(code, env=env).stdout.split()
    assert parent_trace != child_trace and parent_span != child_span


@pytest.mark.skipif(not _compiler(), reason="needs a compiler to show the build failing")
def test_an_install_without_a_compiler_traces_in_python(tmp_path, collector):
    """The extension is optional: where it cannot be built, the install goes on."""
    target, source = tmp_path / "site", tmp_path / "source"   # (a copy: pip builds in the source's build/)
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.so", "*.egg-info",
                                                                "__pycache__", "crosstrace-demo"))
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(source)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "CC": "/bin/false", "PIP_NO_INPUT": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    assert not list(target.glob("crosstrace/tracer/_hotpath*.so")), "it was built after all"
    code = f"""if True:
    import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
    import crosstrace
    from crosstrace.tracer import provider
    assert crosstrace.__file__.startswith({str(target)!r}), crosstrace.__file__
    tracer = crosstrace.TracerProvider(endpoint={collector.address!r}, node_id="no-compiler")
    with tracer.get_tracer("t").start_as_current_span("a"):
        pass
    print(provider.COMPILED, tracer.force_flush(30_000))
    """
    env = {**os.environ, "PYTHONPATH": str(target), "CROSSTRACE_PURE_PYTHON": ""}   # Python for want of a build only
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=env)   # (not in the clone: its crosstrace/)
    assert result.stdout.split() == ["False", "True"], result.stdout + result.stderr
    version = subprocess.run([sys.executable, "-c", "import sys; sys.meta_path[:] = [f for f in sys.meta_path if "
                              "'editable' not in repr(f).lower()]; from crosstrace.cli import main; main(['--version'])"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert "(tracer hot path: Python (not built: no C compiler?))" in version.stdout, version.stderr
