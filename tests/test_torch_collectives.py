"""torch.distributed collectives and point-to-point ops, traced across real gloo ranks.

Each rank is a real process (gloo over loopback, CPU) exporting to a real collector; the
checks read the collector's store: every collective of a step is on every rank of its
group under one (group, seq), every send pairs with one receive, the step trace ids agree.
Also run_ranks() and spans(), shared with the other torch tests.
"""
import collections
import json
import os

import pytest

from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.launch import free_port
from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind, Status
from crosstrace.tracer.step import step_trace_id

from .conftest import launch_ranks, run_python, tracer_env

pytest.importorskip("torch.distributed")


def run_ranks(code: str, world: int, collector, timeout_s: float = 120, args: tuple = (), **options) -> list[dict]:
    """Run `code` as `world` ranks of one gloo job (torchrun's environment, CROSSTRACE_*
    `options`, command-line `args`); each prints one JSON line last, returned per rank with
    its stderr."""
    port = free_port()

    def env(rank: int) -> dict:
        return {**os.environ, **tracer_env(collector, f"rank{rank}", **options), "RANK": str(rank),
                "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}

    return [{**json.loads(stdout.strip().splitlines()[-1]), "stderr": stderr}
            for stdout, stderr in launch_ranks(code, world, env, lambda rank: args, timeout_s=timeout_s)]


def spans(collector) -> list[dict]:
    """Every stored span as a dict: name, kind, rank, trace, ids, local start/end, thread, status, a(ttributes)."""
    store = Store(collector.store, readonly=True)
    try:
        t = spantable.load(store)
    finally:
        store.close()
    rank = t.rank
    return [{"name": t.names[t.name[i]], "kind": int(t.kind[i]), "rank": int(rank[i]),
             "trace": t.trace_ids[t.trace[i]], "span_id": int(t.span_id[i]), "parent": int(t.parent_id[i]),
             "start": int(t.start[i]), "end": int(t.end[i]), "thread": int(t.thread[i]), "status": int(t.status[i]),
             "a": t.attributes[i] or {}} for i in range(len(t))]


def step_traces(rows, job: str) -> dict[str, int]:
    """trace id -> step number, for the steps of `job`, each trace id the one its job, run,
    number and round give."""
    steps = [r for r in rows if sc.STEP in (r["a"] or {}) and r["a"].get(sc.JOB_ID) == job]
    derived = [step_trace_id(job, r["a"][sc.STEP], r["a"][sc.RUN_ID], r["a"].get(sc.STEP_ROUND, 0)) for r in steps]
    assert steps and all(r["trace"] == f"{t:032x}" for r, t in zip(steps, derived))
    return {r["trace"]: r["a"][sc.STEP] for r in steps}


def check_collectives_join(rows) -> dict:
    """Every (group, seq) is on every rank of its group, with one op, in one trace."""
    instances = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == Kind.COLLECTIVE:
            instances[r["a"][sc.COLL_GROUP], r["a"][sc.COLL_SEQ]].append(r)
    for key, members in instances.items():
        assert sorted(m["rank"] for m in members) == sorted(members[0]["a"][sc.COLL_RANKS]), key
        assert len({m["a"][sc.COLL_OP] for m in members}) == 1, key
        assert len({m["trace"] for m in members}) == 1, key
    return instances


def check_p2p_pairs(rows) -> list[tuple[dict, dict]]:
    """Every send has exactly one receive with its (group, src, dst, tag, seq), and the reverse."""
    def key(r):
        a = r["a"]
        return a[sc.P2P_GROUP], a[sc.P2P_SRC], a[sc.P2P_DST], a[sc.P2P_TAG], a[sc.P2P_SEQ]
    sends = collections.Counter(key(r) for r in rows if r["kind"] == Kind.SEND)
    recvs = collections.Counter(key(r) for r in rows if r["kind"] == Kind.RECV)
    assert sends and sends == recvs and set(sends.values()) == {1}
    recv_of = {key(r): r for r in rows if r["kind"] == Kind.RECV}
    return [(s, recv_of[key(s)]) for s in rows if s["kind"] == Kind.SEND]


WORKER = """
import json, os, time
import torch, torch.distributed as dist
import crosstrace
from crosstrace.tracer.instrument import torch_dist

provider = crosstrace.init()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
report = {}

def error_of(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

# Before any process group: torch's own error comes through, unchanged.
crosstrace.instrument_collectives()
traced_error = error_of(lambda: dist.all_reduce(torch.ones(1)))
crosstrace.uninstrument_collectives()
report["no_group_error"] = [traced_error, error_of(lambda: dist.all_reduce(torch.ones(1)))]
crosstrace.instrument_collectives()
crosstrace.instrument_collectives()  # twice is once

dist.init_process_group("gloo")
evens = dist.new_group([r for r in range(world) if r % 2 == 0])
nxt, prv = (rank + 1) % world, (rank - 1) % world

def one_of_each():
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    time.sleep(0.03)                  # the span of an async op ends at wait()
    work.wait()
    dist.all_gather([torch.zeros(4) for _ in range(world)], t)
    dist.all_gather_into_tensor(torch.zeros(4 * world), t)
    dist.reduce_scatter(torch.zeros(4), [t.clone() for _ in range(world)])
    dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * world))
    dist.broadcast(t, src=world - 1)
    dist.reduce(t, dst=0)
    dist.gather(t, [torch.zeros(4) for _ in range(world)] if rank == 0 else None, dst=0)
    dist.scatter(torch.zeros(4), [torch.ones(4) for _ in range(world)] if rank == world - 1 else None, src=world - 1)
    dist.all_reduce_coalesced([t, torch.ones(2)])
    dist.all_gather_single(torch.zeros(4 * world), t)
    dist.reduce_scatter_single(torch.zeros(4), torch.ones(4 * world))
    dist.all_to_all([torch.zeros(2) for _ in range(world)], [torch.ones(2) for _ in range(world)])
    dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world))
    dist.barrier()
    dist.barrier(async_op=True).wait()
    if rank % 2 == 0:
        dist.all_reduce(t, group=evens)
    if rank % 2 == 0:                 # a ring of blocking sends ...
        dist.send(t, nxt); dist.recv(t, prv)
    else:
        dist.recv(t, prv); dist.send(t, nxt)
    for work in [dist.isend(t, nxt, tag=7), dist.irecv(torch.zeros(4), prv, tag=7)]:  # ... of isend/irecv
        work.wait()
    global kept
    kept = ops = [dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, torch.zeros(4), prv)]
    for work in dist.batch_isend_irecv(ops):  # ... and a batch
        work.wait()
    if world == 2:                    # a receive from any source learns its sender at completion
        if rank == 0:
            dist.send(t, 1, tag=3)
        else:
            dist.recv(torch.zeros(4), tag=3)

for k in range(5):
    with crosstrace.step(k, every=2 if k >= 3 else 1):  # step 3 is not sampled
        one_of_each()

crosstrace.uninstrument_collectives()
report["restored"] = dist.all_reduce is torch.distributed.distributed_c10d.all_reduce is torch_dist.original("all_reduce")
# P2POps built and batched while traced, batched again untraced (torch tells their ops apart by identity)
report["kept_ops"] = error_of(lambda: [work.wait() for work in dist.batch_isend_irecv(kept)])
with crosstrace.step(6):
    dist.all_reduce(torch.ones(1))   # untraced now
dist.destroy_process_group()
report["flushed"] = provider.force_flush(30000)
print(json.dumps(report))
"""

PER_STEP = {"all_reduce": 2, "all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter": 1,
            "reduce_scatter_tensor": 1, "broadcast": 1, "reduce": 1, "gather": 1, "scatter": 1,
            "all_reduce_coalesced": 1, "all_gather_single": 1, "reduce_scatter_single": 1,
            "all_to_all": 1, "all_to_all_single": 1, "barrier": 2}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_p2p_join_across_ranks(world, collector):
    job = f"collectives-{world}"
    reports = run_ranks(WORKER, world, collector, job_id=job)
    for report in reports:
        traced, plain = report["no_group_error"]
        assert traced == plain and "process group" in plain.lower()
        assert report["restored"] and report["flushed"] and report["kept_ops"] is None, report

    rows = spans(collector)
    assert not [r for r in rows if r["status"] == Status.ERROR]
    step_of = step_traces(rows, job)
    assert sorted(step_of.values()) == [0, 1, 2, 4, 6]  # step 3 unsampled
    steps = [r for r in rows if r["name"] == "step"]
    assert len(steps) == 5 * world and all(r["trace"] in step_of for r in steps)

    instances = check_collectives_join(rows)
    ops = [r for r in rows if r["kind"] == Kind.COLLECTIVE]
    assert all(r["trace"] in step_of and step_of[r["trace"]] in (0, 1, 2, 4) for r in ops)
    world_group = [r for r in ops if len(r["a"][sc.COLL_RANKS]) == world]
    for rank in range(world):
        for k in (0, 1, 2, 4):
            mine = collections.Counter(r["name"] for r in world_group
                                       if r["rank"] == rank and step_of[r["trace"]] == k)
            assert mine == PER_STEP, (rank, k)
    # seq counts collectives per group, whether recorded or not: step 3's are missing from the
    # store, but step 4 continues where step 3 left off.
    per_step = sum(PER_STEP.values())
    seqs = sorted({r["a"][sc.COLL_SEQ] for r in world_group})
    assert seqs == list(range(3 * per_step)) + list(range(4 * per_step, 5 * per_step))
    evens = sorted(seq for (group, seq), members in instances.items()
                   if members[0]["a"][sc.COLL_RANKS] == list(range(0, world, 2)))
    assert evens == [0, 1, 2, 4]  # a subgroup keeps its own count

    root = {r["name"]: r["a"].get(sc.COLL_ROOT) for r in ops}
    assert root["broadcast"] == root["scatter"] == world - 1 and root["reduce"] == root["gather"] == 0
    assert root["all_reduce"] is None
    # each rooted op's span says whether its rank is the root (the collector may not know the rank)
    assert all(r["a"][sc.COLL_IS_ROOT] == (r["rank"] == root[r["name"]]) for r in ops if root[r["name"]] is not None)
    nbytes = {"all_reduce": 16, "all_gather": 16, "all_gather_into_tensor": 16, "reduce_scatter": 16 * world,
              "reduce_scatter_tensor": 16 * world, "broadcast": 16, "reduce": 16, "gather": 16, "scatter": 16,
              "all_reduce_coalesced": 24, "all_gather_single": 16, "reduce_scatter_single": 16 * world,
              "all_to_all": 8 * world, "all_to_all_single": 8 * world, "barrier": 0}
    assert all(r["a"][sc.COLL_BYTES] == nbytes[r["name"]] for r in ops), {r["name"]: r["a"][sc.COLL_BYTES] for r in ops}
    assert {r["a"].get(sc.COLL_DEVICE) for r in ops if r["name"] != "barrier"} == {"cpu"}   # ends when done
    waited = [r["end"] - r["start"] for r in ops if r["name"] == "all_reduce" and r["a"][sc.COLL_ASYNC]]
    assert len(waited) == 4 * world and min(waited) >= 30e6

    pairs = check_p2p_pairs(rows)
    assert {r["a"].get(sc.P2P_DEVICE) for pair in pairs for r in pair} == {"cpu"}
    per_step = 3 * world + (world == 2)  # send, isend, batch isend per rank; the any-source pair
    assert len(pairs) == 4 * per_step
    assert all(s["trace"] == r["trace"] for s, r in pairs)
    assert {s["name"] for s, _ in pairs} == {"send", "isend"} and {r["name"] for _, r in pairs} == {"recv", "irecv"}
    assert all(r["a"][sc.P2P_BYTES] == 16 for s, r in pairs)



def test_torch_without_distributed_warns_once_and_the_job_goes_on():
    out = run_python("""
        import warnings
        import torch, torch.distributed as dist, torch.nn as nn
        dist.is_available = lambda: False        # as on a torch built without torch.distributed
        import crosstrace
        model = nn.Linear(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [crosstrace.instrument_collectives(), crosstrace.instrument_ddp(model) is model,
                       crosstrace.instrument_pipeline(), crosstrace.instrument_collectives()]
            with crosstrace.step(0):
                loss = model(torch.ones(2)).sum()
                loss.backward()
        print(results)
        print(len(caught))
        print(caught[0].message)
    """, timeout=120)
    results, count, message = out.stdout.strip().splitlines()
    assert results == "[False, True, False, False]" and count == "1"
    assert "has no torch.distributed; nothing is traced" in message


def test_disabled_tracing_wraps_nothing():
    """With CROSSTRACE_DISABLED nothing is recorded, so nothing is wrapped: torch's own
    functions, a DDP model without crosstrace's hook or process group, no pipeline hooks."""
    out = run_python(f"""
        import json
        import torch.distributed as dist, torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        import crosstrace

        crosstrace.init()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        all_reduce, model = dist.all_reduce, DDP(nn.Linear(2, 2))
        group = model.process_group
        print(json.dumps({{"collectives": crosstrace.instrument_collectives(), "same": dist.all_reduce is all_reduce,
                          "ddp": crosstrace.instrument_ddp(model) is model, "hooks": len(model._forward_hooks),
                          "group": model.process_group is group, "pipeline": crosstrace.instrument_pipeline()}}))
        dist.destroy_process_group()
    """, env={"CROSSTRACE_DISABLED": "1", "OMP_NUM_THREADS": "1"}, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "collectives": False, "same": True, "ddp": True, "hooks": 0, "group": True, "pipeline": False}


GROUPS_WORKER = """
import json
import torch, torch.distributed as dist
import crosstrace

provider = crosstrace.init()
crosstrace.instrument_collectives()
dist.init_process_group("gloo")
rank = dist.get_rank()
g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
with crosstrace.step(0):
    if rank == 0:
        works = [dist.isend(torch.full((4,), float(g)), 1, group=group) for g, group in ((1, g1), (2, g2))]
    else:
        got = {2: torch.zeros(4), 1: torch.zeros(4)}
        works = [dist.irecv(got[g], 0, group=group) for g, group in ((2, g2), (1, g1))]   # the other order
    for work in works:
        work.wait()
dist.destroy_process_group()
print(json.dumps({"flushed": provider.force_flush(30000), "names": [g1.group_name, g2.group_name]}))
"""


def test_messages_on_two_groups_pair_within_their_group(collector):
    """Each process group is a communicator of its own: rank 0 sends on g1 then g2, rank 1
    receives on g2 first. Keyed (src, dst, tag, seq) alone, both were message 0 from 0 to 1
    and, of one size, were paired across the groups in silence."""
    reports = run_ranks(GROUPS_WORKER, 2, collector, job_id="p2p-groups")
    assert all(report["flushed"] for report in reports)
    pairs = check_p2p_pairs(spans(collector))
    assert len(pairs) == 2 and all(s["a"][sc.P2P_GROUP] == r["a"][sc.P2P_GROUP] for s, r in pairs)
    assert sorted(s["a"][sc.P2P_GROUP] for s, _ in pairs) == sorted(reports[0]["names"])
    from crosstrace.collector.matching import match
    store = Store(collector.store, readonly=True)
    try:
        table = spantable.load(store)
    finally:
        store.close()
    for send, recv in match(table).p2p.tolist():   # the collector pairs them so too
        assert table.attributes[send][sc.P2P_GROUP] == table.attributes[recv][sc.P2P_GROUP]


OWN_TRACE_WORKER = """
import json, warnings
import torch, torch.distributed as dist
from opentelemetry import trace
import crosstrace

provider = crosstrace.init()
crosstrace.instrument_collectives()
dist.init_process_group("gloo")
tracer = trace.get_tracer("train")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.all_reduce(torch.ones(1))                     # in no span: a trace every rank derives
    with crosstrace.step(0), tracer.start_as_current_span("forward"):
        dist.all_reduce(torch.ones(1))                 # in a step, under a span of the user's
    with tracer.start_as_current_span("epoch"):
        dist.all_reduce(torch.ones(1))                 # in the user's own trace: said once
        dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
print(json.dumps({"flushed": provider.force_flush(30000),
                  "warnings": [str(w.message) for w in caught if "crosstrace" in str(w.message)]}))
"""


def test_a_collective_in_a_span_of_the_users_own_is_told_once(collector):
    """Under a span of the user's own and no crosstrace.step, a collective is in that rank's
    own trace, where the other ranks' side of it never is: said once, with what to do."""
    for report in run_ranks(OWN_TRACE_WORKER, 2, collector, job_id="own-trace"):
        assert report["flushed"]
        assert len(report["warnings"]) == 1, report["warnings"]
        assert "a collective ran inside the span 'epoch', which is in no crosstrace.step" in report["warnings"][0]
        assert "crosstrace.step(k)" in report["warnings"][0]
