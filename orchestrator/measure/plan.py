"""The arithmetic of a measurement's warmup, from the config alone: the loader's pre-filled queue,
a round of its workers, and the steps a warmup takes to read that queue before anything is
measured. The loop (runtime/loop.py) warms up by it, the tuner sizes fixed-length trials by it
(measure.rel_precision=0) and the benchmarks size their steady-state references by it."""

from __future__ import annotations

import math

from ..schema import Config


def loader_queue(cfg: Config) -> int:
    """Micro-batches the DataLoader's workers pre-fill when its iterator starts (num_workers x
    prefetch_factor, torch's default factor 2): a warmup reads them before anything is measured."""
    d = cfg.data
    return d.num_workers * (d.prefetch_factor or 2) if d.num_workers > 0 else 0


def loader_round(cfg: Config) -> int:
    """Optimizer steps in one round of the loader's workers (each hands over one micro-batch in
    turn): num_workers / gcd(num_workers, accumulation_steps); 1 without workers. Measured windows
    last whole rounds (see StepMeter)."""
    w, accum = cfg.data.num_workers, cfg.trainer.accumulation_steps
    return w // math.gcd(w, accum) if w > 0 else 1


def rewarm_steps(cfg: Config) -> int:
    """Optimizer steps that read the loader's pre-filled queue (+ 1 micro-batch) after an iterator starts."""
    return math.ceil((loader_queue(cfg) + 1) / cfg.trainer.accumulation_steps)


def steady_warmup_steps(cfg: Config) -> int:
    """Optimizer steps the first warmup takes: measure.warmup_steps (+ profile_steps), and at least
    the loader's pre-filled queue + 1 micro-batches."""
    t, drain = cfg.measure, rewarm_steps(cfg)
    if t.profile_steps:  # the queue is read again after the profiled steps (see train())
        return t.warmup_steps + t.profile_steps + drain
    return max(t.warmup_steps, drain)
