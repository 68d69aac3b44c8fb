"""crosstrace.step: one trace per training step that every rank derives alike, sampling
alike on every rank, with crosstrace's provider (real tracer processes into a real
collector) and with the OpenTelemetry SDK as the global provider."""
import json

import numpy as np
import pytest

import crosstrace
from crosstrace.collector.report import analyse_report
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind, Status
from crosstrace.tracer.step import step_trace_id

from .conftest import load_table, run_python, tracer_env

TRAINING_LOOP = """
import crosstrace
from opentelemetry import trace

provider = crosstrace.init()
tracer = trace.get_tracer("train")

for k in range(6):
    with crosstrace.step(k, every=2):                 # steps 0, 2, 4 are traced
        with tracer.start_as_current_span("forward", attributes={"crosstrace.kind": "compute"}):
            pass

@crosstrace.step
def train_step():                                     # steps 6 and 7: numbers continue
    with tracer.start_as_current_span("forward"):
        pass

train_step()
train_step()
for batch in crosstrace.steps(["a", "b"]):            # steps 8, 9; fetching 10 ends the loop
    with tracer.start_as_current_span("forward"):
        pass
try:
    with crosstrace.step(20):
        raise ValueError("boom")
except ValueError:
    pass
for batch in crosstrace.steps(range(100), start=30):  # step 30, closed by the break
    break
provider.shutdown()
"""


def spans_of(table) -> list[dict]:
    return [{"name": table.names[table.name[i]], "kind": int(table.kind[i]), "node": table.nodes[table.node[i]],
             "trace": table.trace_ids[table.trace[i]], "span_id": int(table.span_id[i]),
             "parent": int(table.parent_id[i]), "status": int(table.status[i]), "a": table.attributes[i] or {}}
            for i in range(len(table))]


def test_step_trace_id_is_a_function_of_job_and_step():
    ids = {step_trace_id(job, k) for job in ("a", "b") for k in range(1000)}
    assert len(ids) == 2000 and all(0 < t < 1 << 128 for t in ids)
    assert step_trace_id("a", 7) == step_trace_id("a", 7)
    keyed = {step_trace_id("a", k, run, round_) for k in (0, 1, 7, "7", -1) for run in ("", "r1", "r2")
             for round_ in (0, 1)}
    assert len(keyed) == 30 and 0 not in keyed   # runs, rounds and shared roots' keys apart
    assert step_trace_id("a", np.int64(7), "r1", 1) == step_trace_id("a", 7, "r1", 1)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="every"):
        crosstrace.step(1, every=0)
    with pytest.raises(TypeError, match="decorator"):
        crosstrace.step(3)(lambda: None)


def test_ranks_agree_on_step_traces_without_talking(collector):
    clocks = {"rank0": 0, "rank1": 300_000_000, "other-job": -50_000_000}
    for node, offset in clocks.items():
        job = "other" if node == "other-job" else "train-job"
        run_python(TRAINING_LOOP, env=tracer_env(collector, node, job_id=job, sim_clock_offset_ns=offset))
    spans = spans_of(load_table(collector.store))
    steps = {(s["node"], s["a"][sc.STEP]): s for s in spans if s["name"] == "step"}
    traced = [0, 2, 4, 6, 7, 8, 9, 20, 30]
    for node in clocks:
        assert sorted(k for n, k in steps if n == node) == traced
    for k in traced:
        expected = f"{step_trace_id('train-job', k):032x}"
        assert steps["rank0", k]["trace"] == steps["rank1", k]["trace"] == expected
        assert steps["other-job", k]["trace"] == f"{step_trace_id('other', k):032x}" != expected
        assert all(steps[node, k]["parent"] == 0 for node in clocks)  # each rank's step is a root
        assert steps["rank0", k]["a"][sc.JOB_ID] == "train-job"
    assert steps["rank0", 20]["status"] == Status.ERROR and steps["rank0", 0]["status"] == Status.UNSET

    # Everything under a step is in its trace, under its span; unsampled steps left nothing.
    by_id = {(s["node"], s["span_id"]): s for s in spans}
    children = [s for s in spans if s["name"] != "step"]
    for child in children:
        parent = by_id[child["node"], child["parent"]]
        assert parent["name"] == "step" and parent["trace"] == child["trace"]
    forwards = [s for s in children if s["name"] == "forward" and s["node"] == "rank0"]
    assert sorted(by_id["rank0", s["parent"]]["a"][sc.STEP] for s in forwards) == [0, 2, 4, 6, 7, 8, 9]
    assert forwards[0]["kind"] == Kind.COMPUTE
    fetches = [s for s in children if s["name"] == "next_batch" and s["node"] == "rank0"]
    assert sorted(by_id["rank0", s["parent"]]["a"][sc.STEP] for s in fetches) == [8, 9, 30]
    assert all(s["kind"] == Kind.DATA for s in fetches)


def test_steps_with_the_opentelemetry_sdk_as_global_provider():
    out = run_python("""
        import json, crosstrace
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        tracer = trace.get_tracer("train")
        for k in range(4):
            with crosstrace.step(k, every=2) as step:
                with tracer.start_as_current_span("forward") as child:
                    recording = child.is_recording()
                print(json.dumps({"k": k, "child_recording": recording}))
        try:
            with crosstrace.step(4):   # a failed step: the user's exception, nothing of crosstrace's
                raise ValueError("boom")
        except ValueError:
            pass
        print(json.dumps([{"name": s.name, "trace": f"{s.context.trace_id:032x}",
                           "parent_remote": s.parent.is_remote if s.parent else None,
                           "step": s.attributes.get("crosstrace.step")} for s in exporter.get_finished_spans()]))
    """, env={"CROSSTRACE_JOB_ID": "sdk-job"})
    *per_step, finished = [json.loads(line) for line in out.stdout.splitlines()]
    assert [s["child_recording"] for s in per_step] == [True, False, True, False]
    assert sorted((s["name"], s["step"]) for s in finished if s["name"] == "step") == [("step", 0), ("step", 2),
                                                                                      ("step", 4)]
    assert len(finished) == 5
    steps = {s["trace"]: s for s in finished if s["name"] == "step"}
    assert set(steps) == {f"{step_trace_id('sdk-job', k):032x}" for k in (0, 2, 4)}
    assert all(s["parent_remote"] for s in steps.values())  # the never-recorded origin carrying the id
    assert all(s["trace"] in steps for s in finished)


def test_steps_without_any_provider_cost_nothing_and_work():
    out = run_python("""
        import crosstrace
        from opentelemetry import trace
        with crosstrace.step(0) as span:
            with trace.get_tracer("t").start_as_current_span("x") as child:
                print(span.is_recording(), child.is_recording())
    """)
    assert out.stdout.split() == ["False", "False"]


RUN_TWICE = """
import datetime, json
import torch
import torch.distributed as dist
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
crosstrace.instrument_collectives()
for k in range(2):
    with crosstrace.step(k):
        dist.barrier()
t = torch.ones(4)
dist.all_reduce(t)            # outside any step: keyed within the run
if dist.get_rank() == 0:
    dist.send(t, 1)
else:
    dist.recv(t, 0)
provider.shutdown()
print(json.dumps({}))
"""


def test_runs_of_one_job_keep_their_steps_apart(collector):
    """A job run again into the same collector: each run's ranks agree on a run id once
    (torch.distributed's store), so step k of the two runs are two traces, not one, and
    the collectives and transfers of the two runs, numbered alike, are not joined, in
    steps or outside them."""
    pytest.importorskip("torch.distributed")
    from crosstrace.collector.matching import match

    from .test_torch_collectives import run_ranks

    for _ in range(2):
        run_ranks(RUN_TWICE, 2, collector, job_id="rerun")
    table = load_table(collector.store)
    matches = match(table)
    members = matches.collective_members()
    # every instance's spans in one trace: a step's, or outside steps one every rank derives
    assert len(members) == 6 and all(len(m) == 2 and len({table.trace[r] for r in m}) == 1 for m in members)
    run_of = [table.attributes[r][sc.RUN_ID] for r in range(len(table))]
    assert all(len({run_of[r] for r in m}) == 1 for m in members)
    outside = [m for m in members if table.names[table.name[m[0]]] == "all_reduce"]
    assert len(outside) == 2 and table.trace[outside[0][0]] != table.trace[outside[1][0]]   # one per run
    assert len(matches.p2p) == 2 and all(run_of[send] == run_of[recv] and table.trace[send] == table.trace[recv]
                                         for send, recv in matches.p2p.tolist())
    report, _, _ = analyse_report(collector.store)
    assert not any(report["unmatched"].values()), report["unmatched"]
    loose = [t for t in report["traces"] if t["name"] == "all_reduce"]
    assert len(loose) == 2 and all(t["nodes"] == 2 and t["collectives"]["all_reduce"]["count"] == 1 for t in loose)
    steps = [s for s in spans_of(table) if s["name"] == "step"]
    assert len(steps) == 8
    runs = {s["a"][sc.RUN_ID] for s in steps}
    assert len(runs) == 2
    for run in runs:
        for k in range(2):
            traces = {s["trace"] for s in steps if s["a"][sc.RUN_ID] == run and s["a"][sc.STEP] == k}
            assert traces == {f"{step_trace_id('rerun', k, run):032x}"}   # both ranks, one trace
    assert len({s["trace"] for s in steps}) == 4


def test_torchruns_run_id_tells_runs_and_restarts_apart(monkeypatch):
    """Under torchrun every rank has the run id from the start: no exchange is needed, and
    steps taken before init_process_group agree too."""
    from crosstrace.tracer import step as step_mod

    for env, expected in (({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}, "abc/1"),
                          ({"TORCHELASTIC_RUN_ID": "none", "CROSSTRACE_RUN_ID": "mine"}, "mine"),
                          ({"TORCHELASTIC_RUN_ID": "none"}, "")):     # static rendezvous, no process group
        with monkeypatch.context() as m:
            for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "CROSSTRACE_RUN_ID"):
                m.delenv(name, raising=False)
            for name, value in env.items():
                m.setenv(name, value)
            m.setattr(step_mod, "_run", None)
            assert step_mod.run_id() == expected


EPOCHS = """
import asyncio
import crosstrace
from opentelemetry import trace

provider = crosstrace.init()
tracer = trace.get_tracer("train")
for epoch in range(2):
    for k, batch in enumerate("abc"):               # each epoch numbers its steps from 0 again
        with crosstrace.step(k):
            with tracer.start_as_current_span("forward"):
                pass
with crosstrace.step(2):                             # the same number again, not lower: the same step
    with tracer.start_as_current_span("log"):
        pass

@crosstrace.step
async def serve_step():                              # a coroutine's step covers its awaits
    await asyncio.sleep(0)
    with tracer.start_as_current_span("after-await"):
        pass

asyncio.run(serve_step())
provider.shutdown()
"""


def test_an_epoch_that_numbers_its_steps_from_zero_again_has_traces_of_its_own(collector):
    """Step numbers that go down start a new round of steps (`for k, batch in
    enumerate(loader)` in an epoch loop): every rank gives each round's step k a new trace
    alike, where the two epochs' steps had been stitched into one trace each."""
    for node in ("rank0", "rank1"):
        run_python(EPOCHS, env=tracer_env(collector, node, job_id="epochs"))
    spans = spans_of(load_table(collector.store))
    steps = [s for s in spans if s["name"] == "step"]
    by_key = {}
    for s in steps:
        by_key.setdefault((s["a"][sc.STEP], s["a"].get(sc.STEP_ROUND, 0)), set()).add(s["trace"])
    assert sorted(by_key) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 1)]
    assert all(len(traces) == 1 for traces in by_key.values())          # both ranks alike
    assert len({t for traces in by_key.values() for t in traces}) == 7
    assert by_key[0, 0] == {f"{step_trace_id('epochs', 0):032x}"}       # the first round as before
    by_id = {(s["node"], s["span_id"]): s for s in spans}
    parent_step = {s["name"]: by_id[s["node"], s["parent"]]["a"] for s in spans if s["name"] in ("log", "after-await")}
    assert parent_step["log"] == {sc.STEP: 2, sc.JOB_ID: "epochs", sc.STEP_ROUND: 1}
    assert parent_step["after-await"][sc.STEP] == 3


def test_steps_on_threads_may_end_in_any_order():
    """Two threads' steps, ended in the order they began: the step open is the one still
    open, and none once both are closed (threads without a context of their own, such as
    DDP's backend threads, go by it)."""
    out = run_python("""
        import threading, crosstrace
        from crosstrace.tracer.step import active_step
        from opentelemetry.trace.propagation import _SPAN_KEY
        crosstrace.init(endpoint="127.0.0.1:9", exit_flush_timeout_s=0.1)
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = []
        def a():
            with crosstrace.step(0):
                a_in.set(); b_in.wait()
            seen.append(active_step()[_SPAN_KEY].attributes["crosstrace.step"])
            a_out.set()
        def b():
            a_in.wait()
            with crosstrace.step(1):
                b_in.set(); a_out.wait()
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print(seen[0], active_step())
    """)
    assert out.stdout.split() == ["1", "None"]
