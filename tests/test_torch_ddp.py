"""DDP gradient buckets traced by crosstrace, on 3 real gloo ranks (3: so that averaging
by multiplying with 1/n and by dividing by n give different bits).

One job checks: the gradients are exactly DDP's own (loss and parameters after N steps,
bit for bit, through crosstrace's process group for DDP's reducer, with a user hook it
wraps, with gradients as bucket views and with find_unused_parameters); every bucket is a
collective joined across ranks with its index, bytes, parameter count and ready time;
uninstrument_ddp stops the recording and instrument_ddp resumes it; buckets issued on a
thread without a context of its own land in their step's trace; a rank sleeping 50 ms
before backward makes the others enter the bucket all-reduce ~50 ms before it; models that
cannot be traced warn once and train untraced. A second job checks that the collectives'
numbers agree across ranks under DDP's join() with uneven inputs and unsampled steps.
"""
import collections
import statistics

import pytest

from crosstrace.proto import semconv as sc
from crosstrace.proto.semconv import Kind

from .test_torch_collectives import check_collectives_join, run_ranks, spans, step_traces

pytest.importorskip("torch.distributed")

WORKER = """
import json, os, threading, time, warnings
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
STRAGGLER = world - 1

class WithUnused(nn.Module):   # an MLP and a layer its forward never calls
    def __init__(self, mlp):
        super().__init__()
        self.mlp, self.unused = mlp, nn.Linear(8, 8)
    def forward(self, x):
        return self.mlp(x)

def ddp(**options):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    if options.pop("unused", False):
        mlp = WithUnused(mlp)
    return DDP(mlp, bucket_cap_mb=0.01, **options)   # several buckets

def train(model, first_step, steps=5, straggle_s=0.0, set_to_none=True, backward_thread=False, every=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    losses = []
    for k in range(first_step, first_step + steps):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
        with crosstrace.step(k, every=every):
            loss = nn.functional.mse_loss(model(x), y)
            if straggle_s and rank == STRAGGLER:
                time.sleep(straggle_s)
            opt.zero_grad(set_to_none=set_to_none)
            if backward_thread:    # as autograd's device threads do on GPUs: no context of their own
                with torch.no_grad():
                    model(x)       # and an evaluation forward in between, which no all-reduce follows
                worker = threading.Thread(target=loss.backward)
                worker.start()
                worker.join()
            else:
                loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]

def same(a, b):
    return a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))

report = {}
plain = train(ddp(), 0)                                                 # DDP's own all-reduce
report["default_hook_exact"] = same(plain, train(crosstrace.instrument_ddp(ddp()), 10))
def user_hooked():                        # a user's own hook, registered the usual way
    model = ddp()
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model
user_hook = train(user_hooked(), 70)      # allreduce_hook divides by n: other bits than DDP's own
report["user_hook_exact"] = same(user_hook, train(crosstrace.instrument_ddp(
    ddp(), hook=default_hooks.allreduce_hook), 20))
views = dict(gradient_as_bucket_view=True)                              # gradients live in the buckets
report["views_exact"] = same(train(ddp(**views), 50, set_to_none=False),
                             train(crosstrace.instrument_ddp(ddp(**views)), 60, set_to_none=False))
unused = dict(unused=True, find_unused_parameters=True)  # the reducer all-reduces its int32 map too
report["unused_exact"] = same(train(ddp(**unused), 90), train(crosstrace.instrument_ddp(ddp(**unused)), 100))

toggled = crosstrace.instrument_ddp(ddp())
train(toggled, 80, steps=2)
crosstrace.uninstrument_ddp(toggled)
crosstrace.uninstrument_ddp(toggled)                                    # twice: nothing more to undo
train(toggled, 82, steps=2)                                             # not recorded
crosstrace.instrument_ddp(toggled)
train(toggled, 84, steps=2)
train(crosstrace.instrument_ddp(ddp()), 110, steps=3, backward_thread=True)
# every other step unsampled: its buckets are counted, not recorded
report["sampled_exact"] = same(train(ddp(), 120, steps=6),
                               train(crosstrace.instrument_ddp(ddp()), 130, steps=6, every=2))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    crosstrace.instrument_ddp(nn.Linear(2, 2))                          # not a DDP model
    hooked = user_hooked()
    crosstrace.instrument_ddp(hooked)                                   # DDP allows one hook
    crosstrace.instrument_ddp(hooked)                                   # said once
    report["hooked_still_exact"] = same(user_hook, train(hooked, 30))
    hooked_later = crosstrace.instrument_ddp(ddp())
    hooked_later.register_comm_hook(None, default_hooks.allreduce_hook)   # replaces what crosstrace traces
    train(hooked_later, 140, steps=1)
report["warnings"] = [str(w.message) for w in caught if "crosstrace" in str(w.message)]
report["warned_in"] = sorted({w.filename for w in caught if "crosstrace" in str(w.message)})

train(crosstrace.instrument_ddp(ddp()), 40, steps=7, straggle_s=0.05)
dist.destroy_process_group()
report["flushed"] = provider.force_flush(30000)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    from crosstrace.launch import CollectorProcess

    tmp = tmp_path_factory.mktemp("ddp")
    with CollectorProcess(str(tmp / "store.db")) as collector:
        reports = run_ranks(WORKER, 3, collector, job_id="ddp-test")
        yield reports, spans(collector)


def test_gradients_are_exactly_ddps_own(ddp_job):
    reports, _ = ddp_job
    for report in reports:
        assert report["default_hook_exact"] and report["user_hook_exact"] and report["hooked_still_exact"]
        assert report["views_exact"] and report["unused_exact"] and report["sampled_exact"]
        assert report["flushed"]


def test_hook_that_cannot_apply_warns_once_and_training_goes_on(ddp_job):
    reports, rows = ddp_job
    for report in reports:
        assert len(report["warnings"]) == 3, report["warnings"]
        not_ddp, hooked, hooked_later = report["warnings"]
        assert "needs a DistributedDataParallel model, not Linear" in not_ddp
        assert "already has the comm hook allreduce_hook" in hooked and "instrument_ddp(model, hook=" in hooked
        assert "allreduce_hook was registered on this DDP model after" in hooked_later
        assert report["warned_in"] == ["<string>"]   # this code's lines, not torch's or crosstrace's
    step_of = step_traces(rows, "ddp-test")
    assert not [r for r in rows if r["kind"] == Kind.COLLECTIVE and 30 <= step_of[r["trace"]] < 40]


def test_buckets_are_collectives_joined_across_ranks(ddp_job):
    _, rows = ddp_job
    step_of = step_traces(rows, "ddp-test")
    buckets = [r for r in rows if r["name"] == "ddp.all_reduce"]
    assert buckets and all(r["kind"] == Kind.COLLECTIVE for r in buckets)
    # and each model's bucket rebuild (its second forward) broadcasts the new order from rank 0
    orders = [r for r in rows if r["name"] == "ddp.broadcast_bucket_order"]
    assert orders and all(r["a"][sc.COLL_OP] == "broadcast" and r["a"][sc.COLL_ROOT] == 0 for r in orders)
    assert all(r["a"][sc.COLL_IS_ROOT] == (r["rank"] == 0) for r in orders)
    assert len(check_collectives_join(rows)) * 3 == len(buckets) + len(orders)
    assert not [r for r in rows if r["kind"] == Kind.COLLECTIVE and r["name"] not in ("ddp.all_reduce",
                                                                                      "ddp.broadcast_bucket_order")]
    by_step = collections.defaultdict(list)
    for r in buckets:
        by_step[step_of[r["trace"]], r["rank"]].append(r)
    toggled = {80, 81, 84, 85}  # 82 and 83 ran between uninstrument_ddp and instrument_ddp
    assert {k for k, _ in by_step} == {*range(10, 15), *range(20, 25), *range(40, 47), *range(60, 65),
                                       *range(100, 105), *toggled, *range(110, 113), 130, 132, 134}
    for (k, rank), mine in by_step.items():
        n_params, size = 6, 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8  # 3 Linear layers: weight and bias each
        if 100 <= k < 105:
            n_params, size = n_params + 2, size + 8 * 8 + 8              # and the unused one
        assert sum(r["a"][sc.DDP_PARAMS] for r in mine) == n_params, (k, mine)
        assert sum(r["a"][sc.COLL_BYTES] for r in mine) == 4 * size
        assert len({r["a"][sc.DDP_BUCKET] for r in mine}) == len(mine)
        for r in mine:
            assert r["a"][sc.COLL_OP] == "all_reduce" and r["a"][sc.COLL_RANKS] == [0, 1, 2]
            assert r["a"][sc.DDP_READY_NS] <= r["start"] <= r["end"]  # ready, then issued, then done
    if len(by_step[11, 0]) < 2:
        pytest.fail("the test model should be split into several buckets")
    for rank in range(3):   # while untraced, the reducer all-reduced through the model's own group again
        seqs = {k: sorted(r["a"][sc.COLL_SEQ] for r in by_step[k, rank]) for k in (81, 84)}
        assert seqs[84][0] == seqs[81][-1] + 1
        # the unsampled steps' buckets (131, 133) were not recorded and still took their numbers:
        # as many as the next step has (130, the first, ran before DDP rebuilt its buckets), and
        # in 131's forward the rebuild's two broadcasts (the bucket indices, then their sizes)
        seqs = [sorted(r["a"][sc.COLL_SEQ] for r in by_step[k, rank]) for k in (130, 132, 134)]
        assert [b[0] - a[-1] - 1 - len(b) for a, b in zip(seqs, seqs[1:])] == [2, 0], seqs
    step_thread = {(step_of[r["trace"]], r["rank"]): r["thread"] for r in rows if r["name"] == "step"}
    for (k, rank), mine in by_step.items():   # on the thread that issued them (recorded elsewhere, later)
        assert all((r["thread"] == step_thread[k, rank]) == (not 110 <= k < 113) for r in mine), k
    step_start = {(step_of[r["trace"]], r["rank"]): r["start"] for r in rows if r["name"] == "step"}
    for (k, rank), mine in by_step.items():   # ready after the step began (and before the issue, above)
        assert all(r["a"][sc.DDP_READY_NS] >= step_start[k, rank] for r in mine)
    assert all(r["a"][sc.DDP_HOOK] == "allreduce_hook" for r in buckets if 20 <= step_of[r["trace"]] < 25)
    assert not [r for r in buckets if sc.DDP_HOOK in r["a"] and not 20 <= step_of[r["trace"]] < 25]


def test_straggler_makes_the_others_wait_in_the_first_bucket(ddp_job):
    """Rank 2 sleeps 50 ms before backward: ranks 0 and 1 enter each step's first bucket
    all-reduce ~50 ms before it (raw local times: one host, no simulated offsets) and wait
    there, while the straggler's all-reduce is short."""
    _, rows = ddp_job
    step_of = step_traces(rows, "ddp-test")
    first = {}
    for r in rows:
        k = step_of.get(r["trace"])
        if r["name"] == "ddp.all_reduce" and k is not None and 41 <= k < 47:  # 40 warms up DDP
            key = (k, r["rank"])
            if key not in first or r["a"][sc.COLL_SEQ] < first[key]["a"][sc.COLL_SEQ]:
                first[key] = r
    leads, waits, straggler_waits = [], [], []
    for k in range(41, 47):
        straggler = first[k, 2]
        for rank in range(2):
            assert first[k, rank]["a"][sc.COLL_SEQ] == straggler["a"][sc.COLL_SEQ]
            leads.append(straggler["start"] - first[k, rank]["start"])
            waits.append(first[k, rank]["end"] - first[k, rank]["start"])
        straggler_waits.append(straggler["end"] - straggler["start"])
    lead_ms, wait_ms = statistics.median(leads) / 1e6, statistics.median(waits) / 1e6
    print(f"others enter the bucket all-reduce {lead_ms:.1f} ms before the straggler (median), "
          f"and spend {wait_ms:.1f} ms in it; the straggler {statistics.median(straggler_waits) / 1e6:.1f} ms")
    assert 40 <= lead_ms <= 80
    assert 40 <= wait_ms and statistics.median(straggler_waits) / 1e6 < 25


JOIN_WORKER = """
import json
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo")
crosstrace.instrument_collectives()
rank = dist.get_rank()
torch.manual_seed(0)
def ddp():
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return crosstrace.instrument_ddp(DDP(mlp, bucket_cap_mb=0.01))

model = ddp()
data = torch.Generator().manual_seed(rank)
backend_seq = {}   # step -> gloo's own count of the group's operations before the explicit all-reduce

def step(k, backward=True, explicit=True, net=model):
    x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
    with crosstrace.step(k, every=2):          # even steps sampled
        loss = nn.functional.mse_loss(net(x), y)
        if backward:
            net.zero_grad()
            loss.backward()
        if explicit:
            backend_seq[k] = dist.group.WORLD._get_sequence_number_for_group()
            dist.all_reduce(loss.detach())     # a collective of the user's after the buckets

with Join([model]):        # uneven inputs: rank 0 runs out of data after 2 steps, the others after 5
    for k in range(10, 12 if rank == 0 else 15):
        step(k, explicit=False)                # Join matches DDP's collectives only
step(16)
step(17)
step(18)
step(19, backward=False)   # a forward with gradients and no backward pass: no all-reduce follows
step(20)
crosstrace.uninstrument_ddp(model)
fresh = ddp()
with Join([fresh]):        # rank 0 joins before its second forward: DDP rebuilds its buckets in the join hook
    for k in range(30, 31 if rank == 0 else 33):
        step(k, explicit=False, net=fresh)
for k in range(34, 37):
    step(k, net=fresh)
fresh._update_process_group(dist.new_group(backend="gloo"))   # DDP moves the model to another group
for k in range(38, 41):
    step(k, net=fresh)
dist.destroy_process_group()
print(json.dumps({"flushed": provider.force_flush(30000), "backend_seq": backend_seq}))
"""


def test_bucket_numbers_agree_after_uneven_inputs_and_unsampled_steps(tmp_path):
    """DDP's join: rank 0 runs out of data two steps before ranks 1 and 2 and matches their
    bucket all-reduces with zeros; the unsampled steps' buckets run untraced. Every rank
    still numbers each collective alike: in the steps after the join, and in the join's own
    all-reduces, which the joined rank records outside any step. A second model: rank 0 joins
    before its second forward (DDP rebuilds its buckets in the join hook), then DDP moves
    the model to another process group."""
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(JOIN_WORKER, 3, collector, job_id="ddp-join")
        rows = spans(collector)
    assert all(report["flushed"] for report in reports)
    step_of = step_traces(rows, "ddp-join")
    colls = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == Kind.COLLECTIVE:
            colls[step_of.get(r["trace"]), r["rank"]].append((r["a"][sc.COLL_SEQ], r["name"]))
    assert {k for k, _ in colls} == {None, 10, 12, 14, 16, 18, 20, 30, 32, 34, 36, 38, 40}   # None: outside steps
    for k in (16, 18, 20, 34, 36, 38, 40):
        mine = sorted(colls[k, 0])
        assert {name for _, name in mine} == {"ddp.all_reduce", "all_reduce"}, mine
        assert sorted(colls[k, 1]) == sorted(colls[k, 2]) == mine, k
    group_of = {step_of[r["trace"]]: r["a"][sc.COLL_GROUP] for r in rows if r["name"] == "ddp.all_reduce"}
    assert group_of[38] == group_of[40] != group_of[36]   # the buckets follow the model to its new group
    # The numbers follow the group's real order: gloo counts the same operations from here
    # on, so the two differ by a constant (an unsampled pass is counted if its backward ran).
    offsets = {seq - report["backend_seq"][str(k)] for rank, report in enumerate(reports)
               for k in (16, 18, 20) for seq, name in colls[k, rank] if name == "all_reduce"}
    assert len(offsets) == 1, offsets
    # While joined, rank 0 records the join's two all-reduces of each step of the others
    # (theirs are async and never waited on: not recorded), then counts that step's buckets.
    joined = sorted(seq for seq, _ in colls[None, 0] if seq < min(colls[16, 0])[0])
    for k in (12, 14):
        mine = sorted(colls[k, 1])
        assert sorted(colls[k, 2]) == mine and not colls[k, 0] and {name for _, name in mine} == {"ddp.all_reduce"}
        first = mine[0][0]
        assert {first - 2, first - 1} <= set(joined) and not {seq for seq, _ in mine} & set(joined), (mine, joined)
    assert len(joined) == 8 and joined[-2:] == sorted(seq for seq, _ in colls[None, 1])[:2]  # the join's last two


REBUILD_WORKER = """
import json, threading
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo")
for n in range(150):       # each fresh model rebuilds its buckets in its second forward
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model = crosstrace.instrument_ddp(DDP(mlp, bucket_cap_mb=0.01))
    for k in range(2):
        with crosstrace.step(1000 * n + k):
            loss = model(torch.randn(16, 32)).sum()
            worker = threading.Thread(target=loss.backward)   # autograd on a thread of its own
            worker.start()
            worker.join()
dist.destroy_process_group()
print(json.dumps({"models": n + 1, "flushed": provider.force_flush(30000)}))
"""


def test_bucket_rebuild_never_deadlocks(tmp_path):
    """DDP rebuilds its buckets in a model's second forward and broadcasts their order
    through the reducer's process group, crosstrace's here. Inherited from ProcessGroup,
    that broadcast reached gloo with the GIL held, while a gloo worker freeing a finished
    all-reduce (whose thread-local state holds a Python object) waited for the GIL under
    the queue lock the broadcast needs. Without the fix this test hung in its one run, and
    a similar script in 5 of 6."""
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(REBUILD_WORKER, 3, collector, timeout_s=90, job_id="ddp-rebuild")
    assert all(report["models"] == 150 and report["flushed"] for report in reports)


def test_a_bucket_keeps_the_parent_of_where_it_was_issued():
    """A bucket is recorded later than issued, maybe inside the next step; its parent is the
    context (and the step: none here) captured where DDP issued it, not the one open then."""
    from opentelemetry.context import Context

    import crosstrace
    from crosstrace.tracer.instrument.torch_dist import _parent

    outside = Context()   # a thread's context outside any span and step
    for k, every in ((0, 1), (1, 2)):   # recorded inside a sampled step, then an unsampled one
        with crosstrace.step(k, every=every):
            assert _parent(outside, None) is outside            # a root, as where it was issued
            assert _parent() is (None if every == 1 else False)  # a bucket issued in this step


BUFFERS_WORKER = """
import json, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from opentelemetry import trace
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))
model = crosstrace.instrument_ddp(DDP(net))
if sys.argv[1] == "compiled":
    model = torch.compile(model, backend="eager")
tracer = trace.get_tracer("worker")
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
data = torch.Generator().manual_seed(rank)
for k in range(4):
    with crosstrace.step(k):
        with tracer.start_as_current_span("load", kind=crosstrace.Kind.DATA):
            time.sleep(0.1 if rank == 1 else 0.001)
            x = torch.randn(16, 32, generator=data)
        with tracer.start_as_current_span("forward", kind=crosstrace.Kind.COMPUTE):
            loss = model(x).square().mean()
        with tracer.start_as_current_span("backward", kind=crosstrace.Kind.COMPUTE):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
params = [p.detach().sum().item() for p in net.parameters()]   # buffers: each rank's own last forward
dist.destroy_process_group()
print(json.dumps({"flushed": provider.force_flush(30000), "params": params}))
"""


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_late_rank_is_waited_for_in_ddps_buffer_broadcast(tmp_path, mode):
    """DDP broadcasts a model's buffers (BatchNorm's statistics) before each forward: rank 0
    waits there for a late rank 1. Untraced, that wait counted as rank 0's compute and the
    straggler went unnamed. Also under torch.compile, where Dynamo traced into crosstrace's
    hooks and crashed."""
    from crosstrace.collector.report import analyse_report
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(BUFFERS_WORKER, 2, collector, job_id=f"ddp-buffers-{mode}", args=(mode,))
        report, _, _ = analyse_report(collector.store)
    assert all(r["flushed"] for r in reports) and reports[0]["params"] == reports[1]["params"]
    steps = [t for t in report["traces"] if t["name"] == "step"]
    assert len(steps) == 4
    for t in steps[1:]:   # the first also waits for the first forward's setup
        waited = t["per_rank"]["rank0"]["attribution"]
        assert waited["collective.wait"] >= 80 * 1_000_000 and waited["compute"] < 50 * 1_000_000, waited
        assert (t["straggler"]["node"], t["straggler"]["span"]) == ("rank1", "load"), t["straggler"]


SLOW_CALLBACKS = """
import json, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from opentelemetry import trace
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace

provider = crosstrace.init()
dist.init_process_group("gloo")
SLOW_S = float(sys.argv[1])

def slow_callbacks(state, bucket):   # the all-reduce's future runs a slow callback before crosstrace's
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
    future.add_done_callback(lambda _: time.sleep(SLOW_S))
    return future

torch.manual_seed(0)
model = crosstrace.instrument_ddp(DDP(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)), bucket_cap_mb=0.01),
                                  hook=slow_callbacks)
"""

LATE_BUCKETS_WORKER = SLOW_CALLBACKS + """
with crosstrace.step(0):
    model(torch.randn(4, 32)).sum().backward()
provider.shutdown()     # at once: the bucket's callbacks are still running
time.sleep(0.4)         # for a span the bucket's callback would end after shutdown
print(json.dumps({"dropped": provider.dropped_spans}))
"""


def test_a_bucket_completing_late_as_the_tracer_shuts_down_is_recorded(tmp_path):
    """The reducer's wait returns when the future completes, before its callbacks run, so
    the last buckets' spans are recorded while the training loop may already be shutting
    the tracer down (the demo lost 2 a rank that way): shutdown waits for them, briefly."""
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(LATE_BUCKETS_WORKER, 2, collector, args=("0.2",), job_id="late-buckets")
        stored = spans(collector)
    assert [r["dropped"] for r in reports] == [0, 0], [r["stderr"][-2000:] for r in reports]
    buckets = [s for s in stored if s["name"] == "ddp.all_reduce"]
    assert sorted(s["rank"] for s in buckets) == [0, 1]


LATE_STAMP_WORKER = SLOW_CALLBACKS + """
tracer = trace.get_tracer("test")
for k in range(2):   # crosstrace's callback, which stamps each bucket's end, runs SLOW_S late
    with crosstrace.step(k):
        with tracer.start_as_current_span("backward"):
            model(torch.randn(4, 32)).sum().backward()
        time.sleep(0.01)
time.sleep(0.5)
print(json.dumps({"flushed": provider.force_flush(20000)}))
"""


def test_a_bucket_ends_within_the_backward_that_waited_for_it(tmp_path):
    """DDP's backward returns once every bucket's future has completed, before the callbacks
    that stamp their ends have run (they wait for the GIL on the backend thread): buckets
    ended after their rank's backward, and after its step, as a fake transfer at the end
    of the step's critical path."""
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(LATE_STAMP_WORKER, 2, collector, args=("0.1",), job_id="late-stamps")
        stored = spans(collector)
    assert all(r["flushed"] for r in reports)
    by_id = {s["span_id"]: s for s in stored}
    buckets = [s for s in stored if s["name"] == "ddp.all_reduce"]
    assert len(buckets) >= 2 * 2
    for bucket in buckets:
        backward = by_id[bucket["parent"]]
        assert backward["name"] == "backward"
        assert backward["start"] <= bucket["start"] < bucket["end"] <= backward["end"]


FORK_WORKER = """
import json, os, multiprocessing as mp
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import crosstrace
from crosstrace.tracer.instrument.torch_dist import _InFlight, _tracers

provider = crosstrace.init()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = crosstrace.instrument_ddp(DDP(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)), bucket_cap_mb=0.01))
def worker():   # a DataLoader worker, forked as the next epoch starts; gone without an exit flush
    os._exit(0 if not _InFlight.held and not any(t.completed for t in _tracers.values()) else 3)
codes = []
for epoch in range(2):
    for k in range(2):
        with crosstrace.step(epoch * 10 + k):
            model(torch.randn(4, 32)).sum().backward()
    child = mp.get_context("fork").Process(target=worker)
    child.start()
    child.join(30)
    codes.append(child.exitcode)
print(json.dumps({"children": codes, "flushed": provider.force_flush(30000)}))
"""


def test_forked_workers_do_not_inherit_buckets_in_flight(tmp_path):
    """A DataLoader worker forked right after a step held the parent's buckets whose
    callbacks it has none of: its exit waited for them (1 s, at every epoch's end)."""
    from crosstrace.launch import CollectorProcess

    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        reports = run_ranks(FORK_WORKER, 2, collector, job_id="ddp-fork")
        rows = spans(collector)
    assert [(r["children"], r["flushed"]) for r in reports] == [([0, 0], True)] * 2, reports
    buckets = collections.Counter((r["rank"], r["a"][sc.COLL_SEQ]) for r in rows if r["name"] == "ddp.all_reduce")
    assert len(buckets) >= 8 and set(buckets.values()) == {1}     # 2 ranks x 4 steps, none twice
