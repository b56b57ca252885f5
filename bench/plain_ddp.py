"""Seed 000's workload with DDP over gloo, written as a user following the seed writes it; the
baseline of bench/bench_launch.py. Run it under torchrun:

    .venv/bin/python -m torch.distributed.run --nproc-per-node=2 --master-port=PORT bench/plain_ddp.py 200

Rank 0 prints `FIRST_STEP` (flushed) right after its first optimizer step, and at the end
`STEP_TIME_S <s>`: the median over windows of 10 steps after 5 warm-up steps of the mean step
time, the same statistic the orchestrator's StepMeter reports as `step_time_s`.
"""

import statistics
import sys
import time


import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from tasks.datasets import random_classification


def windowed_step_time(ends, warmup=5, window=10):
    """ends[i]: when step i+1 ended; ends[-1] of the warm-up is where the first window starts."""
    bounds = list(range(warmup, len(ends) + 1, window))
    if bounds[-1] != len(ends):
        bounds.append(len(ends))
    per = [(ends[b - 1] - ends[a - 1]) / (b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    return statistics.median(per)


def main(steps):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dataset = random_classification(size=4096, features=1000, classes=10, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model = DDP(nn.Linear(1000, 10))
    ce = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    ends, done, epoch = [], 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            out = model(x)
            loss = ce(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ends.append(time.perf_counter())
            done += 1
            if done == 1 and rank == 0:
                print("FIRST_STEP", flush=True)
            if done == steps:
                break
        epoch += 1
    if rank == 0:
        print(f"STEP_TIME_S {windowed_step_time(ends)} LOSS {loss.item()}", flush=True)
    dist.barrier()  # without it, gloo's teardown aborts a rank now and then (SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
