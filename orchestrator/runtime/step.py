"""One optimizer step of the loop (runtime/loop.py): `trainer.accumulation_steps` micro-batches
forward and backward (gradient accumulation, AMP, non_blocking copies), the exposed
communication, clipping and the update, each phase marked for the meter. The FLOP counter
(runtime/flops.py) wraps the forward and backward of the run's first step."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..measure.phases import COMM, COMPUTE, DATA, H2D, OPTIMIZER
from ..rundir import DIVERGED_AT
from .batch import Feed, to_device
from .flops import StepCounter


class Stepper:
    """Runs `run`'s next optimizer step (`loop.Run`: its model, optimizer, iterator, meter).

    Hot path: on a ~200 us step every microsecond shows, so work that does nothing is skipped
    (CPU copies, a disabled autocast, a division by 1, loss bookkeeping on unlogged steps)."""

    def __init__(self, run: Any) -> None:
        t = run.cfg.trainer
        self.accum, self.clip, self.log_every = t.accumulation_steps, t.grad_clip, t.log_every
        self.checkpoint_every = t.checkpoint_every  # checkpointed steps are logged: a checkpoint follows a checked loss
        self.feed = Feed(run.cfg)
        self.criterion = self.feed.criterion
        self.move = run.device.type != "cpu"
        self.autocast = ((lambda: torch.autocast(run.device.type, dtype=run.amp_dtype)) if run.amp
                         else contextlib.nullcontext)
        self.plain = not run.amp and self.accum == 1  # no context to enter: the micro-step is the seed's own code
        # FLOPs are counted over the first step, a warmup step (never measured); see runtime/flops.py
        self.counter: Optional[StepCounter] = StepCounter() if t.warmup_steps > 0 else None
        self.counted_step = run.step
        self.flops: Dict[str, Any] = {"flops": None,
                                      "reason": "not counted: trainer.warmup_steps=0 leaves no unmeasured step"}

    def __call__(self, run: Any) -> tuple:
        """(samples, micro-batches, the step's loss or None when the step is not logged); advances
        run.step and run.b (the batch in the epoch)."""
        step, b, model, it, device, mark = run.step, run.b, run.model, run.it, run.device, run.meter.mark
        adapter, balancer, scaler, criterion = run.adapter, run.balancer, run.scaler, self.criterion
        counting = self.counter is not None and step == self.counted_step
        if counting:
            self.counter.__enter__()  # type: ignore[union-attr]
        micro = min(self.accum, run.n_batches - b)  # the epoch's last step takes the remainder
        logged = ((step + 1) % self.log_every == 0 or step == 0 or step + 1 == run.total
                  or (self.checkpoint_every > 0 and (step + 1) % self.checkpoint_every == 0))
        samples = 0
        step_loss = 0.0
        feed = self.feed
        for m in range(micro):
            batch = next(it)
            mark(DATA)
            if not feed.checked:  # the run's first batch: its structure fits model.loss (one line if not)
                feed.check(batch, model)
            if feed.pair:  # (input, target) with cross_entropy / mse: the plain loop, as fast as hand-written
                x, y = batch
                if self.move:
                    x = x.to(device, non_blocking=True)
                    y = y.to(device, non_blocking=True)
                    mark(H2D)
                n = x.shape[0]
            else:
                if feed.masked:  # before the copy: the mask is counted in host memory
                    run.meter.add_tokens(*feed.tokens(batch))
                if self.move:
                    batch = to_device(batch, device)
                    mark(H2D)
                n = feed.size(batch)
            if self.plain:
                loss = criterion(model(x), y) if feed.pair else feed.loss(model, batch)
                (loss if balancer is None else weigh(balancer, loss, n, b + m)).backward()
            else:
                with adapter.grad_sync(model, enabled=m == micro - 1), self.autocast():
                    loss = criterion(model(x), y) if feed.pair else feed.loss(model, batch)
                    if micro > 1:
                        loss = loss / micro
                    weighted = loss if balancer is None else weigh(balancer, loss, n, b + m)
                    (scaler.scale(weighted) if scaler is not None else weighted).backward()
            if logged:
                step_loss += loss.detach()
            samples += n
            mark(COMPUTE)
        run.b = b + micro
        if counting:
            self.counter.__exit__(None, None, None)  # type: ignore[union-attr]
            self.flops, self.counter = self.counter.per_sample(samples), None  # type: ignore[union-attr]
        self.update(run)
        run.step = step + 1
        return samples, micro, (step_loss if logged else None)

    def update(self, run: Any) -> None:
        """The exposed communication, clipping and the optimizer step."""
        optimizer, scaler, mark = run.optimizer, run.scaler, run.meter.mark
        if run.adapter.exposed_comm:
            run.adapter.synchronize(optimizer)
            mark(COMM)
        if self.clip:  # the global norm, also over sharded (DTensor) gradients
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(run.model.parameters(), self.clip)
        run.adapter.step(optimizer, scaler)
        optimizer.zero_grad()  # set_to_none (torch's default; Horovod's override takes no args)
        mark(OPTIMIZER)


def weigh(balancer: Any, loss: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """balance=speed: the loss times world x this rank's share of global micro-batch k."""
    w = balancer.sampler.weight(n, k)
    return loss if w == 1.0 else loss * w


# a loss over this x max(|the first logged loss|, 1) has exploded: far past any noise of training,
# so a run that merely gets worse is never cut short
EXPLODES_AT = 1e3


class Diverged(FloatingPointError):
    """The run diverged (its loss or its weights are not finite, or the loss exploded): training on
    cannot recover, so it ends DIVERGED with one line. `last_good`: the last logged step whose loss
    passed (-1: none); a checkpoint written before it is the last good one."""

    def __init__(self, step: int, said: str, last_good: int) -> None:
        super().__init__(f"{DIVERGED_AT} {step}: {said}; lower trainer.lr or turn off trainer.amp")
        self.step, self.last_good = step, last_good


def check_loss(loss: float, step: int, first: float = math.nan, last_good: int = -1) -> float:
    """`loss`, unless it is not finite or over EXPLODES_AT x max(|first|, 1): Diverged."""
    if not math.isfinite(loss):
        raise Diverged(step, f"the loss is {loss} (not finite)", last_good)
    if math.isfinite(first) and loss > EXPLODES_AT * max(abs(first), 1.0):
        raise Diverged(step, f"the loss is {loss:.4g}, over {EXPLODES_AT:g} x the first logged loss ({first:.4g})",
                       last_good)
    return loss
