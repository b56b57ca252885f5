"""The search space: validation before any trial, sampling, and the trial's config.

Every sampled point becomes a full `Config` through the same `to_config` validation as a normal
run, so an invalid combination is never launched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from ..schema import Config, ConfigError, ParamSpec, ParamType, global_batch_mode, to_config

ACCUM_KEY = "trainer.accumulation_steps"
BATCH_KEY = "data.batch_size"
WORKERS_KEY = "data.num_workers"
PREFETCH_KEY = "data.prefetch_factor"
FREE_FORM = ("model.args", "data.args")  # kwargs of the model / dataset targets


def default_max_workers(cfg: Config, cpu_count: Optional[int] = None) -> int:
    """2 x CPU cores per local rank: loaders that wait on storage gain from more workers than cores."""
    cores = cpu_count or os.cpu_count() or 1
    local = 1 if cfg.single_process else cfg.parallelism.nproc_per_node
    return max(2, 2 * cores // local)


def apply(cfg: Config, values: Dict[str, Any]) -> Config:
    """`cfg` with dotted `key: value` pairs set, validated like any run (raises ConfigError; an
    unknown key too). A study applies values once or twice per trial and per confirmation run, on
    the path from one run to the next: when every key is a field of the schema and every value
    already has its field's type, the sections are replaced (`dataclasses.replace`, which runs
    their checks and the whole config's again); otherwise through a plain copy and `to_config`
    (about 30 ms a call on 2 cores; an OmegaConf node of `cfg` cost 0.13 s)."""
    fast = _replaced(cfg, values)
    if fast is not None:
        return fast
    plain = asdict(cfg)
    for key, value in values.items():
        *path, last = key.split(".")
        node = plain
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # a key the schema lacks: to_config names it
            node = node[part]
        node[last] = value
    return to_config(plain)


def _replaced(cfg: Config, values: Dict[str, Any]) -> Optional[Config]:
    """`cfg` with `values` set by dataclasses.replace, or None when a key is not a typed field of
    the schema or a value is not exactly of its field's type (`apply` then converts and checks it
    as any config; an int for a float field is converted here, as there)."""
    changes: Dict[str, Dict[str, Any]] = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        part = getattr(cfg, section, None)
        if "." in name or not dataclasses.is_dataclass(part) or name not in _hints(type(part)):
            return None
        fitted = _fitted(_hints(type(part))[name], value)
        if fitted is _MISFIT:
            return None
        changes.setdefault(section, {})[name] = fitted
    try:
        return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in changes.items()})
    except ConfigError:
        raise
    except ValueError as exc:  # a check's own error, as to_config reports it
        raise ConfigError(str(exc).splitlines()[0]) from None


_MISFIT = object()


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _fitted(hint: Any, value: Any) -> Any:
    """`value` for a field typed `hint`: as it is (None for an Optional), an int as a float for a
    float field, or _MISFIT (a type this does not check: enums by name, containers, unions)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and len(args) == 2 and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint in (int, bool, str) and type(value) is hint:
        return value
    if hint is float and type(value) in (int, float):
        return float(value)
    return _MISFIT


NEEDS_WORKERS = (PREFETCH_KEY, "data.persistent_workers")  # sampled only when num_workers > 0
NEEDS_CUDA = ("data.pin_memory",)  # left out of the space on a machine without a CUDA device


def knob_words(values: Dict[str, Any]) -> str:
    """A trial's knobs as a person reads them: `batch_size=64 num_workers=4 ...`, without those
    that do not apply (None, and the worker-only knobs of a trial without workers)."""
    workers = values.get("data.num_workers")
    return " ".join(f"{k.split('.')[-1]}={v}" for k, v in values.items()
                    if v is not None and not (k in NEEDS_WORKERS and workers == 0))


@dataclass
class Dimension:
    """One searched knob. Ordered values are sampled as ordinals so the sampler sees their order:
    a pow2 range as an integer exponent (Optuna parameter `<name>_log2`), numeric choices as an
    integer rank into the sorted choices (`<name>_rank`), int and float ranges as themselves;
    only non-numeric choices (e.g. booleans) are categorical."""

    name: str
    key: str
    type: ParamType
    low: Optional[float]
    high: Optional[float]
    log: bool
    choices: Optional[List[Any]]

    @property
    def ordinal(self) -> bool:
        """Choices sampled by rank: pow2, and categorical choices that are all numbers."""
        return self.choices is not None and (self.type is ParamType.pow2 or all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in self.choices))

    @property
    def param(self) -> str:
        """The Optuna parameter's name (ordinals carry a suffix: a study made before they were
        sampled as ordinals resumes without a clash of distributions)."""
        if self.type is ParamType.pow2:
            return f"{self.name}_log2"
        return f"{self.name}_rank" if self.ordinal else self.name

    def sample(self, trial: Any) -> Any:
        if self.type is ParamType.pow2:
            lo, hi = (int(math.log2(c)) for c in self.extremes())
            return 2 ** trial.suggest_int(self.param, lo, hi)
        if self.ordinal:
            return self.choices[trial.suggest_int(self.param, 0, len(self.choices) - 1)]  # type: ignore[index]
        if self.choices is not None:
            return trial.suggest_categorical(self.param, list(self.choices))
        if self.type is ParamType.float:
            return trial.suggest_float(self.param, float(self.low), float(self.high), log=self.log)  # type: ignore[arg-type]
        return trial.suggest_int(self.param, int(self.low), int(self.high), log=self.log)  # type: ignore[arg-type]

    def to_param(self, value: Any) -> Any:
        """A config value as this dimension's Optuna parameter value (to enqueue a point)."""
        if self.type is ParamType.pow2:
            return int(math.log2(value))
        return self.choices.index(value) if self.ordinal else value  # type: ignore[union-attr]

    def values(self) -> List[Any]:
        """Every value of a countable dimension; raises for a float range (tune.sampler=grid)."""
        if self.choices is not None:
            return list(self.choices)
        if self.type is ParamType.float:
            raise ConfigError(f"tune.sampler: grid needs countable dimensions; tune.space.{self.name} is a float "
                              "range (give it choices, or use tpe, gp, random or guided)")
        return list(range(int(self.low), int(self.high) + 1))  # type: ignore[arg-type]

    def contains(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        return self.low <= value <= self.high  # type: ignore[operator]

    def describe(self) -> str:
        """The range as a user wrote it: `[0, 4]` for integers, the list for choices."""
        if self.choices is not None:
            return str(list(self.choices))
        return str(self.extremes())

    def extremes(self) -> List[Any]:
        if self.choices is not None:
            return [min(self.choices), max(self.choices)] if self.ordinal else list(self.choices)
        cast = float if self.type is ParamType.float else int
        return [cast(self.low), cast(self.high)]


class SearchSpace:
    """Dimensions of `tune.space` resolved against the base config (caps, global batch)."""

    def __init__(self, cfg: Config, cpu_count: Optional[int] = None) -> None:
        self.base = cfg
        t = cfg.tune
        self.world = cfg.world_size
        # the global batch held (None: free): tune.global_batch=user holds the base config's
        mode = global_batch_mode(cfg)
        held = cfg.data.batch_size * cfg.trainer.accumulation_steps * self.world if mode == "user" else mode
        self.global_batch: Optional[int] = None if held == "free" else held
        dims: List[Dimension] = []
        self.left_out: Dict[str, str] = {}  # dimension -> why it is not searched here
        for name, spec in t.space.items():
            if spec.key in NEEDS_CUDA and not self._on_cuda(cfg):
                self.left_out[name] = "no CUDA device (it only matters for host-to-GPU copies)"
                continue
            dims.append(self._dimension(name, spec, cfg, cpu_count))
        workers = next((d for d in dims if d.key == WORKERS_KEY), None)
        if (max(workers.extremes()) if workers else cfg.data.num_workers) == 0:
            for d in [d for d in dims if d.key in NEEDS_WORKERS]:
                dims.remove(d)
                self.left_out[d.name] = "data.num_workers is 0 in every trial"
        if not dims:
            raise ConfigError("tune.space: empty; add at least one parameter (see conf/tune/default.yaml)"
                              + "".join(f"; {n} is left out: {why}" for n, why in self.left_out.items()))
        self._base_workers = cfg.data.num_workers
        if self.global_batch:
            dims = self._hold(dims, cfg)
        self.dims = dims
        self.keys = {d.key for d in dims}
        self._check_keys()

    def _hold(self, dims: List[Dimension], cfg: Config) -> List[Dimension]:
        """The dimensions with the global batch held at self.global_batch: accumulation derived
        from the batch, whose choices are those that reach it. Holding the user's own
        (tune.global_batch=user) never refuses a study: the user's batch is always a choice, an
        int range of batches becomes its divisors, and without a batch dimension the global batch
        does not move."""
        user = global_batch_mode(cfg) == "user"
        why = (f"yours: tune.global_batch=auto holds it with {cfg.trainer.optimizer.value}, whose learning-rate rule "
               "did not train sooner at a larger batch; " if cfg.tune.global_batch == "auto" else "yours; ")
        accum = next((d for d in dims if d.key == ACCUM_KEY), None)
        dims = [d for d in dims if d.key != ACCUM_KEY]  # derived from the batch
        if accum is not None:
            self.left_out[accum.name] = (f"derived from the batch: the global batch is held at {self.global_batch}"
                                         + (f" ({why}free it with tune.global_batch=free)" if user else ""))
        batch = next((d for d in dims if d.key == BATCH_KEY), None)
        per_rank, rem = divmod(self.global_batch, self.world)  # type: ignore[arg-type]
        if user and batch is None:
            self.global_batch = None
        elif user and batch.choices is None:  # an int range: the batches in it that reach the user's
            lo, hi = int(batch.low), int(batch.high)  # type: ignore[arg-type]
            batch.choices = [b for b in range(lo, hi + 1) if b < 1 or per_rank % b == 0]  # b < 1: _check_keys names it
            batch.type = ParamType.categorical
        if batch is None or batch.choices is None:
            if user:
                if not dims:
                    raise ConfigError("tune.space: only accumulation_steps, which holding your global batch fixes; "
                                      "free it with tune.global_batch=free")
                return dims
            raise ConfigError("tune.global_batch: needs a data.batch_size parameter of type pow2 or categorical")
        ok = [b for b in batch.choices if rem == 0 and per_rank % int(b) == 0]
        if user and cfg.data.batch_size not in ok:  # the user's own batch always reaches it
            ok, batch.type = sorted([*ok, cfg.data.batch_size]), ParamType.categorical
        if not ok:
            raise ConfigError(
                f"tune.global_batch: {self.global_batch} cannot be reached: with world size {self.world} no "
                f"batch size in {batch.choices} times an integer accumulation gives it"
            )
        batch.choices = ok
        return dims

    @staticmethod
    def _on_cuda(cfg: Config) -> bool:
        import torch

        return cfg.backend.device.value != "cpu" and torch.cuda.is_available()

    @staticmethod
    def _dimension(name: str, spec: ParamSpec, cfg: Config, cpu_count: Optional[int]) -> Dimension:
        where = f"tune.space.{name}"
        high = spec.high
        if high is None and spec.key == WORKERS_KEY:
            high = cfg.tune.max_workers if cfg.tune.max_workers is not None else default_max_workers(cfg, cpu_count)
        choices = list(spec.choices) if spec.choices is not None else None
        if choices is not None and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices):
            choices = sorted(set(choices))  # ranked in order (Dimension.ordinal)
        if spec.type is ParamType.pow2:
            lo, hi = int(spec.low), int(high)  # type: ignore[arg-type]
            choices = [2**k for k in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]
            if not choices:
                raise ConfigError(f"{where}: no power of two in [{lo}, {hi}]")
        if spec.type in (ParamType.int, ParamType.pow2) and spec.low is not None and spec.low != int(spec.low):
            raise ConfigError(f"{where}.low: type={spec.type.value} needs an integer, got {spec.low:g}")
        return Dimension(name, spec.key, spec.type, spec.low, high, spec.log, choices)

    def _check_keys(self) -> None:
        """Every key exists and both ends of every range make a valid config: errors name the field."""
        node = OmegaConf.structured(self.base)
        for d in self.dims:
            free_form = d.key.rsplit(".", 1)[0] in FREE_FORM  # checked against the target's signature instead
            if not free_form and OmegaConf.select(node, d.key, default="__missing__") == "__missing__":
                raise ConfigError(f"tune.space.{d.name}.key: '{d.key}' is not a config key")
            for value in d.extremes():
                values = {d.key: value}
                if d.key == WORKERS_KEY and value == 0:  # options that need workers are tuned with them
                    values.update({PREFETCH_KEY: None, "data.persistent_workers": False})
                if d.key in NEEDS_WORKERS:  # ... and checked with some
                    values[WORKERS_KEY] = max(1, self.base.data.num_workers)
                try:
                    point = apply(self.base, values)
                except ConfigError as exc:
                    raise ConfigError(f"tune.space.{d.name}: {value!r} is not valid: {exc}") from None
                if point.world_size != self.world:  # e.g. backend.name: ddp vs fsdp, never vs single
                    raise ConfigError(f"tune.space.{d.name}: {value!r} runs {point.world_size} process(es), the base "
                                      f"config {self.world}; a study compares points of one world size (backend.name: "
                                      "ddp, fsdp, horovod for several ranks)")

    def sample(self, trial: Any) -> Dict[str, Any]:
        """Config values for this trial (accumulation derived under global_batch); knobs that need
        loader workers are sampled only when the trial has some."""
        values: Dict[str, Any] = {}
        for d in sorted(self.dims, key=lambda d: d.key in NEEDS_WORKERS):  # num_workers first
            if d.key in NEEDS_WORKERS and values.get(WORKERS_KEY, self._base_workers) == 0:
                continue
            values[d.key] = d.sample(trial)
        self._complete(values)
        return values

    def contains(self, key: str, value: Any) -> bool:
        d = next((d for d in self.dims if d.key == key), None)
        return d is not None and d.contains(value)

    def snap(self, key: str, current: Any, target: Any) -> Any:
        """The value of the space nearest to `target` on the way from `current` (a move the
        diagnosis proposes, e.g. 3 workers where the choices are 0, 1, 2, 4, becomes 4: the nearer,
        the bolder on a tie, never back past `current`); None when the space has nothing that way."""
        d = next((d for d in self.dims if d.key == key), None)
        if d is None or current is None or target == current:
            return None
        if d.contains(target):
            return target
        up = target > current
        if d.choices is None and d.type is ParamType.float:
            edge = d.high if up else d.low
            return edge if (edge > current if up else edge < current) else None  # type: ignore[operator]
        ahead = [v for v in (d.choices if d.choices is not None else d.extremes())
                 if (v > current if up else v < current)]
        if d.choices is None and ahead:  # an int range: the nearest end of it
            return max(ahead) if up else min(ahead)
        return min(ahead, key=lambda v: (abs(v - target), -v if up else v)) if ahead else None  # ties: the bolder

    def grid(self) -> Dict[str, List[Any]]:
        """tune.sampler=grid: Optuna parameter -> every value."""
        return {d.param: [d.to_param(v) for v in d.values()] for d in self.dims}

    def grid_size(self) -> int:
        """Distinct configs of the grid: the knobs that need workers multiply only the points with some."""
        grid = {d.key: len(d.values()) for d in self.dims}
        free = math.prod(n for k, n in grid.items() if k not in NEEDS_WORKERS and k != WORKERS_KEY)
        queue = math.prod(n for k, n in grid.items() if k in NEEDS_WORKERS)
        workers = next((d.values() for d in self.dims if d.key == WORKERS_KEY), [self._base_workers])
        return free * sum(1 if w == 0 else queue for w in workers)

    def _complete(self, values: Dict[str, Any]) -> None:
        if self.global_batch:
            values[ACCUM_KEY] = self.global_batch // (self.world * int(values[BATCH_KEY]))
        if values.get(WORKERS_KEY) == 0:  # these need workers; reset rather than launch an invalid mix
            if PREFETCH_KEY not in values:
                values[PREFETCH_KEY] = None
            if "data.persistent_workers" not in values:
                values["data.persistent_workers"] = False

    def baseline(self) -> Dict[str, Any]:
        """The base config's own values of the searched keys (trial 0)."""
        node = OmegaConf.structured(self.base)
        values = {d.key: OmegaConf.select(node, d.key) for d in self.dims}
        if values.get(PREFETCH_KEY, 0) is None and self.base.data.num_workers > 0:
            values[PREFETCH_KEY] = 2  # torch's default, which null means
        return {k: (v.value if hasattr(v, "value") else v) for k, v in values.items()}

    def params_of(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """Config values -> Optuna parameters (to enqueue a point): the dimensions that hold
        the value, the rest left to the sampler."""
        return {d.param: d.to_param(values[d.key]) for d in self.dims
                if values.get(d.key) is not None and d.contains(values[d.key])}
