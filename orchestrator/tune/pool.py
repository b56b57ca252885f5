"""Ranks kept alive across the trials of a study (`tune.reuse_ranks`).

Launching torchrun or horovodrun costs seconds per trial; a pool starts the ranks once per
(backend, world size, ...) and hands them one trial after another through job files
(`<pool dir>/jobs/<seq>.json`, renamed into place). The ranks rebuild the data loader, model and
optimizer for each trial's knobs (orchestrator.rank.pool_main). A failed, timed-out or pruned
trial ends the pool's processes and the next trial starts fresh ranks, except a trial that ran out
of memory on a pool of one rank: that rank says it survived (`rankN.survived`, see
orchestrator.rank.survivable) and takes the next trial. `close()` (study end, failure or
interrupt) ends them all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..launch import build_launch
from ..rundir import (pool_job_path, pool_owner_path, pool_stop_path, process_tag, ranks_dir, write_atomic,
                      write_json)
from ..schema import Config
from ..supervise import Launched, Outcome, watch


def pool_key(cfg: Config) -> tuple:
    """What needs new processes when it changes."""
    b, p = cfg.backend, cfg.parallelism
    return (b.name, b.device, b.dist_backend, b.gloo, cfg.world_size, p.nproc_per_node, p.nnodes, p.hosts,
            p.hostfile, p.master_addr)


class RankPool:
    def __init__(self, base_dir: Path) -> None:
        self.base = Path(base_dir)
        self.launched: Optional[Launched] = None
        self.key: Optional[tuple] = None
        self.dir: Optional[Path] = None
        self.seq = 0
        self.starts = 0

    def _start(self, cfg: Config) -> None:
        self.close()
        self.starts += 1
        self.dir = self.base / f"pool{self.starts:03d}"
        (self.dir / "jobs").mkdir(parents=True, exist_ok=True)
        write_atomic(pool_owner_path(self.dir), process_tag())  # the ranks end if this process dies
        launch = build_launch(cfg, self.dir, pool_dir=self.dir)
        self.launched = Launched(launch, echo=False, log=self.dir / "output.log")
        self.key, self.seq = pool_key(cfg), 0

    def prestart(self, cfg: Config) -> None:
        """Start the ranks for jobs like `cfg` now, so that they import torch and the training
        loop while the study prepares its first trial; the first `run` uses them."""
        if not self.alive() or self.key != pool_key(cfg):
            self._start(cfg)

    def alive(self) -> bool:
        return self.launched is not None and self.launched.proc.poll() is None

    def run(self, cfg: Config, run_dir: Path, **watch_kwargs: Any) -> Outcome:
        """Run the job in `run_dir` (its config.yaml and job.json written) on the pool's ranks."""
        self.prestart(cfg)
        assert self.launched is not None and self.dir is not None
        write_json(pool_job_path(self.dir, self.seq), {"run_dir": str(run_dir)})
        self.seq += 1
        world = self.launched.world_size
        ranks = ranks_dir(run_dir)

        def all_wrote(*suffixes: str) -> bool:
            """Every rank wrote a `rankN<suffix>` file for one of `suffixes` (a result, or that it
            survived its failure): one listing of the folder, as `done` runs every 20 ms."""
            names = [n for n in os.listdir(ranks) if n.startswith("rank")] if ranks.is_dir() else []
            return any(sum(n.endswith(s) for n in names) >= world for s in suffixes)

        outcome = watch(self.launched, run_dir, poll_s=0.02, **watch_kwargs,
                        done=lambda: all_wrote(".json", ".survived"))
        if not outcome.ok and not (self.alive() and all_wrote(".survived")):
            self.close()  # fresh ranks for the next trial
        return outcome

    def release(self) -> None:
        """Ask the ranks to end (the stop file) without waiting: they exit while the study writes
        its report, and `close` then finds them gone (about 1 s of a study's wall time)."""
        if self.launched is not None and self.dir is not None and self.alive():
            pool_stop_path(self.dir).touch()

    def close(self) -> None:
        """End the pool's processes: ask politely (stop file), then kill what is left."""
        if self.launched is None:
            return
        if self.dir is not None and self.alive():
            self.release()
            try:
                self.launched.proc.wait(timeout=10)
            except Exception:
                pass
        self.launched.kill(grace_s=2.0)
        self.launched = None
        self.key = None
