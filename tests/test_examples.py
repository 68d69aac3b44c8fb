"""The torchrun examples (examples/) and the training demo workloads (crosstrace/demo/ddp.py,
pipeline.py), run for real against a real collector: their spans arrive, join across
ranks, and the analysis finds what the demos inject."""
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from crosstrace.collector.report import analyse_report
from crosstrace.demo import ddp as ddp_demo
from crosstrace.demo import pipeline as pipeline_demo
from crosstrace.demo.workers import Workers
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind, Status

from .conftest import REPO
from .test_torch_collectives import check_collectives_join, check_p2p_pairs, spans, step_traces

pytest.importorskip("torch.distributed.pipelining")

MS = 1_000_000


def torchrun(script: str, args: list[str], env: dict, timeout_s: float = 120, exit_code: int = 0,
             options: tuple = ()) -> str:
    """`python -m torch.distributed.run --nproc-per-node 2 script args` (a script of
    examples/, or a path); the whole process group (torchrun and its ranks) is killed if it
    outlives the timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *options,
           os.path.join(REPO, "examples", script), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"{script} did not finish within {timeout_s} s:\n{out[-4000:]}")
    assert proc.returncode == exit_code, f"{script} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_ddp_example_under_torchrun(collector):
    torchrun("ddp_train.py", ["--steps", "4", "--every", "2"], {"CROSSTRACE_ENDPOINT": collector.address})
    rows = spans(collector)
    assert not [r for r in rows if r["status"] == Status.ERROR]
    step_of = step_traces(rows, "ddp-example")
    assert sorted(step_of.values()) == [0, 2]  # every 2nd step
    steps = [r for r in rows if r["name"] == "ddp-step"]
    assert sorted(r["rank"] for r in steps) == [0, 0, 1, 1]
    buckets = [r for r in rows if r["name"] == "ddp.all_reduce"]
    assert buckets and len(check_collectives_join(rows)) * 2 == len(buckets)
    for name in ("forward", "backward", "optimizer"):
        assert sorted(r["rank"] for r in rows if r["name"] == name) == [0, 0, 1, 1]


def test_pipeline_example_under_torchrun(collector):
    torchrun("pipeline_train.py", ["--steps", "2", "--schedule", "Schedule1F1B"],
             {"CROSSTRACE_ENDPOINT": collector.address})
    rows = spans(collector)
    assert not [r for r in rows if r["status"] == Status.ERROR]
    step_of = step_traces(rows, "pipeline-example")
    assert sorted(step_of.values()) == [0, 1]
    assert sorted(r["rank"] for r in rows if r["name"] == "pipeline-step") == [0, 0, 1, 1]   # apart from DDP's
    compute = [r for r in rows if r["kind"] == Kind.COMPUTE]
    assert {(r["rank"], r["name"]) for r in compute} == {(rank, name) for rank in (0, 1)
                                                         for name in ("forward", "backward")}
    assert all(r["a"][sc.PP_SCHEDULE] == "Schedule1F1B" and r["a"][sc.PP_STAGE] == r["rank"] for r in compute)
    assert len(compute) == 2 * 2 * 2 * 4  # steps x ranks x (F, B) x microbatches
    pairs = check_p2p_pairs(rows)
    assert len([s for s, _ in pairs if sc.PP_ACTION in s["a"]]) == 2 * 2 * 4  # steps x (F, B) x microbatches


def test_interleaved_pipeline_example_under_torchrun(collector):
    torchrun("pipeline_train.py", ["--steps", "2", "--schedule", "ScheduleInterleaved1F1B"],
             {"CROSSTRACE_ENDPOINT": collector.address})
    rows = spans(collector)
    assert not [r for r in rows if r["status"] == Status.ERROR]
    compute = [r for r in rows if r["kind"] == Kind.COMPUTE]
    # rank r holds stages r and r + 2; each runs F and B of each microbatch in each step
    assert {(r["rank"], r["a"][sc.PP_STAGE]) for r in compute} == {(0, 0), (0, 2), (1, 1), (1, 3)}
    assert len(compute) == 2 * 4 * 2 * 4 and {r["a"][sc.PP_SCHEDULE] for r in compute} == {"ScheduleInterleaved1F1B"}
    check_p2p_pairs(rows)


FAILING_RANK = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace
crosstrace.init(job_id="fails")
dist.init_process_group("gloo")
rank = dist.get_rank()
model = crosstrace.instrument_ddp(DDP(nn.Linear(32, 32)))
for k in range(4):
    with crosstrace.step(k, name="failing-step"):
        loss = model(torch.randn(8, 32)).sum()
        if rank == 1 and k == 2:
            raise RuntimeError("rank 1 fails")
        loss.backward()
"""


def test_a_rank_that_torchrun_ends_after_another_failed_keeps_its_spans(collector, tmp_path):
    """When one rank fails, torchrun ends the others by SIGTERM. The other rank's spans were
    all lost: its steps waited for the next round (5 s), and its exit for DDP's buckets,
    which a failed all-reduce leaves in flight."""
    script = tmp_path / "fails.py"
    script.write_text(FAILING_RANK)
    # torchrun looking once a second (0.1 s by default) leaves time on a loaded machine; the
    # code before waited 5 s
    out = torchrun(str(script), [], {"CROSSTRACE_ENDPOINT": collector.address}, exit_code=1,
                   options=("--monitor-interval", "1"))
    assert "rank 1 fails" in out
    steps = {(r["rank"], r["a"][sc.STEP]): r["status"] for r in spans(collector) if r["name"] == "failing-step"}
    assert steps == {(0, 0): Status.UNSET, (0, 1): Status.UNSET, (0, 2): Status.ERROR,
                     (1, 0): Status.UNSET, (1, 1): Status.UNSET, (1, 2): Status.ERROR}, out[-3000:]


def test_training_demos_find_what_they_inject(collector):
    """Both workloads into one collector, as `crosstrace demo` runs them: each its own steps."""
    workers = Workers(collector, epoch_ns=time.monotonic_ns())
    try:
        ddp = ddp_demo.run(workers, say=lambda message: None)
        pipeline = pipeline_demo.run(workers, say=lambda message: None)
    finally:
        workers.stop_all()
    report, _, _ = analyse_report(collector.store)
    check_ddp_demo(ddp, [t for t in report["traces"] if t["name"] == "ddp-step"])
    check_pipeline_demo(pipeline, [t for t in report["traces"] if t["name"] == "pipeline-step"])
    assert set(report["clocks"]) == {*(f"trainer-{rank}" for rank in range(ddp["ranks"])),
                                     *(f"stage-{stage}" for stage in range(pipeline["stages"]))}


def check_ddp_demo(injected: dict, traces: list[dict]) -> None:
    """The straggler is named, with the span it was late in; the others wait for it."""
    straggler = injected["straggler_node"]
    assert len(traces) == injected["steps"] and all(t["nodes"] == injected["ranks"] for t in traces)
    late = sorted(traces, key=lambda t: t["start_ns"])[2:]  # DDP builds its buckets in the first steps
    named = [t["straggler"]["node"] for t in late]
    assert named.count(straggler) >= 0.75 * len(late), named
    assert [t["straggler"]["span"] for t in late].count(injected["straggler_span"]) >= 0.75 * len(late)
    excess = []  # its delay cost counts each waiting rank's time once, however many buckets were in flight
    for t in late:
        waited = sum(r["attribution"].get("collective.wait", 0) for n, r in t["per_rank"].items() if n != straggler)
        if t["straggler"]["node"] == straggler:
            assert waited - 2 * MS <= t["straggler"]["delay_cost_ns"], (t["straggler"], waited)
            excess.append(t["straggler"]["delay_cost_ns"] / waited)
    # Counted once per bucket, the cost would be a multiple of the wait; beyond it is only the
    # waiting ranks' backward going on while buckets wait. The median, as a loaded machine
    # now and then stretches one rank's step.
    assert statistics.median(excess) <= 1.25, excess
    for node in late[0]["per_rank"]:  # the median step: a loaded 2-core machine delays a rank now and then
        wait = statistics.median(t["per_rank"][node]["attribution"].get("collective.wait", 0) for t in late)
        if node == straggler:
            assert wait < 10 * MS
        else:
            assert 0.6 * injected["straggle_ms"] * MS <= wait <= 1.5 * injected["straggle_ms"] * MS, (node, wait)


def check_pipeline_demo(injected: dict, traces: list[dict]) -> None:
    assert len(traces) == injected["steps"]
    for t in traces:
        pipe = t["pipeline"]
        assert pipe["schedule"] == injected["schedule"] and pipe["microbatches"] == injected["microbatches"]
        assert pipe["ideal_bubble_fraction"] == pytest.approx(injected["ideal_bubble_fraction"])
        assert 0.5 * injected["ideal_bubble_fraction"] <= pipe["bubble_fraction"] <= 0.7
        assert t["duration_ns"] < 2_000 * MS
        assert t["unmatched"].get("send", 0) == t["unmatched"].get("recv", 0) == 0
