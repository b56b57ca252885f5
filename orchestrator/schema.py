"""Typed schema of every config group, registered in Hydra's ConfigStore.

Each `conf/<group>/*.yaml` names its schema in its defaults list, so a typo or a wrong type is
an error at compose time. Choices are Enums so the error lists the allowed values. Meaning
(ranges, combinations) is checked in `__post_init__`, which runs when the parent calls
`to_config`, once, before anything is launched.
"""

from __future__ import annotations

import copy
import functools
import dataclasses
import importlib
import inspect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .stores import misread_password, redact


class ConfigError(ValueError):
    """A user error in the configuration: one line naming the field and the allowed values."""


def _allowed(enum: type[Enum]) -> str:
    return ", ".join(e.value for e in enum)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class Mode(str, Enum):
    run = "run"
    tune = "tune"


class BackendName(str, Enum):
    single = "single"
    dp = "dp"
    ddp = "ddp"
    fsdp = "fsdp"  # FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over the ranks
    horovod = "horovod"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DistBackend(str, Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    gloo = "gloo"
    nccl = "nccl"


class Launcher(str, Enum):
    auto = "auto"  # slurm inside a SLURM job that spans more than one node, else local
    slurm = "slurm"  # the ranks of the SLURM allocation's nodes, started with srun (orchestrator/slurm.py)
    local = "local"  # this machine (or the nodes given by hand: nnodes, node_rank, master_addr)


class Balance(str, Enum):
    even = "even"  # every rank data.batch_size samples per micro-step
    speed = "speed"  # each rank's share of the global batch set by its measured speed (runtime/balance.py)


class Loss(str, Enum):
    cross_entropy = "cross_entropy"  # against the batch's target: (input, target), or a dict's "labels"
    mse = "mse"
    model = "model"  # the model's output is the loss, or has `.loss` / `["loss"]` (Hugging Face models)


LOSS_ALLOWED = f"{_allowed(Loss)}, or {{_target_: pkg.module.fn, args: {{...}}}} called as fn(output, batch, **args)"


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"


class AmpDtype(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class CheckpointSignal(str, Enum):
    """trainer.checkpoint_signal: the signal that means "checkpoint now and stop" (a SLURM job's
    warning before its time limit, `sbatch --signal=B:USR1@<s>`; docs/long-runs.md); none: off."""

    USR1 = "USR1"
    USR2 = "USR2"
    none = "none"

    @property
    def signum(self) -> Optional[int]:
        import signal

        return None if self is CheckpointSignal.none else int(getattr(signal, f"SIG{self.value}"))


def import_target(path: str) -> Any:
    """`pkg.module.attr` -> the object (what `_target_` names). Not `hydra.utils.get_object`: it
    logs a multi-line error before raising, and reports a missing attribute as a missing module."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ImportError(f"'{path}' is not a dotted path like package.module.Name")
    return getattr(importlib.import_module(module), attr)


def check_target(node: str, target: str, args: Dict[str, Any], positional: tuple = ()) -> None:
    """`target` must import, and `args` must bind to its signature (names the bad key); with
    `positional` (names), it is called with that many positional values before the args."""
    try:
        obj = import_target(target)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{node}._target_: cannot import '{target}' ({exc}); make its package importable: run from the "
            f"directory that holds it, add that directory to PYTHONPATH, or pip install it into this venv"
        ) from None
    except Exception as exc:  # ImportError, AttributeError, ValueError
        raise ConfigError(f"{node}._target_: cannot import '{target}' ({type(exc).__name__}: {exc})") from None
    if not callable(obj):
        raise ConfigError(f"{node}._target_: '{target}' is not callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    if positional:  # called with these before the args (a collate function's items, a loss's output and batch)
        sig = _after_positional(node, target, sig, positional)
    params = sig.parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in args:
            _require(key in names, f"{node}.args.{key}: not an argument of {target}; allowed: {', '.join(names) or '(none)'}")
    try:
        sig.bind(**args)
    except TypeError as exc:  # a required argument is missing (docs/running.md: checked before launch)
        missing = [n for n, p in params.items() if p.default is p.empty and n not in args
                   and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise ConfigError(f"{node}.args.{missing[0]}: required by {target} and not given; "
                              f"set it, e.g. +{node}.args.{missing[0]}=...") from None
        raise ConfigError(f"{node}.args: do not fit the signature of {target} ({exc})") from None


def _after_positional(node: str, target: str, sig: inspect.Signature, positional: tuple) -> inspect.Signature:
    """`sig` less the parameters the first len(`positional`) positional values take."""
    params = list(sig.parameters.values())
    taken = 0
    while taken < len(positional) and taken < len(params) and params[taken].kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        taken += 1
    if taken < len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"{node}._target_: {target} is called as {target.rpartition('.')[2]}"
                          f"({', '.join(positional)}, **args) and takes {taken} positional argument(s)")
    return sig.replace(parameters=[p for p in params[taken:] if p.kind is not p.VAR_POSITIONAL])


def target_spec(node: str, value: Any) -> tuple:
    """(target, args) of a `{_target_, args}` mapping; ConfigError naming `node` otherwise."""
    _require(isinstance(value, dict) and isinstance(value.get("_target_"), str) and value["_target_"] != ""
             and set(value) <= {"_target_", "args"} and isinstance(value.get("args", {}), dict),
             f"{node}: expected {{_target_: pkg.module.name, args: {{...}}}}, got {value!r}")
    return value["_target_"], dict(value.get("args") or {})


@dataclass
class ModelConfig:
    """`_target_` is any importable callable returning an `nn.Module`; `args` are its kwargs."""

    _target_: str = MISSING
    args: Dict[str, Any] = field(default_factory=dict)
    # a Loss, or {_target_, args}: a callable (output, batch, **args) -> loss (docs/running.md)
    loss: Any = Loss.cross_entropy

    def __post_init__(self) -> None:
        check_target("model", self._target_, self.args)
        if isinstance(self.loss, dict):
            target, args = target_spec("model.loss", self.loss)
            check_target("model.loss", target, args, positional=("output", "batch"))
        else:
            _require(isinstance(self.loss, str) and self.loss in Loss.__members__,
                     f"model.loss: got {self.loss!r}; allowed: {LOSS_ALLOWED}")
            self.loss = Loss(self.loss)


@dataclass
class DataConfig:
    """`_target_` builds the dataset (see tasks/datasets.py for the factory signature).

    The loader knobs below belong to the orchestrator and are what the tuner searches.
    """

    _target_: str = MISSING
    args: Dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: Optional[int] = None  # None: torch's default (2) when num_workers > 0
    persistent_workers: bool = False
    shuffle: bool = True
    drop_last: bool = True
    # {_target_, args}: the loaders' collate_fn, called as fn(items, **args); null: torch's default
    collate_fn: Optional[Any] = None  # Any: OmegaConf merges a mapping given on the command line over null
    batch_key: Optional[str] = None  # a dict batch's key whose leading dimension is the batch size; null: the first tensor's
    # validation (runtime/evaluate.py): a dataset {_target_, args} built like _target_, or a held-out
    # fraction of the training set (the same items whatever trainer.seed); null and 0: none
    val: Any = None  # Any: a mapping given on the command line replaces null (a typed one would merge into it)
    val_fraction: float = 0.0

    @property
    def validates(self) -> bool:
        """A validation set is configured (data.val or data.val_fraction)."""
        return self.val is not None or self.val_fraction > 0

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, f"data.batch_size: must be an integer >= 1, got {self.batch_size}")
        _require(self.num_workers >= 0, f"data.num_workers: must be an integer >= 0, got {self.num_workers}")
        _require(
            self.prefetch_factor is None or self.prefetch_factor >= 1,
            f"data.prefetch_factor: must be null or an integer >= 1, got {self.prefetch_factor}",
        )
        _require(
            self.prefetch_factor is None or self.num_workers > 0,
            "data.prefetch_factor: only applies with data.num_workers > 0; set it to null or raise num_workers",
        )
        _require(
            not self.persistent_workers or self.num_workers > 0,
            "data.persistent_workers: needs data.num_workers > 0; set it to false or raise num_workers",
        )
        check_target("data", self._target_, self.args)
        if self.collate_fn is not None:
            target, args = target_spec("data.collate_fn", self.collate_fn)
            check_target("data.collate_fn", target, args, positional=("items",))
        _require(self.batch_key is None or self.batch_key != "",
                 "data.batch_key: must be a key of the batch (e.g. input_ids) or null (the first tensor's leading dimension)")
        _require(0 <= self.val_fraction < 1,
                 f"data.val_fraction: must be in [0, 1) (a share of the training set held out; 0 = none), got {self.val_fraction}")
        if self.val is not None:
            _require(self.val_fraction == 0, "data.val / data.val_fraction: give one or the other (a validation dataset, "
                                             "or a share of the training set held out)")
            target, args = target_spec("data.val", self.val)
            check_target("data.val", target, args)


@dataclass
class SimConfig:
    """A simulated slow storage for the benchmarks and tests (and `experiment=input_bound`): a
    per-item read latency around any dataset (runtime/data.py, LatencyDataset), and a change of
    it at a step, a load change for the loader's autotune to follow."""

    read_latency_ms: float = 0.0  # per-item read latency, training and validation sets alike; 0: none
    latency_jump_at: int = 0  # at this optimizer step the per-item latency becomes latency_after_ms; 0: never
    latency_after_ms: float = 0.0  # with latency_jump_at: the latency from then on (a slower tier, heavier work)

    def __post_init__(self) -> None:
        _require(self.read_latency_ms >= 0, f"sim.read_latency_ms: must be >= 0, got {self.read_latency_ms}")
        _require(self.latency_jump_at >= 0, f"sim.latency_jump_at: must be a step >= 0 (0 = never), got {self.latency_jump_at}")
        _require(self.latency_after_ms >= 0, f"sim.latency_after_ms: must be >= 0, got {self.latency_after_ms}")
        _require(self.latency_jump_at > 0 or self.latency_after_ms == 0,
                 "sim.latency_after_ms: applies with sim.latency_jump_at > 0 (the step the latency changes at)")


@dataclass
class BackendConfig:
    name: BackendName = BackendName.single
    device: Device = Device.auto
    dist_backend: DistBackend = DistBackend.auto  # ddp only
    fp16_compression: bool = False  # horovod only: compress gradients to fp16 for the allreduce
    gloo: bool = True  # horovod only: horovodrun --gloo (False: MPI)
    # fsdp only (other backends ignore them, so one tuning space can switch backend.name):
    shard_modules: List[str] = field(default_factory=list)  # class names sharded as units; []: by shard_min_params
    shard_min_params: int = 1_000_000  # shard_modules=[]: a module holding this many parameters is a unit
    reshard_after_forward: bool = True  # free gathered parameters after forward (all-gather again in backward)

    def __post_init__(self) -> None:
        _require(
            not self.fp16_compression or self.name is BackendName.horovod,
            "backend.fp16_compression: applies to backend=horovod only",
        )
        _require(self.shard_min_params >= 1, f"backend.shard_min_params: must be >= 1, got {self.shard_min_params}")
        for name in self.shard_modules:
            _require(name.isidentifier(), f"backend.shard_modules: '{name}' is not a class name (e.g. TransformerEncoderLayer)")


@dataclass
class ParallelismConfig:
    """Degrees of parallelism; the world size the ranks see must agree (checked in the ranks)."""

    launcher: Launcher = Launcher.auto  # how the ranks start: see Launcher, docs/distributed.md
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node only)
    hosts: Optional[str] = None  # horovod: "host1:slots,host2:slots"
    hostfile: Optional[str] = None  # horovod: a hostfile instead of hosts
    shard_size: int = 0  # fsdp: ranks a model is sharded over (HSDP: replicated across groups); 0: all ranks
    balance: Balance = Balance.even  # speed: split the global batch by the ranks' measured speeds
    oversubscribe: bool = False  # start nproc_per_node ranks even beyond 4 a CPU core of this machine (launch.py)

    def __post_init__(self) -> None:
        _require(self.shard_size >= 0, f"parallelism.shard_size: must be >= 0 (0 = all ranks), got {self.shard_size}")
        _require(self.nproc_per_node >= 1, f"parallelism.nproc_per_node: must be >= 1, got {self.nproc_per_node}")
        _require(self.nnodes >= 1, f"parallelism.nnodes: must be >= 1, got {self.nnodes}")
        _require(
            0 <= self.node_rank < self.nnodes,
            f"parallelism.node_rank: must be in 0..{self.nnodes - 1} (nnodes={self.nnodes}), got {self.node_rank}",
        )
        _require(0 <= self.master_port <= 65535, f"parallelism.master_port: must be 0..65535, got {self.master_port}")
        _require(bool(self.master_addr.strip()), "parallelism.master_addr: empty; allowed: a host name or address "
                                                 "(127.0.0.1 unless set)")
        _require(
            self.master_port != 0 or self.nnodes == 1 or self.launcher is Launcher.slurm,
            "parallelism.master_port: set a fixed port when nnodes > 1 (every node must agree on it)",
        )
        _require(
            self.launcher is not Launcher.slurm or (self.node_rank == 0 and not (self.hosts or self.hostfile)),
            "parallelism.launcher: slurm takes the nodes from the allocation; leave parallelism.node_rank, hosts and "
            "hostfile unset (allowed with them: parallelism.launcher=local)",
        )
        _require(
            not (self.hosts and self.hostfile), "parallelism.hosts / parallelism.hostfile: give one or the other"
        )
        if self.hosts:
            for item in self.hosts.split(","):
                host, _, slots = item.strip().partition(":")
                _require(
                    bool(host) and slots.isdigit() and int(slots) >= 1,
                    f"parallelism.hosts: expected 'host:slots,host:slots' with slots >= 1, got '{self.hosts}'",
                )

    @property
    def world_size(self) -> int:
        if self.hosts:
            return sum(int(item.split(":")[1]) for item in self.hosts.split(","))
        return self.nproc_per_node * self.nnodes


@dataclass
class TrainerConfig:
    """A *step* is one optimizer step (= accumulation_steps micro-batches) everywhere."""

    epochs: int = 1
    max_steps: int = 0  # 0: no cap, run `epochs` epochs
    lr: float = 0.01
    optimizer: OptimizerName = OptimizerName.sgd
    momentum: float = 0.0
    weight_decay: float = 0.0
    accumulation_steps: int = 1
    grad_clip: float = 0.0  # clip the gradients' global L2 norm to this before each step; 0: off
    amp: bool = False
    amp_dtype: AmpDtype = AmpDtype.bf16
    seed: int = 0
    deterministic: bool = False
    warmup_lr_steps: int = 0  # optimizer steps of linear learning-rate warmup from lr/n to lr; 0: off
    log_every: int = 10  # steps between logged loss/throughput/utilization points
    timeout_s: float = 0.0  # whole-job wall-clock limit; 0: none
    save_model: bool = True  # rank 0 writes the trained weights to RUN_DIR/model.pt
    memory_cap_mb: float = 0.0  # a rank process above this RSS fails the job (CPU "OOM"); 0: none
    checkpoint_every: int = 0  # steps between checkpoints (rank 0, atomic); 0: off
    # on this signal (SLURM's warning before the time limit): checkpoint at the next step boundary and stop;
    # in a requeue-able SLURM batch job, requeue it (the requeued job resumes there); none: off
    checkpoint_signal: CheckpointSignal = CheckpointSignal.USR1
    resume: Optional[str] = None  # a run dir, or `latest`: continue from its last checkpoint
    loader_autotune: bool = False  # tune data.num_workers / prefetch_factor online (runtime/autotune.py)
    loader_autotune_every: int = 100  # steps between the autotuner's looks at the last windows
    eval_every: int = 0  # with data.val or data.val_fraction: evaluate every this many steps; 0: at the end only
    # {_target_, args}: a metric fn(output, batch, **args) -> a tensor or float averaged over the batch's items
    val_metric: Any = None
    # stop once reached: the validation loss when there is validation, else the training loss over a log interval
    target_loss: Optional[float] = None
    # off | auto | a study name: apply the pick of the newest study of this job (its fingerprint) in tune.storage
    tuned: str = "off"

    def __post_init__(self) -> None:
        _require(isinstance(self.tuned, str) and self.tuned.strip() == self.tuned != "",
                 f"trainer.tuned: allowed: off, auto, or a study's name (tune.storage's), got {self.tuned!r}")
        _require(self.epochs >= 1, f"trainer.epochs: must be >= 1, got {self.epochs}")
        _require(self.max_steps >= 0, f"trainer.max_steps: must be >= 0 (0 = no cap), got {self.max_steps}")
        _require(self.lr > 0, f"trainer.lr: must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, f"trainer.momentum: must be in [0, 1), got {self.momentum}")
        _require(self.weight_decay >= 0, f"trainer.weight_decay: must be >= 0, got {self.weight_decay}")
        _require(
            self.accumulation_steps >= 1,
            f"trainer.accumulation_steps: must be an integer >= 1, got {self.accumulation_steps}",
        )
        _require(self.grad_clip >= 0, f"trainer.grad_clip: must be >= 0 (0 = off), got {self.grad_clip}")
        _require(self.warmup_lr_steps >= 0,
                 f"trainer.warmup_lr_steps: must be an integer >= 0 (0 = off), got {self.warmup_lr_steps}")
        _require(self.log_every >= 1, f"trainer.log_every: must be >= 1, got {self.log_every}")
        _require(self.timeout_s >= 0, f"trainer.timeout_s: must be >= 0 (0 = none), got {self.timeout_s}")
        _require(self.checkpoint_every >= 0, f"trainer.checkpoint_every: must be >= 0 (0 = off), got {self.checkpoint_every}")
        _require(self.memory_cap_mb >= 0, f"trainer.memory_cap_mb: must be >= 0 (0 = none), got {self.memory_cap_mb}")
        _require(self.loader_autotune_every >= 1,
                 f"trainer.loader_autotune_every: must be an integer >= 1 (steps), got {self.loader_autotune_every}")
        _require(self.eval_every >= 0, f"trainer.eval_every: must be an integer >= 0 (steps; 0 = at the end only), "
                                       f"got {self.eval_every}")
        if self.val_metric is not None:
            target, args = target_spec("trainer.val_metric", self.val_metric)
            check_target("trainer.val_metric", target, args, positional=("output", "batch"))


def _check_validation(data: DataConfig, trainer: TrainerConfig) -> None:
    """trainer.eval_every and trainer.val_metric need a validation set (trainer.target_loss does
    not: without one it is on the training loss)."""
    need = "needs a validation set: set data.val={_target_: ..., args: {...}} or data.val_fraction (e.g. 0.1)"
    _require(trainer.eval_every == 0 or data.validates, f"trainer.eval_every: {need}")
    _require(trainer.val_metric is None or data.validates, f"trainer.val_metric: {need}")


def _refuse_non_finite(node: Any, where: str) -> None:
    """Every float of the schema (the search space's too) is a finite number: YAML and OmegaConf
    take nan and inf, which no check of a range refuses (inf > 0)."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{where}.{f.name}" if where else f.name
        if isinstance(value, float):
            _require(math.isfinite(value), f"{key}: must be a finite number, got {value}")
        elif dataclasses.is_dataclass(value):
            _refuse_non_finite(value, key)
        elif isinstance(value, dict):
            for name, item in value.items():
                if dataclasses.is_dataclass(item):
                    _refuse_non_finite(item, f"{key}.{name}")


# The defaults a null of MeasureConfig takes: a plain run measures its whole length in windows of 20
# steps, or of a second where those are longer (but at most its planned steps over RUN_WINDOWS:
# runtime/loop.py), unless it sets window_steps or tunes its loader or shares as it goes (those decide on a
# few windows); a study's trial (tune/launch.py, trial_config) stops once its throughput is known to 5%.
RUN_MEASURE = {"warmup_steps": 5, "window_steps": 20, "window_s": 1.0, "rel_precision": 0.0,
               "min_measure_s": 0.0, "max_measure_s": 0.0}
RUN_WINDOWS = 8
TRIAL_MEASURE = {"warmup_steps": 3, "window_steps": 5, "window_s": 0.1, "rel_precision": 0.05,
                 "min_measure_s": 0.3, "max_measure_s": 2.0}


@dataclass
class MeasureConfig:
    """How a job's figures are measured (docs/measurement.md), read by a plain run and by every
    trial of a study alike. A null is the mode's default (RUN_MEASURE, TRIAL_MEASURE): a trial
    measures less, and stops once its throughput is precise enough; `Config` fills them in."""

    warmup_steps: Optional[int] = None  # excluded from every measured figure; null: 5 (a study's trials: 3)
    # a window's steps (a trial's first window: at most this many, the step time not known yet); null: 20 (trials: 5)
    window_steps: Optional[int] = None
    # windows after the first last this long (whole steps), or window_steps where that is longer in a plain run;
    # 0: window_steps each; null: 1 (0 where the run sets window_steps or tunes as it goes: RUN_MEASURE; trials: 0.1)
    window_s: Optional[float] = None
    # stop once throughput's relative standard error over windows <= this (its t interval); 0: off; null: 0 (trials: 0.05)
    rel_precision: Optional[float] = None
    min_measure_s: Optional[float] = None  # with rel_precision: measure at least this long; null: 0 (trials: 0.3)
    max_measure_s: Optional[float] = None  # with rel_precision: stop after this much measured time; 0: no cap; null: 0 (trials: 2)
    trial_steps: int = 20  # a study's trial with rel_precision=0 measures this many steps after its warmup
    profile_steps: int = 0  # torch.profiler over this many steps after warmup (not measured); 0: off
    peak_tflops: float = 0.0  # the device's peak for MFU; 0: the table by GPU name, or measured on CPU
    # the gradient noise scale B_simple, measured while training (runtime/noise.py, docs/measurement.md)
    noise_scale: bool = True
    # steps between the estimated ones, besides the warmup's; 0: automatic, as many as hold the
    # estimated steps' measured extra time to ~1% of the step time (2 to 1000; every 8th, or 50th with
    # `halves`, until it is timed; the same on every rank; runtime/noise.py)
    noise_every: int = 0

    def resolved(self, trial: bool, long_windows: bool = False) -> "MeasureConfig":
        """Every null replaced by the run's default (or a study's trial's, `trial`); a plain run's
        windows are of window_steps steps (window_s 0) where it sets them, or where something in it
        decides on a few windows (not `long_windows`)."""
        defaults = TRIAL_MEASURE if trial else RUN_MEASURE
        if not trial and (self.window_steps is not None or not long_windows):
            defaults = {**defaults, "window_s": 0.0}
        nulls = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **nulls) if nulls else self

    def __post_init__(self) -> None:
        def given(name: str) -> bool:
            return getattr(self, name) is not None

        _require(not given("warmup_steps") or self.warmup_steps >= 0,
                 f"measure.warmup_steps: must be >= 0, got {self.warmup_steps}")
        _require(not given("window_steps") or self.window_steps >= 1,
                 f"measure.window_steps: must be >= 1, got {self.window_steps}")
        _require(not given("window_s") or self.window_s >= 0,
                 f"measure.window_s: must be >= 0 seconds (0 = windows of window_steps), got {self.window_s}")
        _require(not given("rel_precision") or 0 <= self.rel_precision < 1,
                 f"measure.rel_precision: must be in [0, 1) (0 = off), got {self.rel_precision}")
        _require(not given("min_measure_s") or self.min_measure_s >= 0,
                 f"measure.min_measure_s: must be >= 0 seconds, got {self.min_measure_s}")
        _require(not given("max_measure_s") or self.max_measure_s >= 0,
                 f"measure.max_measure_s: must be >= 0 seconds (0 = no cap), got {self.max_measure_s}")
        if given("min_measure_s") and given("max_measure_s"):
            _require(self.max_measure_s == 0 or self.max_measure_s >= self.min_measure_s,
                     f"measure.max_measure_s: must be 0 (no cap) or >= measure.min_measure_s "
                     f"({self.min_measure_s:g}), got {self.max_measure_s:g}")
        _require(self.trial_steps >= 1, f"measure.trial_steps: must be >= 1, got {self.trial_steps}")
        _require(self.profile_steps >= 0, f"measure.profile_steps: must be >= 0 (0 = off), got {self.profile_steps}")
        _require(self.peak_tflops >= 0,
                 f"measure.peak_tflops: must be >= 0 (0 = the table or a CPU measurement), got {self.peak_tflops}")
        _require(self.noise_every >= 0,
                 f"measure.noise_every: must be an integer >= 0 (steps; 0 = automatic), got {self.noise_every}")


class Objective(str, Enum):
    utilization = "utilization"  # max utilization among trials near the best throughput (docs/tuning.md)
    throughput = "throughput"
    mfu = "mfu"  # model FLOPs utilization (runtime/flops.py): useful FLOP/s over the device's peak
    tokens = "tokens"  # real tokens/s, padding excluded: dict batches with an attention_mask (runtime/batch.py)
    goodput = "goodput"  # samples/s x the statistical efficiency of the global batch (tune/goodput.py)
    both = "both"  # multi-objective: the Pareto front is reported


class LrScaling(str, Enum):
    auto = "auto"  # linear for the SGD family, sqrt for the Adam family (trainer.optimizer)
    linear = "linear"  # lr x M/M0
    sqrt = "sqrt"  # lr x sqrt(M/M0)
    adascale = "adascale"  # lr x AdaScale's gain ratio from the measured noise scale (sqrt of it for Adam)
    none = "none"  # the user's rate whatever the global batch


GLOBAL_BATCH_WORDS = ("auto", "user", "free")


class ParamType(str, Enum):
    int = "int"
    pow2 = "pow2"  # powers of two in [low, high]
    float = "float"
    categorical = "categorical"


class PrunerName(str, Enum):
    interval = "interval"  # stop a trial once its throughput interval lies below the floor of the fastest's
    median = "median"
    none = "none"


class SamplerName(str, Enum):
    guided = "guided"  # TPE, plus the neighbour each completed trial's diagnosis points to (interleaved)
    tpe = "tpe"
    gp = "gp"  # Gaussian process (Optuna's GPSampler)
    random = "random"
    grid = "grid"  # every point of a countable space that fits in tune.n_trials


@dataclass
class ParamSpec:
    """One dimension of the search: the config `key` it sets and its range or choices."""

    key: str = MISSING
    type: ParamType = ParamType.int
    low: Optional[float] = None
    high: Optional[float] = None  # data.num_workers only: null = tune.max_workers
    log: bool = False
    choices: Optional[List[Any]] = None


def _param_spec(name: str, spec: Any) -> ParamSpec:
    if isinstance(spec, ParamSpec):
        return spec
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(spec, dict):
        raise ConfigError(f"tune.space.{name}: expected a mapping like {{key: data.batch_size, type: pow2, low: 8, high: 256}}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParamSpec), spec))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        first = str(exc).splitlines()[0]
        allowed = f"; allowed: {_allowed(ParamType)}" if key == "type" else ""
        raise ConfigError(f"tune.space.{name}{'.' + key if key else ''}: {first}{allowed}") from None


@dataclass
class TuneConfig:
    """The Optuna study (mode=tune). Every default is here; conf/tune/default.yaml holds only the
    default space (it composes)."""

    n_trials: int = 20
    study_name: Optional[str] = None  # null: a new study; a name resumes that study
    storage: str = "sqlite:///outputs/optuna.db"  # any Optuna RDB URL (postgresql+psycopg://user@host/db), or journal:///<file>
    workers: int = 1  # > 1: tuner workers sharing the study, a SLURM job array (hydra/launcher=submitit_slurm)
    wait: bool = True  # with workers > 1: follow them to the end; false: submit, say how to follow and collect, return
    # goodput (samples/s x what a sample is worth at its global batch: time to a trained model) | utilization |
    # throughput | mfu | tokens | both (utilization and throughput, a Pareto front)
    objective: Objective = Objective.goodput
    throughput_floor: float = 0.95  # utilization objective: trials below floor x best throughput can't win
    confirm_top: int = 3  # re-measure this many best candidates, interleaved, before picking; 0: off
    run_noise: float = 0.10  # a run's mean is off by this (relative sd) beyond its windows' spread: every interval is widened by it
    # batch x accumulation x world: user (held at the base config's), free (searched), or held at an integer
    # (auto: free with SGD, held with the Adam family: see global_batch_mode)
    global_batch: Any = "auto"
    lr_scaling: LrScaling = LrScaling.auto  # the learning rate of a trial whose global batch differs from the user's
    max_workers: Optional[int] = None  # cap of data.num_workers; null: 2 x CPU cores per rank
    max_failure_rate: float = 0.5  # end the study once more than this share of its trials failed
    pruner: PrunerName = PrunerName.none  # none | interval: a trial whose throughput interval lies below the floor | median
    sampler: SamplerName = SamplerName.guided  # guided: TPE plus the job model's and the diagnosis' proposals | tpe | gp | random | grid
    seed: int = 0
    baseline: bool = True  # trial 0 runs the config as given, for comparison
    reuse_ranks: bool = True  # keep the ranks alive across trials (new ones when backend/world size change)
    trial_plots: bool = False  # timeline/breakdown PNGs for every trial (~0.4 s each); the report files always
    trial_timeout_s: float = 600.0
    extend_edges: bool = True  # a best on the top of a dimension its verdict points past: widen it a step, try it
    allow_large_global_batch: bool = False  # pick a trial that trains one optimizer step per epoch (or fewer)
    patience: int = 10  # end the study after this many trials in a row that beat the best by less than its noise; 0: off
    # auto: a new study starts from the newest earlier study of this job (its fingerprint) in tune.storage;
    # off; or a study's name, or its MLflow run id
    warm_start: str = "auto"
    # name -> ParamSpec fields; free-form so `+tune.space.x={key: ..., ...}` works from the CLI
    # (OmegaConf cannot add a typed dict entry through an override). Typed in __post_init__.
    space: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.space = {name: _param_spec(name, spec) for name, spec in self.space.items()}
        _require(self.n_trials >= 1, f"tune.n_trials: must be >= 1, got {self.n_trials}")
        _require(self.workers >= 1, f"tune.workers: must be an integer >= 1 (1: this process tunes), got {self.workers}")
        _require(0 < self.throughput_floor <= 1, f"tune.throughput_floor: must be in (0, 1], got {self.throughput_floor}")
        _require(0 <= self.run_noise < 1, f"tune.run_noise: must be in [0, 1), got {self.run_noise}")
        _require(self.confirm_top >= 0, f"tune.confirm_top: must be >= 0 (0 = off), got {self.confirm_top}")
        self.global_batch = _global_batch(self.global_batch)
        _require(self.max_workers is None or self.max_workers >= 0,
                 f"tune.max_workers: must be null or >= 0, got {self.max_workers}")
        _require(0 <= self.max_failure_rate <= 1, f"tune.max_failure_rate: must be in [0, 1], got {self.max_failure_rate}")
        _require(self.trial_timeout_s > 0, f"tune.trial_timeout_s: must be > 0, got {self.trial_timeout_s}")
        _require(self.patience >= 0, f"tune.patience: must be >= 0 (0 = off), got {self.patience}")
        _require(isinstance(self.warm_start, str) and self.warm_start.strip() == self.warm_start != "",
                 f"tune.warm_start: allowed: auto, off, a study's name or its MLflow run id, got {self.warm_start!r}")
        misread = misread_password(self.storage)
        _require(misread is None, f"tune.storage: {misread}")
        for name, p in self.space.items():
            where = f"tune.space.{name}"
            if p.type is ParamType.categorical:
                _require(bool(p.choices), f"{where}.choices: a categorical parameter needs a non-empty list")
                continue
            _require(p.choices is None, f"{where}.choices: only for type=categorical; allowed types: {_allowed(ParamType)}")
            _require(p.low is not None, f"{where}.low: required for type={p.type.value}")
            for bound in ("low", "high"):
                value = getattr(p, bound)
                _require(value is None or math.isfinite(value), f"{where}.{bound}: must be a finite number, got {value}")
            if p.high is None:
                _require(p.key == "data.num_workers", f"{where}.high: required (null is only for data.num_workers)")
                continue
            _require(p.low <= p.high, f"{where}: low ({p.low:g}) > high ({p.high:g})")
            if p.type is ParamType.pow2:
                _require(p.low >= 1, f"{where}.low: powers of two start at 1, got {p.low:g}")
            if p.log:
                _require(p.low > 0, f"{where}.low: a log scale needs low > 0, got {p.low:g}")


def _global_batch(value: Any) -> Any:
    """tune.global_batch as `user`, `free` or an int >= 1 (a digit string from the CLI is an int)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    ok = value in GLOBAL_BATCH_WORDS if isinstance(value, str) else (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    _require(ok, f"tune.global_batch: must be auto (free with sgd, user with adamw), user (hold your config's "
                 f"batch x accumulation x world size), free, or an integer >= 1, got {value!r}")
    return value


def global_batch_mode(cfg: "Config") -> Any:
    """tune.global_batch with `auto` resolved: `free` with SGD, whose linear learning-rate rule
    trained the user's model sooner at a larger global batch (bench/bench_target.py), `user` (held)
    with the Adam family, whose square-root rule did not (docs/tuning.md)."""
    value = cfg.tune.global_batch
    if value != "auto":
        return value
    return "free" if cfg.trainer.optimizer is OptimizerName.sgd else "user"


_TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///outputs/mlflow.db"  # or http://host:5000 for an MLflow server
    experiment: str = "orchestrator"
    run_name: Optional[str] = None
    enabled: bool = True

    def __post_init__(self) -> None:
        scheme = self.uri.split(":", 1)[0].split("+", 1)[0] if ":" in self.uri else ""
        _require(
            scheme in _TRACKING_SCHEMES,
            f"tracking.uri: unsupported '{redact(self.uri)}'; allowed schemes: {', '.join(_TRACKING_SCHEMES)} "
            "(MLflow's file store is gone: use sqlite:///outputs/mlflow.db)",
        )
        _require(bool(self.experiment.strip()), "tracking.experiment: must be a non-empty name")
        misread = misread_password(self.uri)
        _require(misread is None, f"tracking.uri: {misread}")


@dataclass
class Config:
    mode: Mode = Mode.run
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    backend: BackendConfig = field(default_factory=BackendConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sim: SimConfig = field(default_factory=SimConfig)  # benchmarks and tests: a simulated slow storage
    tags: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _refuse_non_finite(self, "")
        self.measure = self.measure.resolved(trial=self.mode is Mode.tune, long_windows=not self.trainer.loader_autotune
                                             and self.parallelism.balance is not Balance.speed)
        _require(self.mode is not Mode.tune or self.measure.rel_precision == 0 or self.measure.max_measure_s > 0,
                 f"measure.max_measure_s: must be > 0 with measure.rel_precision > 0 in a study (a trial needs a cap), "
                 f"got {self.measure.max_measure_s:g}")
        _require(
            not self.single_process or self.parallelism.nnodes == 1,
            f"parallelism.nnodes: backend={self.backend.name.value} runs one process on one machine; "
            "use backend=ddp or backend=horovod for several machines",
        )
        _require(
            not (self.parallelism.hosts or self.parallelism.hostfile) or self.backend.name is BackendName.horovod,
            "parallelism.hosts / parallelism.hostfile: apply to backend=horovod only",
        )
        _require(
            self.trainer.tuned == "off" or self.mode is not Mode.tune,
            "trainer.tuned: applies a study's pick to a plain run; a study starts from earlier ones by "
            "tune.warm_start; allowed with mode=tune: off",
        )
        _require(
            not (self.trainer.loader_autotune and self.mode is Mode.tune),
            "trainer.loader_autotune: a study measures fixed loader settings; allowed with mode=tune: false",
        )
        _require(
            not (self.trainer.loader_autotune and self.parallelism.balance is Balance.speed),
            "trainer.loader_autotune: not with parallelism.balance=speed (its batch sampler splits each global "
            "micro-batch by shares; the autotune rebuilds an index-sampled loader); allowed: "
            "trainer.loader_autotune=false, or parallelism.balance=even",
        )
        _check_validation(self.data, self.trainer)
        world, shard = self.world_size, self.parallelism.shard_size
        if self.backend.name is BackendName.fsdp and shard:
            divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
            _require(world % shard == 0, f"parallelism.shard_size: {shard} does not divide the world size {world} "
                                         f"(nproc_per_node x nnodes); allowed: 0 (all ranks), {divisors}")
        _require(
            self.parallelism.balance is Balance.even or not self.single_process,
            f"parallelism.balance: speed splits the batch between ranks, and backend={self.backend.name.value} runs "
            f"one process; use a backend with several ranks (ddp, horovod) or parallelism.balance=even",
        )

    @property
    def single_process(self) -> bool:
        """single and dp run one process (dp spreads over the visible GPUs inside it)."""
        return self.backend.name in (BackendName.single, BackendName.dp)

    @property
    def world_size(self) -> int:
        """Processes the job runs; nproc_per_node does not apply to one-process backends, so a
        sweep like `-m backend=single,ddp parallelism.nproc_per_node=2` compares like with like."""
        return 1 if self.single_process else self.parallelism.world_size


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, node in (
        ("model", ModelConfig),
        ("data", DataConfig),
        ("backend", BackendConfig),
        ("parallelism", ParallelismConfig),
        ("trainer", TrainerConfig),
        ("measure", MeasureConfig),
        ("tune", TuneConfig),
        ("tracking", TrackingConfig),
        ("sim", SimConfig),
    ):
        # conf/<group>/*.yaml start with `- /<group>_schema@_here_`: a root config, not a group, so
        # neither the group's choices nor --help list it
        cs.store(name=f"{group}_schema", node=node)


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema as an OmegaConf node, built once (0.06 s each time on 2 cores; a study validates
    a config per trial and per confirmation run, and several times for each)."""
    return OmegaConf.structured(Config)


def to_config(cfg: DictConfig | dict) -> Config:
    """Validate a composed config and return the typed object. Raises ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        # A plain container merged into a fresh schema: keys added with `+key=` are rejected too.
        plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        node = OmegaConf.merge(_schema(), plain)  # a new node: the cached schema is not changed
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        from .errors import format_error

        raise ConfigError(format_error(exc, Config)) from None
    except ValueError as exc:  # __post_init__ raising ConfigError gets wrapped by OmegaConf
        raise ConfigError(str(exc).splitlines()[0]) from None


def shown(cfg: Config) -> Config:
    """`cfg` as it is written down (config.yaml, MLflow params): the passwords of the store URLs
    (tune.storage, tracking.uri) masked. Nothing reads them back: ranks never connect to a store,
    and a tuner or job takes its URLs from its own command line or environment (docs/distributed.md, "Passwords")."""
    out = copy.copy(cfg)
    out.tune, out.tracking = copy.copy(cfg.tune), copy.copy(cfg.tracking)
    out.tune.storage, out.tracking.uri = redact(cfg.tune.storage), redact(cfg.tracking.uri)
    return out


def plain(obj: Any) -> Any:
    """A typed config (or any part of it) as plain containers, as OmegaConf's own conversion writes
    it (`OmegaConf.to_container(OmegaConf.structured(obj), enum_to_str=True)`: dataclasses as
    dicts in field order, enums by name) at a small part of its cost: OmegaConf's takes about 90 ms
    a config on 2 cores, twice per trial and confirmation run (config.yaml, the MLflow params), on
    the path from one run to the next."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.name
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def to_yaml(cfg: Config) -> str:
    """config.yaml: `plain(cfg)` written by OmegaConf's own YAML dumper, which quotes the strings
    its loader would read as something else (a tag "1e-3" stays a string)."""
    import yaml
    from omegaconf._utils import get_omega_conf_dumper

    return yaml.dump(plain(shown(cfg)), Dumper=get_omega_conf_dumper(), default_flow_style=False, allow_unicode=True,
                     sort_keys=False)


def load_config(path: str) -> Config:
    """What the ranks call: the parent's resolved YAML, validated again (cheap), no Hydra; a
    run's config.yaml written before a key moved reads with the new names (moved.migrate)."""
    from .moved import migrate

    return to_config(migrate(OmegaConf.to_container(OmegaConf.load(path))))


def flatten(cfg: Config) -> Dict[str, Any]:
    """Dotted keys -> scalar values, for MLflow params (passwords masked: `shown`)."""
    out: Dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, list):
            out[prefix] = str(node)
        else:
            out[prefix] = node

    walk("", plain(shown(cfg)))
    return out


__all__: List[str] = [
    "AmpDtype", "Balance", "Launcher", "BackendConfig", "BackendName", "Config", "ConfigError", "DataConfig", "Device",
    "DistBackend", "Loss", "MeasureConfig", "Mode", "ModelConfig", "OptimizerName", "ParallelismConfig", "SimConfig",
    "TrackingConfig", "TrainerConfig", "TuneConfig", "flatten", "load_config", "register_configs",
    "plain", "to_config", "to_yaml",
]
