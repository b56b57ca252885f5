"""The training loop, the same for every backend (seed 001's accumulation, seed 002's AMP and
cudnn.benchmark, non_blocking copies), instrumented by `StepMeter`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from ..schema import Balance, Config, ConfigError, DataConfig, Loss, OptimizerName, import_target
from .. import checkpoint
from ..rundir import BalanceEvent, CheckpointEvent, Event, LoaderEvent, LogEvent, ResumeEvent, StartEvent, WindowEvent
from .autotune import LoaderSettings, LoaderTuner
from .balance import Balancer, ShareSampler
from .dist import Adapter, amp_dtype
from .flops import StepCounter, mfu_figures
from ..measure.plan import loader_queue, loader_round, rewarm_steps
from ..measure.stats import StopRule
from ..measure.phases import COMM, COMPUTE, DATA, H2D, OPTIMIZER, OTHER
from .meter import StepMeter, Window, model_state_mb


class LatencyDataset(Dataset):
    """Adds a per-item read latency, as remote storage would (`data.read_latency_ms`). `set_latency`
    changes it in the loader's workers too (shared memory they inherit): `data.latency_jump_at`."""

    def __init__(self, inner: Dataset, latency_ms: float) -> None:
        self.inner = inner
        self._delay = multiprocessing.RawValue("d", latency_ms / 1000.0)

    def set_latency(self, latency_ms: float) -> None:
        self._delay.value = latency_ms / 1000.0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, idx: int):
        delay = self._delay.value
        if delay:
            time.sleep(delay)
        return self.inner[idx]


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_dataset(cfg: Config) -> Dataset:
    ds = import_target(cfg.data._target_)(**cfg.data.args)
    size = len(ds) if hasattr(ds, "__len__") else None  # type: ignore[arg-type]
    if size == 0:  # else torch's "num_samples should be a positive integer"
        raise ConfigError(f"data._target_: {cfg.data._target_} returned a dataset of 0 items (data.args: "
                          f"{dict(cfg.data.args)}); it needs at least data.batch_size={cfg.data.batch_size} per rank")
    if cfg.data.read_latency_ms > 0 or cfg.data.latency_jump_at > 0:
        ds = LatencyDataset(ds, cfg.data.read_latency_ms)
    return ds


class EpochSampler(Sampler):
    """The loader's sampler (the adapter's, or a seeded shuffle in one process), able to start an
    epoch part-way: with `skip` set, the next epoch's first `skip` indices are drawn (its order
    stays the same) but not handed to the loader, so batches already trained are never loaded.
    Resume and the loader autotune restart an epoch this way (`epoch_iterator`). The shuffle's own
    generator, apart from the DataLoader's (workers' base seeds), makes the order independent of
    num_workers and persistent_workers."""

    def __init__(self, inner: Sampler) -> None:
        self.inner, self.skip = inner, 0

    @property
    def generator(self) -> Optional[torch.Generator]:
        """The shuffle's generator, whose state at an epoch's start fixes its order (None: the
        order depends on the epoch alone, as DistributedSampler's)."""
        return getattr(self.inner, "generator", None) if isinstance(self.inner, RandomSampler) else None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __iter__(self):
        it, skip = iter(self.inner), self.skip
        self.skip = 0
        for _ in itertools.islice(it, skip):
            pass
        return it


def build_loader(cfg: Config, dataset: Dataset, adapter: Adapter) -> DataLoader:
    """The rank's loader: the adapter's sampler (an even split), or with parallelism.balance=speed
    its piece of every global micro-batch (`ShareSampler`, runtime/balance.py)."""
    d = cfg.data
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    if cfg.parallelism.balance is Balance.speed:
        return make_loader(d, dataset, ShareSampler(len(dataset), adapter.rank, adapter.world_size,  # type: ignore[arg-type]
                                                    d.batch_size, d.shuffle, cfg.trainer.seed, d.drop_last),
                           generator, adapter.device)
    sampler = adapter.sampler(dataset, d.shuffle, cfg.trainer.seed, d.drop_last)
    if sampler is None:  # one process: shuffled by its own seeded generator
        sampler = (RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.trainer.seed)) if d.shuffle
                   else SequentialSampler(dataset))
    return make_loader(d, dataset, EpochSampler(sampler), generator, adapter.device)


def make_loader(d: DataConfig, dataset: Dataset, sampler: Union[EpochSampler, ShareSampler], generator: torch.Generator,
                device: torch.device) -> DataLoader:
    """A DataLoader with `d`'s knobs over `sampler` (built once per run, kept across rebuilds): an
    EpochSampler of indices, or balance=speed's ShareSampler of whole micro-batches."""
    kwargs: Dict[str, Any] = {}
    if isinstance(sampler, ShareSampler):
        kwargs["batch_sampler"] = sampler
    else:
        kwargs.update(batch_size=d.batch_size, sampler=sampler, drop_last=d.drop_last)
    if d.num_workers > 0:
        kwargs["persistent_workers"] = d.persistent_workers
        if d.prefetch_factor is not None:
            kwargs["prefetch_factor"] = d.prefetch_factor
    return DataLoader(
        dataset,
        num_workers=d.num_workers,
        pin_memory=d.pin_memory and device.type == "cuda",
        worker_init_fn=_seed_worker if d.num_workers > 0 else None,
        generator=generator,
        **kwargs,
    )


def epoch_iterator(loader: DataLoader, batches_done: int) -> Any:
    """An iterator over the epoch the sampler is set to, from its `batches_done`-th batch: the
    same batches in the same order as an uninterrupted epoch, those before not loaded (with
    balance=speed's ShareSampler, loaded and dropped: its shares schedule counts what was drawn)."""
    if isinstance(loader.batch_sampler, ShareSampler):
        it = iter(loader)
        for _ in range(batches_done):
            next(it)
        return it
    loader.sampler.skip = batches_done * (loader.batch_size or 1)  # type: ignore[union-attr]
    return iter(loader)


def reset_latency(cfg: Config, dataset: Dataset, step: int) -> None:
    """The per-item latency a run starting at `step` reads with (data.latency_jump_at passed or
    not); a kept-alive rank's dataset may carry an earlier job's jump."""
    if isinstance(dataset, LatencyDataset):
        jumped = 0 < cfg.data.latency_jump_at <= step
        dataset.set_latency(cfg.data.latency_after_ms if jumped else cfg.data.read_latency_ms)


def build_model(cfg: Config) -> nn.Module:
    model = import_target(cfg.model._target_)(**cfg.model.args)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_: {cfg.model._target_} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_model(cfg: Config) -> None:
    """Before launch: model._target_ must build an nn.Module. Built on the meta device (no memory, no
    init cost); a factory that cannot build there is left to the ranks. Raises ConfigError."""
    try:
        with torch.device("meta"):
            build_model(cfg)
    except ConfigError:
        raise
    except Exception:
        return


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.trainer
    if t.optimizer is OptimizerName.adamw:
        return torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def loss_fn(kind: Loss) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind is Loss.mse:
        return nn.functional.mse_loss

    def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.dim() > 2:  # sequence models: (B, T, V) logits against (B, T) targets
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return nn.functional.cross_entropy(out, target)

    return cross_entropy


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


def weights_finite(model: nn.Module, adapter: Adapter) -> bool:
    """Every parameter is finite. Sharded weights (fsdp): every rank's part, agreed by all ranks
    (a collective; each of them writes its part of a checkpoint)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    bad = float(not bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all())) if local else 0.0
    if adapter.sharded_state:
        bad = adapter.all_reduce_sum([bad])[0]
    return bad == 0


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DDP."""
    wrapped = isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
    return model.module if wrapped else model


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
    windows: list


def item_bytes(dataset: Dataset) -> int:
    """Bytes of one item's tensors (what a DataLoader worker hands over per sample)."""
    try:
        item = dataset[0]
    except Exception:  # an iterable-style or failing dataset: unknown
        return 0
    parts = item if isinstance(item, (tuple, list)) else (item,)
    return sum(x.element_size() * x.nelement() if isinstance(x, torch.Tensor) else 8 for x in parts)


def rewarms_epochs(cfg: Config, loader: DataLoader) -> bool:
    """A new epoch's iterator refills the loader's queue: warm up again at each epoch, unless there
    is no queue (no workers: an epoch restart is only a reshuffle) or the epoch is too short to get
    past it, counted in optimizer steps: the steps left after the re-warmup (`epoch_measured_steps`)
    must be at least as many as the re-warmup and hold a whole round of the loader's workers. Then
    epoch restarts are part of the steady state. Counted in micro-batches instead, a 1-step epoch of
    8 micro-batches (batch 512 x accumulation 8 on a small dataset) re-warmed at every epoch and
    never measured a window: its trial ran to the trial timeout."""
    if loader_queue(cfg) == 0:
        return False
    left = epoch_measured_steps(cfg, loader)
    return left >= rewarm_steps(cfg) and left >= loader_round(cfg)


def epoch_measured_steps(cfg: Config, loader: DataLoader) -> int:
    """Steps of an epoch after its re-warmup: when epochs re-warm, a measured window must fit in
    them (StepMeter.epoch_steps), else every window is cut short by the next epoch, none enters the
    estimate and a trial's stop rule never stops it (a 4-step epoch with windows of 10 steps)."""
    return steps_per_epoch(loader, cfg.trainer.accumulation_steps) - rewarm_steps(cfg)


def steps_per_epoch(loader: DataLoader, accumulation: int) -> int:
    """Optimizer steps in one epoch: every N micro-batches and once more for a remainder."""
    return math.ceil(len(loader) / accumulation)


class Profiler:
    """torch.profiler over the steps [warmup, warmup + n): CPU, and CUDA where present, with shapes."""

    def __init__(self, device: torch.device, trace_path: Path) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.cuda, self.trace_path = device.type == "cuda", trace_path
        self.prof = profile(activities=acts, record_shapes=True)
        self.running = self.done = False
        self.top_ops: list = []

    def at_step(self, step: int, start: int, n: int) -> bool:
        """Start or stop at the top of `step`; True when it just stopped (its teardown ran)."""
        if step == start and not self.running and not self.done:
            self.prof.start()
            self.running = True
        elif step == start + n and self.running:
            self.stop()
            return True
        return False

    def stop(self) -> None:
        if not self.running:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        self.running, self.done = False, True
        self.prof.export_chrome_trace(str(self.trace_path))
        self.top_ops = top_ops(self.prof, self.cuda)


def top_ops(prof: Any, cuda: bool, n: int = 15) -> list:
    """The operators that took the most device time (self time: children not double counted)."""
    def dev(e: Any) -> float:
        return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)

    events = [e for e in prof.key_averages(group_by_input_shape=True) if not e.key.startswith("ProfilerStep")]
    events.sort(key=(dev if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000.0,
             "self_device_ms": dev(e) / 1000.0, "input_shapes": str(e.input_shapes)[:200]} for e in events[:n]]


# -- loader autotune (runtime/autotune.py decides; these apply its settings to the loop) ----------
def loader_config(cfg: Config, ck: Optional[Dict[str, Any]]) -> Config:
    """`cfg`, or with trainer.loader_autotune, `cfg` with the loader settings its checkpoint kept."""
    saved = (ck or {}).get("meta", {}).get("loader")
    if not cfg.trainer.loader_autotune or not saved:
        return cfg
    settings = LoaderSettings(int(saved["num_workers"]), saved.get("prefetch_factor"))
    return dataclasses.replace(cfg, data=settings.data(cfg.data))


def loader_tuner(cfg: Config, adapter: Adapter, dataset: Dataset, events: EventLog,
                 ck: Optional[Dict[str, Any]]) -> Optional[LoaderTuner]:
    """The run's loader tuner (trainer.loader_autotune), its starting settings recorded (rank 0)."""
    if not cfg.trainer.loader_autotune:
        return None

    def emit(ev: LoaderEvent) -> None:
        if adapter.rank == 0:
            events.write(ev)
            if ev["action"] != "start":
                print(f"[loader-autotune] step {ev['step']}: {ev['action']} "
                      f"{LoaderSettings(ev['num_workers'], ev['prefetch_factor']).text} "
                      f"(was {LoaderSettings(ev['from_workers'], ev['from_prefetch']).text}): {ev['reason']}", flush=True)

    settings = LoaderSettings.of(cfg.data)
    tuner = LoaderTuner(cfg, settings, rank=adapter.rank, world_size=adapter.world_size, device=str(adapter.device),
                        item_bytes=item_bytes(dataset), emit=emit, all_reduce_sum=adapter.all_reduce_sum)
    step = ck["meta"]["step"] if ck is not None else 0
    tuner.record(step, "start", settings, settings, "resumed with the checkpoint's settings" if ck else "configured")
    return tuner


def switch_loader(cfg: Config, new: LoaderSettings, loader: DataLoader, it: Any, generator: Optional[torch.Generator],
                  epoch_generator: Optional[torch.Tensor], batches_done: int, device: torch.device) -> tuple:
    """(cfg, loader, iterator) with `new` loader settings, the iterator at the same batch of the
    same epoch: the old workers end, the sampler's order is restored to the epoch's start and the
    batches already trained are skipped unloaded (`epoch_iterator`, as a resume does)."""
    shutdown = getattr(it, "_shutdown_workers", None)  # torch's own teardown of the old iterator's workers
    if shutdown is not None:
        shutdown()
    cfg = dataclasses.replace(cfg, data=new.data(cfg.data))
    if generator is not None and epoch_generator is not None:
        generator.set_state(epoch_generator)
    loader = make_loader(cfg.data, loader.dataset, loader.sampler, loader.generator, device)  # type: ignore[arg-type]
    return cfg, loader, epoch_iterator(loader, batches_done)


def train(cfg: Config, adapter: Adapter, events: Optional[EventLog] = None,
          model: Optional[nn.Module] = None, trace_path: Optional[Path] = None,
          ckpt_dir: Optional[Path] = None, resume: Optional[Path] = None,
          dataset: Optional[Dataset] = None, mlflow_run_id: Optional[str] = None) -> TrainResult:
    """Train per `cfg` on an adapter that is already set up; returns loss and measured load."""
    events = events or EventLog(None)
    t = cfg.trainer
    device = adapter.device
    seed_everything(t.seed, t.deterministic)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not t.deterministic

    dataset = dataset if dataset is not None else build_dataset(cfg)
    ck = checkpoint.load(resume) if resume is not None else None
    cfg = loader_config(cfg, ck)  # a resumed autotuned run continues with its checkpoint's loader settings
    loader = build_loader(cfg, dataset, adapter)
    if len(loader) == 0:
        raise ValueError(
            f"data: the dataset ({len(dataset)} items) gives no batch of data.batch_size={cfg.data.batch_size} "  # type: ignore[arg-type]
            f"per rank (world size {adapter.world_size}); lower the batch size or enlarge the dataset"
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
    criterion = loss_fn(cfg.model.loss)
    amp, amp_dtype, scaler = amp_settings(cfg, device)
    if ck is not None and scaler is not None and ck.get("scaler"):
        scaler.load_state_dict(ck["scaler"])
    # saved per epoch: the single-process shuffle's generator (EpochSampler), or with balance=speed
    # the DataLoader's (workers' base seeds; ShareSampler's order is that of seed + epoch)
    generator = loader.sampler.generator if isinstance(loader.sampler, EpochSampler) else loader.generator
    balancer: Optional[Balancer] = None
    if isinstance(loader.batch_sampler, ShareSampler):  # parallelism.balance=speed
        saved = (ck["meta"].get("balance") or {}).get("sizes") if ck is not None else None
        balancer = Balancer(loader.batch_sampler, adapter, cfg.parallelism.balance_tolerance,
                            step=ck["meta"]["step"] if ck is not None else 0, resumed=saved)
    writes_checkpoints = t.checkpoint_every > 0 and ckpt_dir is not None and (adapter.rank == 0 or adapter.sharded_state)

    # profiled steps follow the warmup and are kept out of the measured windows, and so is their
    # teardown (trace export) and the loader queue that filled up meanwhile: the meter warms up again
    profiler = Profiler(device, trace_path) if t.profile_steps and trace_path is not None else None
    meter = StepMeter(device, window_steps=t.window_steps, queue=loader_queue(cfg), round_steps=loader_round(cfg),
                      memory_cap_mb=t.memory_cap_mb,
                      warmup_steps=t.warmup_steps + (t.profile_steps + 1 if profiler is not None else 0))
    meter.fit_epoch(epoch_measured_steps(cfg, loader) if rewarms_epochs(cfg, loader) else 0)
    # tuning trials: measure until precise enough (every rank sees the same all-reduced figures)
    rule = StopRule(t.rel_precision, t.min_measure_s, t.max_measure_s) if t.rel_precision > 0 else None
    collective = adapter.world_size > 1 and (rule is not None or t.window_s > 0 or t.loader_autotune)
    tuner = loader_tuner(cfg, adapter, dataset, events, ck)
    reset_latency(cfg, dataset, ck["meta"]["step"] if ck is not None else 0)
    jump_at = cfg.data.latency_jump_at if isinstance(dataset, LatencyDataset) else 0

    def job_figures(win: Window) -> list:
        """[throughput summed over ranks, step time and wall time averaged]: the same on every rank."""
        figures = [win.throughput, win.wall_s / win.steps, win.wall_s]
        if collective:
            figures = adapter.all_reduce_sum(figures)
            figures[1:] = [v / adapter.world_size for v in figures[1:]]
        return figures

    def write_shares(at: int) -> None:
        if adapter.rank == 0:  # the same on every rank; the parent logs rank<R>/share
            events.write(BalanceEvent(type="balance", step=at, shares=balancer.shares))  # type: ignore[union-attr]

    def on_window(win: Window) -> bool:
        """A window closed: report it, size the next ones, feed the stop rule; True: stop now."""
        meter.check_memory()
        if win.warmup:  # its step time includes the start-up: it may only shorten the first window
            if t.window_s > 0:
                meter.resize(job_figures(win)[1], t.window_s, at_most=t.window_steps)
            return False
        events.write(WindowEvent(type="window", step=win.first_step + win.steps, throughput=win.throughput,
                                 utilization=win.utilization, data_wait_frac=win.share("data"),
                                 comm_frac=win.share("comm"), step_time_s=win.wall_s / win.steps))
        if win.partial:  # cut short by a new epoch: left out of the estimate, and of the rule
            return False
        # the run's step (the meter counts from this process's start, a resume's too)
        if balancer is not None and balancer.on_window(win.wall_s, win.phases_s["comm"], win.samples, win.steps, step):
            write_shares(step)
            meter.rewarm("balance")  # the loader's queue holds micro-batches split the old way
            return False
        figures = job_figures(win)
        if tuner is not None:
            tuner.add(figures[0], win.phases_s, win.steps)
        meter.resize(figures[1], t.window_s)
        return rule is not None and rule.add(figures[0], figures[2]) is not None

    adapter.install_comm_hook(model, meter)
    accum = t.accumulation_steps
    per_epoch = steps_per_epoch(loader, accum)
    rewarm_epochs = rewarms_epochs(cfg, loader)
    total = per_epoch * t.epochs if t.max_steps == 0 else min(per_epoch * t.epochs, t.max_steps)
    events.write(StartEvent(type="start", total_steps=total, steps_per_epoch=per_epoch, device=str(device),
                            utilization_source=meter.source))

    step, epoch, first_loss, last_loss, stop = 0, 0, math.nan, math.nan, False
    start_epoch, skip = 0, 0
    if ck is not None:
        meta = ck["meta"]
        step, start_epoch, skip = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        checkpoint.set_rng_state(ck["rng"])
        events.write(ResumeEvent(type="resume", step=step, epoch=start_epoch))
    # FLOPs are counted over the first step, a warmup step (never measured); see runtime/flops.py
    counter: Optional[StepCounter] = StepCounter() if t.warmup_steps > 0 else None
    counted_step = step
    flops: Dict[str, Any] = {"flops": None, "reason": "not counted: trainer.warmup_steps=0 leaves no unmeasured step"}
    # Hot path: on a ~200 us step every microsecond shows, so work that does nothing is skipped
    # (CPU copies, a disabled autocast, a division by 1, loss bookkeeping on unlogged steps).
    move = device.type != "cpu"
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp else contextlib.nullcontext
    exposed_comm = adapter.exposed_comm
    plain = not amp and accum == 1  # no context to enter: the micro-step is the seed's own code
    clip = t.grad_clip

    def weigh(loss: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """balance=speed: the loss times world x this rank's share of global micro-batch k."""
        w = balancer.sampler.weight(n, k)  # type: ignore[union-attr]
        return loss if w == 1.0 else loss * w
    mark = meter.mark

    def save_checkpoint(epoch: int, batch_in_epoch: int, epoch_generator: Optional[torch.Tensor]) -> None:
        # the loss is checked on logged steps only: weights that diverged in between are never
        # written, so a resume always finds the last finite checkpoint (rotation keeps the newest)
        if not weights_finite(model, adapter):
            raise FloatingPointError(f"the weights are not finite (NaN or inf) at step {step}: not checkpointed, the "
                                     "last finite checkpoint is kept; lower trainer.lr or turn off trainer.amp")
        state = {"scaler": scaler.state_dict() if scaler is not None else None,
                 "rng": checkpoint.rng_state(), "loader_generator": epoch_generator}
        if not adapter.sharded_state:
            state.update(model=unwrap(model).state_dict(), optimizer=optimizer.state_dict())
        checkpoint.save(ckpt_dir, step, state,  # type: ignore[arg-type]
                        {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "world_size": adapter.world_size,
                         "backend": cfg.backend.name.value, "mlflow_run_id": mlflow_run_id,
                         "loader": (tuner.settled if tuner is not None else LoaderSettings.of(cfg.data)).as_dict(),
                         "balance": {"sizes": balancer.sampler.sizes} if balancer is not None else None},
                        sharded=(model, base_optimizer) if adapter.sharded_state else None, rank=adapter.rank)
        if adapter.rank == 0:
            events.write(CheckpointEvent(type="checkpoint", step=step))

    if balancer is not None:
        write_shares(step)
    t_start = time.perf_counter()
    model.train()
    meter.start()
    try:
        for epoch in range(start_epoch, t.epochs):
            for sampler in (loader.sampler, loader.batch_sampler):
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)  # type: ignore[union-attr]
            resuming = ck is not None and epoch == start_epoch
            if resuming and generator is not None and ck.get("loader_generator") is not None:  # type: ignore[union-attr]
                generator.set_state(ck["loader_generator"])  # type: ignore[index]
            epoch_generator = generator.get_state() if generator is not None else None
            b = skip if resuming else 0  # the same order, from where the checkpoint was taken
            it = epoch_iterator(loader, b)
            n_batches = len(loader)
            while b < n_batches and step < total:
                if profiler is not None and profiler.at_step(step, t.warmup_steps, t.profile_steps):
                    meter.rewarm("profiler")
                if counter is not None and step == counted_step:
                    counter.__enter__()
                micro = min(accum, n_batches - b)  # the epoch's last step takes the remainder
                logged = (step + 1) % t.log_every == 0 or step == 0 or step + 1 == total
                samples = 0
                step_loss = 0.0
                for m in range(micro):
                    x, y = next(it)
                    mark(DATA)
                    if move:
                        x = x.to(device, non_blocking=True)
                        y = y.to(device, non_blocking=True)
                        mark(H2D)
                    if plain:
                        loss = criterion(model(x), y)
                        (loss if balancer is None else weigh(loss, x.shape[0], b + m)).backward()
                    else:
                        with adapter.grad_sync(model, enabled=m == micro - 1), autocast():
                            loss = criterion(model(x), y)
                            if micro > 1:
                                loss = loss / micro
                            weighted = loss if balancer is None else weigh(loss, x.shape[0], b + m)
                            (scaler.scale(weighted) if scaler is not None else weighted).backward()
                    if logged:
                        step_loss += loss.detach()
                    samples += x.shape[0]
                    mark(COMPUTE)
                b += micro
                if counter is not None and step == counted_step:
                    counter.__exit__(None, None, None)
                    flops, counter = counter.per_sample(samples), None
                if exposed_comm:
                    adapter.synchronize(optimizer)
                    mark(COMM)
                if clip:  # the global norm, also over sharded (DTensor) gradients
                    if scaler is not None:
                        scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                adapter.step(optimizer, scaler)
                optimizer.zero_grad()  # set_to_none (torch's default; Horovod's override takes no args)
                mark(OPTIMIZER)
                step += 1
                window = meter.end_step(samples, micro)
                if logged:
                    last_loss = float(step_loss)
                    if not math.isfinite(last_loss):
                        raise FloatingPointError(f"loss is {last_loss} at step {step}; lower trainer.lr or turn off trainer.amp")
                    if math.isnan(first_loss):
                        first_loss = last_loss
                    events.write(LogEvent(type="log", step=step, epoch=epoch, loss=last_loss))
                if window is not None:
                    stop = on_window(window)
                if writes_checkpoints and step % t.checkpoint_every == 0:
                    save_checkpoint(epoch, b, epoch_generator)
                    logged = True
                if step == jump_at:
                    dataset.set_latency(cfg.data.latency_after_ms)  # type: ignore[union-attr]
                if tuner is not None and not stop and step % t.loader_autotune_every == 0 and step < total:
                    new = tuner.at_step(step)
                    if new is not None:  # every rank switches here, at the same batch of the epoch
                        cfg, loader, it = switch_loader(cfg, new, loader, it, generator, epoch_generator, b, device)
                        rewarm_epochs = rewarms_epochs(cfg, loader)
                        meter.queue = loader_queue(cfg)
                        meter.set_round(loader_round(cfg))
                        meter.fit_epoch(epoch_measured_steps(cfg, loader) if rewarm_epochs else 0)
                        partial = meter.rewarm("loader")  # the new workers fill their queue: warm up again
                        stop = partial is not None and on_window(partial)
                    logged = True
                if logged or window is not None:
                    mark(OTHER)  # the bookkeeping above is nobody's data wait
                if stop:
                    break
            if stop or step >= total:
                meter.flush()  # before the iterator's shutdown below
            elif rewarm_epochs:
                partial = meter.rewarm("epoch")  # the next epoch's iterator refills the loader's queue
                stop = partial is not None and on_window(partial)
            if b == n_batches:
                next(it, None)  # finish the epoch's iterator as a plain `for` loop would (sampler RNG)
            if stop or step >= total:
                break
        meter.flush()
        if writes_checkpoints and step % t.checkpoint_every != 0 and step > (ck["meta"]["step"] if ck else 0):
            # the end of the run is a checkpoint too: raising max_steps or epochs continues from here
            save_checkpoint(epoch, b, epoch_generator)
    finally:
        meter.close()
        if profiler is not None:
            profiler.stop()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t_start
    summary = meter.summary()
    summary.update(mfu_figures(flops, summary.get("throughput"), device, amp, amp_dtype, t.peak_tflops))
    summary["stopped_by"] = rule.reason if rule is not None and rule.reason else "steps"
    summary["model_state_mb"] = model_state_mb(model, optimizer)
    summary["warmup"]["epochs_rewarm"] = rewarm_epochs
    if balancer is not None:
        summary["balance"] = balancer.summary()
    if profiler is not None:
        summary["profile"] = {"steps": t.profile_steps, "trace": str(trace_path), "top_ops": profiler.top_ops}
    if tuner is not None and adapter.rank == 0:
        summary["loader_autotune"] = tuner.summary()
    return TrainResult(model=unwrap(model), param_digest=param_digest(model), steps=step, epochs=epoch + 1,
                       steps_per_epoch=per_epoch, item_bytes=item_bytes(dataset), final_loss=last_loss,
                       first_loss=first_loss, wall_s=wall,
                       meter=summary, windows=[w.as_dict() for w in meter.warmup_windows + meter.windows])
