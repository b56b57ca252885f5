"""Everything that can refuse a job, checked once before anything is launched or written.

`preflight` is what run_job calls first: the SLURM allocation the config runs in, where it starts
(resume.decide), the model, its shard modules, the devices and the launcher, the run dir, and the
MLflow store. Each refusal is one line naming the field (ConfigError, the CLI's exit 2), or
NothingToResume; a refused job prints nothing about resuming and changes nothing but a run dir
it had to make. What the command line refuses before Hydra makes a run dir is __main__'s
(check_command_line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import slurm
from .launch import build_launch
from .resume import Refuse, ResumeFrom, StartFresh, decide
from .runtime.dist import check_devices, check_shard_modules
from .runtime.loop import check_model
from .schema import Config, ConfigError
from .tracking import Tracker


@dataclass(frozen=True)
class Checked:
    """A job that passed every check: where it starts (its config, with trainer.resume resolved
    to the run dir it continues) and the MLflow tracker it records to."""

    start: Union[StartFresh, ResumeFrom]
    tracker: Tracker

    @property
    def cfg(self) -> Config:
        return self.start.cfg

    @property
    def run_dir(self) -> Path:
        return self.start.run_dir

    @property
    def resumed(self) -> Optional[ResumeFrom]:
        return self.start if isinstance(self.start, ResumeFrom) else None


def preflight(cfg: Config, run_dir: Path, tracker: Optional[Tracker] = None) -> Checked:
    """Check the job of `cfg` in `run_dir` (a resume: in the run dir it continues) before launch.
    `tracker`: one the caller checked already (the tuner's); else this job's, checked here. Raises
    ConfigError or NothingToResume."""
    cfg = slurm.resolve(cfg)  # inside a SLURM allocation: its nodes and ranks per node (ConfigError if it cannot)
    start = decide(cfg, run_dir)
    if isinstance(start, Refuse):
        raise start.error()
    check_launch(start.cfg, start.run_dir)
    check_run_dir(start.cfg, start.run_dir)
    if tracker is None:
        tracker = Tracker(start.cfg.tracking, enabled=start.cfg.parallelism.node_rank == 0)  # one MLflow run per job: node 0
        tracker.check()
    return Checked(start, tracker)


def check_launch(cfg: Config, run_dir: Path) -> None:
    """What the launch of `cfg` refuses, checked without starting or writing anything: the model
    (built on the meta device), its shard modules, the devices, the launcher. Raises ConfigError
    (the tuner calls it on its base config before it creates a study)."""
    check_model(cfg)
    check_shard_modules(cfg)
    check_devices(cfg)
    build_launch(cfg, run_dir)


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """The run dir can be made (it is, when it did not exist) and written. Raises ConfigError."""
    key = "trainer.resume" if cfg.trainer.resume else "hydra.run.dir"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot make {run_dir} ({exc.strerror or exc}); allowed: a directory "
                          "this user can create or write") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):  # the job's records go there (a read-only one ends with a traceback)
        raise ConfigError(f"{key}: the run dir {run_dir} is not writable; allowed: a directory this user can write")
