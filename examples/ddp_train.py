"""Data-parallel training traced with crosstrace: one trace per training step across all
ranks, with each gradient bucket's all-reduce as a span.

    crosstrace collector --store traces.db        # first, in another terminal
    torchrun --nproc-per-node 2 examples/ddp_train.py [--steps 20] [--every 1]
    crosstrace report --store traces.db

The collector is expected at 127.0.0.1:4327; set CROSSTRACE_ENDPOINT for another address.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from opentelemetry import trace
from torch.nn.parallel import DistributedDataParallel as DDP

import crosstrace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=1, help="trace every n-th step")
    args = parser.parse_args()

    crosstrace.init(job_id="ddp-example")  # rank and world size come from torchrun
    dist.init_process_group("gloo")        # "nccl" on GPUs
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)))
    crosstrace.instrument_ddp(model)       # each gradient bucket becomes a span
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = trace.get_tracer(__name__)
    compute = crosstrace.Kind.COMPUTE

    for k in range(args.steps):
        x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
        with crosstrace.step(k, every=args.every, name="ddp-step"):  # the same trace id on every rank
            with tracer.start_as_current_span("forward", kind=compute):
                loss = nn.functional.cross_entropy(model(x), y)
            with tracer.start_as_current_span("backward", kind=compute):
                opt.zero_grad()
                loss.backward()
            with tracer.start_as_current_span("optimizer", kind=compute):
                opt.step()
    dist.destroy_process_group()  # spans still queued are sent at exit


if __name__ == "__main__":
    main()
