"""Measuring the gradient noise scale while the job trains (trainer.noise_scale; the estimator is
measure/noise.py, the method is docs/measurement.md's "Gradient noise scale").

Each estimated step gives a pair of squared gradient norms at two batch sizes:

- `ranks` (several ranks: ddp, fsdp, horovod): each rank's own gradient before the all-reduce
  (DDP's communication hook sees every bucket; Horovod each gradient as its allreduce starts;
  FSDP each group's unsharded gradient before its reduce-scatter) at the local batch, and the
  averaged gradient after it at the global batch. Costs a norm of the gradients twice a step.
- `accumulation` (one rank, trainer.accumulation_steps > 1): the first micro-batch's gradient and
  the accumulated one.
- `halves` (one rank, single or dp, no accumulation): the warmup's steps (never measured) and
  every trainer.noise_every-th step run their batch as two halves (the same gradient: each half's
  loss weighs by its share); the first half's gradient and the whole's.

The norms stay on the device (one fused `_foreach_norm` per measurement, no sync); they are read,
and averaged over the ranks in one all-reduce, at a logged step (which syncs for its loss anyway)
once FLUSH_AT pairs wait, and at the run's end."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..measure.noise import NoiseEstimator
from ..measure.results import NoiseScale
from ..schema import BackendName, Balance, Config
from .dist import sq_norm
from .hooks import Hook

FLUSH_AT = 32  # pairs waiting on the device before a logged step reads them


def _total(parts: List[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def method_for(cfg: Config, world_size: int) -> Tuple[Optional[str], str]:
    """(method, '') for this run, or (None, why it is not measured)."""
    t, name = cfg.trainer, cfg.backend.name
    if not t.noise_scale:
        return None, "trainer.noise_scale=false"
    if world_size > 1:
        if cfg.parallelism.balance is Balance.speed:
            return None, "not measured with parallelism.balance=speed (the ranks' batches differ)"
        return "ranks", ""
    if name is BackendName.fsdp:
        return None, "not measured with backend=fsdp on one rank"
    if t.accumulation_steps > 1:
        return "accumulation", ""
    if name in (BackendName.single, BackendName.dp):
        return "halves", ""
    return None, f"not measured with backend={name.value} on one rank without accumulation"


class NoiseProbe:
    """One rank's side: this step's parts of the two squared norms (from the adapter's hooks or
    the step), the steps' pairs waiting on the device, and the run's estimator."""

    def __init__(self, method: str, world_size: int, big_div: int, every: int, scaler: Any = None) -> None:
        self.method, self.world, self.big_div, self.every, self.scaler = method, world_size, big_div, every, scaler
        self.fed = method != "ranks"  # ranks: the adapter sets it once its hooks feed this probe
        self.small: List[torch.Tensor] = []
        self.big: List[torch.Tensor] = []
        self.b_small = 0
        self.pending: List[Tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self.estimator = NoiseEstimator(method)

    # -- what the hooks and the step call ------------------------------------------------------
    def add_small(self, sq: Optional[torch.Tensor]) -> None:
        if sq is not None:
            self.small.append(sq)  # list.append: safe from a communication thread's callback

    def add_big(self, sq: Optional[torch.Tensor]) -> None:
        if sq is not None:
            self.big.append(sq)

    def first_part(self, model: nn.Module, n_part: int, weight: float) -> None:
        """After the first micro-batch's (or half's) backward, whose loss weighed `weight`: its own
        gradient is the accumulated one over `weight`."""
        sq = sq_norm(grads(model))
        if sq is not None:
            self.small.append(sq / (weight * weight))
            self.b_small = n_part

    def end_step(self, model: nn.Module, samples: int) -> None:
        """After the gradients are synchronized, before clipping: close the step's pair."""
        if not self.small:
            self.big.clear()
            return
        if self.method == "ranks":
            b_small, b_big = samples, samples * self.world
        else:
            b_small, b_big = self.b_small, samples
        if not self.big:  # the averaged gradient's norm, where no hook saw it (not DDP)
            self.add_big(sq_norm(grads(model)))
        small, big = _total(self.small), _total(self.big) if self.big else None
        self.small, self.big = [], []
        if big is None:
            return
        scale = getattr(self.scaler, "_scale", None)  # AMP fp16: the gradients are scaled by it
        if isinstance(scale, torch.Tensor):
            small, big = small / scale.square(), big / scale.square()
        self.pending.append((small, big, b_small, b_big))

    # -- reading them ---------------------------------------------------------------------------
    def flush(self, adapter: Any) -> None:
        """Read the pairs waiting (every rank at the same step: with several ranks, one all-reduce
        averages the ranks' own gradients' norms, and sums FSDP's shards of the averaged one)."""
        if not self.pending:  # the same on every rank: every rank closes a pair at the same steps
            return
        values = torch.stack([s for s, _, _, _ in self.pending] + [b for _, b, _, _ in self.pending]).tolist()
        if self.world > 1:
            values = adapter.all_reduce_sum(values)
        k = len(self.pending)
        for i, (_, _, b_small, b_big) in enumerate(self.pending):
            small = values[i] / self.world if self.world > 1 else values[i]
            big = values[k + i] / self.big_div if self.world > 1 else values[k + i]
            self.estimator.add(small, big, b_small, b_big)
        self.pending.clear()

    def result(self) -> NoiseScale:
        return self.estimator.result()


class NoiseHook(Hook):
    """Reads the probe's pairs at logged steps (their loss already synced) and puts the run's
    `noise_scale` (measure.results.NoiseScale) into the rank's result."""

    def __init__(self, probe: Optional[NoiseProbe], log_every: int, method: str = "halves") -> None:
        self.probe, self.log_every, self.method = probe, log_every, method

    def after_step(self, run: Any) -> bool:
        probe = self.probe
        if probe is None or len(probe.pending) < FLUSH_AT or run.step % self.log_every:
            return False
        probe.flush(run.adapter)
        return True

    def summary(self, run: Any, out: Dict[str, Any]) -> None:
        if self.probe is None:
            out["noise_scale"] = NoiseScale(method=self.method).as_dict()
            return
        self.probe.flush(run.adapter)
        out["noise_scale"] = self.probe.result().as_dict()


def check_fed(run: Any, hook: Optional[NoiseHook]) -> None:
    """After the adapter installed its hooks: a `ranks` probe that nothing feeds (FSDP internals
    that differ in this torch) measures nothing; say so once."""
    probe = run.noise
    if hook is None or probe is None or probe.fed:
        return
    if run.adapter.rank == 0:
        print(f"[noise] the gradient noise scale is not measured: backend={run.cfg.backend.name.value} "
              "gives no hook on each rank's gradient before its reduction here")
    hook.probe = run.noise = None


def noise_hook(run: Any) -> Optional[NoiseHook]:
    """The run's noise-scale hook (its probe on run.noise), or None when trainer.noise_scale is off.
    A method the run cannot use says why once, and the result carries an empty estimate."""
    cfg, adapter = run.cfg, run.adapter
    if not cfg.trainer.noise_scale:
        return None
    method, why = method_for(cfg, adapter.world_size)
    if method is None:
        if adapter.rank == 0:
            print(f"[noise] the gradient noise scale is {why}")
        return NoiseHook(None, cfg.trainer.log_every, "ranks" if adapter.world_size > 1 else "halves")
    shard = cfg.parallelism.shard_size or adapter.world_size
    big_div = adapter.world_size // shard if cfg.backend.name is BackendName.fsdp else adapter.world_size
    run.noise = NoiseProbe(method, adapter.world_size, big_div, cfg.trainer.noise_every, run.scaler)
    return NoiseHook(run.noise, cfg.trainer.log_every, method)
