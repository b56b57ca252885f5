"""Validation (data.val or data.val_fraction, trainer.eval_every, trainer.val_metric) and the
target loss (trainer.target_loss), plugged into the loop as a hook (`EvalHook`, runtime/hooks.py's
points): at the end of every `eval_every`-th step, at the end of the run, and for a target on the
training loss at the end of every log interval.

- The set: data.val's dataset (built like data._target_, with the same read latency), or
  data.val_fraction of the training set held out by a generator of its own (`HOLDOUT_SEED`, not
  trainer.seed: every config of a study, whatever its seed, holds out the same items); the
  training set is the rest. Trials of a study hold the items out too (their epochs are the run's),
  and evaluate nothing: an evaluation would be measured as the config's cost.
- Over the ranks without padding: rank r takes items r, r + W, r + 2W, ...; each rank sums its
  batches' loss x items (and a metric's) and the items, and one all-reduce of the sums
  (Adapter.all_reduce_sum) gives the mean over the whole set, what one process computes over it
  for a loss that is a mean over the batch's items. Under FSDP forward is a collective: every rank
  runs it as often as the rank with the most batches, the extra ones weighed 0.
- The model in eval mode under no_grad (and the run's autocast); under DDP its module (DDP's own
  forward would sync buffers, a collective); batches of any structure through `batch.Feed`.
- One loader for the run's evaluations: with loader workers they start at the first evaluation
  and wait, idle, for the next (persistent workers), and end with the run. Started anew at each
  evaluation they cost more than the evaluation itself on small models.
- The time is kept out of the measured windows: the meter pauses (`StepMeter.pause`); with loader
  workers the training loader refilled its queue meanwhile, so the meter also warms up again (as
  after the profiler). Its total and its share of the loop's wall time are `eval_s`, `eval_frac`.
- trainer.target_loss: on the validation loss at every evaluation when there is validation, else
  on the training loss averaged over the steps of each log interval and over the ranks. Reached,
  the run stops there (`stopped_by: target_loss`) and records the loop's wall time to it
  (evaluation included) and the global samples it trained on.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ..rundir import EvalEvent
from ..schema import Config, ConfigError, Mode, import_target
from .batch import Feed, to_device
from .data import LatencyDataset, collate_fn, end_workers
from .dist import Adapter
from .state import Hook, Run

__all__ = ["HOLDOUT_SEED", "EvalHook", "Evaluator", "eval_hook", "held_out", "validation_sets"]

HOLDOUT_SEED = 54_0001  # data.val_fraction's split: fixed, so every config and seed holds out the same items


def held_out(dataset: Dataset, fraction: float, latency_ms: float = 0.0) -> Tuple[Dataset, Dataset]:
    """(training set, validation set): `fraction` of `dataset`'s items, drawn by HOLDOUT_SEED, held
    out (both keep their items' order). A dataset with a read latency keeps it in both."""
    inner = dataset.inner if isinstance(dataset, LatencyDataset) else dataset
    n = len(inner)  # type: ignore[arg-type]
    k = round(n * fraction)
    if not 1 <= k < n:
        raise ConfigError(f"data.val_fraction: {fraction:g} of the dataset's {n} items holds out {k}; "
                          f"allowed: a fraction that holds out at least 1 item and keeps at least 1")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    train, val = Subset(inner, sorted(order[k:].tolist())), Subset(inner, sorted(order[:k].tolist()))
    if isinstance(dataset, LatencyDataset):
        return LatencyDataset(train, latency_ms), LatencyDataset(val, latency_ms)
    return train, val


def validation_sets(cfg: Config, dataset: Dataset) -> Tuple[Dataset, Optional[Dataset]]:
    """(the training set, the validation set or None) of the run: data.val_fraction splits
    `dataset` (in a study's trials too); data.val is built where it is evaluated (mode=run)."""
    d = cfg.data
    if d.val_fraction > 0:
        return held_out(dataset, d.val_fraction, cfg.sim.read_latency_ms)
    if d.val is None or cfg.mode is not Mode.run:
        return dataset, None
    val = import_target(d.val["_target_"])(**(d.val.get("args") or {}))
    if hasattr(val, "__len__") and len(val) == 0:
        raise ConfigError(f"data.val._target_: {d.val['_target_']} returned a dataset of 0 items "
                          f"(data.val.args: {dict(d.val.get('args') or {})})")
    latency = cfg.sim.read_latency_ms
    return dataset, (LatencyDataset(val, latency) if latency > 0 else val)


class Evaluator:
    """The validation loss (and trainer.val_metric) of the run's model over the whole validation
    set, the same on every rank (see the module's doc)."""

    def __init__(self, cfg: Config, adapter: Adapter, val_set: Dataset, autocast: Callable[[], Any]) -> None:
        self.cfg, self.adapter, self.val_set, self.autocast = cfg, adapter, val_set, autocast
        self.feed = Feed(cfg)
        spec = cfg.trainer.val_metric
        self.metric: Optional[Callable[..., Any]] = None
        self.metric_name = ""
        if spec is not None:
            fn = import_target(spec["_target_"])
            self.metric = functools.partial(fn, **(spec.get("args") or {}))
            self.metric_name = getattr(fn, "__name__", spec["_target_"].rpartition(".")[2])
        n, world, rank, b = len(val_set), adapter.world_size, adapter.rank, cfg.data.batch_size  # type: ignore[arg-type]
        self.indices = list(range(rank, n, world))  # no padding: the ranks' items are the set, once
        # every rank runs as many forward passes as the rank with the most items (rank 0) where forward is a collective
        self.passes = math.ceil(math.ceil(n / world) / b) if adapter.sharded_state else 0
        self._own: Optional[DataLoader] = None  # this rank's items, built at the first evaluation
        self._it: Any = None  # its iterator: with workers, the same one every evaluation

    def loader(self, indices: List[int], workers: bool = True) -> DataLoader:
        """A loader over `indices` of the set, in order, with the run's loader knobs (the storage
        a validation set is read from is the training set's); its workers persistent."""
        d = self.cfg.data
        n = d.num_workers if workers else 0
        kwargs: Dict[str, Any] = {"prefetch_factor": d.prefetch_factor} if n and d.prefetch_factor else {}
        # a generator of its own: the loader's base seed is not drawn from the global RNG, which
        # training's dropout and the like read (a run trains the same with or without evaluations)
        return DataLoader(self.val_set, batch_size=d.batch_size, sampler=indices, drop_last=False,
                          num_workers=n, collate_fn=collate_fn(d), generator=torch.Generator().manual_seed(0),
                          pin_memory=d.pin_memory and self.adapter.device.type == "cuda",
                          persistent_workers=n > 0, **kwargs)

    def batches(self) -> Iterator[Tuple[Any, float]]:
        """(batch, weight): this rank's batches, then forward passes weighed 0 up to `passes`."""
        own = math.ceil(len(self.indices) / self.cfg.data.batch_size)
        if self._own is None:
            self._own = self.loader(self.indices)
        self._it = iter(self._own)  # persistent workers: the same iterator, reset
        yield from ((batch, 1.0) for batch in self._it)
        if self.passes > own:
            pad = next(iter(self.loader([0], workers=False)))
            yield from ((pad, 0.0) for _ in range(self.passes - own))

    def __call__(self, model: nn.Module) -> Dict[str, float]:
        """{"val_loss", "val/<metric>"}: means over the validation set's items (every rank takes part)."""
        device, feed = self.adapter.device, self.feed
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        zero = torch.zeros((), dtype=torch.float64, device=device)
        loss_sum, metric_sum, items = zero.clone(), zero.clone(), 0.0
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.autocast():
                for batch, weight in self.batches():
                    if not feed.checked:
                        feed.check(batch, inner)
                    batch = to_device(batch, device) if device.type != "cpu" else batch
                    n = feed.size(batch) * weight
                    loss, output = feed.forward(inner, batch)
                    loss_sum += loss.detach().double() * n
                    if self.metric is not None:
                        metric_sum += torch.as_tensor(self.metric(output, batch), device=device).double() * n
                    items += n
        finally:
            model.train(training)
        sums = self.adapter.all_reduce_sum([float(loss_sum), float(metric_sum), items])
        out = {"val_loss": sums[0] / sums[2] if sums[2] else math.nan}
        if self.metric is not None:
            out[f"val/{self.metric_name}"] = sums[1] / sums[2] if sums[2] else math.nan
        return out

    def close(self) -> None:
        """End the loader's workers (the run ended)."""
        if self._it is not None:
            end_workers(self._it)
        self._own = self._it = None


class EvalHook(Hook):
    """Evaluates every `eval_every` steps and at the end (with a validation set), and stops the
    run at trainer.target_loss; keeps its time out of the measured windows. Its part of the
    rank's result: `summary`."""

    def __init__(self, cfg: Config, evaluator: Optional[Evaluator]) -> None:
        t = cfg.trainer
        self.evaluator, self.every, self.log_every, self.target = evaluator, t.eval_every, t.log_every, t.target_loss
        self.evals: List[Dict[str, Any]] = []
        self.eval_s = 0.0
        self.samples0 = 0  # a resumed run's samples before its checkpoint (full batches assumed)
        self.reached: Optional[Dict[str, Any]] = None

    def start(self, run: Run) -> None:
        d, t = run.cfg.data, run.cfg.trainer
        self.samples0 = run.step * d.batch_size * t.accumulation_steps * run.adapter.world_size

    def samples(self, run: Run) -> float:
        """Global samples trained so far (the ranks' own counts summed)."""
        return self.samples0 + (run.adapter.all_reduce_sum([float(run.samples)])[0] if run.adapter.world_size > 1
                                else run.samples)

    def after_step(self, run: Run) -> bool:
        if run.stop:  # stopped at this step by another rule: the end's evaluation follows (finish)
            return False
        if self.evaluator is None:
            return self._train_target(run)
        if self.every and run.step % self.every == 0 and run.step < run.total:
            self.evaluate(run)
            return True
        return False

    def finish(self, run: Run) -> None:
        if self.evaluator is not None and run.stopped_by != "checkpoint_signal" and (
                not self.evals or self.evals[-1]["step"] != run.step):
            self.evaluate(run, final=True)

    def close(self, run: Run) -> None:
        if self.evaluator is not None:
            self.evaluator.close()

    def evaluate(self, run: Run, final: bool = False) -> None:
        """One evaluation; the meter paused meanwhile, and warmed up again after it when the loader's
        workers refilled their queue (not at the end: nothing is measured after it)."""
        meter = run.meter
        if not final and meter.queue:
            partial = meter.rewarm("eval")
            if partial is not None:
                run.on_window(partial)  # a partial window: reported, kept out of the estimate
        if not final:
            meter.pause()
        t_begin = time.perf_counter()
        try:
            figures = self.evaluator(run.model)  # type: ignore[misc]
            samples = self.samples(run)
        finally:
            took = meter.resume() if not final else time.perf_counter() - t_begin  # the time out of the windows
        self.eval_s += took
        record = {"step": run.step, "epoch": run.epoch, "samples": samples, "wall_s": time.perf_counter() - run.t_start,
                  "eval_s": took, **figures}
        self.evals.append(record)
        if run.adapter.rank == 0:
            run.events.write(EvalEvent(type="eval", step=run.step, samples=samples, wall_s=record["wall_s"],
                                       val_loss=figures["val_loss"],
                                       metrics={k[4:]: v for k, v in figures.items() if k.startswith("val/")}))
        self._check(run, figures["val_loss"], record)

    def _train_target(self, run: Run) -> bool:
        """trainer.target_loss without validation: the training loss over the last log interval
        (the Stepper sums every step's loss meanwhile: run.loss_sum), averaged over the ranks."""
        if not (run.loss_steps and (run.step % self.log_every == 0 or run.step == run.total)):
            return False
        mean = float(run.loss_sum) / run.loss_steps
        world = run.adapter.world_size
        if world > 1:
            mean = run.adapter.all_reduce_sum([mean])[0] / world
        run.loss_sum, run.loss_steps = 0.0, 0
        self._check(run, mean, {"step": run.step, "wall_s": time.perf_counter() - run.t_start})
        return True

    def _check(self, run: Run, loss: float, record: Dict[str, Any]) -> None:
        if self.target is None or self.reached is not None or not loss <= self.target:
            return
        samples = record["samples"] if "samples" in record else self.samples(run)
        self.reached = {"step": record["step"], "wall_s": record["wall_s"], "samples": samples, "loss": loss}
        if run.step < run.total:
            run.stop, run.stopped_by = True, "target_loss"

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        wall = time.perf_counter() - run.t_start
        if self.evals:
            last = self.evals[-1]
            out.update(val_loss=last["val_loss"], evals=self.evals, eval_s=self.eval_s,
                       eval_frac=self.eval_s / wall if wall > 0 else None,
                       val_metrics={k[4:]: v for k, v in last.items() if k.startswith("val/")})
        if self.target is not None:
            reached = self.reached
            out.update(target_loss=self.target, target_on="val_loss" if self.evaluator is not None else "train_loss",
                       target_reached=reached is not None,
                       time_to_target_s=reached["wall_s"] if reached else None,
                       samples_to_target=reached["samples"] if reached else None,
                       target_step=reached["step"] if reached else None)


def eval_hook(run: Run) -> Optional[EvalHook]:
    """The run's EvalHook, or None: no validation set and no target loss, or a study's trial
    (mode=tune: its runs measure the config, and an evaluation would be measured as its cost)."""
    cfg = run.cfg
    if cfg.mode is not Mode.run or (run.val_set is None and cfg.trainer.target_loss is None):
        return None
    autocast = ((lambda: torch.autocast(run.device.type, dtype=run.amp_dtype)) if run.amp
                else contextlib.nullcontext)
    evaluator = Evaluator(cfg, run.adapter, run.val_set, autocast) if run.val_set is not None else None
    run.sum_train_loss = evaluator is None  # the Stepper sums every step's loss for the target
    return EvalHook(cfg, evaluator)
