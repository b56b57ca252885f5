"""Costs of this host that advice and figures rest on, measured once and cached in
~/.cache/orchestrator/costs.json (ORCHESTRATOR_CACHE overrides the folder): the DataLoader worker
hand-off below, and the CPU's matmul peak (the denominator of MFU on CPU, runtime/flops.py).

The DataLoader worker hand-off: with `num_workers > 0`, every batch is built in a worker process
and handed to the training process through shared memory and a pipe. That costs time per batch
in the training process, whatever the data costs to load. When a batch is cheap to build in
process (in-memory tensors, a light transform), the hand-off can cost more than the work it moves
out of the way, and adding workers makes the job slower. The diagnosis compares the measured
per-batch data time with this cost before it advises workers.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from torch.utils.data import DataLoader, Dataset

from .rundir import write_json


def cache_dir() -> Path:
    return Path(os.environ.get("ORCHESTRATOR_CACHE", Path.home() / ".cache" / "orchestrator"))


class _Synthetic(Dataset):
    """Items of a given size, built in no time: what remains is the hand-off."""

    def __init__(self, item_bytes: int, n: int) -> None:
        self.x = torch.zeros(max(1, item_bytes // 4), dtype=torch.float32)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int):
        return self.x, idx


def _per_batch_s(loader: DataLoader, batches: int) -> float:
    it = iter(loader)
    for _ in range(5):  # workers start, the prefetch queue fills
        next(it)
    time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches


def measure_handoff(batch_bytes: int, batch_size: int, batches: int = 40) -> float:
    """Seconds per batch that one worker adds over building the same batch in process (>= 0)."""
    item = max(1, batch_bytes // max(1, batch_size))
    ds = _Synthetic(item, (batches + 10) * batch_size)
    in_process = _per_batch_s(DataLoader(ds, batch_size=batch_size), batches)
    # one worker, no prefetch to hide behind: each batch pays the whole trip
    worker = _per_batch_s(DataLoader(ds, batch_size=batch_size, num_workers=1, prefetch_factor=1), batches)
    return max(0.0, worker - in_process)


def _cached(key: str, measure: Callable[[], float]) -> Dict[str, Any]:
    """The value cached under `key` in cache_dir()/costs.json, else `measure()` (then cached)."""
    path = cache_dir() / "costs.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return {"value": cached[key], "source": "measured on this host"}
    value = measure()
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, cached)  # concurrent writers: the last one wins, each file is whole
    except OSError:
        pass  # a read-only home: measure again next time
    return {"value": value, "source": "measured on this host"}


def _host() -> str:
    return f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}"


def handoff_s(batch_bytes: int, batch_size: int) -> Dict[str, Any]:
    """The hand-off cost for batches of about this size on this host: {"seconds", "source"},
    measured once per host, torch version and power-of-two size class, then cached."""
    size_class = 2 ** max(10, math.ceil(math.log2(max(1, batch_bytes))))
    got = _cached(f"handoff|{_host()}|{size_class}|{batch_size}", lambda: measure_handoff(size_class, batch_size))
    return {"seconds": got["value"], "source": got["source"]}


CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an n x n matmul at the current thread count: the best of `reps` after a warmup."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def cpu_peak_flops(dtype: str, threads: int) -> Dict[str, Any]:
    """{"flops", "source"}: the matmul peak this host reaches in `dtype` with `threads` threads,
    measured once (about 0.2 s) and cached."""
    if dtype not in CPU_DTYPES:
        return {"flops": None, "source": f"unknown peak: no CPU measurement for {dtype}"}
    got = _cached(f"matmul|{_host()}|{dtype}|{threads}", lambda: measure_matmul_flops(CPU_DTYPES[dtype]))
    return {"flops": got["value"], "source": f"{got['source']}: {dtype} matmul, {threads} threads"}
