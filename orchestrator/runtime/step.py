"""One optimizer step of the loop (runtime/loop.py): `trainer.accumulation_steps` micro-batches
forward and backward (gradient accumulation, AMP, non_blocking copies), the exposed
communication, clipping and the update, each phase marked for the meter. The FLOP counter
(runtime/flops.py) wraps the forward and backward of the run's first step."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..measure.phases import COMM, COMPUTE, DATA, H2D, OPTIMIZER
from ..rundir import DIVERGED_AT
from .batch import Feed, to_device
from .dist import Adapter
from .flops import StepCounter

if TYPE_CHECKING:  # the run is built by loop.setup; its module does not import this one
    from .state import Run


class Stepper:
    """Runs `run`'s next optimizer step (`state.Run`: its model, optimizer, iterator, meter).

    Hot path: on a ~200 us step every microsecond shows, so work that does nothing is skipped
    (CPU copies, a disabled autocast, a division by 1, loss bookkeeping on unlogged steps), and
    what a run never changes (its device, the meter's mark, whether the adapter exposes its
    communication) is read once here."""

    def __init__(self, run: Run) -> None:
        t = run.cfg.trainer
        self.accum, self.clip, self.log_every = t.accumulation_steps, t.grad_clip, t.log_every
        self.checkpoint_every = t.checkpoint_every  # checkpointed steps are logged: a checkpoint follows a checked loss
        self.feed = Feed(run.cfg)
        self.criterion = self.feed.criterion
        self.device, self.mark, self.exposed_comm = run.device, run.meter.mark, run.adapter.exposed_comm
        # the adapter's step is the optimizer's own (no scaler, no backend's override): called directly
        self.direct_step = run.scaler is None and type(run.adapter).step is Adapter.step
        self.move = self.device.type != "cpu"
        self.autocast = ((lambda: torch.autocast(run.device.type, dtype=run.amp_dtype)) if run.amp
                         else contextlib.nullcontext)
        self.sum_losses = run.sum_train_loss  # trainer.target_loss on the training loss (runtime/evaluate.py)
        self.plain = not run.amp and self.accum == 1  # no context to enter: the micro-step is a hand-written loop's
        self.fast = self.plain and run.balancer is None  # ... and its loss is the batch's own
        # FLOPs are counted over the first step, a warmup step (never measured); see runtime/flops.py
        self.counter: Optional[StepCounter] = StepCounter() if run.cfg.measure.warmup_steps > 0 else None
        self.counted_step = run.step
        self.flops: Dict[str, Any] = {"flops": None,
                                      "reason": "not counted: measure.warmup_steps=0 leaves no unmeasured step"}
        # the gradient noise scale (runtime/noise.py): estimated on the warmup's steps (never
        # measured) and past them at noise.next_at, every noise.every-th step. measure.noise_every=0:
        # an estimated step and the steps before and after it are timed (noise.timed), from the
        # step's start to its update's end; no other step reads the clock
        self.noise = run.noise
        self.noise_until = run.step + run.cfg.measure.warmup_steps
        if self.noise is not None:
            self.noise.plan(self.noise_until)
        self.noise_halves = self.noise is not None and self.noise.method == "halves"
        self.first_micro = self.noise is not None and self.noise.method == "accumulation"

    def __call__(self, run: Run) -> tuple:
        """(samples, micro-batches, the step's loss or None when the step is not logged); advances
        run.step and run.b (the batch in the epoch)."""
        step, b, it, mark, feed, noise = run.step, run.b, run.it, self.mark, self.feed, self.noise
        counting = step == self.counted_step and self.counter is not None
        if counting:
            self.counter.__enter__()  # type: ignore[union-attr]
        micro = 1 if self.accum == 1 else min(self.accum, run.n_batches - b)  # the last step: the remainder
        logged = ((step + 1) % self.log_every == 0 or step == 0 or step + 1 == run.total
                  or (self.checkpoint_every > 0 and (step + 1) % self.checkpoint_every == 0))
        summed = logged or self.sum_losses
        t0 = 0.0
        if noise is not None:
            if step >= noise.next_at:  # an estimated step past the warmup
                if noise.begin(step):
                    t0 = time.perf_counter()
            else:
                noise.active = step < self.noise_until
                if step == noise.before or step == noise.after:
                    t0 = time.perf_counter()
        halves = self.noise_halves and noise.active  # type: ignore[union-attr]
        samples, step_loss = 0, None
        for m in range(micro):
            batch = next(it)
            mark(DATA)
            if not feed.checked:  # the run's first batch: its structure fits model.loss (one line if not)
                feed.check(batch, run.model)
            if feed.pair and not self.move:  # (input, target) with cross_entropy / mse, in host memory
                n = batch[0].shape[0]
            else:
                batch, n = self.arrive(run, batch)
            if halves and n > 1:
                loss = self.halves(run, batch, n)
            elif self.fast and feed.pair:  # as fast as a hand-written loop
                loss = self.criterion(run.model(batch[0]), batch[1])  # type: ignore[misc]
                loss.backward()
            else:
                loss = self.micro_step(run, batch, n, m, micro)
            if summed:  # the first micro-batch's loss as it is (adding it to 0.0 costs a tensor)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            samples += n
            mark(COMPUTE)
        run.b = b + micro
        if counting:
            self.counter.__exit__(None, None, None)  # type: ignore[union-attr]
            self.flops, self.counter = self.counter.per_sample(samples), None  # type: ignore[union-attr]
        if self.sum_losses:
            run.loss_sum, run.loss_steps = run.loss_sum + step_loss, run.loss_steps + 1
        self.update(run, samples)
        if t0:
            noise.timed(step, time.perf_counter() - t0)  # type: ignore[union-attr]
        run.step = step + 1
        return samples, micro, (step_loss if logged else None)

    def arrive(self, run: Run, batch: Any) -> tuple:
        """(the batch on the run's device, its size): an (input, target) pair moved as a
        hand-written loop moves it; a dict's tokens counted first, in host memory."""
        feed = self.feed
        if feed.pair:
            x, y = batch
            batch = (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            self.mark(H2D)
            return batch, x.shape[0]
        if feed.masked:  # before the copy: the mask is counted in host memory
            run.meter.add_tokens(*feed.tokens(batch))
        if self.move:
            batch = to_device(batch, self.device)
            self.mark(H2D)
        return batch, feed.size(batch)

    def micro_step(self, run: Run, batch: Any, n: int, m: int, micro: int) -> torch.Tensor:
        """Micro-batch `m` of `micro`'s forward and backward (returns its loss): the gradients
        synchronized on the last one only, AMP's autocast and scaler, the loss over `micro`,
        balance=speed's weight (of global micro-batch run.b + m: run.b moves when the step ends),
        the first micro-batch's gradient to the noise probe."""
        model, balancer, scaler = run.model, run.balancer, run.scaler
        if self.plain:  # no context to enter
            loss = self.batch_loss(model, batch)
            (loss if balancer is None else weigh(balancer, loss, n, run.b + m)).backward()
            return loss
        with run.adapter.grad_sync(model, enabled=m == micro - 1), self.autocast():
            loss = self.batch_loss(model, batch)
            if micro > 1:
                loss = loss / micro
            weighted = loss if balancer is None else weigh(balancer, loss, n, run.b + m)
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
        if m == 0 and micro > 1 and self.first_micro and self.noise.active:  # type: ignore[union-attr]
            self.noise.first_part(model, n, 1.0 / micro)  # type: ignore[union-attr]
        return loss

    def batch_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's loss on `batch` as model.loss takes it (runtime/batch.py)."""
        if self.feed.pair:
            return self.criterion(model(batch[0]), batch[1])  # type: ignore[misc]
        return self.feed.loss(model, batch)

    def halves(self, run: Run, batch: Any, n: int) -> torch.Tensor:
        """The batch's forward and backward as two halves, each loss weighed by its share (the
        same gradient as the whole batch's); each half's gradient goes to the noise probe.
        Returns the batch's loss."""
        model, scaler, feed = run.model, run.scaler, self.feed
        k = n // 2
        total = None
        cut = (lambda a, b: (batch[0][a:b], batch[1][a:b])) if feed.pair else (lambda a, b: split(batch, n, a, b))
        for i, (part, size) in enumerate(((cut(0, k), k), (cut(k, n), n - k))):
            with self.autocast():
                loss = self.batch_loss(model, part)
                weighted = loss * (size / n)
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
            if i == 0:
                self.noise.first_part(model, size, size / n)  # type: ignore[union-attr]
            else:
                self.noise.second_part(model, size / n)  # type: ignore[union-attr]
            total = weighted.detach() if total is None else total + weighted.detach()
        return total  # type: ignore[return-value]

    def update(self, run: Run, samples: int) -> None:
        """The exposed communication, the noise probe's pair, clipping and the optimizer step."""
        optimizer, scaler, mark = run.optimizer, run.scaler, self.mark
        if self.exposed_comm:
            run.adapter.synchronize(optimizer)
            mark(COMM)
        if self.noise is not None and self.noise.active:  # the gradients as the optimizer gets them, before clipping
            self.noise.end_step(run.model, samples, run.step)
        if self.clip:  # the global norm, also over sharded (DTensor) gradients
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(run.model.parameters(), self.clip)
        if self.direct_step:
            optimizer.step()
        else:
            run.adapter.step(optimizer, scaler)
        optimizer.zero_grad()  # set_to_none (torch's default; Horovod's override takes no args)
        mark(OPTIMIZER)


def split(batch: Any, n: int, start: int, stop: int) -> Any:
    """Samples [start, stop) of a batch of `n`: every tensor in it whose first dimension is `n`
    (an (input, target) pair, a dict's fields); other leaves as they are."""
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t,
                    batch)


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
