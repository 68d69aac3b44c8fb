"""Demo workload: a 2-stage pipeline (torch.distributed.pipelining, 4 microbatches) on 2
gloo ranks (CPU), each rank on its own simulated clock.

    python -m crosstrace.demo.pipeline --schedule Schedule1F1B --steps 4
is one rank (torchrun's environment); `crosstrace demo` starts both with run(). Each
stage's forward and backward of a microbatch take a fixed time (a sleep), so the bubbles
the report finds can be held against the schedule's ideal (p - 1) / (m + p - 1).
"""
import argparse
import datetime
import time

from .workers import SimClock, Workers

STAGES = 2
MICROBATCHES = 4
STEPS = 4
SCHEDULE = "Schedule1F1B"
FORWARD_MS, BACKWARD_MS = 10, 20
CLOCKS = (SimClock(-150_000_000, 30.0), SimClock(200_000_000, -20.0))


def run(workers: Workers, say) -> dict:
    say(f"pipeline: {STAGES} stages on {STAGES} gloo ranks, {SCHEDULE}, {MICROBATCHES} microbatches, "
        f"{STEPS} steps, each rank its own clock; every stage takes {FORWARD_MS} ms forward and "
        f"{BACKWARD_MS} ms backward per microbatch")
    workers.run_ranks("crosstrace.demo.pipeline", "demo-pipeline", "stage", CLOCKS,
              ["--schedule", SCHEDULE, "--steps", str(STEPS), "--microbatches", str(MICROBATCHES)])
    return {"workload": "pipeline", "schedule": SCHEDULE, "stages": STAGES, "microbatches": MICROBATCHES,
            "steps": STEPS, "forward_ms": FORWARD_MS, "backward_ms": BACKWARD_MS,
            "ideal_bubble_fraction": (STAGES - 1) / (MICROBATCHES + STAGES - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank (stage) of the pipeline demo")
    parser.add_argument("--schedule", default=SCHEDULE, choices=("ScheduleGPipe", "Schedule1F1B"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed import pipelining

    import crosstrace

    class FixedCost(torch.autograd.Function):
        """The identity, taking a fixed time forward and backward (a stage's compute)."""

        @staticmethod
        def forward(ctx, x):
            time.sleep(FORWARD_MS / 1000)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(BACKWARD_MS / 1000)
            return grad

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(64, 64)

        def forward(self, x):
            return FixedCost.apply(torch.relu(self.layer(x)))

    provider = crosstrace.init(role="trainer")  # endpoint, node id, job id and clock from CROSSTRACE_* env
    crosstrace.instrument_pipeline()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage = pipelining.PipelineStage(Stage(), rank, world, torch.device("cpu"))
    schedule = getattr(pipelining, args.schedule)(stage, n_microbatches=args.microbatches, loss_fn=nn.MSELoss())
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(0)  # the same batches on both ranks: rank 0 reads x, the last y
    for k in range(args.steps):
        x, y = torch.randn(8 * args.microbatches, 64, generator=data), torch.randn(8 * args.microbatches, 64,
                                                                                  generator=data)
        with crosstrace.step(k, name="pipeline-step"):
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
    dist.destroy_process_group()
    provider.shutdown()


if __name__ == "__main__":
    main()
