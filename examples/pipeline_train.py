"""Pipeline-parallel training (torch.distributed.pipelining) traced with crosstrace: one
trace per step across all stages, with every stage's forward and backward of each
microbatch and every activation and gradient transfer as spans.

    crosstrace collector --store traces.db        # first, in another terminal
    torchrun --nproc-per-node 2 examples/pipeline_train.py [--steps 10] [--schedule Schedule1F1B]
    crosstrace report --store traces.db

One stage per rank (two with ScheduleInterleaved1F1B: rank r holds stages r and r + world).
The collector is expected at 127.0.0.1:4327; set CROSSTRACE_ENDPOINT for another address.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining

import crosstrace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schedule", default="ScheduleGPipe",
                        choices=("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"))
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    crosstrace.init(job_id="pipeline-example")  # rank and world size come from torchrun
    crosstrace.instrument_pipeline()            # stages, schedules and their sends and receives
    dist.init_process_group("gloo")             # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    interleaved = args.schedule == "ScheduleInterleaved1F1B"
    per_rank = 2 if interleaved else 1
    parts = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(per_rank)]  # this rank's part of the model
    stages = [pipelining.PipelineStage(part, rank + v * world, world * per_rank, torch.device("cpu"))
              for v, part in enumerate(parts)]
    schedule = getattr(pipelining, args.schedule)(stages if interleaved else stages[0],
                                                  n_microbatches=args.microbatches, loss_fn=nn.MSELoss())
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.01)
    data = torch.Generator().manual_seed(0)  # the same batches on every rank

    for k in range(args.steps):
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 64, generator=data)
        with crosstrace.step(k, name="pipeline-step"):  # the same trace id on every rank
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
    dist.destroy_process_group()  # spans still queued are sent at exit


if __name__ == "__main__":
    main()
