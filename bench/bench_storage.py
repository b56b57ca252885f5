"""Studies shared through PostgreSQL: how fast, and what the database costs per trial.

1. Wall time of a 12-trial study on experiment=input_bound (sim.read_latency_ms=1, tracking
   off, kept-alive ranks) with 1, 2 and 4 tuner processes on one PostgreSQL study: trials per
   minute. On 2 cores the processes share the CPU, so more of them mostly overlap start-up and
   storage round trips; on machines of their own they would add up.
2. Per-trial storage overhead: the Optuna calls a trial makes (count under the study lock, ask,
   8 user attributes, tell), timed over 40 trials on PostgreSQL and on SQLite, median and
   spread.

A throwaway PostgreSQL server is started in a temporary directory (tests/pg.py; Debian's
postgresql package, which `make setup` installs).

    .venv/bin/python -m bench.bench_storage
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna

from bench.lib import ROOT, prepare, table
from orchestrator.tune.rules import counted
from orchestrator.tune.storage import study_lock
from tests.pg import PostgresServer  # the throwaway server the tests use too

TRIALS = 12


def study_wall_time(storage: str, processes: int, tmp: Path) -> float:
    name = f"bench-{processes}"
    args = [sys.executable, "-m", "orchestrator", "mode=tune", "experiment=input_bound", "sim.read_latency_ms=1",
            "tracking.enabled=false", f"tune.n_trials={TRIALS}", f"tune.study_name={name}", f"tune.storage={storage}", "tune.warm_start=off",
            "tune.pruner=none", "tune.space.batch_size.high=64", "tune.max_workers=4"]
    t0 = time.monotonic()
    procs = [subprocess.Popen([*args, f"hydra.run.dir={tmp}/{name}-{i}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT) for i in range(processes)]
    codes = [p.wait(timeout=1200) for p in procs]
    wall = time.monotonic() - t0
    n = counted(optuna.load_study(study_name=name, storage=storage).trials)
    if any(codes) or n != TRIALS:
        raise RuntimeError(f"{processes} tuners: exit codes {codes}, {n} counted trials")
    return wall


def storage_overhead(storage: str, trials: int = 40) -> list:
    study = optuna.create_study(study_name=f"overhead-{time.time_ns()}", storage=storage, direction="maximize")
    times = []
    for i in range(trials):
        t0 = time.perf_counter()
        with study_lock(storage, study.study_name):
            counted(study.get_trials(deepcopy=False))
            trial = study.ask()
        for k in ("values", "owner", "utilization", "throughput", "mfu", "measured_s", "mlflow_run_id", "duration_s"):
            trial.set_user_attr(k, i)
        study.tell(trial, float(i))
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help says what it does
    tmp = prepare("bench_storage-", [])
    pg = PostgresServer(["optuna"])
    rows = [["figure", "measured"]]
    try:
        url = pg.url("optuna")
        for n in (1, 2, 4):
            wall = study_wall_time(url, n, tmp)
            rows.append([f"{TRIALS}-trial study, {n} tuner process{'es' if n > 1 else ''}",
                         f"{wall:.0f}s = {60 * TRIALS / wall:.1f} trials/min"])
            print(f"  {rows[-1][0]}: {rows[-1][1]} (load {os.getloadavg()[0]:.2f})", flush=True)
        for label, storage in (("PostgreSQL", url), ("SQLite", f"sqlite:///{tmp}/overhead.db")):
            t = sorted(storage_overhead(storage))
            rows.append([f"storage per trial, {label}",
                         f"median {1000 * statistics.median(t):.1f} ms (min {1000 * t[0]:.1f}, max {1000 * t[-1]:.1f})"])
    finally:
        pg.stop()
    print("\n== bench_storage results")
    print(table(rows))
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
