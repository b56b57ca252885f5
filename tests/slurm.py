"""A throwaway 2-node SLURM cluster on this machine for tests and benchmarks: Debian's `slurm-wlm`
and `munge` (which `make setup` installs), `slurmctld` plus `slurmd -N n1` and `slurmd -N n2`,
both nodes on 127.0.0.1 sharing this machine's cores, every file in a temporary directory. It
needs root (two slurmd on one host, munged as the munge user); `skip_reason()` says why not.
Clients find it through SLURM_CONF, which `SlurmCluster.env` holds and `start()` exports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

NODES = ("n1", "n2")
TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "sinfo", "munged")


def _which(tool: str) -> Optional[str]:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.path.exists(p)), None)


def skip_reason() -> Optional[str]:
    """Why this machine cannot run the test cluster, or None."""
    missing = [t for t in TOOLS if _which(t) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm munge; make setup does it)"
    if os.geteuid() != 0:
        return "the test SLURM cluster needs root (two slurmd on one host, munged as the munge user)"
    return None


def _free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _munge_up() -> bool:
    return subprocess.run([_which("munge") or "munge", "-n"], capture_output=True).returncode == 0


def _hosts_entries() -> None:
    """The node names resolve to this machine (srun, torchrun's rendezvous on the first node)."""
    hosts = Path("/etc/hosts")
    known = {name for line in hosts.read_text().splitlines() for name in line.split()[1:] if not line.startswith("#")}
    if not set(NODES) <= known:
        with open(hosts, "a") as f:
            f.write(f"127.0.0.1 {' '.join(NODES)}\n")


class SlurmCluster:
    def __init__(self, cpus: Optional[int] = None) -> None:
        why = skip_reason()
        if why:
            raise RuntimeError(why)
        self.root = Path(tempfile.mkdtemp(prefix="orchestrator-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.env: Dict[str, str] = {"SLURM_CONF": str(self.conf)}
        self.cpus = cpus or os.cpu_count() or 1
        self.procs: List[subprocess.Popen] = []
        self.munged: Optional[subprocess.Popen] = None

    def _write_conf(self) -> None:
        ctld, n1, n2 = _free_ports(3)
        host = socket.gethostname().split(".")[0]
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir()
        lines = [
            "ClusterName=orchestrator-test", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld}",
            "SlurmUser=root", "AuthType=auth/munge", "CredType=cred/munge", f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n", f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "ReturnToService=2", "KillWait=5", "MinJobAge=30",
            "SchedulerParameters=sched_interval=1", "MessageTimeout=30", "JobRequeue=1",
            f"NodeName={NODES[0]} NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs={self.cpus} State=UNKNOWN",
            f"NodeName={NODES[1]} NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={NODES[0]},{NODES[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        if _munge_up():
            return  # someone's munged answers: shared, not ours to stop
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
            shutil.chown(key, "munge", "munge")
        run = Path("/run/munge")
        run.mkdir(exist_ok=True)
        shutil.chown(run, "munge", "munge")
        self.munged = subprocess.Popen(["runuser", "-u", "munge", "--", _which("munged"), "--foreground"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait(_munge_up, 10, "munged did not answer")

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not ok():
            if time.monotonic() > end:
                raise RuntimeError(f"{what}: " + self.logs())
            time.sleep(0.2)

    def start(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.stop()  # what did start is ended; the error says why
            raise
        os.environ.update(self.env)
        return self

    def _start(self) -> None:
        self._start_munge()
        _hosts_entries()
        self._write_conf()
        env = {**os.environ, **self.env}
        daemons = [[_which("slurmctld"), "-D", "-i", "-f", str(self.conf)]]
        daemons += [[_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)] for n in NODES]
        for cmd in daemons:
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True))
            if len(self.procs) == 1:
                self._wait(lambda: self.sinfo_ok(), 30, "slurmctld did not answer")
        self._wait(lambda: self.idle_nodes() == len(NODES), 60, "the nodes did not come up idle")

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def sinfo_ok(self) -> bool:
        return self.run("sinfo", "-h", check=False, timeout=20).returncode == 0

    def idle_nodes(self) -> int:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20).stdout.split()
        return sum(state == "idle" for state in out[1::2])

    def jobs(self) -> List[str]:
        """Job ids still queued or running."""
        return self.run("squeue", "-h", "-o", "%i", check=False, timeout=20).stdout.split()

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Until no job is queued or running (the tests run one job at a time: the nodes share the cores)."""
        self._wait(lambda: not self.jobs(), timeout_s, f"jobs still running: {self.jobs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        if self.procs and self.sinfo_ok():
            self.run("scancel", "--user=root", check=False, timeout=20)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs = []
        if self.munged is not None:
            self.munged.terminate()
            self.munged.wait(timeout=10)
            self.munged = None
        for key in self.env:
            if os.environ.get(key) == self.env[key]:
                del os.environ[key]
        shutil.rmtree(self.root, ignore_errors=True)
