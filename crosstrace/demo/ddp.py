"""Demo workload: DDP training on 4 gloo ranks (CPU), one rank a straggler, each rank on
its own simulated clock.

    python -m crosstrace.demo.ddp --steps 10 --straggler-rank 3 --straggle-ms 50
is one rank (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment);
`crosstrace demo` starts all of them with run(). The straggler sleeps at the end of its
forward pass (before backward) in every step, so the others enter the first gradient
bucket's all-reduce that much earlier and wait there: what the report should find
(collective.wait on the others, the straggler's forward as the cause).
"""
import argparse
import datetime
import time

from ..proto.semconv import Kind
from .workers import SimClock, Workers

RANKS = 4
STEPS = 10
STRAGGLER_RANK = 3
STRAGGLE_MS = 50
CLOCKS = (SimClock(120_000_000, 25.0), SimClock(-80_000_000, -40.0), SimClock(310_000_000, 15.0),
          SimClock(-45_000_000, 60.0))
def run(workers: Workers, say) -> dict:
    say(f"ddp: {RANKS} gloo ranks on CPU train an MLP for {STEPS} steps, each rank its own clock; "
        f"trainer-{STRAGGLER_RANK} is made a straggler ({STRAGGLE_MS} ms sleep at the end of its forward, every step)")
    workers.run_ranks("crosstrace.demo.ddp", "demo-ddp", "trainer", CLOCKS,
              ["--steps", str(STEPS), "--straggler-rank", str(STRAGGLER_RANK), "--straggle-ms", str(STRAGGLE_MS)])
    return {"workload": "ddp", "ranks": RANKS, "steps": STEPS, "straggler_rank": STRAGGLER_RANK,
            "straggler_node": f"trainer-{STRAGGLER_RANK}", "straggler_span": "forward", "straggle_ms": STRAGGLE_MS}


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of the DDP demo")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--straggler-rank", type=int, default=STRAGGLER_RANK)
    parser.add_argument("--straggle-ms", type=float, default=STRAGGLE_MS)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from opentelemetry import trace
    from torch.nn.parallel import DistributedDataParallel as DDP

    import crosstrace

    provider = crosstrace.init(role="trainer")  # endpoint, node id, job id and clock from CROSSTRACE_* env
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    model = crosstrace.instrument_ddp(DDP(mlp, bucket_cap_mb=0.5))  # a few buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = trace.get_tracer("crosstrace.demo")
    data = torch.Generator().manual_seed(rank)
    straggle_s = args.straggle_ms / 1000 if rank == args.straggler_rank else 0.0
    for k in range(args.steps):
        x, y = torch.randn(64, 256, generator=data), torch.randint(0, 10, (64,), generator=data)
        with crosstrace.step(k, name="ddp-step"):
            with tracer.start_as_current_span("forward", kind=Kind.COMPUTE):
                loss = nn.functional.cross_entropy(model(x), y)
                time.sleep(straggle_s)  # the injected straggler: a slow forward pass
            with tracer.start_as_current_span("backward", kind=Kind.COMPUTE):
                opt.zero_grad()
                loss.backward()
            with tracer.start_as_current_span("optimizer", kind=Kind.COMPUTE):
                opt.step()
    dist.destroy_process_group()
    provider.shutdown()


if __name__ == "__main__":
    main()
