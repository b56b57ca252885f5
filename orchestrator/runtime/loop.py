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
from dataclasses import dataclass
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
from ..measure.results import Window
from ..measure.stats import StopRule
from ..rundir import LogEvent, ResumeEvent, StartEvent, checkpoint_request_path
from ..schema import CheckpointSignal, Config, ConfigError, Mode, OptimizerName, RUN_WINDOWS, import_target
from .balance import TOLERANCE as BALANCE_TOLERANCE, Balancer, ShareSampler
from .data import (EpochSampler, LatencyDataset, build_dataset, build_loader, end_workers, item_bytes, loader_config,
                   reset_latency, steps_per_epoch)
from .dist import Adapter, amp_dtype, unwrap
from .flops import mfu_figures
from .evaluate import eval_hook, validation_sets
from .hooks import (BalanceHook, CheckpointHook, LatencyJumpHook, LoaderAutotuneHook, LrWarmupHook, Profiler, ProfilerHook,
                    SignalCheckpointHook, loader_tuner)
from .meter import StepMeter, model_state_mb
from .noise import NoiseHook, check_fed, noise_hook
from .batch import loss_fn
from .state import SPAN_EPOCHS_OF_CAP, EventLog, Hook, Run, after_period, overriding
from .step import Stepper, check_loss
from .windows import plain_window_cap

__all__ = ["SPAN_EPOCHS_OF_CAP", "EventLog", "Run", "TrainResult", "build_dataset", "build_loader", "build_model", "check_model", "loss_fn",
           "seed_everything", "train"]


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed the RNGs; torch's deterministic algorithms on or off as this run asks (a kept-alive rank's
    next run does not inherit the last one's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


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
                      memory_cap_mb=t.memory_cap_mb, one_process=adapter.world_size == 1,
                      warmup_steps=m.warmup_steps + (m.profile_steps + 1 if profiling else 0))
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
    if run.rule is None and m.window_s > 0:  # a plain run's windows of window_s: a short run still has several
        meter.max_window = plain_window_cap(m.window_steps, run.total - run.step - meter.warmup_steps, run.per_epoch,
                                            RUN_WINDOWS)
    return run


# steps between the ranks' checks whether trainer.checkpoint_signal arrived (one all-reduce of a float)
SIGNAL_CHECK_EVERY = 10


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
    after_every = after_period(after)  # the steps the `after` hooks may act on (state.Hook.after_every)
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
                    log_loss(run, loss)
                if window is not None:
                    run.stop = run.on_window(window)
                busy = loss is not None or window is not None
                if after and run.step % after_every == 0:
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


def log_loss(run: Run, loss: Any) -> None:
    """A logged step's loss: checked (step.check_loss: a diverged run stops here), kept and written."""
    run.last_loss = check_loss(float(loss), run.step, run.first_loss, run.logged_step)
    run.logged_step = run.step
    if math.isnan(run.first_loss):
        run.first_loss = run.last_loss
    run.events.write(LogEvent(type="log", step=run.step, epoch=run.epoch, loss=run.last_loss))


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
