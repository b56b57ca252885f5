"""The SLURM path against the local one on the same job, on the simulated cluster of tests/slurm.py
(2 nodes on this machine: they SHARE its cores, so 2 workers there compete for the same CPUs a
single local process has; on a real cluster each node brings its own).

1. Time from the command to the first measured step (the first `window` event of rank 0) of a
   2-rank ddp job: local (`torchrun --standalone`, 2 ranks on this machine) vs SLURM (`sbatch
   --nodes=2`, one torchrun agent per node by srun, c10d rendezvous), median of --repeats.
2. A study of --trials trials (tune.reuse_ranks, sim.read_latency_ms=1, tracking off): a local
   tuner vs SLURM job arrays of 1 and 2 workers (tune.workers, a journal study): wall time,
   trials per hour, and the median share of a trial's wall time outside its measurement (its
   overhead), as the study's summary.json has it. One journal storage for all three.

Needs root and Debian's slurm-wlm + munge (make setup installs them).

    .venv/bin/python -m bench.bench_slurm [--repeats 3] [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from bench.lib import ROOT, table
from tests.slurm import SlurmCluster, skip_reason

JOB = ["backend=ddp", "data.args.size=4096", "data.batch_size=32", "trainer.max_steps=40", "measure.warmup_steps=2",
       "measure.window_steps=4", "tracking.enabled=false"]
TUNE = ["mode=tune", "measure.warmup_steps=2", "measure.trial_steps=8", "measure.window_steps=4", "tune.pruner=none",
        "measure.rel_precision=0", "tune.confirm_top=0", "tune.patience=0", "tune.space.batch_size.high=32",
        "tune.space.num_workers.high=0", "sim.read_latency_ms=1", "tracking.enabled=false"]
PY = sys.executable


def first_window(run_dir: Path, proc: subprocess.Popen, t0: float, timeout: float = 300) -> float:
    """Seconds from t0 until rank 0 wrote its first measured window."""
    events = run_dir / "ranks" / "rank0.jsonl"
    while time.monotonic() - t0 < timeout:
        if events.exists() and '"type": "window"' in events.read_text().replace('"type":"window"', '"type": "window"'):
            return time.monotonic() - t0
        if proc.poll() is not None and not events.exists():
            break
        time.sleep(0.05)
    raise RuntimeError(f"no measured window in {events}")


def to_first_step(cluster: SlurmCluster, slurm: bool, tmp: Path, i: int) -> float:
    run_dir = tmp / f"{'slurm' if slurm else 'local'}{i}"
    args = [*JOB, f"hydra.run.dir={run_dir}"]
    if slurm:
        wrap = " ".join([PY, "-m", "orchestrator", *args])
        cmd = ["sbatch", "--wait", "--nodes=2", "--exclusive", f"--output={run_dir}.out", f"--chdir={ROOT}", "--wrap", wrap]
    else:
        cmd = [PY, "-m", "orchestrator", *args, "parallelism.nproc_per_node=2"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, **cluster.env})
    took = first_window(run_dir, proc, t0)
    proc.wait(timeout=600)
    cluster.wait_idle()
    return took


def study(cluster: SlurmCluster, workers: int, tmp: Path, trials: int) -> dict:
    """workers 0: a local tuner; else a SLURM job array of that many workers."""
    tag = f"w{workers}"
    args = [*TUNE, f"tune.n_trials={trials}", f"tune.study_name={tag}", f"hydra.run.dir={tmp / tag}",
            f"tune.storage=journal:///{tmp / tag}.log", "tune.warm_start=off"]  # one storage for all three
    if workers:
        args += ["hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=30", f"tune.workers={workers}"]
    t0 = time.monotonic()
    done = subprocess.run([PY, "-m", "orchestrator", *args], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **cluster.env})
    wall = time.monotonic() - t0
    cluster.wait_idle()
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    summary = json.loads((tmp / tag / "summary.json").read_text())
    return {"wall": wall, "n": summary["n_trials"], "overhead": (summary.get("trial_overhead") or {}).get("median")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=6)
    a = ap.parse_args()
    why = skip_reason()
    if why:
        print(f"bench_slurm: skipped: {why}")
        return 0
    cluster = SlurmCluster().start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    try:
        local = [to_first_step(cluster, False, tmp, i) for i in range(a.repeats)]
        remote = [to_first_step(cluster, True, tmp, i) for i in range(a.repeats)]
        lm, rm = statistics.median(local), statistics.median(remote)
        rows: List[List[str]] = [["2-rank ddp, command -> first measured step", "median s", "runs"],
                                 ["local (torchrun --standalone)", f"{lm:.1f}", " ".join(f"{x:.1f}" for x in local)],
                                 ["SLURM (sbatch --nodes=2, srun + c10d)", f"{rm:.1f}", " ".join(f"{x:.1f}" for x in remote)],
                                 ["ratio SLURM / local", f"{rm / lm:.2f}", ""]]
        print(table(rows))
        print()
        res = {w: study(cluster, w, tmp, a.trials) for w in (1, 0, 2)}
        rows = [["study", "trials", "wall s", "trials/hour", "overhead share (median)", "vs local"]]
        for w, name in ((0, "local tuner"), (1, "SLURM, 1 worker"), (2, "SLURM, 2 workers")):
            r = res[w]
            rate = 3600 * r["n"] / r["wall"]
            rows.append([name, str(r["n"]), f"{r['wall']:.0f}", f"{rate:.0f}",
                         "-" if r["overhead"] is None else f"{r['overhead']:.2f}",
                         f"{rate / (3600 * res[0]['n'] / res[0]['wall']):.2f}x"])
        print(table(rows))
        print(f"\n(the simulated cluster's 2 nodes share this machine's {os.cpu_count()} cores; load average "
              f"{os.getloadavg()[0]:.1f} at the end)")
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
