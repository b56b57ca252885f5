"""Workloads that fail on purpose, to exercise supervision (a crashing rank, a hung rank), and one
whose rank is slower than the others by a known factor (parallelism.balance=speed)."""

from __future__ import annotations

import os
import signal as signals
import time

import torch
from torch import nn


def _rank() -> int:
    for var in ("RANK", "HOROVOD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class FailingLinear(nn.Linear):
    """nn.Linear that raises on `fail_rank` at its `fail_at`-th forward (or hangs, with `hang`; or
    sends itself `signal`, e.g. 9: a rank killed with no traceback, as by the OOM killer; or, with
    `oom`, raises torch.OutOfMemoryError as CUDA's allocator does; or, with `nan`, returns NaN from
    then on, as a diverged model does)."""

    def __init__(self, in_features: int = 1000, out_features: int = 10, fail_rank: int = 0, fail_at: int = 3,
                 hang: bool = False, signal: int = 0, oom: bool = False, nan: bool = False) -> None:
        super().__init__(in_features, out_features)
        self.fail_rank, self.fail_at, self.hang, self.signal, self.calls = fail_rank, fail_at, hang, signal, 0
        self.oom, self.nan = oom, nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if _rank() == self.fail_rank and self.calls >= self.fail_at:
            if self.hang:
                time.sleep(3600)
            if self.signal:
                os.kill(os.getpid(), signals.Signals(self.signal))
            if self.nan:
                return super().forward(x) * float("nan")
            if self.oom:
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {self.fail_rank} at forward {self.calls})")
            raise RuntimeError(f"injected failure on rank {self.fail_rank} at forward {self.calls}")
        return super().forward(x)


class SlowLinear(nn.Linear):
    """nn.Linear plus emulated device work: its forward sleeps `sample_ms` per sample, and
    `slow_factor` times as long on `slow_rank`, a device that much slower. Sleeping, not computing:
    ranks sharing a few CPU cores would slow each other down and blur the factor. The math is
    nn.Linear's (the same initialization and output on every rank)."""

    def __init__(self, in_features: int = 1000, out_features: int = 10, sample_ms: float = 0.5, slow_rank: int = 1,
                 slow_factor: float = 2.0) -> None:
        super().__init__(in_features, out_features)
        self.sample_ms = sample_ms * (slow_factor if _rank() == slow_rank else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sample_ms * x.shape[0] / 1000.0)
        return super().forward(x)
