"""How the ranks of a job are started: a pure function per backend returning `Launch(cmd, env)`.

Argv lists, never shell strings. Nothing here spawns a process, so every command is unit-tested
as built. The ranks run `python -m orchestrator.rank RUN_DIR` and read `RUN_DIR/config.yaml`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from . import slurm
from .schema import BackendName, Config, ConfigError, Launcher

RANK_MODULE = "orchestrator.rank"


@dataclass(frozen=True)
class Launch:
    cmd: List[str]
    env: Dict[str, str] = field(default_factory=dict)  # added to the parent's environment
    world_size: int = 1
    local_ranks: int = 1
    # what the kernel sends the launcher when the orchestrator process dies (supervise._die_with_parent)
    death_signal: int = signal.SIGTERM


def _threads_per_rank(local_ranks: int, cpu_count: Optional[int]) -> str:
    return str(max(1, (cpu_count or 1) // local_ranks))


def _base_env(local_ranks: int, environ: Mapping[str, str], cpu_count: Optional[int]) -> Dict[str, str]:
    """Unbuffered output, and the cores shared by the node's ranks (unless the user set threads)."""
    env = {"PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in environ:  # ranks on one node share its cores
        env["OMP_NUM_THREADS"] = _threads_per_rank(local_ranks, cpu_count)
    return env


def _single(cfg: Config, target: List[str], environ: Mapping[str, str], cpu_count: Optional[int]) -> Launch:
    program = [sys.executable, "-m", RANK_MODULE]
    if cfg.parallelism.launcher is Launcher.slurm:  # one task on the allocation's first node
        prefix, _ = slurm.single_args(environ)
        program = [*prefix, *slurm.task_program(cfg, RANK_MODULE)]
    return Launch([*program, *target], {"PYTHONUNBUFFERED": "1"})


def _torchrun(cfg: Config, target: List[str], environ: Mapping[str, str], cpu_count: Optional[int]) -> Launch:
    p = cfg.parallelism
    agent = [sys.executable, "-m", "torch.distributed.run"]
    if p.launcher is Launcher.slurm:  # one agent per node of the allocation (srun), c10d rendezvous on the first
        prefix, where, cpu_count = slurm.torchrun_args(cfg, environ)
        agent = [*prefix, *slurm.task_program(cfg, "torch.distributed.run")]
    elif p.nnodes == 1 and not p.master_port:
        where = ["--standalone"]  # one node: torchrun picks a free port on localhost itself
    else:
        where = [f"--nnodes={p.nnodes}", f"--node-rank={p.node_rank}", f"--master-addr={p.master_addr}",
                 f"--master-port={p.master_port}"]
    cmd = [
        *agent,
        f"--nproc-per-node={p.nproc_per_node}", *where,
        "--max-restarts=0",
        # torchrun's per-rank log folders (empty: ranks print to this console, tracebacks go to the run
        # dir) would otherwise be a new torchelastic_* folder in the system temp dir at every launch
        f"--log-dir={os.devnull}",
        "--module", RANK_MODULE, *target,
    ]
    # SIGTERM leaves torchrun to end its ranks, and about one agent in five never exited: its ranks
    # gone (zombies), its main thread waiting on a lock forever. Its ranks are on this node and end
    # by themselves when the orchestrator is gone (rank.watch_owner), so a plain agent is killed;
    # srun gets SIGTERM, which it forwards to the step's tasks on every node.
    death = signal.SIGTERM if p.launcher is Launcher.slurm else signal.SIGKILL
    return Launch(cmd, _base_env(p.nproc_per_node, environ, cpu_count), p.world_size, p.nproc_per_node, death)


def horovodrun_path() -> str:
    """horovodrun next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).with_name("horovodrun")
    if here.exists():
        return str(here)
    found = shutil.which("horovodrun")
    if not found:
        raise ConfigError(
            "backend=horovod: horovodrun not found; install Horovod with scripts/install_horovod.sh "
            "(or re-run scripts/setup.sh), or pick backend=ddp"
        )
    return found


def _horovodrun(cfg: Config, target: List[str], environ: Mapping[str, str], cpu_count: Optional[int],
                horovodrun: Optional[str] = None) -> Launch:
    p = cfg.parallelism
    world = p.world_size
    if p.hostfile and not Path(p.hostfile).is_file():  # before horovodrun: it would end in a traceback
        what = "is a directory" if Path(p.hostfile).is_dir() else "does not exist"
        raise ConfigError(f"parallelism.hostfile: {p.hostfile} {what}; allowed: a file of 'host slots=N' lines, "
                          "or parallelism.hosts='host:slots,...'")
    cmd = [horovodrun or horovodrun_path(), "-np", str(world)]
    if cfg.backend.gloo:
        cmd.append("--gloo")
    if p.launcher is Launcher.slurm:  # the allocation's nodes, nproc_per_node slots each (docs/distributed.md)
        cmd += ["-H", slurm.horovod_hosts(cfg, environ)]
        local = p.nproc_per_node
    elif p.hostfile:
        cmd += ["-hostfile", p.hostfile]
        local = p.nproc_per_node
    elif p.hosts:
        cmd += ["-H", p.hosts]
        local = max(int(h.split(":")[1]) for h in p.hosts.split(","))
    else:
        cmd += ["-H", f"localhost:{world}"]
        local = world
    cmd += [sys.executable, "-m", RANK_MODULE, *target]
    return Launch(cmd, _base_env(local, environ, cpu_count), world, local)


BUILDERS: Dict[BackendName, Callable[..., Launch]] = {
    BackendName.single: _single,
    BackendName.dp: _single,
    BackendName.ddp: _torchrun,
    BackendName.fsdp: _torchrun,
    BackendName.horovod: _horovodrun,
}


def build_launch(cfg: Config, run_dir: Path, environ: Optional[Mapping[str, str]] = None,
                 cpu_count: Optional[int] = None, pool_dir: Optional[Path] = None, **kwargs: str) -> Launch:
    """The command and extra environment that start this node's ranks for `cfg`: they run the
    job in `run_dir`, or with `pool_dir`, wait there for one job after another (tune.reuse_ranks)."""
    environ = os.environ if environ is None else environ
    cpu_count = cpu_count if cpu_count is not None else os.cpu_count()
    target = ["--pool", str(pool_dir)] if pool_dir is not None else [str(run_dir)]
    launch = BUILDERS[cfg.backend.name](cfg, target, environ, cpu_count, **kwargs)
    _check_cores(cfg, launch.local_ranks, cpu_count)
    return launch


RANKS_PER_CORE = 4  # more ranks than this per CPU core of this machine: refused unless parallelism.oversubscribe


def _check_cores(cfg: Config, local_ranks: int, cpu_count: Optional[int]) -> None:
    """Ranks started on this machine far beyond its cores (64 on 2) only thrash: one ConfigError
    line, unless parallelism.oversubscribe=true says it is meant. Ranks SLURM or a host list place
    elsewhere are theirs to count."""
    p = cfg.parallelism
    if p.oversubscribe or p.launcher is Launcher.slurm or p.hosts or p.hostfile or not cpu_count:
        return
    if local_ranks > RANKS_PER_CORE * cpu_count:
        raise ConfigError(f"parallelism.nproc_per_node: {local_ranks} ranks on this machine's {cpu_count} CPU core(s) "
                          f"(more than {RANKS_PER_CORE} a core); allowed: at most {RANKS_PER_CORE * cpu_count} here, or "
                          f"parallelism.oversubscribe=true to start them anyway")
