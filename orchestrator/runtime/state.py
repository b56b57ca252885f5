"""The run the loop, its step and its hooks share (loop.setup builds it): what it is built with,
once (`RunParts`: config, adapter, data, model, optimizer, meter, the features' parts), where the
loop is (`LoopState`: step, epoch, batch, losses, why it stops), and `Run`, both with what happens
at an epoch's ends and when a window closes; the points a hook overrides (`Hook`) and the rank's
event log. Below the hooks, the step and the loop: they import it, it imports none of them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..measure.plan import loader_queue, loader_round
from ..measure.results import Window, WindowFigures, job_window
from ..measure.stats import StopRule
from ..rundir import Event, WindowEvent
from ..schema import Config
from .autotune import LoaderSettings, LoaderTuner
from .balance import Balancer
from .data import epoch_iterator, steps_per_epoch, switch_loader
from .dist import Adapter
from .meter import StepMeter

SPAN_EPOCHS_OF_CAP = 2.0  # a measurement goes on to whole epochs when that takes at most this x its cap


class EventLog:
    """JSON lines the parent tails: progress, logged points, windows. One file per rank."""

    def __init__(self, path: Optional[Path]) -> None:
        self._f = open(path, "a", buffering=1) if path else None

    def write(self, event: Event) -> None:
        if self._f:
            self._f.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()


class Hook:
    """A point the loop calls does nothing unless a hook overrides it (runtime/hooks.py says when
    the loop calls each)."""

    after_every = 1  # after_step does nothing unless run.step is a multiple of this

    def before_step(self, run: Run) -> None:
        pass

    def after_step(self, run: Run) -> bool:
        return False

    def on_window(self, run: Run, win: Window) -> bool:
        return False

    def on_figures(self, run: Run, win: Window, figures: WindowFigures) -> None:
        pass

    def start(self, run: Run) -> None:
        pass

    def finish(self, run: Run) -> None:
        pass

    def close(self, run: Run) -> None:
        pass

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        pass


def overriding(hooks: List[Hook], point: str) -> List[Hook]:
    """The hooks that override `point` (the loop calls no empty method on its hot path)."""
    return [h for h in hooks if getattr(type(h), point) is not getattr(Hook, point)]


def after_period(hooks: List[Hook]) -> int:
    """The steps between the loop's calls of `hooks`' after_step: every hook acts on multiples of
    its `after_every` only, so on multiples of their greatest common divisor (1: none)."""
    return math.gcd(*(h.after_every for h in hooks)) if hooks else 1


@dataclass(eq=False)
class RunParts:
    """What a run is built with (loop.setup), once: its config, adapter, data, model, optimizer and
    meter, and the parts its features add. The loader autotune alone replaces two of them (the
    config's data settings and the loader: Run.change_loader)."""

    cfg: Config
    adapter: Adapter
    events: EventLog
    dataset: Dataset
    loader: DataLoader
    model: nn.Module
    base_optimizer: torch.optim.Optimizer
    optimizer: torch.optim.Optimizer
    scaler: Optional[Any]
    amp: bool
    amp_dtype: torch.dtype
    meter: StepMeter
    ck: Optional[Dict[str, Any]]
    generator: Optional[torch.Generator]  # its state at an epoch's start fixes the epoch's order
    balancer: Optional[Balancer] = None
    loader_tuner: Optional[LoaderTuner] = None
    rule: Optional[StopRule] = None  # tuning trials: measure until precise enough
    collective: bool = False  # the window figures are all-reduced (the same on every rank)
    total: int = 0
    per_epoch: int = 0
    val_set: Optional[Dataset] = None  # data.val or data.val_fraction's items (runtime/evaluate.py)
    sum_train_loss: bool = False  # trainer.target_loss on the training loss: the Stepper sums every step's loss
    hooks: List[Hook] = field(default_factory=list)
    noise: Optional[Any] = None  # runtime/noise.NoiseProbe (noise.py imports this module): the noise scale's collection


@dataclass(eq=False)
class LoopState:
    """Where the loop is: its step, epoch and batch in the epoch, the losses, why it stops."""

    step: int = 0
    epoch: int = 0
    start_epoch: int = 0
    b: int = 0  # micro-batches of this epoch done
    n_batches: int = 0
    it: Any = None
    epoch_generator: Optional[torch.Tensor] = None
    stop: bool = False
    stopped_by: str = ""  # why it stopped before `total`, when not the stop rule (checkpoint_signal)
    checkpointed: int = -1  # the step of the last checkpoint this rank wrote (none: -1)
    first_loss: float = math.nan
    last_loss: float = math.nan
    samples: int = 0  # this rank's samples trained by this process
    t_start: float = 0.0  # perf_counter when the loop began (its wall time, result's wall_s, counts from here)
    loss_sum: Any = 0.0  # sum_train_loss: the steps' losses summed (a tensor once summed), over loss_steps steps
    loss_steps: int = 0
    logged_step: int = -1  # the last step whose loss was logged (and passed check_loss)
    rule_met_s: Optional[float] = None  # the rule's measured seconds when it was first met (span_done)


@dataclass(eq=False)
class Run(LoopState, RunParts):
    """What the loop, its step and its hooks share: the built parts and where the loop is, with
    what happens at an epoch's ends and when a window closes."""

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    def begin_epoch(self) -> None:
        """Set the sampler to `epoch` and open its iterator (from the checkpoint's batch on a resume)."""
        loader, epoch = self.loader, self.epoch
        for sampler in (loader.sampler, loader.batch_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)  # type: ignore[union-attr]
        resuming = self.ck is not None and epoch == self.start_epoch
        if resuming and self.generator is not None and self.ck.get("loader_generator") is not None:  # type: ignore[union-attr]
            self.generator.set_state(self.ck["loader_generator"])  # type: ignore[index]
        self.epoch_generator = self.generator.get_state() if self.generator is not None else None
        self.b = self.ck["meta"]["batch_in_epoch"] if resuming else 0  # the same order, from the checkpoint's batch
        self.it = epoch_iterator(loader, self.b)
        self.n_batches = len(loader)

    def end_epoch(self) -> None:
        if self.b == self.n_batches and not self.stop:  # windows of whole epochs end here (the next
            window = self.meter.epoch_end()  # epoch's restart is measured in the next window)
            self.stop = window is not None and self.on_window(window)
        if self.stop or self.step >= self.total:
            self.meter.flush()  # before the iterator's shutdown below
        if self.b == self.n_batches:
            next(self.it, None)  # finish the epoch's iterator as a plain `for` loop would (sampler RNG)

    def rewarm(self, why: str) -> None:
        partial = self.meter.rewarm(why)
        self.stop = partial is not None and self.on_window(partial)

    def job_figures(self, win: Window, own: Optional[WindowFigures] = None) -> WindowFigures:
        """The job's figures of this window (measure.results.job_window over every rank's window),
        the same on every rank: one all-reduce, each rank's figures (`own`: win.figures())
        summed into its own slots. Not collective, they are this rank's own (job_window of one)."""
        own = own if own is not None else win.figures()
        if not self.collective:
            return own
        n, world, rank = len(WindowFigures.PACKED), self.adapter.world_size, self.adapter.rank
        slots = [0.0] * (n * world)
        slots[n * rank:n * (rank + 1)] = own.packed()
        got = self.adapter.all_reduce_sum(slots)
        return job_window([WindowFigures.unpacked(got[n * r:n * (r + 1)]) for r in range(world)])

    def on_window(self, win: Window) -> bool:
        """A window closed: report it, size the next ones, feed the stop rule; True: stop now."""
        m, meter = self.cfg.measure, self.meter
        meter.check_memory()
        own = win.figures()
        if win.warmup:  # its step time includes the start-up: it may only shorten the first window
            if m.window_s > 0:
                meter.resize(self.job_figures(win, own).step_time_s, m.window_s, at_most=m.window_steps)
            return False
        self.events.write(WindowEvent(type="window", step=own.step, throughput=own.throughput,
                                      utilization=own.utilization, data_wait_frac=own.data_wait_frac,
                                      comm_frac=own.comm_frac, step_time_s=own.step_time_s,
                                      tokens_per_s=own.tokens_per_s, wall_s=own.wall_s))
        if win.partial:  # cut short by a new epoch: left out of the estimate, and of the rule
            return False
        for hook in overriding(self.hooks, "on_window"):
            if hook.on_window(self, win):
                return False
        job = self.job_figures(win, own)
        for hook in overriding(self.hooks, "on_figures"):
            hook.on_figures(self, win, job)
        meter.resize(job.step_time_s, m.window_s)
        if self.rule is None or self.rule.add(job.throughput, job.wall_s) is None:
            return False
        return self.span_done(job.step_time_s)

    def span_done(self, step_time_s: float) -> bool:
        """The stop rule is met: True when the measured span holds whole epochs, or when the
        rest of the epoch would last longer than SPAN_EPOCHS_OF_CAP x the measurement's cap (without
        a cap, x what was measured); else the measurement goes on to the epoch's point where it
        began (StepMeter.steps_to_whole_epochs: an epoch's pre-made tail is paid for by its restart),
        for at most that long again in all, whatever the windows do meanwhile."""
        assert self.rule is not None
        meter, cap = self.meter, self.cfg.measure.max_measure_s or self.rule.measured_s
        if self.rule_met_s is None:
            self.rule_met_s = self.rule.measured_s
        left = meter.steps_to_whole_epochs()
        if (left == 0 or left * step_time_s > SPAN_EPOCHS_OF_CAP * cap
                or self.rule.measured_s - self.rule_met_s > SPAN_EPOCHS_OF_CAP * cap):
            return True
        meter.stop_at(meter.steps + left)
        return False

    def change_loader(self, new: LoaderSettings) -> None:
        """The loader autotune's switch, at this batch of the epoch; the new workers fill their
        queue: the meter fits the new loader and warms up again."""
        self.cfg, self.loader, self.it = switch_loader(self.cfg, new, self.loader, self.it, self.generator,
                                                       self.epoch_generator, self.b, self.device)
        self.meter.queue = loader_queue(self.cfg)
        self.meter.set_round(loader_round(self.cfg))
        self.meter.fit_epoch(steps_per_epoch(self.loader, self.cfg.trainer.accumulation_steps))
        self.rewarm("loader")
