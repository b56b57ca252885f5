"""Are trials trustworthy? A trial's estimate vs a long steady-state run of the same config, and
the tuner's pick judged by steady-state figures; measured side by side in one run, on CPU.

Workloads and grids are bench_tune's (`WORKLOADS[...]["space"]`, 24 points each: batch x workers
x accumulation): input_bound (single process) and comm_heavy (backend=ddp, 2 ranks). Tracking is
off; everything lives under one temporary directory; every job of a workload runs on one set of
kept-alive ranks (orchestrator/tune/pool.py), as the tuner's trials do.

1. Measurement validity, per grid config:
   * the trial: `run_job(trial_config(cfg, values))`, exactly the job a trial launches (steady
     warmup, measured to measure.rel_precision); its estimate is `result["estimate"]["mean"]`;
   * the steady-state reference: the same config with a warmup of 3x the steady warmup (well past
     the loader's queue) and >= 10x the trial's measured samples, in windows of 0.25 s; its figure
     is the same estimator over its windows (epoch restarts included, as in every run).
   Printed: the ratio trial / steady per config; targets: within +-10% for >= 90% of configs, and
   the best config by the trials' figures (the objective's rule) scores >= 0.97 of the steady best.
   The references near the steady best (score >= 0.85) are then measured 3 times in all, in
   interleaved rounds, and averaged (`settle`): one reference run's utilization moves by +-10%
   between runs here, enough to change which config is the grid-best.
2. Tuning quality: `run_study` with 25% of the grid as trials (6), seeds 0, 1, 2; its pick scored
   by the steady-state figures of that config vs the steady-state grid-best (>= 0.97 median).
   Score of a config (the objective's rule, utilization): its steady utilization / the best's when
   its steady throughput is within tune.throughput_floor of the best throughput, else its
   throughput / the best's.
3. Study time: each of those studies is also run as before this change (measure.rel_precision=0,
   measure.trial_steps=20, tune.confirm_top=0: a fixed 20 steps after the warmup, no confirmation);
   the ratio of study wall times (target <= 2x) and the median trial durations are printed.

`--quick` runs every other accumulation of each grid (12 or 16 of its 24 points; the studies search
the same points, so every pick has a reference), 2 seeds, and 5x the samples for the reference. The full run takes about 25-35 minutes on 2 idle cores; the load average is printed
before and after (other work on the machine makes every figure noisier).

    .venv/bin/python -m bench.bench_trials [--quick] [--only input_bound|comm_heavy] [--keep]

`--cache FILE` keeps the trial and steady-state figures per grid point in a JSON file that
bench_samplers reads too (same workload and reference factor), so the long reference runs are made once;
`--retrial` keeps the file's references and measures every trial again (after a change to trials).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import optuna

from bench.lib import (KNOBS, TARGET_QUALITY, WORKLOADS, Point, Results, add_run_args, fmt, objective_best, point_of,
                       prepare, quality, run_workloads, space_overrides, table, validity)
from orchestrator.compose import compose_config
from orchestrator.tune.space import SearchSpace
from orchestrator.tune.study import run_study

TARGET_RATIO = 0.10  # a trial's estimate within +-10% of the steady state ...
TARGET_SHARE = 0.90  # ... for at least 90% of the configs
TARGET_TIME = 2.0
TRIALS_SHARE = 0.25


def study_time(name: str, cfg_overrides: List[str], seed: int, tmp: Path, old: bool) -> Dict[str, Any]:
    tag = "old" if old else "new"
    extra = ["measure.rel_precision=0", "measure.trial_steps=20", "tune.confirm_top=0"] if old else []
    cfg = compose_config([*cfg_overrides, f"tune.seed={seed}", f"tune.study_name=bench-{name}-{seed}-{tag}", *extra])
    t0 = time.monotonic()
    summary = run_study(cfg, tmp / "studies" / f"{name}-{seed}-{tag}", echo=False)
    wall = time.monotonic() - t0
    trials = optuna.load_study(study_name=summary["study_name"], storage=summary["storage"]).trials
    durations = [t.user_attrs["duration_s"] for t in trials if t.user_attrs.get("duration_s")]
    pick = point_of(summary["best"]["values"]) if summary.get("best") else None
    return {"wall_s": wall, "trial_s": statistics.median(durations) if durations else float("nan"), "pick": pick,
            "launched": sum("duplicate_of" not in t.user_attrs for t in trials)}


def bench_workload(name: str, spec: Dict[str, Any], quick: bool, tmp: Path, cache: Optional[Path],
                   retrial: bool = False) -> Dict[str, Any]:
    space_spec = dict(spec["space"])
    if quick:  # every other accumulation: the studies search the quick grid, so every pick is scored
        space_spec[KNOBS[-1]] = space_spec[KNOBS[-1]][::2]
    grid: List[Point] = list(itertools.product(*(space_spec[k] for k in KNOBS)))
    n_trials = max(1, math.floor(TRIALS_SHARE * len(grid)))
    common = [*spec["overrides"], "tracking.enabled=false", f"tune.storage=sqlite:///{tmp}/optuna.db", "tune.warm_start=off",
              "tune.baseline=false", f"tune.n_trials={n_trials}", *space_overrides(space_spec)]
    cfg = compose_config(common)
    space, floor = SearchSpace(cfg), cfg.tune.throughput_floor
    print(f"\n== {name}: grid {len(grid)} points, load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.monotonic()
    v = validity(name, cfg, space, grid, 5.0 if quick else 10.0, tmp, cache, retrial)
    print(f"  validity: {time.monotonic() - t0:.0f}s", flush=True)

    studies = []
    for seed in range(2 if quick else 3):
        new = study_time(name, common, seed, tmp, old=False)
        old = study_time(name, common, seed, tmp, old=True)
        studies.append({"seed": seed, "new": new, "old": old})
        q = quality(v["steady"], new["pick"], floor) if new["pick"] in v["steady"] else float("nan")
        print(f"    seed {seed}: pick {fmt(new['pick']) if new['pick'] else 'none'} (quality {q:.3f}); study "
              f"{new['wall_s']:.0f}s vs {old['wall_s']:.0f}s before, median trial {new['trial_s']:.1f}s vs "
              f"{old['trial_s']:.1f}s", flush=True)
    return {"name": name, "grid": grid, "floor": floor, "n_trials": n_trials, **v, "studies": studies}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every other accumulation, 2 seeds, 5x reference samples")
    add_run_args(ap, WORKLOADS)
    ap.add_argument("--cache", type=Path, default=None, help="JSON file of steady-state figures shared with bench_samplers")
    ap.add_argument("--retrial", action="store_true", help="with --cache: keep its references, measure every trial again")
    args = ap.parse_args()

    tmp = prepare("bench_trials-", ["quick" if args.quick else "full"])
    start = time.monotonic()
    results = run_workloads(args.only, args.keep, tmp, lambda name, spec: bench_workload(name, spec, args.quick, tmp, args.cache,
                                                                               args.retrial))

    results_table = Results()
    row, rows, verdicts = results_table.row, results_table.rows, results_table.verdicts

    for name, r in results.items():
        grid, steady, trial, floor = r["grid"], r["steady"], r["trial"], r["floor"]
        ratios = sorted(trial[p]["throughput"] / steady[p]["throughput"] for p in grid if steady[p]["throughput"])
        within = sum(abs(x - 1) <= TARGET_RATIO for x in ratios)
        row("trial / steady throughput", name, f"median {statistics.median(ratios):.3f}, "
            f"range {ratios[0]:.3f}-{ratios[-1]:.3f} (n={len(ratios)})", "", None)
        row("configs within +-10%", name, f"{within}/{len(ratios)} = {100 * within / len(ratios):.0f}%",
            f">= {100 * TARGET_SHARE:.0f}%", within >= TARGET_SHARE * len(ratios))
        sbest, tbest = objective_best(steady, floor), objective_best(trial, floor)
        q = quality(steady, tbest, floor)
        row("trials' best, steady score", name, f"{fmt(tbest)} vs steady best {fmt(sbest)}: {q:.3f}",
            f">= {TARGET_QUALITY}", q >= TARGET_QUALITY)
        picks = [s["new"]["pick"] for s in r["studies"]]
        qs = [quality(steady, p, floor) if p in steady else 0.0 for p in picks]
        row("tuner pick, steady score", name, f"median {statistics.median(qs):.3f} ("
            + ", ".join(f"{fmt(p) if p else 'none'} {x:.3f}" for p, x in zip(picks, qs))
            + f"; {r['n_trials']} trials of {len(grid)})", f">= {TARGET_QUALITY} median",
            statistics.median(qs) >= TARGET_QUALITY)
        times = [s["new"]["wall_s"] / s["old"]["wall_s"] for s in r["studies"]]
        row("study time / before", name, f"median {statistics.median(times):.2f}x ("
            + ", ".join(f"{s['new']['wall_s']:.0f}s/{s['old']['wall_s']:.0f}s" for s in r["studies"]) + ")",
            f"<= {TARGET_TIME:g}x", statistics.median(times) <= TARGET_TIME)
        row("median trial wall time", name, ", ".join(f"{s['new']['trial_s']:.1f}s vs {s['old']['trial_s']:.1f}s"
                                                       for s in r["studies"]) + " (now vs before)", "report", None)

    print(f"\n== bench_trials results ({'quick' if args.quick else 'full'}); total {time.monotonic() - start:.0f}s, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(rows))
    print(f"targets met: {sum(verdicts)}/{len(verdicts)}")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
