"""A run inside a SLURM allocation uses the allocation (`parallelism.launcher=slurm`, or `auto`
inside a job of more than one node).

`allocation()` reads the job from SLURM's own environment (SLURM_JOB_ID, SLURM_JOB_NODELIST,
SLURM_JOB_CPUS_PER_NODE, SLURM_GPUS_*), `resolve()` turns a config into the one the allocation
runs (nnodes and nproc_per_node from it; one-line ConfigError when it cannot), and the builders
return the `srun` command lines launch.py hands to the supervisor: one torchrun agent per node
(c10d rendezvous on the first node) for ddp/fsdp, one task on the first node for single/dp;
for horovod, horovodrun's hosts from the node list (why: docs/distributed.md). Nothing
here starts a process but `scontrol show hostnames` (the node list, expanded by SLURM itself).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import List, Mapping, Optional

from .schema import Config, ConfigError, Launcher

ALLOWED = "auto, slurm, local"


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: List[str]  # the allocation's node names, the first one first
    cpus_per_node: int  # the fewest CPUs the allocation holds on any of its nodes
    gpus_per_node: int  # 0 where it holds no GPUs
    here: str  # the node this process runs on (SLURMD_NODENAME; '' on a login node under salloc)

    @property
    def first(self) -> str:
        return self.nodes[0]


def _expand(nodelist: str) -> List[str]:
    """SLURM's compressed node list (`n[1-2],gpu07`) as names, by SLURM's own scontrol."""
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    scontrol = shutil.which("scontrol") or "scontrol"
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"parallelism.launcher: cannot expand the SLURM node list '{nodelist}' ({exc}); "
                          f"allowed: {ALLOWED} (local stays on this node)") from None
    if out.returncode != 0 or not out.stdout.split():
        raise ConfigError(f"parallelism.launcher: scontrol show hostnames '{nodelist}' failed: "
                          f"{(out.stderr or out.stdout).strip()[:200]}; allowed: {ALLOWED}")
    return out.stdout.split()


def _per_node(value: str) -> List[int]:
    """SLURM_JOB_CPUS_PER_NODE's `2(x3),1` as [2, 2, 2, 1]."""
    out: List[int] = []
    for item in filter(None, value.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _gpus(environ: Mapping[str, str]) -> int:
    """GPUs per node the job holds: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (`4` or `a100:4`)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "").split(",")[0].rsplit(":", 1)[-1].split("(")[0]
        if value.isdigit():
            return int(value)
    return 0


def allocation(environ: Optional[Mapping[str, str]] = None) -> Optional[Allocation]:
    """The SLURM job this process runs in, or None outside one."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    nodes = _expand(nodelist) if nodelist else []
    cpus = _per_node(environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
    return Allocation(job, nodes, min(cpus) if cpus else (os.cpu_count() or 1), _gpus(environ),
                      environ.get("SLURMD_NODENAME", ""))


def uses_slurm(cfg: Config, alloc: Optional[Allocation]) -> bool:
    """Whether `cfg`'s ranks start on the allocation: launcher=slurm, or auto in a job of > 1 node."""
    launcher = cfg.parallelism.launcher
    if launcher is Launcher.slurm:
        return True
    return launcher is Launcher.auto and alloc is not None and len(alloc.nodes) > 1


def resolve(cfg: Config, environ: Optional[Mapping[str, str]] = None, say=print) -> Config:
    """The config the run has: unchanged off SLURM; on it, launcher=slurm with nnodes (the
    allocation's nodes, or the first parallelism.nnodes of them when that is > 1) and
    nproc_per_node (GPUs per node where the job holds GPUs, else parallelism.nproc_per_node).
    ConfigError, before anything starts, outside an allocation or when it cannot hold the world."""
    p = cfg.parallelism
    if p.launcher is Launcher.local:
        return cfg
    alloc = allocation(environ)
    if not uses_slurm(cfg, alloc):
        return cfg
    if alloc is None or not alloc.nodes:
        raise ConfigError("parallelism.launcher: slurm runs inside a SLURM allocation (sbatch, salloc), and "
                          "SLURM_JOB_ID / SLURM_JOB_NODELIST are not set here; allowed outside one: auto, local")
    if p.nnodes > len(alloc.nodes):
        raise ConfigError(f"parallelism.nnodes: {p.nnodes} nodes asked and SLURM job {alloc.job_id} holds "
                          f"{len(alloc.nodes)} ({','.join(alloc.nodes)}); allowed: 1 (all of them) .. {len(alloc.nodes)}")
    if cfg.single_process:
        nnodes, nproc = 1, p.nproc_per_node
    else:
        nnodes = p.nnodes if p.nnodes > 1 else len(alloc.nodes)
        nproc = alloc.gpus_per_node if alloc.gpus_per_node and cfg.backend.device.value != "cpu" else p.nproc_per_node
        if nproc > alloc.cpus_per_node:
            raise ConfigError(
                f"parallelism.nproc_per_node: {nproc} ranks per node and SLURM job {alloc.job_id} holds "
                f"{alloc.cpus_per_node} CPU(s) per node, so it cannot hold a world of {nproc * nnodes}; allowed: "
                f"1..{alloc.cpus_per_node}, or an allocation with more CPUs per node (sbatch --cpus-per-task, --exclusive)")
    if p.launcher is Launcher.auto:
        say(f"[orchestrator] SLURM job {alloc.job_id} spans {len(alloc.nodes)} nodes: launching on them with srun "
            "(parallelism.launcher=auto; parallelism.launcher=local stays on this node)")
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(p, launcher=Launcher.slurm, nnodes=nnodes,
                                                                    nproc_per_node=nproc))


def secondary_task(environ: Optional[Mapping[str, str]] = None) -> bool:
    """A submitit job of several tasks (hydra.launcher.nodes > 1) runs the Hydra job on each of
    them; all but the first return at once: the first launches the ranks on every node (srun)."""
    environ = os.environ if environ is None else environ
    return environ.get("SUBMITIT_EXECUTOR") == "slurm" and environ.get("SLURM_PROCID", "0") not in ("", "0")


def _port(alloc: Allocation, fixed: int) -> int:
    """The rendezvous port on the first node: parallelism.master_port when set; a free one when
    this process runs there; else one derived from the job id (a login node cannot probe it)."""
    if fixed:
        return fixed
    if alloc.here == alloc.first:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]
    return 29500 + int(re.sub(r"\D", "", alloc.job_id) or 0) % 20000


def srun(alloc: Allocation, nnodes: int, tasks_per_node: int) -> List[str]:
    """srun for one step on the first `nnodes` nodes, `tasks_per_node` tasks each, holding the
    node's CPUs. --overlap: the step shares the CPUs of the step this process runs in (the batch
    script's, or a submitit task's); --kill-on-bad-exit: one failed task ends the step."""
    return [shutil.which("srun") or "srun", f"--nodes={nnodes}", f"--ntasks={nnodes * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(alloc.nodes[:nnodes])}",
            f"--cpus-per-task={max(1, alloc.cpus_per_node // tasks_per_node)}", "--overlap",
            "--kill-on-bad-exit=1", "--export=ALL", "--unbuffered"]


def torchrun_args(cfg: Config, environ: Mapping[str, str]) -> tuple:
    """(srun prefix, torchrun's node options): one agent per node, c10d rendezvous on the first."""
    alloc = allocation(environ)
    assert alloc is not None  # resolve() refused the config outside an allocation
    p = cfg.parallelism
    where = [f"--nnodes={p.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={alloc.first}:{_port(alloc, p.master_port)}",
             f"--rdzv-id={alloc.job_id}-{secrets.token_hex(4)}"]
    return srun(alloc, p.nnodes, 1), where, alloc.cpus_per_node


def horovod_hosts(cfg: Config, environ: Mapping[str, str]) -> str:
    """horovodrun's -H for the allocation: its first nnodes nodes, nproc_per_node slots each."""
    alloc = allocation(environ)
    assert alloc is not None
    p = cfg.parallelism
    return ",".join(f"{node}:{p.nproc_per_node}" for node in alloc.nodes[:p.nnodes])


def single_args(environ: Mapping[str, str]) -> tuple:
    """(srun prefix, CPUs) for one process on the first node (single, dp)."""
    alloc = allocation(environ)
    assert alloc is not None
    return srun(alloc, 1, 1), alloc.cpus_per_node


__all__ = ["Allocation", "allocation", "resolve", "secondary_task", "srun", "torchrun_args", "single_args", "uses_slurm"]
