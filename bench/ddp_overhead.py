"""Cost of tracing DDP training: a 4-rank gloo DDP job on CPU, traced vs. untraced.

Every rank trains one DDP model, an MLP of a few million parameters, in blocks of steps
that alternate, in a random order per round, between four modes: untraced (plain DDP),
traced every step, traced every 10th step (unsampled steps run crosstrace's unsampled
path), and untraced again, whose ratio to untraced is the benchmark's own noise. Tracing is switched on and off between blocks with instrument_ddp/uninstrument_ddp
on the same model, because two copies of one model differ by about 1 % in step time on
this machine (where their memory lies), more than the targets. A traced step runs inside
crosstrace.step with forward/backward/optimizer spans, exporting to a real collector.
Rank 0 reports each mode's median step time and its ratio to untraced, paired per round,
with the middle half of the rounds' ratios. For reference, a second model runs torch's
own Python allreduce_hook, untraced: what a comm hook costs against DDP's C++ all-reduce
(that copy's placement counts in its ratio). Targets (issue 3): every step <= 1.02 x
untraced, every 10th step <= 1.005 x.

Four ranks on two cores wait for each other through the scheduler, and the untraced-again
ratio spreads over several percent between runs. So the same worker then runs alone
(world size 1, three times as many rounds: a round takes a quarter of the time): what each
mode adds to its step, paired per round, is tracing's own cost on a rank's path, and is
printed against the 4-rank untraced step too.

The export runs on background threads (crosstrace's and gRPC's) whenever its interval comes
round, so its cost falls on the blocks of every mode alike, where the pairing cannot see it.
It is measured apart, after the rounds: each mode runs --export-steps steps on end, at the
exporter's own pace, then flushes; the CPU time of those threads (the export, and the DDP
bucket spans the exporter builds) against the ranks' whole CPU time in that run is the
mode's share. What a traced mode's share has beyond the untraced one's is what its export
costs, to add to its ratio (an upper bound: a part of it is already inside the step times).
The collector runs on the same two cores here, unlike a real job.

The ranks' CPU time per step (all four, every thread, per block, paired per round) is
printed too: waiting for the scheduler does not count in it, so it spreads less than wall
time here (still by a few percent), though it is not the step time the targets name. On
two cores, four ranks' added CPU time delays one another: what a rank adds alone counts
up to twice in the 4-rank step here, and once on a machine with a core per rank.

    python bench/ddp_overhead.py [--rounds R] [--steps S] [--hidden H] [--export-steps N]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from opentelemetry import trace
    from torch.nn.parallel import DistributedDataParallel as DDP

    import crosstrace

    provider = crosstrace.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tracer = trace.get_tracer("bench")

    def mlp():
        torch.manual_seed(0)
        h = args.hidden
        return DDP(nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h)))

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model, reference = mlp(), mlp()
    reference.register_comm_hook(None, allreduce_hook)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, reference)}
    x, y = torch.randn(64, args.hidden), torch.randn(64, args.hidden)
    step_number = iter(range(10**9))

    def plain_step(m):
        loss = nn.functional.mse_loss(m(x), y)
        optimizers[m].zero_grad()
        loss.backward()
        optimizers[m].step()

    def traced_step(every):
        with crosstrace.step(next(step_number), every=every):
            with tracer.start_as_current_span("forward", attributes={"crosstrace.kind": "compute"}):
                loss = nn.functional.mse_loss(model(x), y)
            with tracer.start_as_current_span("backward", attributes={"crosstrace.kind": "compute"}):
                optimizers[model].zero_grad()
                loss.backward()
            with tracer.start_as_current_span("optimizer", attributes={"crosstrace.kind": "compute"}):
                optimizers[model].step()

    modes = {"untraced": lambda: plain_step(model),
             "untraced 2": lambda: plain_step(model),
             "python hook": lambda: plain_step(reference),
             "every step": lambda: traced_step(1),
             "every 10th": lambda: traced_step(10)}

    def switch(mode: str) -> None:
        if mode in ("every step", "every 10th"):
            crosstrace.instrument_ddp(model)
        else:
            crosstrace.uninstrument_ddp(model)

    times = {mode: [] for mode in modes}  # per round: the step times of that round's block
    cpu = {mode: [] for mode in modes}    # per round: this rank's CPU seconds per step in that block
    for mode in modes:  # warm up: DDP rebuilds its buckets after the first iterations
        switch(mode)
        for _ in range(3):
            modes[mode]()
    order = random.Random(0)  # the same on every rank: they must run the same model
    for _ in range(args.rounds):
        for mode in order.sample(list(modes), len(modes)):
            switch(mode)
            block = []
            c0 = time.process_time()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                modes[mode]()
                block.append(time.perf_counter() - t0)
            cpu[mode].append((time.process_time() - c0) / args.steps)
            times[mode].append(block)
    export_cpu = {}   # per mode: CPU ns of the export threads, of all threads, in its run on end
    for mode in ("untraced", "every step", "every 10th"):
        switch(mode)
        provider.force_flush(30_000)
        before = thread_cpu()
        for _ in range(args.export_steps):
            modes[mode]()
        provider.force_flush(30_000)
        export_cpu[mode] = [after - b for after, b in zip(thread_cpu(), before)]
    flushed = provider.force_flush(60_000)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, export_cpu)
    cpus = [None] * dist.get_world_size()
    dist.all_gather_object(cpus, cpu)
    dist.destroy_process_group()
    if rank == 0:
        background = {mode: sum(share[mode][0] for share in shares) / sum(share[mode][1] for share in shares)
                      for mode in shares[0]}
        ranks_cpu = {mode: [sum(per_rank) for per_rank in zip(*(c[mode] for c in cpus))] for mode in modes}
        print(json.dumps({"times": times, "cpu": ranks_cpu, "flushed": flushed, "dropped": provider.dropped_spans,
                          "background": background}))


def thread_cpu() -> tuple[int, int]:
    """(CPU ns of this process's export threads, of all its threads) so far, from /proc's
    schedstat (to the ns, where stat counts 10 ms ticks): the export threads are every
    Python thread but the main one (crosstrace's and gRPC's; only crosstrace uses gRPC
    here) and gRPC's own; the rest are the training loop's, gloo's and the TCP store's."""
    import threading

    exporters = {t.native_id for t in threading.enumerate() if t is not threading.main_thread()}
    grpc_prefixes = ("grpc", "event_engine", "lifeguard", "default-execu", "resolver-exec")
    background = total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue  # the thread has ended
        total += ns
        if int(tid) in exporters or name.startswith(grpc_prefixes):
            background += ns
    return background, total


def step_cost_us(endpoint: str, n: int = 20000) -> dict:
    """crosstrace.step() itself, sampled and not, with three child spans each (no torch),
    exported to the collector at `endpoint`; and the peer: the same four spans with the
    OpenTelemetry SDK (BatchSpanProcessor, no-op exporter)."""
    import crosstrace
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider as SdkProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from peers import NoopExporter

    sdk = SdkProvider()
    sdk.add_span_processor(BatchSpanProcessor(NoopExporter()))
    sdk_tracer = sdk.get_tracer("bench")
    t0 = time.perf_counter()
    for _ in range(n):
        with sdk_tracer.start_as_current_span("step"):
            for name in ("forward", "backward", "optimizer"):
                with sdk_tracer.start_as_current_span(name):
                    pass
    out = {"sdk": (time.perf_counter() - t0) / n * 1e6}
    sdk.shutdown()
    provider = crosstrace.init(endpoint=endpoint, node_id="bench-step", max_queue=10 * n)
    tracer = trace.get_tracer("bench")
    for label, every in (("sampled", 1), ("unsampled", 2)):
        t0 = time.perf_counter()
        for k in range(n):
            with crosstrace.step(2 * k + (every - 1), every=every):
                for name in ("forward", "backward", "optimizer"):
                    with tracer.start_as_current_span(name):
                        pass
        out[label] = (time.perf_counter() - t0) / n * 1e6
    provider.shutdown()
    return out


def run_job(world: int, endpoint: str, rounds: int) -> dict:
    """Run the worker on `world` ranks for `rounds` rounds; rank 0's result."""
    from crosstrace.launch import free_port

    port, procs = free_port(), []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "CROSSTRACE_ENDPOINT": endpoint, "CROSSTRACE_NODE_ID": f"bench-rank{rank}",
               "CROSSTRACE_JOB_ID": f"ddp-bench-{world}"}
        command = [sys.executable, __file__, "--worker", *sys.argv[1:], "--rounds", str(rounds)]
        procs.append(subprocess.Popen(command, env=env, text=True,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    out, _ = procs[0].communicate(timeout=1800)
    for proc in procs[1:]:
        proc.wait(120)
    if procs[0].returncode != 0 or not out.strip():
        sys.exit(f"rank 0 of {world} failed ({procs[0].returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="rounds; each runs every mode, in random order")
    parser.add_argument("--steps", type=int, default=5, help="steps per mode per round")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (3 layers: ~3 h^2 parameters)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--export-steps", type=int, default=400, help="steps per mode run on end for the export's "
                        "share (400: about 25 s at 4 ranks, five export rounds and two clock-probe bursts)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from crosstrace.launch import CollectorProcess

    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(f"{tmp}/bench.db") as collector:
        result = run_job(args.world, collector.address, args.rounds)
        alone = run_job(1, collector.address, 3 * args.rounds)["times"]
        cost = step_cost_us(collector.address)
    times = result["times"]
    medians = {mode: statistics.median(t for block in blocks for t in block) * 1e3 for mode, blocks in times.items()}

    def per_round(mode: str) -> list[float]:
        """Each round's block median against the untraced one's: paired within a round, so
        that load drifting over the run cancels out."""
        return [statistics.median(a) / statistics.median(b) for a, b in zip(times[mode], times["untraced"])]

    def ratio(mode: str) -> float:
        return statistics.median(per_round(mode))

    def spread(mode: str) -> str:
        """The middle half of the rounds' ratios: how far one round's noise reaches."""
        q1, _, q3 = statistics.quantiles(per_round(mode), n=4)
        return f"(rounds' middle half {q1:.3f}-{q3:.3f})"

    def added_us(mode: str) -> float:
        """What a mode adds to a step of one rank alone, paired per round."""
        return statistics.median(statistics.median(a) - statistics.median(b)
                                 for a, b in zip(alone[mode], alone["untraced"])) * 1e6

    params = 3 * (args.hidden ** 2 + args.hidden)
    print(f"DDP, {args.world} gloo ranks on CPU, MLP of {params / 1e6:.1f} M parameters; {args.rounds} rounds, "
          f"each {args.steps} steps per mode, modes in random order")
    for mode, ms in medians.items():
        print(f"  {mode:11s} median step {ms:7.2f} ms   ratio to untraced {ratio(mode):.4f} {spread(mode)}")
    print(f"ratio traced every step / untraced: {ratio('every step'):.4f}   (target <= 1.02)")
    print(f"ratio traced every 10th / untraced: {ratio('every 10th'):.4f}   (target <= 1.005)")
    print(f"ratio untraced again / untraced: {ratio('untraced 2'):.4f}   (no difference: the noise of this run)")
    print(f"ratio torch's own Python allreduce_hook, untraced / untraced: {ratio('python hook'):.4f}"
          "   (what any Python comm hook costs here, for reference)")
    untraced_us = medians["untraced"] * 1e3
    print(f"one rank alone (world size 1, the same model, no rank to wait for): added per step "
          + ", ".join(f"{mode} {added_us(mode):+.0f} us" for mode in ("untraced 2", "every step", "every 10th"))
          + f"; against the {args.world}-rank untraced step: every step {1 + added_us('every step') / untraced_us:.4f}, "
          f"every 10th {1 + added_us('every 10th') / untraced_us:.4f}")
    cpu = result["cpu"]

    def cpu_ratio(mode: str) -> tuple[float, float, float]:
        """All ranks' CPU seconds per step in the mode's block against the untraced block's,
        paired per round: median and middle half."""
        ratios = [a / b for a, b in zip(cpu[mode], cpu["untraced"])]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        return median, q1, q3

    print(f"{args.world} ranks' CPU time per step, paired per round (scheduling does not count): "
          + ", ".join("{} {:.4f} ({:.3f}-{:.3f})".format(mode, *cpu_ratio(mode))
                      for mode in ("untraced 2", "every step", "every 10th")))
    shares = result["background"]
    print(f"export threads' share of the ranks' CPU time, each mode {args.export_steps} steps on end: "
          + ", ".join(f"{mode} {share:.4f}" for mode, share in shares.items())
          + "; beyond untraced (add to the ratio at most; see the docstring): "
          + ", ".join(f"{mode} {shares[mode] - shares['untraced']:+.4f}" for mode in ("every step", "every 10th")))
    print(f"all spans acked by the collector: {result['flushed']}, dropped: {result['dropped']}")
    print(f"crosstrace.step() with 3 child spans: {cost['sampled']:.1f} us sampled, {cost['unsampled']:.1f} us "
          f"unsampled; the same 4 spans with the opentelemetry-sdk: {cost['sdk']:.1f} us, ratio (sampled) "
          f"{cost['sampled'] / cost['sdk']:.3f}")


if __name__ == "__main__":
    main()
