"""A job's fingerprint: what a study measures of a job that holds for every config the tuner tries.

Three parts, each a short digest of canonical JSON:

- `job`: the model and data targets with their arguments (but an argument named `seed`: the
  same job drawn again), the loss, the optimizer and AMP (what a sample costs and how it trains),
  not the knobs the tuner sets (batch, workers, accumulation, prefetch, pinning), nor the learning
  rate, epochs, seed, validation split or the measurement's settings;
- `layout`: the backend (and its device) and the world size;
- `hardware`: the CPU model and the cores this process may use, the memory, the GPUs' name and count.

`id` digests the three: two runs with the same `id` run the same job the same way on the same kind of
machine (a study's measured job model and picks carry over whole); the same `job` with another
`layout` or `hardware` is a partial match (the per-item costs carry over). Nothing here depends on
the host's name or a path: the same job on two machines of a kind has one `id`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Dict, Optional

from .schema import Config

DIGEST_CHARS = 12
TAG_PREFIX = "fingerprint"  # MLflow tags fingerprint, fingerprint.job, fingerprint.layout, fingerprint.hardware


def digest(value: Any) -> str:
    """A short, stable digest of a JSON-able value (keys sorted, enums by value)."""
    text = json.dumps(value, sort_keys=True, default=lambda v: getattr(v, "value", str(v)), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def _plain(value: Any) -> Any:
    """An OmegaConf container or a dataclass field as plain JSON-able Python."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return value


def _args(args: Any) -> Dict[str, Any]:
    return {k: v for k, v in (_plain(args) or {}).items() if k != "seed"}


def job_part(cfg: Config) -> Dict[str, Any]:
    """What the job is: model, data, loss, optimizer, AMP."""
    m, d, t = cfg.model, cfg.data, cfg.trainer
    return {"model": {"target": m._target_, "args": _args(m.args)},
            "data": {"target": d._target_, "args": _args(d.args)},
            "loss": _plain(m.loss), "optimizer": t.optimizer, "amp": t.amp, "amp_dtype": t.amp_dtype if t.amp else None}


def layout_part(cfg: Config) -> Dict[str, Any]:
    """How it runs: the backend, its device and the world size."""
    return {"backend": cfg.backend.name, "device": cfg.backend.device, "world_size": cfg.world_size}


@lru_cache(maxsize=1)
def hardware_part() -> Dict[str, Any]:
    """This machine's kind: the CPU model, the cores this process may use, the memory (GiB, rounded)
    and the GPUs (name and count; none without CUDA)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    if not cpu:
        import platform

        cpu = platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import psutil

    memory = round(psutil.virtual_memory().total / 2 ** 30)
    return {"cpu": cpu, "cores": cores, "memory_gib": memory, **_gpus()}


def _gpus() -> Dict[str, Any]:
    """The GPUs by NVML where nvidia-ml-py is installed (no CUDA context in this process: the ranks
    get the devices), else by torch."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if count else None
            return {"gpu": name.decode() if isinstance(name, bytes) else name, "gpus": count}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library, no driver: ask torch
        pass
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpus": 0}
    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}


@dataclass(frozen=True)
class Fingerprint:
    job: str
    layout: str
    hardware: str
    id: str

    def tags(self) -> Dict[str, str]:
        """MLflow tags: `fingerprint` (the whole) and one a part."""
        return {TAG_PREFIX: self.id, **{f"{TAG_PREFIX}.{k}": v for k, v in asdict(self).items() if k != "id"}}

    def matches(self, other: "Fingerprint") -> str:
        """`full` (the same id), `job` (the same job, another layout or hardware) or `none`."""
        if self.id == other.id:
            return "full"
        return "job" if self.job == other.job else "none"

    @classmethod
    def from_tags(cls, tags: Dict[str, str]) -> Optional["Fingerprint"]:
        try:
            return cls(job=tags[f"{TAG_PREFIX}.job"], layout=tags[f"{TAG_PREFIX}.layout"],
                       hardware=tags[f"{TAG_PREFIX}.hardware"], id=tags[TAG_PREFIX])
        except KeyError:
            return None


def fingerprint(cfg: Config, hardware: Optional[Dict[str, Any]] = None) -> Fingerprint:
    """The fingerprint of `cfg`'s job on this machine (or on `hardware`, a hardware_part())."""
    parts = {"job": digest(job_part(cfg)), "layout": digest(layout_part(cfg)),
             "hardware": digest(hardware if hardware is not None else hardware_part())}
    return Fingerprint(**parts, id=digest(parts))


def describe(cfg: Config) -> str:
    """One line for the summary: the id and what it stands for."""
    fp, hw, lay = fingerprint(cfg), hardware_part(), layout_part(cfg)
    gpu = f", {hw['gpus']}x {hw['gpu']}" if hw["gpus"] else ""
    return (f"fingerprint {fp.id} (job {fp.job}: {cfg.model._target_} on {cfg.data._target_}; "
            f"{lay['backend'].value} x{lay['world_size']}; {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB{gpu})")
