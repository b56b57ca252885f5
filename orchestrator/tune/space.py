"""The search space: validation before any trial, sampling, and the trial's config.

Every sampled point becomes a full `Config` through the same `to_config` validation as a normal
run, so an invalid combination is never launched.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from ..schema import Config, ConfigError, ParamSpec, ParamType, to_config

ACCUM_KEY = "trainer.accumulation_steps"
BATCH_KEY = "data.batch_size"
WORKERS_KEY = "data.num_workers"
FREE_FORM = ("model.args", "data.args")  # kwargs of the model / dataset targets


def default_max_workers(cfg: Config, cpu_count: Optional[int] = None) -> int:
    """2 x CPU cores per local rank: loaders that wait on storage gain from more workers than cores."""
    cores = cpu_count or os.cpu_count() or 1
    local = 1 if cfg.single_process else cfg.parallelism.nproc_per_node
    return max(2, 2 * cores // local)


def apply(cfg: Config, values: Dict[str, Any]) -> Config:
    """`cfg` with dotted `key: value` pairs set, validated like any run (raises ConfigError)."""
    node = OmegaConf.structured(cfg)
    for key, value in values.items():
        OmegaConf.update(node, key, value, merge=False)
    return to_config(node)


@dataclass
class Dimension:
    name: str
    key: str
    type: ParamType
    low: Optional[float]
    high: Optional[float]
    log: bool
    choices: Optional[List[Any]]

    def sample(self, trial: Any) -> Any:
        if self.type is ParamType.categorical:
            return trial.suggest_categorical(self.name, list(self.choices or []))
        if self.type is ParamType.pow2:
            return trial.suggest_categorical(self.name, list(self.choices or []))
        if self.type is ParamType.float:
            return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)  # type: ignore[arg-type]
        return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The range as a user wrote it: `[0, 4]` for integers, the list for choices."""
        if self.choices is not None:
            return str(list(self.choices))
        return str(self.extremes())

    def extremes(self) -> List[Any]:
        if self.choices is not None:
            return list(self.choices)
        cast = float if self.type is ParamType.float else int
        return [cast(self.low), cast(self.high)]


class SearchSpace:
    """Dimensions of `tune.space` resolved against the base config (caps, global batch)."""

    def __init__(self, cfg: Config, cpu_count: Optional[int] = None) -> None:
        self.base = cfg
        t = cfg.tune
        if not t.space:
            raise ConfigError("tune.space: empty; add at least one parameter (see conf/tune/default.yaml)")
        self.global_batch = t.global_batch
        self.world = cfg.world_size
        dims: List[Dimension] = []
        for name, spec in t.space.items():
            dims.append(self._dimension(name, spec, cfg, cpu_count))
        if self.global_batch:
            dims = [d for d in dims if d.key != ACCUM_KEY]  # derived from the batch
            batch = next((d for d in dims if d.key == BATCH_KEY), None)
            if batch is None or batch.choices is None:
                raise ConfigError("tune.global_batch: needs a data.batch_size parameter of type pow2 or categorical")
            per_rank, rem = divmod(self.global_batch, self.world)
            ok = [b for b in batch.choices if rem == 0 and per_rank % int(b) == 0]
            if not ok:
                raise ConfigError(
                    f"tune.global_batch: {self.global_batch} cannot be reached: with world size {self.world} no "
                    f"batch size in {batch.choices} times an integer accumulation gives it"
                )
            batch.choices = ok
        self.dims = dims
        self._check_keys()

    @staticmethod
    def _dimension(name: str, spec: ParamSpec, cfg: Config, cpu_count: Optional[int]) -> Dimension:
        where = f"tune.space.{name}"
        high = spec.high
        if high is None and spec.key == WORKERS_KEY:
            high = cfg.tune.max_workers if cfg.tune.max_workers is not None else default_max_workers(cfg, cpu_count)
        choices = list(spec.choices) if spec.choices is not None else None
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
                    values.update({"data.prefetch_factor": None, "data.persistent_workers": False})
                try:
                    point = apply(self.base, values)
                except ConfigError as exc:
                    raise ConfigError(f"tune.space.{d.name}: {value!r} is not valid: {exc}") from None
                if point.world_size != self.world:  # e.g. backend.name: ddp vs fsdp, never vs single
                    raise ConfigError(f"tune.space.{d.name}: {value!r} runs {point.world_size} process(es), the base "
                                      f"config {self.world}; a study compares points of one world size (backend.name: "
                                      "ddp, fsdp, horovod for several ranks)")

    def sample(self, trial: Any) -> Dict[str, Any]:
        """Config values for this trial (accumulation derived under global_batch)."""
        values = {d.key: d.sample(trial) for d in self.dims}
        self._complete(values)
        return values

    def _complete(self, values: Dict[str, Any]) -> None:
        if self.global_batch:
            values[ACCUM_KEY] = self.global_batch // (self.world * int(values[BATCH_KEY]))
        if values.get(WORKERS_KEY) == 0:  # these need workers; reset rather than launch an invalid mix
            if "data.prefetch_factor" not in values:
                values["data.prefetch_factor"] = None
            if "data.persistent_workers" not in values:
                values["data.persistent_workers"] = False

    def baseline(self) -> Dict[str, Any]:
        """The base config's own values of the searched keys (trial 0)."""
        node = OmegaConf.structured(self.base)
        values = {d.key: OmegaConf.select(node, d.key) for d in self.dims}
        return {k: (v.value if hasattr(v, "value") else v) for k, v in values.items()}

    def params_of(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """Optuna param names -> values (to enqueue the baseline)."""
        return {d.name: values[d.key] for d in self.dims if d.key in values}
