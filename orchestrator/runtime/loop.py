"""The training loop, the same for every backend, in the shape of nanoGPT's and torchtitan's:
`train` builds the run (`setup`), then iterates epochs and optimizer steps (`step.Stepper`), hands
every closed window to the measurement (`Run.on_window`) and calls the hooks (runtime/hooks.py:
profiler, balance by speed, checkpoints, the storage-latency jump, the loader autotune) at a few
points. The data side (dataset, loader, an epoch started part-way) is runtime/data.py."""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset

from .. import checkpoint
from ..measure.plan import loader_queue, loader_round
from ..measure.phases import OTHER
from ..measure.results import Window, WindowFigures, job_window
from ..measure.stats import StopRule
from ..rundir import Event, LogEvent, ResumeEvent, StartEvent, WindowEvent, checkpoint_request_path
from ..schema import CheckpointSignal, Config, ConfigError, Mode, OptimizerName, import_target
from .autotune import LoaderSettings, LoaderTuner
from .balance import TOLERANCE as BALANCE_TOLERANCE, Balancer, ShareSampler
from .data import (EpochSampler, LatencyDataset, build_dataset, build_loader, end_workers, epoch_iterator, item_bytes,
                   loader_config, reset_latency, steps_per_epoch, switch_loader)
from .dist import Adapter, amp_dtype, unwrap
from .flops import mfu_figures
from .evaluate import eval_hook, validation_sets
from .hooks import (BalanceHook, CheckpointHook, Hook, LatencyJumpHook, LoaderAutotuneHook, LrWarmupHook, Profiler,
                    ProfilerHook, SignalCheckpointHook, loader_tuner, overriding)
from .meter import StepMeter, model_state_mb
from .noise import NoiseHook, check_fed, noise_hook
from .batch import loss_fn
from .step import Stepper, check_loss

__all__ = ["EventLog", "TrainResult", "build_dataset", "build_loader", "build_model", "check_model", "loss_fn",
           "seed_everything", "train"]


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def build_model(cfg: Config) -> nn.Module:
    model = import_target(cfg.model._target_)(**cfg.model.args)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {cfg.model._target_} returned {type(model).__name__}, not a torch.nn.Module")
    return model


_MODELS_CHECKED: set = set()  # (target, args) that check_model passed in this process
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_",
                           "random_"})


class _SkipRandomFills(TorchFunctionMode):
    """check_model's mode: a random fill of a meta tensor (a layer's init) returns the tensor as it
    is. On the meta device it computes nothing anyway, but `normal_` (nn.Embedding's init) runs
    through torch._refs, whose first call imports torch._dynamo: 1.5-3 s of the orchestrator's
    time, on 2 cores, before a study's first trial."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def check_model(cfg: Config) -> None:
    """Before launch: model._target_ must build an nn.Module. Built on the meta device (no memory);
    a factory that fails there for its arguments (a negative size, a string for a number) is one
    ConfigError line naming model.args; one that fails for the meta device itself (it says so:
    "meta" in its error, or NotImplementedError) is left to the ranks. Once per model config and
    process: a study checks before each of its launches, and on the meta device a layer's init
    still costs (a 10M-parameter embedding: about 0.12 s a build, and a study builds it per launch)."""
    key = json.dumps([cfg.model._target_, cfg.model.args], sort_keys=True, default=str)
    if key in _MODELS_CHECKED:
        return
    try:
        with torch.device("meta"), _SkipRandomFills():
            build_model(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        said = (str(exc).strip().splitlines() or [""])[0]
        if not isinstance(exc, NotImplementedError) and "meta" not in said.lower():
            args = ", ".join(f"{k}={v!r}" for k, v in cfg.model.args.items())
            raise ConfigError(f"model.args: {cfg.model._target_}({args}) cannot be built: {type(exc).__name__}: "
                              f"{said[:300]}") from None
    _MODELS_CHECKED.add(key)


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.trainer
    if t.optimizer is OptimizerName.adamw:
        return torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def amp_settings(cfg: Config, device: torch.device) -> tuple[bool, torch.dtype, Optional[Any]]:
    """(enabled, dtype, GradScaler or None). bf16 where the device supports it, fp16 otherwise."""
    if not cfg.trainer.amp:
        return False, torch.float32, None
    dtype = amp_dtype(cfg, device)
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    return True, dtype, scaler


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


def param_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes: replicas in sync have equal digests. Sharded (DTensor)
    ones are gathered one at a time (a collective: every rank calls this)."""
    h = hashlib.sha256()
    for name, p in sorted(unwrap(model).state_dict().items()):
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class TrainResult:
    model: nn.Module
    param_digest: str
    steps: int
    epochs: int
    steps_per_epoch: int
    item_bytes: int
    final_loss: float
    first_loss: float
    wall_s: float
    meter: Dict[str, Any]
    windows: List[Window]  # warmup windows first
    setup_s: float = 0.0  # before the loop: data loader, model, optimizer, hooks (a resume's checkpoint)


@dataclass(eq=False)
class Run:
    """What the loop, its step and its hooks share: the built pieces and where the run is."""

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
    rule_met_s: Optional[float] = None  # the rule's measured seconds when it was first met (span_done)
    collective: bool = False  # the window figures are all-reduced (the same on every rank)
    total: int = 0
    per_epoch: int = 0
    # where the run is
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
    val_set: Optional[Dataset] = None  # data.val or data.val_fraction's items (runtime/evaluate.py)
    sum_train_loss: bool = False  # trainer.target_loss on the training loss: the Stepper sums every step's loss
    loss_sum: Any = 0.0  # ... into this (a tensor once summed), over loss_steps steps
    loss_steps: int = 0
    logged_step: int = -1  # the last step whose loss was logged (and passed check_loss)
    hooks: List[Hook] = field(default_factory=list)
    noise: Optional[Any] = None  # runtime/noise.NoiseProbe: the gradient noise scale's collection

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

    def log(self, loss: Any) -> None:
        self.last_loss = check_loss(float(loss), self.step, self.first_loss, self.logged_step)
        self.logged_step = self.step
        if math.isnan(self.first_loss):
            self.first_loss = self.last_loss
        self.events.write(LogEvent(type="log", step=self.step, epoch=self.epoch, loss=self.last_loss))

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


def setup(cfg: Config, adapter: Adapter, events: EventLog, model: Optional[nn.Module], dataset: Optional[Dataset],
          resume: Optional[Path], profiling: bool) -> Run:
    """The run's pieces: dataset and loader, the model wrapped by the adapter, the optimizer, AMP,
    the meter; from a checkpoint when `resume` is given."""
    t, device = cfg.trainer, adapter.device
    seed_everything(t.seed, t.deterministic)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not t.deterministic
    dataset, val_set = validation_sets(cfg, dataset if dataset is not None else build_dataset(cfg))
    ck = checkpoint.load(resume) if resume is not None else None
    cfg = loader_config(cfg, ck)  # a resumed autotuned run continues with its checkpoint's loader settings
    loader = build_loader(cfg, dataset, adapter)
    if len(loader) == 0:  # the dataset is the user's code, built here: one line from the rank
        raise ConfigError(
            f"data.batch_size: {cfg.data.batch_size} is more than the dataset's {len(dataset)} items give each of "  # type: ignore[arg-type]
            f"the {adapter.world_size} rank(s) with data.drop_last={cfg.data.drop_last}; allowed: at most "
            f"{len(dataset) // adapter.world_size}, or a larger dataset"  # type: ignore[arg-type]
        )
    model = (model or build_model(cfg)).to(device)
    if ck is not None and not adapter.sharded_state:  # before wrapping: DDP and Horovod then broadcast it
        model.load_state_dict(ck["model"])
    model = adapter.wrap_model(model)
    base_optimizer = build_optimizer(cfg, model)
    if ck is not None and adapter.sharded_state:  # every rank reads its own part
        checkpoint.load_sharded(resume, model, base_optimizer)  # type: ignore[arg-type]
    elif ck is not None:
        base_optimizer.load_state_dict(ck["optimizer"])
    optimizer = adapter.wrap_optimizer(base_optimizer, model)
    amp, dtype, scaler = amp_settings(cfg, device)
    if ck is not None and scaler is not None and ck.get("scaler"):
        scaler.load_state_dict(ck["scaler"])
    # saved per epoch: the single-process shuffle's generator (EpochSampler), or with balance=speed
    # the DataLoader's (workers' base seeds; ShareSampler's order is that of seed + epoch)
    generator = loader.sampler.generator if isinstance(loader.sampler, EpochSampler) else loader.generator
    # profiled steps follow the warmup and are kept out of the measured windows (hooks.ProfilerHook)
    m = cfg.measure
    meter = StepMeter(device, window_steps=m.window_steps, queue=loader_queue(cfg), round_steps=loader_round(cfg),
                      memory_cap_mb=t.memory_cap_mb, warmup_steps=m.warmup_steps + (m.profile_steps + 1 if profiling else 0),
                      optimizer_follows_compute=(t.accumulation_steps == 1 and adapter.world_size == 1
                                                 and not adapter.exposed_comm))
    run = Run(cfg, adapter, events, dataset, loader, model, base_optimizer, optimizer, scaler, amp, dtype, meter, ck,
              generator, step=ck["meta"]["step"] if ck is not None else 0, val_set=val_set)
    if isinstance(loader.batch_sampler, ShareSampler):  # parallelism.balance=speed
        saved = (ck["meta"].get("balance") or {}).get("sizes") if ck is not None else None
        run.balancer = Balancer(loader.batch_sampler, adapter, BALANCE_TOLERANCE, step=run.step,
                                resumed=saved)
    meter.fit_epoch(steps_per_epoch(loader, t.accumulation_steps))
    run.rule = StopRule(m.rel_precision, m.min_measure_s, m.max_measure_s) if m.rel_precision > 0 else None
    run.collective = adapter.world_size > 1 and (run.rule is not None or m.window_s > 0 or t.loader_autotune)
    run.loader_tuner = loader_tuner(cfg, adapter, dataset, events, ck)
    reset_latency(cfg, dataset, run.step)
    run.per_epoch = steps_per_epoch(loader, t.accumulation_steps)
    run.total = run.per_epoch * t.epochs if t.max_steps == 0 else min(run.per_epoch * t.epochs, t.max_steps)
    return run


# steps between the ranks' checks whether trainer.checkpoint_signal arrived (one all-reduce of a float)
SIGNAL_CHECK_EVERY = 10
SPAN_EPOCHS_OF_CAP = 2.0  # a measurement goes on to whole epochs when that takes at most this x its cap


def build_hooks(run: Run, trace_path: Optional[Path], ckpt_dir: Optional[Path],
                mlflow_run_id: Optional[str]) -> List[Hook]:
    """The features this run has, in the order the loop calls them at a step's end: checkpoint,
    latency jump, loader autotune (a checkpoint records the loader the step ran with), evaluation."""
    cfg, t, adapter = run.cfg, run.cfg.trainer, run.adapter
    hooks: List[Hook] = []
    if t.warmup_lr_steps:
        hooks.append(LrWarmupHook(t.lr, t.warmup_lr_steps))
    m = cfg.measure
    if m.profile_steps and trace_path is not None:
        hooks.append(ProfilerHook(Profiler(run.device, trace_path), m.warmup_steps, m.profile_steps))
    if run.balancer is not None:
        hooks.append(BalanceHook(run.balancer))
    saves = ckpt_dir is not None and (adapter.rank == 0 or adapter.sharded_state)
    saver = CheckpointHook(ckpt_dir, t.checkpoint_every, mlflow_run_id, run.step) if saves else None  # type: ignore[arg-type]
    if t.checkpoint_every > 0 and saver is not None:
        hooks.append(saver)
    if t.checkpoint_signal is not CheckpointSignal.none and cfg.mode is Mode.run and ckpt_dir is not None:
        # after the periodic checkpoint (a step both ask for is saved once), before the loader autotune
        request = checkpoint_request_path(ckpt_dir) if adapter.rank == 0 else None
        hooks.append(SignalCheckpointHook(saver, request, SIGNAL_CHECK_EVERY))
    if isinstance(run.dataset, LatencyDataset) and cfg.sim.latency_jump_at > 0:
        hooks.append(LatencyJumpHook(cfg.sim.latency_jump_at, cfg.sim.latency_after_ms))
    if run.loader_tuner is not None:
        hooks.append(LoaderAutotuneHook(run.loader_tuner, t.loader_autotune_every))
    noise = noise_hook(run)  # sets run.noise
    if noise is not None:
        hooks.append(noise)
    evaluating = eval_hook(run)  # last: a step another hook stopped the run at is evaluated by its finish
    if evaluating is not None:
        hooks.append(evaluating)
    return hooks


def start(run: Run) -> None:
    """The start event, the resume's position and RNG, the hooks' start."""
    ranks = run.noise if run.noise is not None and run.noise.method == "ranks" else None
    run.adapter.install_comm_hook(run.model, run.meter, ranks)
    check_fed(run, next((h for h in run.hooks if isinstance(h, NoiseHook)), None))
    run.events.write(StartEvent(type="start", total_steps=run.total, steps_per_epoch=run.per_epoch,
                                device=str(run.device), utilization_source=run.meter.source))
    if run.ck is not None:
        meta = run.ck["meta"]
        run.step, run.start_epoch = meta["step"], meta["epoch"]
        checkpoint.set_rng_state(run.ck["rng"])
        run.events.write(ResumeEvent(type="resume", step=run.step, epoch=run.start_epoch))
    for hook in overriding(run.hooks, "start"):
        hook.start(run)


def train(cfg: Config, adapter: Adapter, events: Optional[EventLog] = None,
          model: Optional[nn.Module] = None, trace_path: Optional[Path] = None,
          ckpt_dir: Optional[Path] = None, resume: Optional[Path] = None,
          dataset: Optional[Dataset] = None, mlflow_run_id: Optional[str] = None) -> TrainResult:
    """Train per `cfg` on an adapter that is already set up; returns loss and measured load."""
    t_setup = time.perf_counter()
    run = setup(cfg, adapter, events or EventLog(None), model, dataset, resume,
                profiling=bool(cfg.measure.profile_steps and trace_path is not None))
    run.hooks = build_hooks(run, trace_path, ckpt_dir, mlflow_run_id)
    before, after = overriding(run.hooks, "before_step"), overriding(run.hooks, "after_step")
    start(run)
    train_step, meter = Stepper(run), run.meter
    t_start = run.t_start = time.perf_counter()
    run.model.train()
    meter.start()
    try:
        for run.epoch in range(run.start_epoch, cfg.trainer.epochs):
            run.begin_epoch()
            while run.b < run.n_batches and run.step < run.total:
                for hook in before:
                    hook.before_step(run)
                samples, micro, loss = train_step(run)
                window = meter.end_step(samples, micro)
                run.samples += samples
                if loss is not None:
                    run.log(loss)
                if window is not None:
                    run.stop = run.on_window(window)
                busy = loss is not None or window is not None
                for hook in after:
                    busy = hook.after_step(run) or busy
                if busy:
                    meter.mark(OTHER)  # the bookkeeping above is nobody's data wait
                if run.stop:
                    break
            run.end_epoch()
            if run.stop or run.step >= run.total:
                break
        meter.flush()
        for hook in overriding(run.hooks, "finish"):
            hook.finish(run)
    finally:
        end_workers(run.it)  # a run stopped mid-epoch: its workers' batches in flight are not waited for
        meter.close()
        for hook in overriding(run.hooks, "close"):
            hook.close(run)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    out = result(run, train_step, time.perf_counter() - t_start)
    out.setup_s = t_start - t_setup
    return out


def result(run: Run, train_step: Stepper, wall: float) -> TrainResult:
    """The rank's result: the meter's summary with MFU, the stop reason and each hook's part."""
    meter = run.meter
    summary = meter.summary()
    summary.update(mfu_figures(train_step.flops, summary.get("throughput"), run.device, run.amp, run.amp_dtype,
                               run.cfg.measure.peak_tflops))
    summary["stopped_by"] = run.stopped_by or (run.rule.reason if run.rule is not None and run.rule.reason else "steps")
    summary["model_state_mb"] = model_state_mb(run.model, run.optimizer)
    for hook in run.hooks:
        hook.summary(run, summary)
    return TrainResult(model=unwrap(run.model), param_digest=param_digest(run.model), steps=run.step,
                       epochs=run.epoch + 1, steps_per_epoch=run.per_epoch, item_bytes=item_bytes(run.dataset),
                       final_loss=run.last_loss, first_loss=run.first_loss, wall_s=wall,
                       meter=summary, windows=meter.warmup_windows + meter.windows)
