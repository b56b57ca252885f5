"""Per-trial overhead with and without kept-alive ranks (tune.reuse_ranks), side by side.

For ddp and horovod with 2 ranks on CPU (gloo), the same small study runs twice in one process:
once relaunching torchrun/horovodrun for every trial, once handing the trials to one pool of
ranks. A trial's overhead is the share of its wall time (as the tuner records it: from sampling
to the trial's MLflow run closed) spent outside its measured window. Target with reuse: <= 10%.

    .venv/bin/python -m bench.bench_pool [--trials 5] [--measure-steps 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from orchestrator.compose import compose_config
from orchestrator.tune.study import run_study


def study(backend: str, reuse: bool, trials: int, measure: int, tmp: Path) -> dict:
    run_dir = tmp / f"{backend}-reuse-{reuse}"
    # ~15 ms steps: seed 000's model behind 0.5 ms reads per sample
    cfg = compose_config([
        "mode=tune", f"backend={backend}", "parallelism.nproc_per_node=2", "sim.read_latency_ms=0.5",
        f"tune.n_trials={trials}", "measure.warmup_steps=5", f"measure.trial_steps={measure}",
        "measure.rel_precision=0", "tune.confirm_top=0",  # a fixed measured part: the overhead is the figure
        f"measure.window_steps={max(1, measure // 5)}", "tune.pruner=none", "tune.baseline=false",
        f"tune.reuse_ranks={reuse}", f"tune.storage=sqlite:///{run_dir}/optuna.db", "tune.warm_start=off",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db", "tune.space.num_workers.high=0",
        "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[16,32,64]",
        "tune.space.accumulation_steps.high=2",
    ])
    t0 = time.monotonic()
    summary = run_study(cfg, run_dir, echo=False)
    wall = time.monotonic() - t0
    done = [t for t in optuna.load_study(study_name=summary["study_name"], storage=summary["storage"]).trials
            if "utilization" in t.user_attrs]
    shares = [1 - t.user_attrs["measured_s"] / t.user_attrs["duration_s"] for t in done]
    later = shares[1:] or shares  # the first trial of a pool pays its launch
    return {"wall": wall, "n": len(done), "median": statistics.median(shares), "later": statistics.median(later),
            "first": shares[0], "trial_s": statistics.median(t.user_attrs["duration_s"] for t in done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--measure-steps", type=int, default=150)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pool-") as tmp:
        for backend in ("ddp", "horovod"):
            for reuse in (False, True):
                r = study(backend, reuse, args.trials, args.measure_steps, Path(tmp))
                rows.append((backend, reuse, r))
                print(f"{backend:8s} reuse={str(reuse):5s} trials={r['n']} median trial {r['trial_s']:.2f}s "
                      f"overhead median {100 * r['median']:.1f}% (first {100 * r['first']:.1f}%, "
                      f"later {100 * r['later']:.1f}%) study {r['wall']:.1f}s", flush=True)
    print()
    print(f"{'backend':8s} {'relaunch':>10s} {'reuse':>10s} {'reuse, after 1st':>17s} {'ratio':>7s}  target <= 10% (reuse)")
    ok = True
    for backend in ("ddp", "horovod"):
        off = next(r for b, u, r in rows if b == backend and not u)
        on = next(r for b, u, r in rows if b == backend and u)
        met = on["median"] <= 0.10
        ok &= met
        print(f"{backend:8s} {100 * off['median']:9.1f}% {100 * on['median']:9.1f}% {100 * on['later']:16.1f}% "
              f"{on['trial_s'] / off['trial_s']:7.2f}  {'MET' if met else 'MISSED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
