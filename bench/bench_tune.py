"""Quality, payoff and cost of the tuner (`mode=tune`), measured side by side in one run, on CPU.

Workloads (tracking off, everything under one temporary directory, Optuna storage
sqlite:///<tmp>/optuna.db):

  * input_bound: experiment=input_bound, sim.read_latency_ms=2, data.args.blur_passes=1
    (single process; the loader's per-sample reads and transform dominate);
  * comm_heavy:  experiment=comm_heavy, backend=ddp, parallelism.nproc_per_node=2
    (many tiny parameter tensors, almost no compute: the all-reduce dominates).

Every job below is `run_job(trial_config(cfg, values))`: exactly the short job a trial launches
(a steady-state warmup, then measured to measure.rel_precision), with `values` built by the tuner's own
`SearchSpace.sample` (so workers=0 points get the same prefetch/persistent resets as trials).

1. Tuning quality, per workload. The search space is categorical on every knob:
     input_bound: batch_size {16,32,64} x num_workers {0,1,2,4} x accumulation_steps {1,2}    (24)
     comm_heavy:  batch_size {8,16,32,64} x num_workers {0,1} x accumulation_steps {1,2,4}    (24)
   (--quick: input_bound {8,16,32,64} x {0,4} x {1,2}, comm_heavy {8,16,32,64} x {0,1} x {1,2}: 16 each).
   * grid: every point measured once; grid-best = the objective's rule applied to the grid
     (highest utilization among points with throughput >= tune.throughput_floor x the grid's
     best throughput);
   * tuner: `run_study` with the default objective and pruner, tune.baseline=false,
     tune.n_trials = floor(25 % of the grid size), the same space (tune.space.* overrides,
     tune.global_batch=free: the grid's every batch x accumulation, as the grid measures them);
   * re-measurement: a single measurement is noisy (+-5-10 %), so the tuner's best and the
     grid-best are re-run interleaved, --rounds times each (order rotated every round), and their
     medians compared. When both are the same config it is measured once per round and the ratio
     is 1 by identity.
   Figures: best-found / grid-best utilization (target >= 0.97), best-found / grid-best
   throughput (the objective's own eligibility rule: >= tune.throughput_floor, 0.95), trials
   used / grid size (target <= 25 %; launched trials: a re-proposed config is not launched again;
   the number of distinct configs among them is shown).
2. Delivered gain on input_bound: the tuner's best vs the seed default (batch 32, workers 0,
   accumulation 1), re-measured in the same interleaved rounds: utilization ratio and
   throughput ratio (target >= 3x, both). The best is the free-batch study's, so it may train
   another global batch than the default's 32; bench_target judges the product's default (held).
3. Trial overhead: for every completed trial of both studies, the share of its wall time spent
   outside its measured window, 1 - measured_s / duration_s: median, min, max (reported; no
   target).

Each grid point / trial is a full launch (2.5-6 s here, mostly start-up; workers=0 points with
large batches are the slowest), so the default run takes about 6-7 minutes on 2 idle cores
(--quick about 4); other work on the machine both slows it and makes every figure noisier (the
load average is printed at the start of each workload and at the end).

    .venv/bin/python -m bench.bench_tune [--quick] [--rounds 3] [--keep]
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
                       prepare, run_workloads, space_overrides, table, values_of)
from orchestrator.app import JobFailed, run_job
from orchestrator.compose import compose_config
from orchestrator.schema import Config
from orchestrator.tune.space import SearchSpace
from orchestrator.tune.study import run_study, trial_config

SEED_DEFAULT = {"batch_size": 32, "num_workers": 0, "accumulation_steps": 1}

TARGET_TRIALS = 0.25
TARGET_GAIN = 3.0


# -- measuring --------------------------------------------------------------------------------
class Runner:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.n = tmp, 0
        self.spent: Dict[str, float] = {}

    def job(self, cfg: Config, space: SearchSpace, p: Point, phase: str) -> Dict[str, float]:
        self.n += 1
        t0 = time.monotonic()
        try:
            r = run_job(trial_config(cfg, values_of(space, p)), self.tmp / "jobs" / f"{self.n:04d}", echo=False)
            out = {"utilization": float(r["utilization"]), "throughput": float(r["throughput"])}
        except JobFailed as exc:
            print(f"    {fmt(p)} FAILED: {str(exc).splitlines()[0]}", flush=True)
            out = {"utilization": 0.0, "throughput": 0.0}
        out["wall_s"] = time.monotonic() - t0
        self.spent[phase] = self.spent.get(phase, 0.0) + out["wall_s"]
        return out


def remeasure(runner: Runner, cfg: Config, space: SearchSpace, arms: Dict[str, Point], rounds: int,
              phase: str) -> Dict[Point, List[Dict[str, float]]]:
    """Each distinct config of `arms` once per round, order rotated every round."""
    distinct = list(dict.fromkeys(arms.values()))
    runs: Dict[Point, List[Dict[str, float]]] = {p: [] for p in distinct}
    for r in range(rounds):
        order = distinct[r % len(distinct):] + distinct[:r % len(distinct)]
        for p in order:
            runs[p].append(runner.job(cfg, space, p, phase))
        print(f"    round {r + 1}/{rounds} (load {os.getloadavg()[0]:.2f}): " + "  ".join(
            f"{fmt(p)} util {runs[p][-1]['utilization']:.3f} thr {runs[p][-1]['throughput']:.0f}" for p in order),
            flush=True)
    return runs


def med(runs: List[Dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def figures(runs: List[Dict[str, float]]) -> str:
    """Medians, with the min-max over rounds."""
    u, t = [r["utilization"] for r in runs], [r["throughput"] for r in runs]
    return (f"util {statistics.median(u):.3f} ({min(u):.2f}-{max(u):.2f}), "
            f"thr {statistics.median(t):.0f}/s ({min(t):.0f}-{max(t):.0f})")


# -- one workload -----------------------------------------------------------------------------
def bench_workload(name: str, spec: Dict[str, Any], quick: bool, rounds: int, tmp: Path,
                   runner: Runner) -> Dict[str, Any]:
    space_spec = spec["quick" if quick else "space"]
    grid: List[Point] = list(itertools.product(*(space_spec[k] for k in KNOBS)))
    n_trials = max(1, math.floor(TARGET_TRIALS * len(grid)))
    common = [*spec["overrides"], "tracking.enabled=false", f"tune.storage=sqlite:///{tmp}/optuna.db", "tune.warm_start=off",
              f"tune.study_name=bench-{name}", "tune.baseline=false", f"tune.n_trials={n_trials}",
              *space_overrides(space_spec)]
    cfg = compose_config(common)
    space = SearchSpace(cfg)
    floor = cfg.tune.throughput_floor
    print(f"\n== {name}: grid {len(grid)} points, tuner {n_trials} trials, floor {floor:g}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    # 1. the exhaustive grid
    t0 = time.monotonic()
    rows: Dict[Point, Dict[str, float]] = {}
    for p in grid:
        rows[p] = runner.job(cfg, space, p, f"{name}: grid")
        print(f"    grid {fmt(p):12s} util {rows[p]['utilization']:.3f}  thr {rows[p]['throughput']:9.1f}"
              f"  ({rows[p]['wall_s']:.1f}s)", flush=True)
    grid_s = time.monotonic() - t0
    gbest = objective_best(rows, floor)
    print(f"  grid-best {fmt(gbest)}: util {rows[gbest]['utilization']:.3f} thr {rows[gbest]['throughput']:.1f}"
          f"  (grid {grid_s:.0f}s)", flush=True)

    # 2. the tuner on the same space
    t0 = time.monotonic()
    summary = run_study(cfg, tmp / "studies" / name, echo=False)
    tune_s = time.monotonic() - t0
    runner.spent[f"{name}: tuner"] = tune_s
    study = optuna.load_study(study_name=summary["study_name"], storage=summary["storage"])
    trials = study.trials
    # where a config sits in the grid (single measurements, ranked by the objective's rule)
    top = max(r["throughput"] for r in rows.values())
    ranked = sorted(grid, key=lambda p: (rows[p]["throughput"] < floor * top, -rows[p]["utilization"]
                                         if rows[p]["throughput"] >= floor * top else -rows[p]["throughput"]))
    for tr in trials:
        a = tr.user_attrs
        p = point_of(a["values"])
        fig = (f"util {a['utilization']:.3f} thr {a['throughput']:9.1f}" if "utilization" in a else " " * 24)
        reported = " ".join(f"{v:.2f}" for _, v in sorted(tr.intermediate_values.items()))
        print(f"    trial {tr.number:2d} {tr.state.name:8s} {fmt(p):12s} {fig}  grid rank {ranked.index(p) + 1:2d}"
              f"  reported util/window [{reported}]", flush=True)
    tbest: Optional[Point] = point_of(summary["best"]["values"]) if summary.get("best") else None
    print(f"  tuner-best {fmt(tbest) if tbest else 'none'}  (study {tune_s:.0f}s, states {summary['states']})",
          flush=True)
    grid_rank = ranked.index(tbest) + 1 if tbest else None

    # 3. re-measure side by side
    arms = {"grid": gbest}
    if tbest:
        arms["tuned"] = tbest
    if name == "input_bound":
        arms["default"] = tuple(SEED_DEFAULT[k] for k in KNOBS)  # type: ignore[assignment]
    print(f"  re-measuring {', '.join(f'{k} {fmt(p)}' for k, p in arms.items())}: {rounds} interleaved rounds",
          flush=True)
    runs = remeasure(runner, cfg, space, arms, rounds, f"{name}: re-measure")

    overhead = [1 - tr.user_attrs["measured_s"] / tr.user_attrs["duration_s"] for tr in trials
                if tr.state == optuna.trial.TrialState.COMPLETE and tr.user_attrs.get("duration_s")
                and tr.user_attrs.get("measured_s") is not None]
    distinct = len({point_of(tr.user_attrs["values"]) for tr in trials if "values" in tr.user_attrs})
    # a config the sampler proposed again is recorded but never launched: it costs no trial
    launched = sum("duplicate_of" not in tr.user_attrs for tr in trials)
    return {"name": name, "grid": len(grid), "trials": launched, "distinct": distinct, "n_trials": n_trials, "arms": arms,
            "runs": runs, "grid_rank": grid_rank, "overhead": overhead, "floor": floor,
            "grid_s": grid_s, "tune_s": tune_s, "states": summary["states"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16-point grids (4 tuner trials each)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved re-measurements per config")
    add_run_args(ap, WORKLOADS)
    args = ap.parse_args()

    tmp = prepare("bench_tune-", ["quick" if args.quick else "full", f"rounds {args.rounds}"])
    start = time.monotonic()
    runner = Runner(tmp)
    results = run_workloads(args.only, args.keep, tmp,
                            lambda name, spec: bench_workload(name, spec, args.quick, args.rounds, tmp, runner))

    results_table = Results()
    row, rows, verdicts = results_table.row, results_table.rows, results_table.verdicts

    for name, r in results.items():
        g, t = r["arms"]["grid"], r["arms"].get("tuned")
        gu, gt = med(r["runs"][g], "utilization"), med(r["runs"][g], "throughput")
        row("grid-best config", name, f"{fmt(g)}: {figures(r['runs'][g])}", "", None)
        if t is None:
            row("tuner-best config", name, "no completed trial", "", False)
            continue
        tu, tt = med(r["runs"][t], "utilization"), med(r["runs"][t], "throughput")
        same = " (same config)" if t == g else ""
        row("tuner-best config", name, f"{fmt(t)}: {figures(r['runs'][t])}{same}  [grid rank {r['grid_rank']}]",
            "", None)
        uq, tq = (1.0, 1.0) if t == g else (tu / gu if gu else float("nan"), tt / gt if gt else float("nan"))
        row("best-found / grid-best util", name, f"{uq:.3f}", f">= {TARGET_QUALITY}", uq >= TARGET_QUALITY)
        row("best-found / grid-best thr", name, f"{tq:.3f}", f">= {r['floor']:g} (floor)", tq >= r["floor"])
        share = r["trials"] / r["grid"]
        row("trials used / grid size", name, f"{r['trials']}/{r['grid']} = {100 * share:.1f}%  "
            f"({r['distinct']} distinct; {r['states']})", f"<= {100 * TARGET_TRIALS:.0f}%", share <= TARGET_TRIALS + 1e-9)
        if "default" in r["arms"]:
            d = r["arms"]["default"]
            du, dt = med(r["runs"][d], "utilization"), med(r["runs"][d], "throughput")
            row("seed default config", name, f"{fmt(d)}: {figures(r['runs'][d])}", "", None)
            row("tuned / default utilization", name, f"{tu / du:.2f}x" if du else "inf", f">= {TARGET_GAIN:g}x",
                du == 0 or tu / du >= TARGET_GAIN)
            row("tuned / default throughput", name, f"{tt / dt:.2f}x" if dt else "inf", f">= {TARGET_GAIN:g}x",
                dt == 0 or tt / dt >= TARGET_GAIN)
    for name, r in [*results.items(), ("all", {"overhead": [x for r in results.values() for x in r["overhead"]]})]:
        ov = sorted(r["overhead"])
        text = (f"median {100 * statistics.median(ov):.1f}%, min {100 * ov[0]:.1f}%, max {100 * ov[-1]:.1f}%"
                f"  (n={len(ov)})" if ov else "no completed trial")
        row("trial overhead 1-measured/wall", name, text, "report", None)

    total = time.monotonic() - start
    print(f"\n== bench_tune results ({'quick' if args.quick else 'full'}; re-measured figures are medians of "
          f"{args.rounds} interleaved runs)")
    print(table(rows))
    print("\ntime: " + ", ".join(f"{k} {v:.0f}s" for k, v in runner.spent.items()) + f"; total {total:.0f}s; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"targets met: {sum(verdicts)}/{len(verdicts)}")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
