"""Seed 000's workload written as a user following the seed writes it, without the orchestrator:
the baselines of bench_overhead (its loop, in one process) and of bench_launch (this module on 2
ranks: DDP over gloo, or Horovod as seed 001 uses it: DistributedOptimizer with named_parameters,
broadcast_parameters from rank 0). From the repository root, under torchrun or horovodrun:

    .venv/bin/python -m torch.distributed.run --nproc-per-node=2 --master-port=29517 -m bench.plain ddp 200
    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python -m bench.plain horovod 200

Rank 0 prints `FIRST_STEP` (flushed) right after its first optimizer step, and at the end
`STEP_TIME_S <s> LOSS <loss>`: the median over windows of 10 steps after 5 warm-up steps of the
mean step time, the same statistic the orchestrator's StepMeter reports as `step_time_s`.
It imports nothing of the orchestrator, so its launch is the plain script's.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from tasks.datasets import random_classification


def train_steps(model: nn.Module, loader: Iterable, opt: Any, steps: int,
                sampler: Optional[DistributedSampler] = None) -> Iterator[torch.Tensor]:
    """The user's loop: cross-entropy, zero_grad, backward, step, epoch after epoch (the sampler
    told each epoch) until `steps` steps; yields each step's loss right after its optimizer step."""
    ce = nn.CrossEntropyLoss()
    done, epoch = 0, 0
    while done < steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            out = model(x)
            loss = ce(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            yield loss
            done += 1
            if done == steps:
                return
        epoch += 1


def windowed_step_time(ends: List[float], warmup: int = 5, window: int = 10) -> float:
    """ends[i]: when step i+1 ended; ends[-1] of the warm-up is where the first window starts."""
    bounds = list(range(warmup, len(ends) + 1, window))
    if bounds[-1] != len(ends):
        bounds.append(len(ends))
    per = [(ends[b - 1] - ends[a - 1]) / (b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    return statistics.median(per)


def _init(backend: str) -> Tuple[int, int]:
    """(rank, world size) once the process group (ddp) or Horovod is up."""
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size()
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _distributed(backend: str, model: nn.Module) -> Tuple[nn.Module, Any]:
    """The model and its SGD optimizer, wrapped as the backend's user wraps them."""
    if backend == "horovod":
        import horovod.torch as hvd

        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model = DDP(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def main(backend: str, steps: int) -> None:
    rank, world = _init(backend)
    torch.manual_seed(0)
    dataset = random_classification(size=4096, features=1000, classes=10, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    model, opt = _distributed(backend, nn.Linear(1000, 10))
    ends: List[float] = []
    for loss in train_steps(model, loader, opt, steps, sampler):
        ends.append(time.perf_counter())
        if len(ends) == 1 and rank == 0:
            print("FIRST_STEP", flush=True)
    if rank == 0:
        print(f"STEP_TIME_S {windowed_step_time(ends)} LOSS {loss.item()}", flush=True)
    if backend == "ddp":
        dist.barrier()  # without it, gloo's teardown aborts a rank now and then (SIGABRT at exit)
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("ddp", "horovod"):
        sys.exit("usage: python -m bench.plain {ddp,horovod} [steps]  (under torchrun or horovodrun)")
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200)
