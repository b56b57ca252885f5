"""What the benchmarks share: the tuning grids and how a grid point becomes a trial's config,
scoring a pick by the objective's rule, steady-state reference runs and their cache file, the
results table, and a quiet temporary directory in the repository root.

Every benchmark runs from the repository root as a module (`.venv/bin/python -m bench.bench_x`):
the root is then on sys.path, and the rank processes a job starts (`python -m orchestrator.rank`,
in the same working directory) import `tasks.*` and `bench.zoo.*` from it too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import optuna

from orchestrator.app import JobFailed, run_job
from orchestrator.compose import compose_config
from orchestrator.measure.plan import steady_warmup_steps
from orchestrator.schema import Config
from orchestrator.tune.pool import RankPool
from orchestrator.tune.space import SearchSpace, apply
from orchestrator.tune.study import run_study, trial_config

ROOT = Path(__file__).resolve().parents[1]

KNOBS = ("batch_size", "num_workers", "accumulation_steps")
KEYS = {"batch_size": "data.batch_size", "num_workers": "data.num_workers",
        "accumulation_steps": "trainer.accumulation_steps"}

# bench_tune's workloads, whose 24-point grids bench_trials and bench_samplers measure too
WORKLOADS: Dict[str, Dict[str, Any]] = {
    "input_bound": {
        "overrides": ["experiment=input_bound", "sim.read_latency_ms=2", "data.args.blur_passes=1"],
        "space": {"batch_size": [16, 32, 64], "num_workers": [0, 1, 2, 4], "accumulation_steps": [1, 2]},
        "quick": {"batch_size": [8, 16, 32, 64], "num_workers": [0, 4], "accumulation_steps": [1, 2]},
    },
    "comm_heavy": {
        "overrides": ["experiment=comm_heavy", "backend=ddp", "parallelism.nproc_per_node=2"],
        "space": {"batch_size": [8, 16, 32, 64], "num_workers": [0, 1], "accumulation_steps": [1, 2, 4]},
        "quick": {"batch_size": [8, 16, 32, 64], "num_workers": [0, 1], "accumulation_steps": [1, 2]},
    },
}

TARGET_QUALITY = 0.97  # a pick's score against the best (the objective's rule)
REFERENCE_WINDOW_S = 0.25
SETTLE_NEAR = 0.85  # references scoring at least this against the steady best are measured again ...
SETTLE_RUNS = 3  # ... until they have this many runs, averaged

Point = Tuple[int, int, int]  # (batch, workers, accumulation)
Figures = Dict[str, float]


# -- grid points as trials --------------------------------------------------------------------
def space_overrides(space: Dict[str, List[int]]) -> List[str]:
    """A study's config (mode=tune) searching the three knobs with these choices, the global batch
    free, by the utilization objective; the default space's other knobs removed."""
    out = ["~tune.space.prefetch_factor", "~tune.space.pin_memory", "tune.extend_edges=false"]  # the grid is all
    out.append("tune.global_batch=free")  # the search is judged over the whole grid; the held default by bench_target
    out.append("tune.objective=utilization")  # the rule these benches score a pick by (goodput's: bench_target)
    out.append("mode=tune")  # the jobs are a study's trials: measured by its trials' defaults (schema.TRIAL_MEASURE)
    for name, choices in space.items():
        out += [f"tune.space.{name}.type=categorical", f"tune.space.{name}.choices=[{','.join(map(str, choices))}]"]
    return out


def point_of(values: Dict[str, Any]) -> Point:
    return tuple(int(values[KEYS[k]]) for k in KNOBS)  # type: ignore[return-value]


def fmt(p: Point) -> str:
    return f"b{p[0]} w{p[1]} a{p[2]}"


def values_of(space: SearchSpace, p: Point) -> Dict[str, Any]:
    """The exact values the tuner would launch for this point (its own sample(), fixed params)."""
    return space.sample(optuna.trial.FixedTrial(space.params_of({KEYS[k]: v for k, v in zip(KNOBS, p)})))


def study(name: str, overrides: List[str], tmp: Path) -> Dict[str, Any]:
    """`run_study` of the composed overrides under tmp/studies/name: its summary, trials and wall time."""
    t0 = time.monotonic()
    summary = run_study(compose_config(overrides), tmp / "studies" / name, echo=False)
    wall = time.monotonic() - t0
    trials = optuna.load_study(study_name=summary["study_name"], storage=summary["storage"]).trials
    return {"summary": summary, "trials": trials, "wall_s": wall}


# -- scoring ----------------------------------------------------------------------------------
def objective_best(rows: Dict[Point, Dict[str, float]], floor: float) -> Point:
    """The tuner's rule (report.best_trials): highest utilization within floor x best throughput."""
    top = max(r["throughput"] for r in rows.values())
    eligible = [p for p, r in rows.items() if r["throughput"] >= floor * top]
    return max(eligible, key=lambda p: rows[p]["utilization"])


def quality(rows: Dict[Point, Figures], p: Point, floor: float) -> float:
    """`p`'s score against the best of `rows` by the utilization objective's rule."""
    best = objective_best(rows, floor)
    top = max(r["throughput"] for r in rows.values())
    if rows[p]["throughput"] >= floor * top:
        return rows[p]["utilization"] / rows[best]["utilization"] if rows[best]["utilization"] else 1.0
    return rows[p]["throughput"] / rows[best]["throughput"]


# -- steady-state references ------------------------------------------------------------------
class Jobs:
    """Jobs of one workload on one pool of kept-alive ranks."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.dir, self.n = tmp / name, 0
        self.pool = RankPool(self.dir / "pools")

    def run(self, cfg: Config) -> Optional[Dict[str, Any]]:
        self.n += 1
        try:
            return run_job(cfg, self.dir / "jobs" / f"{self.n:04d}", echo=False, ranks=self.pool, plots=False)
        except JobFailed as exc:
            print(f"    FAILED: {str(exc).splitlines()[0]}", flush=True)
            return None

    def close(self) -> None:
        self.pool.close()


def figures(result: Optional[Dict[str, Any]]) -> Figures:
    if not result or not (result.get("estimate") or {}).get("mean"):
        return {"throughput": 0.0, "utilization": 0.0, "measured_s": 0.0}
    est = result["estimate"]
    return {"throughput": float(est["mean"]), "utilization": float(result["utilization"]),
            "measured_s": float(est["measured_s"]), "rel_se": est.get("rel_se") or float("nan"),
            "windows": est["windows"]}


def reference_config(trial_cfg: Config, trial: Figures, factor: float) -> Config:
    """The steady-state run of a trial's config: 3x its steady warmup, then >= factor x the
    trial's measured samples, windows of REFERENCE_WINDOW_S, no stop rule."""
    samples_per_step = trial_cfg.data.batch_size * trial_cfg.trainer.accumulation_steps * trial_cfg.world_size
    trial_samples = max(trial["throughput"] * trial["measured_s"], samples_per_step * 4)
    warm = 3 * steady_warmup_steps(trial_cfg)
    steps = warm + math.ceil(factor * trial_samples / samples_per_step)
    return apply(trial_cfg, {"measure.rel_precision": 0.0, "measure.warmup_steps": warm, "trainer.max_steps": steps,
                             "measure.window_s": REFERENCE_WINDOW_S, "trainer.timeout_s": 1800})


def validity(name: str, cfg: Config, space: SearchSpace, grid: List[Point], factor: float, tmp: Path,
             cache: Optional[Path] = None, retrial: bool = False) -> Dict[str, Any]:
    """Trial and steady-state figures per grid point; with `cache` (a JSON file), points measured
    by an earlier run (bench_trials, bench_samplers or bench_zoo, same workload and factor) are
    read back and new ones added, so the benchmarks share the long reference runs. `retrial`: the
    cached references are kept and every trial is measured again (after a change to trials)."""
    key = f"{name} x{factor:g}"
    stored = json.loads(cache.read_text()) if cache and cache.exists() else {}
    trial: Dict[Point, Figures] = {}
    steady: Dict[Point, Figures] = {}
    for p in grid:
        row = stored.get(key, {}).get(fmt(p))
        if row:
            trial[p], steady[p] = row["trial"], row["steady"]
    if trial:
        print(f"    {len(trial)} points read from {cache}", flush=True)
    jobs = Jobs(tmp, f"{name}-validity")
    try:
        for p in [p for p in grid if p not in trial or retrial]:
            tcfg = trial_config(cfg, values_of(space, p))
            t0 = time.monotonic()
            trial[p] = figures(jobs.run(tcfg))
            t_trial = time.monotonic() - t0
            t0 = time.monotonic()
            if p not in steady:
                steady[p] = figures(jobs.run(reference_config(tcfg, trial[p], factor)))
            t_ref = time.monotonic() - t0
            ratio = trial[p]["throughput"] / steady[p]["throughput"] if steady[p]["throughput"] else float("nan")
            print(f"    {fmt(p):12s} trial {trial[p]['throughput']:8.1f}/s (+-{100 * trial[p].get('rel_se', 0):.0f}%, "
                  f"{trial[p].get('windows', 0)} w, {trial[p]['measured_s']:.1f}s, {t_trial:.1f}s wall)  "
                  f"steady {steady[p]['throughput']:8.1f}/s ({steady[p]['measured_s']:.1f}s, {t_ref:.0f}s wall)  "
                  f"ratio {ratio:.3f}  util {trial[p]['utilization']:.2f}/{steady[p]['utilization']:.2f}", flush=True)
            if cache:
                stored.setdefault(key, {})[fmt(p)] = {"trial": trial[p], "steady": steady[p]}
                cache.write_text(json.dumps(stored, indent=1))
        settle(name, cfg, space, steady, jobs, factor, stored if cache else None, cache)
    finally:
        jobs.close()
    return {"trial": trial, "steady": steady}


def settle(name: str, cfg: Config, space: SearchSpace, steady: Dict[Point, Figures], jobs: Jobs, factor: float,
           stored: Optional[Dict[str, Any]], cache: Optional[Path], also: Sequence[Point] = ()) -> None:
    """The references of the configs near the steady best (score >= SETTLE_NEAR), and of `also`
    (a benchmark's picks: a pick is scored by its reference), measured SETTLE_RUNS times in all,
    in interleaved rounds, and replaced by their mean: one long run's utilization moves by +-10%
    between runs of one config on 2 shared cores (input_bound's four 4-worker configs within 5% of
    the best throughput each read 0.52-0.69 in three runs), so the grid-best by a single reference
    run is a draw among them. Prints each one's range."""
    floor = cfg.tune.throughput_floor
    near = [p for p in steady if steady[p].get("runs", 1) < SETTLE_RUNS
            and (quality(steady, p, floor) >= SETTLE_NEAR or p in also)]
    if not near:
        return
    keep = stored is not None and cache is not None  # the settled figures go to the cache file
    runs: Dict[Point, List[Figures]] = {p: [steady[p]] for p in near}
    for r in range(SETTLE_RUNS - 1):
        order = near[r % len(near):] + near[:r % len(near)]
        for p in order:
            tcfg = trial_config(cfg, values_of(space, p))
            trial_like = {"throughput": steady[p]["throughput"], "measured_s": steady[p]["measured_s"] / factor}
            runs[p].append(figures(jobs.run(reference_config(tcfg, trial_like, factor))))
    for p in near:
        got = [f for f in runs[p] if f["throughput"]]
        steady[p] = {**steady[p], "runs": len(got),
                     **{k: statistics.fmean(f[k] for f in got) for k in ("throughput", "utilization")},
                     "utilization_range": [min(f["utilization"] for f in got), max(f["utilization"] for f in got)],
                     "throughput_range": [min(f["throughput"] for f in got), max(f["throughput"] for f in got)]}
        f = steady[p]
        print(f"    settled {fmt(p):12s} {f['runs']} runs: throughput {f['throughput']:8.1f}/s "
              f"({f['throughput_range'][0]:.0f}-{f['throughput_range'][1]:.0f})  utilization {f['utilization']:.3f} "
              f"({f['utilization_range'][0]:.2f}-{f['utilization_range'][1]:.2f})", flush=True)
        if keep:
            stored.setdefault(f"{name} x{factor:g}", {}).setdefault(fmt(p), {})["steady"] = f  # type: ignore[union-attr]
    if keep:
        cache.write_text(json.dumps(stored, indent=1))  # type: ignore[union-attr]


# -- running and reporting --------------------------------------------------------------------
def prepare(prefix: str, header: Optional[Sequence[str]] = None) -> Path:
    """Quiet, in the repository root (ranks import tasks.* and bench.zoo.* from it); returns a new
    temporary dir. With `header`, the run's first line: the benchmark (the prefix), these facts,
    the CPUs, the load averages and the temporary dir."""
    os.chdir(ROOT)
    warnings.filterwarnings("ignore")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    if header is not None:
        facts = [*header, f"{os.cpu_count()} CPUs", f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
        print(f"{prefix.rstrip('-_')}: {', '.join(facts)}, output {tmp}", flush=True)
    return tmp


def add_run_args(ap: argparse.ArgumentParser, workloads: Dict[str, Any], what: str = "workloads") -> None:
    """--only (some of `workloads`) and --keep (the temporary directory), for `run_workloads`."""
    ap.add_argument("--only", choices=sorted(workloads), nargs="*", default=None, help=f"run only these {what}")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")


def run_workloads(only: Optional[List[str]], keep: bool, tmp: Path, bench: Callable[[str, Any], Dict[str, Any]],
                  workloads: Optional[Dict[str, Any]] = None) -> Dict[str, Dict[str, Any]]:
    """`bench(name, spec)` for each workload (of `workloads`, default WORKLOADS; those in `only`,
    when given), in order; `tmp` removed after unless `keep`."""
    results: Dict[str, Dict[str, Any]] = {}
    try:
        for name, spec in (workloads or WORKLOADS).items():
            if only is None or name in only:
                results[name] = bench(name, spec)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(rows: List[List[str]], legend: str, failed: int) -> int:
    """Print a benchmark's closing table and its legend; the exit status: 1 where `failed` targets were missed."""
    print(table(rows))
    print(legend)
    return 1 if failed else 0


class Results:
    """The closing table: a row per figure, and whether each target was met."""

    def __init__(self) -> None:
        self.rows = [["figure", "workload", "measured", "target", "met"]]
        self.verdicts: List[bool] = []

    def row(self, figure: str, workload: str, measured: str, target: str, ok: Optional[bool]) -> None:
        self.rows.append([figure, workload, measured, target, "-" if ok is None else ("yes" if ok else "NO")])
        if ok is not None:
            self.verdicts.append(ok)
