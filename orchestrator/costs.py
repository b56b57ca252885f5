"""Costs of this host that advice rests on, measured once and cached under
~/.cache/orchestrator/ (ORCHESTRATOR_CACHE overrides the folder).

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
from typing import Any, Dict

import torch
from torch.utils.data import DataLoader, Dataset


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


def handoff_s(batch_bytes: int, batch_size: int) -> Dict[str, Any]:
    """The hand-off cost for batches of about this size on this host: {"seconds", "source"},
    measured once per host, torch version and power-of-two size class, then cached."""
    size_class = 2 ** max(10, math.ceil(math.log2(max(1, batch_bytes))))
    key = f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}|{size_class}|{batch_size}"
    path = cache_dir() / "handoff.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return {"seconds": cached[key], "source": "measured on this host"}
    seconds = measure_handoff(size_class, batch_size)
    cached[key] = seconds
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return {"seconds": seconds, "source": "measured on this host"}
