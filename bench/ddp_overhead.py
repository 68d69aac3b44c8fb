"""Cost of tracing DDP training: a 4-rank gloo DDP job on CPU, traced vs. untraced.

Every rank trains two copies of one MLP (a few million parameters): one plain DDP model
(DDP's built-in C++ all-reduce) and one with crosstrace.instrument_ddp, each step inside
crosstrace.step with forward/backward/optimizer spans, exporting to a real collector.
Blocks of steps alternate between untraced, traced every step and traced every 10th step
(unsampled steps still run the hook), in a random order per round, so that machine noise
hits all alike; rank 0 reports each mode's median step time and its ratio to untraced,
paired per round. For reference, a third copy runs torch's own Python
allreduce_hook, untraced: what any Python comm hook costs against DDP's C++ path. Targets (issue 3): every step <= 1.02 x untraced,
every 10th step <= 1.005 x.

    python bench/ddp_overhead.py [--rounds R] [--steps S] [--hidden H]
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

    models = {"untraced": mlp(), "traced": crosstrace.instrument_ddp(mlp()), "python hook": mlp()}
    models["python hook"].register_comm_hook(None, allreduce_hook)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    x, y = torch.randn(64, args.hidden), torch.randn(64, args.hidden)
    step_number = iter(range(10**9))

    def plain_step(model, opt):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def traced_step(model, opt, every):
        with crosstrace.step(next(step_number), every=every):
            with tracer.start_as_current_span("forward", attributes={"crosstrace.kind": "compute"}):
                loss = nn.functional.mse_loss(model(x), y)
            with tracer.start_as_current_span("backward", attributes={"crosstrace.kind": "compute"}):
                opt.zero_grad()
                loss.backward()
            with tracer.start_as_current_span("optimizer", attributes={"crosstrace.kind": "compute"}):
                opt.step()

    modes = {"untraced": lambda: plain_step(models["untraced"], optimizers["untraced"]),
             "python hook": lambda: plain_step(models["python hook"], optimizers["python hook"]),
             "every step": lambda: traced_step(models["traced"], optimizers["traced"], 1),
             "every 10th": lambda: traced_step(models["traced"], optimizers["traced"], 10)}
    times = {mode: [] for mode in modes}  # per round: the step times of that round's block
    for mode in modes:  # warm up: DDP rebuilds its buckets after the first iterations
        for _ in range(3):
            modes[mode]()
    order = random.Random(0)  # the same on every rank: they must run the same model
    for _ in range(args.rounds):
        for mode in order.sample(list(modes), len(modes)):
            block = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                modes[mode]()
                block.append(time.perf_counter() - t0)
            times[mode].append(block)
    dist.destroy_process_group()
    flushed = provider.force_flush(60_000)
    if rank == 0:
        print(json.dumps({"times": times, "flushed": flushed, "dropped": provider.dropped_spans}))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="rounds; each runs every mode, in random order")
    parser.add_argument("--steps", type=int, default=5, help="steps per mode per round")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (3 layers: ~3 h^2 parameters)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from crosstrace.launch import CollectorProcess, free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(f"{tmp}/bench.db") as collector:
        procs = []
        for rank in range(args.world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": f"bench-rank{rank}",
                   "CROSSTRACE_JOB_ID": "ddp-bench"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True))
        out, _ = procs[0].communicate(timeout=1800)
        for proc in procs[1:]:
            proc.wait(120)
        cost = step_cost_us(collector.address)
    if procs[0].returncode != 0 or not out.strip():
        sys.exit(f"rank 0 failed ({procs[0].returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    times = result["times"]
    medians = {mode: statistics.median(t for block in blocks for t in block) * 1e3 for mode, blocks in times.items()}

    def ratio(mode: str) -> float:
        """Median over rounds of this round's block median against the untraced one's: paired
        within a round, so that load drifting over the run cancels out."""
        return statistics.median(statistics.median(a) / statistics.median(b)
                                 for a, b in zip(times[mode], times["untraced"]))

    params = 3 * (args.hidden ** 2 + args.hidden)
    print(f"DDP, {args.world} gloo ranks on CPU, MLP of {params / 1e6:.1f} M parameters; {args.rounds} rounds, "
          f"each {args.steps} steps per mode, modes in random order")
    for mode, ms in medians.items():
        print(f"  {mode:11s} median step {ms:7.2f} ms   ratio to untraced {ratio(mode):.4f}")
    print(f"ratio traced every step / untraced: {ratio('every step'):.4f}   (target <= 1.02)")
    print(f"ratio traced every 10th / untraced: {ratio('every 10th'):.4f}   (target <= 1.005)")
    print(f"ratio torch's own Python allreduce_hook, untraced / untraced: {ratio('python hook'):.4f}"
          "   (what any Python comm hook costs here, for reference)")
    print(f"all spans acked by the collector: {result['flushed']}, dropped: {result['dropped']}")
    print(f"crosstrace.step() with 3 child spans: {cost['sampled']:.1f} us sampled, {cost['unsampled']:.1f} us "
          f"unsampled; the same 4 spans with the opentelemetry-sdk: {cost['sdk']:.1f} us, ratio (sampled) "
          f"{cost['sampled'] / cost['sdk']:.3f}")


if __name__ == "__main__":
    main()
