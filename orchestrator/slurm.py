"""A run inside a SLURM allocation uses the allocation (`parallelism.launcher=slurm`, or `auto`
inside a job of more than one node).

`allocation()` reads the job from SLURM's own environment (SLURM_JOB_ID, SLURM_JOB_NODELIST,
SLURM_JOB_CPUS_PER_NODE, SLURM_GPUS_*), `resolve()` turns a config into the one the allocation
runs (nnodes and nproc_per_node from it; one-line ConfigError when it cannot), and the builders
return the `srun` command lines launch.py hands to the supervisor: one torchrun agent per node
(c10d rendezvous on the first node) for ddp/fsdp, one task on the first node for single/dp;
for horovod, horovodrun's hosts from the node list (why: docs/distributed.md). A job stopped at
a checkpoint by trainer.checkpoint_signal (its time limit near) is requeued (`requeue_target`,
`requeue`) and, run again, resumes its own run dir (`note_run_dir`, `restarted_run_dir`). Nothing
here starts a process but `scontrol` (the node list expanded by SLURM itself, the job's requeue).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
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


# the srun task's program ignores trainer.checkpoint_signal, then runs `-m <module> args...` (the ignoring
# outlives exec: the torchrun agent's ranks inherit it until they catch the signal themselves, rank.py)
_IGNORING = ("import runpy, signal, sys; signal.signal(int(sys.argv[1]), signal.SIG_IGN); sys.argv = sys.argv[2:]; "
             "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def task_program(cfg: Config, module: str) -> List[str]:
    """`python -m <module>` as an srun task. SLURM signals every process of a job step (sbatch
    --signal=USR1@<s>, scancel --signal): the torchrun agent would die of trainer.checkpoint_signal
    (USR1's default action), so the task ignores it; the ranks catch it and checkpoint."""
    signum = cfg.trainer.checkpoint_signal.signum
    if signum is None:
        return [sys.executable, "-m", module]
    return [sys.executable, "-c", _IGNORING, str(signum), module]


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


# -- a job checkpointed at its warning signal, requeued, and resumed where it stopped ----------------
def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("scontrol") or "scontrol", *args], capture_output=True, text=True, timeout=60)


def job_field(show_job: str, key: str) -> str:
    """One field of `scontrol show job -o` ('' when it is not there)."""
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", show_job)
    return m.group(1) if m else ""


def requeue_target(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The SLURM batch job this process runs in, when SLURM can requeue it (sbatch --requeue, or
    the cluster's JobRequeue=1): its id; None outside a job, in an interactive one (salloc) or
    one submitted with --no-requeue."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    try:
        shown = _scontrol("show", "job", "-o", job)
    except (OSError, subprocess.TimeoutExpired):
        return None
    ok = shown.returncode == 0 and job_field(shown.stdout, "Requeue") == "1" and job_field(shown.stdout, "BatchFlag") == "1"
    return job if ok else None


def requeue(job: str) -> str:
    """`scontrol requeue <job>`: '' when SLURM took it (it then ends this job's processes and
    runs the batch script again, SLURM_RESTART_COUNT one higher), else what scontrol said."""
    try:
        done = _scontrol("requeue", job)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else (done.stderr or done.stdout).strip()[:300]


POINTERS = os.path.join("outputs", "slurm")  # relative to the job's working directory, as outputs/runs


def pointer_path(job: str) -> str:
    return os.path.join(POINTERS, f"{job}.json")


def note_run_dir(run_dir: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """In a SLURM job whose run dir Hydra named by the time (a new one at every start): write
    outputs/slurm/<job id>.json naming it, so the requeued job finds it (restarted_run_dir)."""
    from .rundir import RecordError, write_json

    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return
    try:
        os.makedirs(POINTERS, exist_ok=True)
        write_json(pointer_path(job), {"slurm_job_id": job, "run_dir": str(run_dir)})
    except (OSError, RecordError) as exc:
        print(f"[orchestrator] note: cannot write {pointer_path(job)} ({exc}): if SLURM requeues job {job}, "
              f"resume it by hand (trainer.resume={run_dir})")


def restarted_run_dir(explicit: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A requeued SLURM job (SLURM_RESTART_COUNT >= 1) runs its batch script again: the run dir its
    earlier start used (`explicit`: the hydra.run.dir of its command line; else the one
    outputs/slurm/<job id>.json names), when that run was this job's (its job.json) and holds a
    checkpoint to resume from; else None (then it starts afresh)."""
    from .checkpoint import find_latest
    from .rundir import read_job, read_json

    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job or not (environ.get("SLURM_RESTART_COUNT") or "0").isdigit() or int(environ.get("SLURM_RESTART_COUNT") or 0) < 1:
        return None
    run_dir = explicit or (read_json(pointer_path(job), {}) or {}).get("run_dir")
    if not run_dir or not os.path.isdir(run_dir):
        return None
    try:
        ours = str(read_job(run_dir).get("slurm_job_id")) == job
    except (OSError, ValueError):
        return None
    return os.path.abspath(run_dir) if ours and find_latest(Path(run_dir)) is not None else None


__all__ = ["Allocation", "allocation", "resolve", "secondary_task", "srun", "torchrun_args", "single_args", "uses_slurm",
           "task_program", "requeue_target", "requeue", "note_run_dir", "restarted_run_dir"]
