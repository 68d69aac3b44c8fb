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
from crosstrace.tracer.provider import Tracer, _COMPILED

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
print(json.dumps({"compiled": _COMPILED, "grown": grown, "wakes": wakes[:50], "dropped": queue.dropped,
                  "spans": [described(columns) for columns in taken]}))
"""


def _scenario(env=None) -> dict:
    return json.loads(run_python(SCENARIO, env=env, args=("300",), timeout=120).stdout)


def _compiler() -> str | None:
    return shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])


@pytest.mark.skipif(os.environ.get("CROSSTRACE_PURE_PYTHON") or not _compiler(), reason="no compiled hot path here")
def test_the_compiled_hot_path_is_built_and_used():
    assert compiled.hot_path is not None, "tracer/_hotpath.c was not built: pip install -e . with a C compiler"
    assert provider._COMPILED
    assert provider.Tracer.start_as_current_span is compiled.TracerFields._start_scoped
    assert provider.ScopedSpan.__enter__ is compiled.SpanFields._scoped_enter


@pytest.mark.skipif(compiled.hot_path is None, reason="no compiled hot path here")
def test_compiled_and_python_record_every_case_alike():
    ours, python = _scenario(), _scenario(PURE)
    assert ours["compiled"] and not python["compiled"]
    assert ours["grown"] == 0, "the compiled path left objects behind"
    assert ours["dropped"] > 0 and ours["wakes"]   # the queue filled up, and woke the exporter on the way
    for key in ("spans", "wakes", "dropped"):
        assert ours[key] == python[key], key
    names = {row[0] for columns in ours["spans"] for row in columns}
    assert {"root", "server", "typed", "keywords", "linked", "raises", "beside baggage", "entered twice",
            "decorated", "in a task"} <= names


def test_the_python_implementation_alone_passes_the_api_tests():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             os.path.join("tests", "test_otel_api.py")], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env={**os.environ, **PURE})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


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
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), REPO], capture_output=True, text=True, timeout=300,
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
    print(provider._COMPILED, tracer.force_flush(30_000))
    """
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(target)})   # (not in the clone: its crosstrace/)
    assert result.stdout.split() == ["False", "True"], result.stdout + result.stderr
