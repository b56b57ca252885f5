"""Where a job starts: the one decision whether it resumes a checkpoint, and which.

`decide(cfg, run_dir)` reads what trainer.resume names (its newest whole checkpoint, its
config.yaml and result.json) and returns StartFresh, ResumeFrom or Refuse, touching nothing. The
rules it applies live here too: which keys a resume may change (MAY_CHANGE) and when a finished
run's new config trains any further. The command line reaches the same run dir before Hydra makes
one (`resolve_resume`, from __main__.resume_in_place).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from . import checkpoint
from .measure.results import JobResult
from .rundir import Status, config_path, note_unreadable, read_json, result_path
from .schema import Config, ConfigError, flatten, load_config

__all__ = ["MAY_CHANGE", "Decision", "NothingToResume", "Refuse", "ResumeFrom", "StartFresh", "changed_keys", "decide",
           "resolve_resume", "trains_further"]


class NothingToResume(Exception):
    """trainer.resume names a run that finished, and the new config trains no further."""


@dataclass(frozen=True)
class StartFresh:
    """No trainer.resume: the job starts at step 0 in `run_dir`."""

    cfg: Config
    run_dir: Path


@dataclass(frozen=True)
class ResumeFrom:
    """The job continues the run in `run_dir` from its checkpoint (`checkpoint`: its metadata:
    step, world size, the MLflow run id); `cfg.trainer.resume` names that run dir."""

    cfg: Config
    run_dir: Path
    checkpoint: Dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.checkpoint["step"])


@dataclass(frozen=True)
class Refuse:
    """The job must not start: `line` says why. `finished`: the run it names finished and the new
    config trains no further (a note, nothing wrong); else the config is wrong for a resume."""

    line: str
    finished: bool = False

    def error(self) -> Exception:
        """What run_job raises: NothingToResume (the CLI exits 0) or ConfigError (exit 2)."""
        return NothingToResume(self.line) if self.finished else ConfigError(self.line)


Decision = Union[StartFresh, ResumeFrom, Refuse]


def decide(cfg: Config, run_dir: Path) -> Decision:
    """Start fresh in `run_dir`, resume the run trainer.resume names (in that run's own dir), or
    refuse: no checkpoint, another world size, a key the checkpoint fixed changed, a finished run
    the new config trains no further. Reads the run; changes nothing."""
    if not cfg.trainer.resume:
        return StartFresh(cfg, run_dir)
    try:
        resumed_dir = resolve_resume(str(cfg.trainer.resume))
    except ValueError as exc:
        return Refuse(str(exc))
    meta = checkpoint.meta_of(checkpoint.find_latest(resumed_dir))  # type: ignore[arg-type]
    try:
        refusal = _world_size_refusal(meta, cfg) or _config_refusal(resumed_dir, meta, cfg)
    except ConfigError as exc:  # the run's config.yaml reads, and says something the schema refuses
        return Refuse(str(exc))
    if refusal is not None:
        return refusal
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=str(resumed_dir)))
    return ResumeFrom(cfg, resumed_dir, meta)


def _world_size_refusal(meta: Dict[str, Any], cfg: Config) -> Optional[Refuse]:
    if meta["world_size"] == cfg.world_size:
        return None
    return Refuse(f"trainer.resume: the checkpoint was written by {meta['world_size']} ranks and this job has "
                  f"{cfg.world_size}; resume with the same world size (parallelism.nproc_per_node / nnodes)")


def _config_refusal(run_dir: Path, meta: Dict[str, Any], cfg: Config) -> Optional[Refuse]:
    """The new config against the run's own config.yaml: a key the checkpoint fixed changed, or the
    run finished and the new config trains no further. None when it may resume (or the run's
    config.yaml is missing or unreadable: then nothing is compared)."""
    saved = saved_config(config_path(run_dir))
    if saved is None:
        return None
    changed = changed_keys(flatten(saved), flatten(cfg))
    if changed:
        listed = ", ".join(f"{k} ({old} -> {new})" for k, old, new in changed)
        return Refuse(f"trainer.resume: a resume continues the same run, but these keys differ from its config.yaml: "
                      f"{listed}; pass the run's own values (docs/long-runs.md lists what may change)")
    # one left empty by a full disk: skipped, with a note; one written before typed results reads alike
    previous = JobResult.from_dict(read_json(result_path(run_dir), {}))
    if previous.status == Status.FINISHED and not trains_further(
            saved.trainer, cfg.trainer, int(previous.steps or 0), previous.steps_per_epoch):
        return Refuse(f"nothing to resume: {run_dir} finished at step {previous.get('steps', meta['step'])} "
                      f"(trainer.max_steps={saved.trainer.max_steps}, trainer.epochs={saved.trainer.epochs}); raise "
                      "trainer.max_steps or trainer.epochs to train further. Its records are unchanged.", finished=True)
    return None


def saved_config(path: Path) -> Optional[Config]:
    """The run's own config.yaml; None when it is missing, or empty or cut short (written before
    records were atomic): then with a one-line note, and the resume goes on without comparing."""
    import yaml

    if not path.exists():
        return None
    try:
        if path.read_text().strip():
            return load_config(str(path))
        raise ValueError("empty")
    except (ValueError, yaml.YAMLError) as exc:
        if isinstance(exc, ConfigError):  # it reads, and says something the schema refuses
            raise
        note_unreadable(path, exc)
        return None


def resolve_resume(value: str, outputs: Path = Path("outputs")) -> Path:
    """`trainer.resume`: a run dir, or `latest` (the newest run dir under outputs/ holding a
    checkpoint). Returns the run dir; raises ValueError naming the field."""
    if value == "latest":
        dirs = [p.parent.parent for p in outputs.glob(f"**/{checkpoint.DIR}/latest")]
        dirs = [d for d in dirs if checkpoint.find_latest(d) is not None]
        if not dirs:
            raise ValueError(f"trainer.resume: no run under {outputs}/ has a checkpoint (set trainer.checkpoint_every)")
        return max(dirs, key=lambda d: (d / checkpoint.DIR / "latest").stat().st_mtime).resolve()
    run_dir = Path(value).expanduser().resolve()
    if not run_dir.is_dir():
        raise ValueError(f"trainer.resume: '{value}' is not a run directory; allowed: a run dir or latest")
    if checkpoint.find_latest(run_dir) is None:
        raise ValueError(f"trainer.resume: {run_dir} holds no complete checkpoint")
    return run_dir


# What a resume may change: how long and how often, where it is recorded, the loader's speed knobs,
# the machines' addresses and how the global batch is split between ranks (the same global batches
# either way, runtime/balance.py). Everything else (model and data targets and args, batch size,
# accumulation, seed, optimizer, backend, world size, ...) was fixed by the checkpoint and must
# match the run's config.yaml. Prefixes of dotted keys.
MAY_CHANGE = (
    "mode", "tags", "tune.", "tracking.",
    "trainer.max_steps", "trainer.epochs", "trainer.checkpoint_every", "trainer.checkpoint_signal", "trainer.timeout_s",
    "trainer.resume",
    "trainer.log_every", "measure.window_steps", "measure.warmup_steps", "measure.profile_steps",
    "trainer.save_model", "trainer.memory_cap_mb", "measure.window_s", "measure.rel_precision",
    "measure.min_measure_s", "measure.max_measure_s", "measure.trial_steps", "measure.peak_tflops", "trainer.loader_autotune",
    "trainer.eval_every", "trainer.val_metric", "trainer.target_loss", "data.val.",
    "data.num_workers", "data.prefetch_factor", "data.persistent_workers", "data.pin_memory",
    "parallelism.node_rank", "parallelism.master_addr", "parallelism.master_port", "parallelism.hosts",
    "parallelism.hostfile", "backend.reshard_after_forward", "parallelism.balance",
    "parallelism.oversubscribe",
)


def changed_keys(saved: Dict[str, Any], new: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(key, saved value, new value) for every flattened key a resume may not change."""
    keys = sorted(set(saved) | set(new))
    return [(k, saved.get(k), new.get(k)) for k in keys
            if not k.startswith(MAY_CHANGE) and str(saved.get(k)) != str(new.get(k))]


def trains_further(saved: Any, new: Any, steps_done: int, steps_per_epoch: Optional[int]) -> bool:
    """Would the new trainer config (max_steps, epochs) train past `steps_done`, where the saved
    one finished? Without the epoch length (older results), any raised limit counts."""
    if steps_per_epoch:
        total = steps_per_epoch * new.epochs
        return (min(total, new.max_steps) if new.max_steps else total) > steps_done
    if new.epochs > saved.epochs:
        return True
    return saved.max_steps != 0 and (new.max_steps == 0 or new.max_steps > saved.max_steps)
