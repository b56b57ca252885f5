"""Seed 000's workload with Horovod (as seed 001 uses it: DistributedOptimizer with
named_parameters, broadcast_parameters from rank 0), written as a user writes it; the baseline of
bench/bench_launch.py. Run it under horovodrun:

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python bench/plain_horovod.py 200

Rank 0 prints `FIRST_STEP` (flushed) right after its first optimizer step, and at the end
`STEP_TIME_S <s>`: the median over windows of 10 steps after 5 warm-up steps of the mean step
time, the same statistic the orchestrator's StepMeter reports as `step_time_s`.
"""

import statistics
import sys
import time


import horovod.torch as hvd
import torch
from torch import nn
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
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    dataset = random_classification(size=4096, features=1000, classes=10, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model = nn.Linear(1000, 10)
    ce = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
