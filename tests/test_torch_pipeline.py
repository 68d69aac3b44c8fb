"""torch.distributed.pipelining traced on 2 real gloo ranks: ScheduleGPipe, Schedule1F1B
and ScheduleInterleaved1F1B run traced, with the same losses as untraced; each stage's
compute and transfer spans carry stage, microbatch, action and schedule; every send pairs
with its receive. And a torch without pipelining is told once, without breaking the job."""
import collections

import pytest

from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind, Status

from .conftest import run_python
from .test_torch_collectives import check_p2p_pairs, run_ranks, spans, step_traces

pytest.importorskip("torch.distributed.pipelining")

MICROBATCHES = 4
SCHEDULES = {0: ("ScheduleGPipe", 1), 1: ("Schedule1F1B", 1), 2: ("ScheduleInterleaved1F1B", 2)}  # step -> (class, stages per rank)

WORKER = """
import contextlib, json
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed import pipelining
import crosstrace

SCHEDULES, INFERENCE = %r, 3
provider = crosstrace.init()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 16)

def run(k, in_step=True):
    name, per_rank = SCHEDULES[k if k < 10 else k - 10]   # step k + 10: the same, untraced
    stages = []
    for index in (rank + j * world for j in range(per_rank)):   # interleaved: stages r and r + world
        torch.manual_seed(index)
        stages.append(pipelining.PipelineStage(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), index,
                                               world * per_rank, torch.device("cpu")))
    schedule = getattr(pipelining, name)(stages if per_rank > 1 else stages[0], n_microbatches=%d,
                                         loss_fn=nn.MSELoss())
    losses = []
    with crosstrace.step(k) if in_step else contextlib.nullcontext():
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
    return [loss.item() for loss in losses]

def infer(k):
    stage = pipelining.PipelineStage(nn.Sequential(nn.Linear(16, 16)), rank, world, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=%d)   # no loss_fn: forward only
    with torch.no_grad(), crosstrace.step(k):
        schedule.step(x) if rank == 0 else schedule.step()

report = {"instrumented": crosstrace.instrument_pipeline()}
traced = [run(k) for k in SCHEDULES]
infer(INFERENCE)
run(1, in_step=False)   # outside any step
crosstrace.uninstrument_pipeline()
crosstrace.uninstrument_collectives()
report["same_losses"] = traced == [run(k + 10) for k in SCHEDULES]
report["losses"] = traced
dist.destroy_process_group()
report["flushed"] = provider.force_flush(30000)
print(json.dumps(report))
""" % (SCHEDULES, MICROBATCHES, MICROBATCHES)
INFERENCE = 3   # the step of a forward-only schedule

SCHEDULE_KEYS = (sc.PP_SCHEDULE, sc.PP_NUM_STAGES, sc.PP_NUM_MICROBATCHES, sc.PP_STAGES_PER_RANK)


def test_three_schedules_trace_stages_and_transfers(collector):
    reports = run_ranks(WORKER, 2, collector, job_id="pp-test")
    for report in reports:
        assert report["instrumented"] and report["same_losses"] and report["flushed"]
    assert len(reports[1]["losses"][0]) == MICROBATCHES  # the last stage computed the loss

    rows = spans(collector)
    assert not [r for r in rows if r["status"] == Status.ERROR]
    step_of = step_traces(rows, "pp-test")
    rows = [r for r in rows if r["trace"] in step_of]   # not the schedule run outside any step (below)
    assert not [r for r in rows if step_of[r["trace"]] >= 10 and r["name"] != "step"]  # untraced again
    inference = collections.Counter((r["rank"], r["name"]) for r in rows
                                    if step_of[r["trace"]] == INFERENCE and r["kind"] == Kind.COMPUTE)
    assert inference == {(0, "forward"): MICROBATCHES, (1, "forward"): MICROBATCHES}   # no backward spans
    for k, (schedule, per_rank) in SCHEDULES.items():
        mine = [r for r in rows if step_of[r["trace"]] == k]
        stages = 2 * per_rank
        expected = {sc.PP_SCHEDULE: schedule, sc.PP_NUM_STAGES: stages, sc.PP_NUM_MICROBATCHES: MICROBATCHES,
                    sc.PP_STAGES_PER_RANK: per_rank}
        windows = [r for r in mine if r["name"] == "pipeline.step"]
        assert sorted(r["rank"] for r in windows) == [0, 1]
        assert all({key: r["a"][key] for key in SCHEDULE_KEYS} == expected for r in windows)

        compute = [r for r in mine if r["kind"] == Kind.COMPUTE]
        assert all({key: r["a"][key] for key in SCHEDULE_KEYS} == expected for r in compute)
        done = collections.Counter((r["a"][sc.PP_STAGE], r["a"][sc.PP_MICROBATCH], r["a"][sc.PP_ACTION], r["name"])
                                   for r in compute)
        assert done == collections.Counter({(s, m, a, name): 1 for s in range(stages) for m in range(MICROBATCHES)
                                            for a, name in (("F", "forward"), ("B", "backward"))}), schedule
        assert all(r["a"][sc.PP_STAGE] % 2 == r["rank"] for r in compute)  # stage s lives on rank s mod 2

        pairs = check_p2p_pairs(mine)
        labelled = [(s, r) for s, r in pairs if sc.PP_ACTION in s["a"]]
        # every activation goes one stage down and every gradient one stage up, per microbatch
        assert len(labelled) == 2 * (stages - 1) * MICROBATCHES, schedule
        for send, recv in labelled:
            a, b = send["a"], recv["a"]
            assert a[sc.PP_MICROBATCH] == b[sc.PP_MICROBATCH] and a[sc.PP_ACTION] == b[sc.PP_ACTION]
            assert b[sc.PP_STAGE] - a[sc.PP_STAGE] == (1 if a[sc.PP_ACTION] == "F" else -1)
            assert {key: a[key] for key in SCHEDULE_KEYS} == expected == {key: b[key] for key in SCHEDULE_KEYS}
        # the rest is the stages' shape exchange on the first step
        assert all(sc.PP_ACTION not in s["a"] and sc.PP_ACTION not in r["a"] for s, r in pairs
                   if (s, r) not in labelled)


def test_a_schedule_outside_any_step_is_one_trace_across_ranks(collector):
    """Outside crosstrace.step, each rank's pipeline.step was a root of a random trace of its
    own: its stages and transfers never met. Its trace now follows from the job, the run and
    the count of schedule steps, as a step's does."""
    reports = run_ranks(WORKER, 2, collector, job_id="pp-free")
    assert all(report["flushed"] for report in reports)
    rows = spans(collector)
    step_of = step_traces(rows, "pp-free")
    free = [r for r in rows if r["trace"] not in step_of]
    windows = [r for r in free if r["name"] == "pipeline.step"]
    assert len(windows) == 2 and windows[0]["trace"] == windows[1]["trace"], windows
    mine = [r for r in free if r["trace"] == windows[0]["trace"]]
    labelled = [(send, recv) for send, recv in check_p2p_pairs(mine) if sc.PP_ACTION in send["a"]]
    assert len(labelled) == 2 * MICROBATCHES   # activations down, gradients up (and torch's shape exchange)


def test_without_pipelining_support_it_warns_once_and_the_job_goes_on():
    out = run_python("""
        import sys, warnings
        sys.modules["torch.distributed.pipelining"] = None   # as on a torch without it
        import torch, crosstrace
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(crosstrace.instrument_pipeline(), crosstrace.instrument_pipeline())
        print(len(caught))
        print(caught[0].message)
        print(float(torch.ones(2).sum()))
    """, timeout=120)
    first, count, message, result = out.stdout.strip().splitlines()
    assert first == "False False" and count == "1" and result == "2.0"
    assert "has no usable torch.distributed.pipelining" in message and "not traced" in message
