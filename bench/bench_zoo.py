"""The tuner on a zoo of user-like tasks: every pick judged by steady-state figures of the whole
grid, per task, per sampler, per seed; on CPU.

Tasks (bench/zoo/: the user's own code in bench/zoo/tasks.py, loaded by `_target_` with `model=custom
data=custom`; the user's config and the searched space in bench/zoo/__init__.py), each with another
bottleneck:
  storage_0p1, storage_1, storage_5  each item sleeps 0.1 / 1 / 5 ms (storage latency), tiny MLP;
                                     workers [0,2,4,8]: sleeping workers cost no CPU
  cpu_transform   per-item numpy augmentation (~1.3 ms of CPU), small convnet; workers [0,1,2,4]
  storage_cpu     1 ms sleep plus a lighter augmentation (~0.5 ms); the user's workers=1 is off-grid
  comm_ddp        backend=ddp, 2 ranks, a 10M-parameter embedding bag: the all-reduce dominates
  compute         a small transformer encoder on in-memory sequences
  short_epochs    300 items: large batches leave few steps per epoch, and every epoch restarts the workers
  memory_cap      activations grow with the batch; trainer.memory_cap_mb=850 fails batch 512
                  (measured peaks: b64 460 MB, b128 530, b256 695, b512 1040)
  already_best    compute-bound MLP on in-memory data; the user's b64 w0 a1 is (near) the best
Each space is categorical, 24 points (batch x workers x accumulation); the tasks' modules
(`_target_: bench.zoo.tasks.X`) are found from the repository root, where this script and its
ranks run.

Parts (--part, any subset, in this order; all of them by default):
  grid     every grid point as a trial and by a steady-state reference run of the same config
           (bench.lib.validity: 3x the steady warmup, then >= --factor x the trial's samples;
           the references near the steady best are then settled: 3 runs, interleaved, averaged).
           Points already in the cache are not measured again.
  studies  per task, per sampler (--samplers), per seed (--seeds): `run_study` with 6 trials on
           the task's space, tune.baseline=true when the user's config is a grid point, the
           product's defaults otherwise (confirm_top, pruner, patience; extend_edges is off and the
           global batch free: the space is the whole grid, and a pick outside it could not be scored). Stored: the pick, the study's wall time,
           its measured seconds (trials + confirmation runs) and their share of the wall time,
           launched trials, the path of configs tried. A stored (label, task, sampler, seed) is
           not run again. Then every pick (of this label) whose reference is a single run is
           settled like the near-best ones (3 runs, interleaved): a pick is scored by it.
  default  per task, a 12-trial guided study on the DEFAULT space (conf/tune/default.yaml, no
           space overrides, the product's defaults: the user's global batch held); its pick and the
           steady best of the grid points that train that global batch (held_points) are then run
           side by side in steady state (2 interleaved rounds, the same reference runs): ratio = the
           pick's score against that best by the objective's rule (bench.lib.quality; > 1 is shown as 1).
  resettle per task, the references that decide its scores (the configs near the steady best and
           every pick of every label) measured again side by side, --rounds runs each, interleaved;
           today's mean replaces them (the earlier figures are kept as "steady_before", each run's
           as "samples"): references settled hours or days apart differ by the host's drift.
           Configs that today's figures moved near the best get a second look beside it.
  score    reads the cache and prints one table: per task and label, each sampler's median / worst
           seed score, the default-space ratio ("(free)": stored before the default held the global
           batch, scored against the whole grid), the guided studies' median wall time and measured
           share, the load averages. Score of a pick = bench.lib.quality(steady grid, pick,
           floor) (the utilization objective's rule: its steady utilization / the grid-best's
           when its steady throughput is within tune.throughput_floor of the best, else its
           throughput / the best's); "thr" beside it: its steady throughput / the grid's best;
           "ceiling": the best by half of the resettled references' runs scored by the other half
           (median/worst over the splits), how finely the references can judge a pick.
           Targets: guided median >= 0.97 on every task and worst seed >= 0.90; guided's median
           >= tpe's and >= random's on every task; default-space ratio >= 0.97; measured share >= 50%.

Cache (--cache, JSON, default outputs/bench_zoo.json; --smoke: outputs/bench_zoo_smoke.json):
"<task> x<factor>" holds the grid (bench.lib.validity's layout, per point "trial" and "steady"); "grid",
"studies" and "default" hold the rest, the last two under --label (default "current"), so the
code before a change ("--label before") and after it ("--label after") are scored from one
file, against the same references (score prints every label present).

Time, on 2 cores: a trial takes 1-6 s (the --smoke run, load 2-5: 1.2-5.1 s), a reference run
2-4 s at --factor 1 and about 8-15 s at the default 5, so part grid takes about 6-10 minutes per
task (24 points, then ~2 more runs of each near-best one): ~1-1.5 hours for the ten; part studies
30-60 s per study (6 trials, up to 3 confirmed in 2 rounds), 90 studies (3 samplers x 3 seeds x
10 tasks): ~1-1.5 hours per label; part default 3-4 minutes per task (12 trials, then 4 reference
runs): ~35 minutes; score, seconds. All four parts: about 3-4 hours. Other work on the machine
slows every figure and makes it noisier (torch's 2 intra-op threads wait on a busy core: a tiny
step can take 10x longer); the load average is printed with each task's figures and stored.

--smoke shrinks every space to 4 points (first and last batch, first and last workers, first
accumulation) and the default study to 4 trials, for a check that everything runs:

    .venv/bin/python -m bench.bench_zoo --only storage_1 --part grid studies score --seeds 1 \\
        --samplers guided --factor 1 --smoke

Full run, then the same after a change to the tuner, then the comparison:

    .venv/bin/python -m bench.bench_zoo --label before
    .venv/bin/python -m bench.bench_zoo --label after --part studies default score

A variant of the same code, by its overrides (the label names it):

    .venv/bin/python -m bench.bench_zoo --part studies score --label pruner-interval --tune tune.pruner=interval
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import optuna

from bench.lib import (KNOBS, ROOT, SETTLE_NEAR, SETTLE_RUNS, Figures, Jobs, Point, add_run_args, figures, fmt,
                       objective_best, point_of, prepare, quality, reference_config, run_workloads, settle,
                       space_overrides, study, table, validity, values_of)
from bench.zoo import TASKS
from orchestrator.compose import compose_config
from orchestrator.measure.stats import Z95
from orchestrator.schema import Config, TuneConfig
from orchestrator.tune.rules import expected_scores, not_launched
from orchestrator.tune.space import SearchSpace
from orchestrator.tune.study import trial_config

SAMPLERS = ("guided", "tpe", "random")
PARTS = ("grid", "studies", "default", "resettle", "score")
STUDY_TRIALS = 6
DEFAULT_TRIALS = {False: 12, True: 4}  # by --smoke
DEFAULT_ROUNDS = 2
TARGET_MEDIAN, TARGET_WORST, TARGET_DEFAULT, TARGET_SHARE = 0.97, 0.90, 0.97, 0.50
NOT_LAUNCHED = {"duplicate_of": "=", "predicted_below": "~", "over_memory_of": "^"}  # marks in a study's path:
# measured already, predicted below the floor by the job model, a batch above one that ran out of memory
CHECKS = ("guided median", "guided worst seed", "guided >= tpe", "guided >= random", "default-space ratio",
          "measured share")


# -- the cache file ---------------------------------------------------------------------------
def load(cache: Path) -> Dict[str, Any]:
    return json.loads(cache.read_text()) if cache.exists() else {}


def store(cache: Path, keys: Sequence[str], value: Any) -> None:
    """Set [keys...] = value in the file, read again first (validity writes it too)."""
    data = load(cache)
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    part = cache.with_suffix(".part")
    part.write_text(json.dumps(data, indent=1))
    part.replace(cache)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


# -- tasks ------------------------------------------------------------------------------------
def space_of(spec: Dict[str, Any], smoke: bool) -> Dict[str, List[int]]:
    s = spec["space"]
    if not smoke:
        return s
    return {"batch_size": [s["batch_size"][0], s["batch_size"][-1]],
            "num_workers": [s["num_workers"][0], s["num_workers"][-1]], "accumulation_steps": s["accumulation_steps"][:1]}


def grid_of(space: Dict[str, List[int]]) -> List[Point]:
    return list(itertools.product(*(space[k] for k in KNOBS)))  # type: ignore[arg-type]


def base(spec: Dict[str, Any], tmp: Path) -> List[str]:
    return [*spec["overrides"], "mode=tune", "tracking.enabled=false", f"tune.storage=sqlite:///{tmp}/optuna.db",
            "tune.warm_start=off"]


def steady_of(data: Dict[str, Any], name: str, factor: float, grid: List[Point]) -> Dict[Point, Figures]:
    rows = data.get(f"{name} x{factor:g}", {})
    return {p: rows[fmt(p)]["steady"] for p in grid if "steady" in rows.get(fmt(p), {})}


def score(steady: Dict[Point, Figures], pick: Optional[Point], floor: float) -> Tuple[float, float]:
    """(the objective's score, the throughput-only score) of `pick` against the steady grid."""
    if pick is None or pick not in steady:
        return 0.0, 0.0
    top = max(r["throughput"] for r in steady.values())
    return quality(steady, pick, floor), (steady[pick]["throughput"] / top if top else 0.0)


RUN_NOISE = TuneConfig().run_noise
RANGE_OF_3 = 1.69  # the expected range of 3 normal draws, in standard deviations


def with_spread(f: Figures) -> Figures:
    """A steady reference with a 95% throughput interval for its mean: from the range of its
    settled runs when it has them (3 runs: sd ~ range / 1.69), else from its windows widened by
    one run's noise (tune.run_noise's default)."""
    thr = f["throughput"]
    if f.get("runs", 1) > 1 and f.get("throughput_range"):
        lo, hi = f["throughput_range"]
        se = (hi - lo) / RANGE_OF_3 / math.sqrt(f["runs"])
    else:
        se = thr * math.hypot(f.get("rel_se") or 0.0, RUN_NOISE)
    return {**f, "throughput_lo": thr - Z95 * se, "throughput_hi": thr + Z95 * se}


def noise_aware(steady: Dict[Point, Figures], pick: Optional[Point], floor: float) -> float:
    """`pick`'s score by the product's own rule for noisy figures (rules.expected_scores: within the
    floor by utilization, weighted by the chance of keeping up with it) over the references' own
    spread, as a share of the best reference's: a pick the references cannot tell from the best
    scores near 1, where the point rule can drop it to its throughput ratio for a 1% difference."""
    if pick is None or pick not in steady:
        return 0.0
    points = list(steady)
    scores = expected_scores([with_spread(steady[p]) for p in points], floor)
    top = max(scores)
    return scores[points.index(pick)] / top if top > 0 else 0.0


# -- part grid --------------------------------------------------------------------------------
def grid_part(name: str, spec: Dict[str, Any], args: argparse.Namespace, tmp: Path) -> None:
    space_spec = space_of(spec, args.smoke)
    grid = grid_of(space_spec)
    cfg = compose_config([*base(spec, tmp), *space_overrides(space_spec)])
    load0, t0 = load_avg(), time.monotonic()
    print(f"\n== {name} grid: {len(grid)} points, reference x{args.factor:g}, load average {load0:.2f}", flush=True)
    v = validity(name, cfg, SearchSpace(cfg), grid, args.factor, tmp, args.cache)
    floor = cfg.tune.throughput_floor
    best = objective_best(v["steady"], floor)
    wall = time.monotonic() - t0
    print(f"  steady grid-best {fmt(best)}: util {v['steady'][best]['utilization']:.3f} thr "
          f"{v['steady'][best]['throughput']:.1f}/s  ({wall:.0f}s, load average {load0:.2f} -> {load_avg():.2f})", flush=True)
    prev = load(args.cache).get("grid", {}).get(f"{name} x{args.factor:g}", {})
    store(args.cache, ["grid", f"{name} x{args.factor:g}"],
          {"load": [*prev.get("load", []), load0, load_avg()], "wall_s": prev.get("wall_s", 0.0) + wall})


# -- part studies -----------------------------------------------------------------------------
def record(r: Dict[str, Any]) -> Dict[str, Any]:
    """What a study is judged by: pick, wall and measured time, launched trials, path (configs in
    the order proposed; *: a diagnosis proposal; = ~ ^: not launched, see NOT_LAUNCHED; pruned, fail)."""
    summary, trials = r["summary"], sorted(r["trials"], key=lambda t: t.number)
    confirmed = summary.get("confirmed") or {}
    measured = (sum(t.user_attrs.get("measured_s") or 0.0 for t in trials)
                + sum(c.get("measured_s") or 0.0 for c in confirmed.values()))
    path = []
    for t in trials:
        if "values" not in t.user_attrs:
            continue
        mark = "*" if t.user_attrs.get("proposed_by") == "diagnosis" else ""
        why = next((m for k, m in NOT_LAUNCHED.items() if k in t.user_attrs), None)
        state = "" if t.state.name == "COMPLETE" else (why or f" {t.state.name.lower()}")
        path.append(f"{fmt(point_of(t.user_attrs['values']))}{mark}{state}")
    best = summary.get("best")
    return {"pick": list(point_of(best["values"])) if best else None, "wall_s": r["wall_s"], "measured_s": measured,
            "launched": sum(not not_launched(t) for t in trials if "values" in t.user_attrs),
            "confirmed": sorted(map(int, confirmed)), "path": path, "states": summary["states"],
            "stopped": (summary.get("stopped") or {}).get("by"), "load": load_avg(),
            "spent": (summary.get("measured_share") or {}).get("spent") or {}}


def run(sname: str, overrides: List[str], tmp: Path) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """(record, best trial's summary) of one study; a study that raises (e.g. too many failed
    trials) is recorded with its error and no pick: the user gets nothing from it either."""
    t0 = time.monotonic()
    try:
        r = study(sname, overrides, tmp)
    except Exception as exc:  # noqa: BLE001 -- judged, not fatal to the benchmark
        print(f"    study {sname} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return {"pick": None, "wall_s": time.monotonic() - t0, "measured_s": 0.0, "launched": 0, "confirmed": [],
                "path": [], "states": {}, "stopped": None, "load": load_avg(), "error": str(exc)[:500]}, None
    return record(r), r["summary"].get("best")


def studies_part(name: str, spec: Dict[str, Any], args: argparse.Namespace, tmp: Path) -> None:
    space_spec = space_of(spec, args.smoke)
    grid = grid_of(space_spec)
    common = [*base(spec, tmp), *space_overrides(space_spec), f"tune.n_trials={STUDY_TRIALS}", *args.tune]
    cfg = compose_config(common)
    user = point_of(SearchSpace(cfg).baseline())
    common.append(f"tune.baseline={str(user in grid).lower()}")
    data = load(args.cache)
    steady, floor = steady_of(data, name, args.factor, grid), cfg.tune.throughput_floor
    done = data.get("studies", {}).get(args.label, {}).get(name, {})
    print(f"\n== {name} studies ({args.label}): user's config {fmt(user)}{'' if user in grid else ' (off the grid)'}, "
          f"load average {load_avg():.2f}", flush=True)
    for sampler in args.samplers:
        for seed in range(args.seeds):
            if str(seed) in done.get(sampler, {}):
                continue
            sname = f"zoo-{name}-{args.label}-{sampler}-{seed}-{time.time_ns()}"
            rec, _ = run(sname, [*common, f"tune.sampler={sampler}", f"tune.seed={seed}", f"tune.study_name={sname}"],
                         tmp)
            store(args.cache, ["studies", args.label, name, sampler, str(seed)], rec)
            pick = tuple(rec["pick"]) if rec["pick"] else None
            q, thr = score(steady, pick, floor) if steady else (float("nan"), float("nan"))
            print(f"    {sampler:6s} seed {seed}: pick {fmt(pick) if pick else 'none'} (score {q:.3f}, thr {thr:.3f}); "
                  f"study {rec['wall_s']:.0f}s, measured {100 * rec['measured_s'] / rec['wall_s']:.0f}%, "
                  f"{rec['launched']} launched; load {rec['load']:.2f}; path {', '.join(rec['path'])}; spent (s) "
                  + " ".join(f"{k} {v:.1f}" for k, v in rec.get("spent", {}).items()), flush=True)
    settle_picks(name, cfg, args, tmp)


def settle_picks(name: str, cfg: Config, args: argparse.Namespace, tmp: Path) -> None:
    """Every pick of this label's studies of the task scored by a settled reference: the grid
    settles the configs near its best, and a pick below them would be judged by one long run
    (compute's b64 w0 a2 read 0.745 of b64 w0 a1 in one run; runs of one config there spread +-12%)."""
    data = load(args.cache)
    grid = grid_of(space_of(TASKS[name], args.smoke))
    steady = steady_of(data, name, args.factor, grid)
    picks = {tuple(rec["pick"]) for by_seed in data.get("studies", {}).get(args.label, {}).get(name, {}).values()
             for rec in by_seed.values() if rec.get("pick")}
    picks = {p for p in picks if p in steady and steady[p].get("runs", 1) < SETTLE_RUNS}
    if not picks:
        return
    print(f"    settling the references of {len(picks)} pick(s): {', '.join(map(fmt, sorted(picks)))}", flush=True)
    jobs = Jobs(tmp, f"{name}-settle")
    try:
        settle(name, cfg, SearchSpace(cfg), steady, jobs, args.factor, data, args.cache, also=sorted(picks))
    finally:
        jobs.close()


# -- part resettle ----------------------------------------------------------------------------
def resettle_part(name: str, spec: Dict[str, Any], args: argparse.Namespace, tmp: Path) -> None:
    """The references that decide the scores measured again side by side, today: the configs near
    the steady best and near the top throughput (bench.lib.SETTLE_NEAR) and every pick of every
    label, --rounds runs each in interleaved rounds, replacing their figures by today's mean (the
    earlier ones kept as "steady_before", each run's figures as "samples": the split-half ceiling
    is computed from them). References settled on different days differ by the host's drift (a
    matmul loop read 302-698 iterations per 0.5 s on an idle machine within one day), and a
    grid-best decided by a few percent between two configs measured hours apart is a draw.
    Today's figures can move the best: configs near the new best that were not measured today get
    a second look, side by side with the best (storage_cpu's best became a config whose one
    reference was taken on an earlier day, 15-20% faster for every config)."""
    data = load(args.cache)
    grid = grid_of(space_of(spec, args.smoke))
    steady = steady_of(data, name, args.factor, grid)
    if len(steady) < len(grid):
        print(f"\n== {name} resettle: the grid is not measured yet ({len(steady)}/{len(grid)}): run --part grid first")
        return
    cfg = compose_config([*base(spec, tmp), *space_overrides(space_of(spec, args.smoke))])
    floor = cfg.tune.throughput_floor
    picks = {tuple(rec["pick"]) for by_label in data.get("studies", {}).values()
             for by_seed in by_label.get(name, {}).values() for rec in by_seed.values() if rec.get("pick")}
    chosen = [p for p in grid if p in picks or _near(steady, p, floor)]
    space = SearchSpace(cfg)
    runs: Dict[Point, List[Figures]] = {}
    jobs = Jobs(tmp, f"{name}-resettle")
    try:
        _remeasure(jobs, cfg, space, chosen, steady, args, runs, f"{name} resettle")
        today = {p: _today(steady[p], fs) for p, fs in runs.items()}
        now = {**steady, **{p: f for p, f in today.items() if f}}
        more = [p for p in grid if p not in runs and _near(now, p, floor)]
        if more:  # beside the (new) best few, so that they are compared in the same rounds
            best = sorted(runs, key=lambda p: -quality(now, p, floor))[:2]
            _remeasure(jobs, cfg, space, more + best, steady, args, runs, f"{name} resettle, second look")
    finally:
        jobs.close()
    rows = load(args.cache).setdefault(f"{name} x{args.factor:g}", {})
    for p, fs in runs.items():
        before, now_p = steady[p], _today(steady[p], fs)
        if now_p is None:
            continue
        print(f"    {fmt(p):12s} throughput {before['throughput']:7.0f} -> {now_p['throughput']:7.0f}/s "
              f"({now_p['throughput_range'][0]:.0f}-{now_p['throughput_range'][1]:.0f}); utilization "
              f"{before['utilization']:.3f} -> {now_p['utilization']:.3f} "
              f"({now_p['utilization_range'][0]:.2f}-{now_p['utilization_range'][1]:.2f})", flush=True)
        store(args.cache, [f"{name} x{args.factor:g}", fmt(p), "steady"], now_p)
        store(args.cache, [f"{name} x{args.factor:g}", fmt(p), "steady_before"], rows.get(fmt(p), {}).get(
            "steady_before", before))


def _near(steady: Dict[Point, Figures], p: Point, floor: float) -> bool:
    """Near the best by the objective, or near the top throughput (it sets the floor: short_epochs'
    b64 w2 a1 is the fastest and among the least busy)."""
    top = max(f["throughput"] for f in steady.values())
    return quality(steady, p, floor) >= SETTLE_NEAR or steady[p]["throughput"] >= SETTLE_NEAR * top


def _remeasure(jobs: Jobs, cfg: Config, space: SearchSpace, points: List[Point], steady: Dict[Point, Figures],
               args: argparse.Namespace, runs: Dict[Point, List[Figures]], what: str) -> None:
    """--rounds reference runs of each of `points` (as long as their `steady` reference), interleaved,
    added to `runs`."""
    print(f"\n== {what}: {len(points)} configs x {args.rounds} interleaved runs, load average {load_avg():.2f}",
          flush=True)
    for r in range(args.rounds):
        for p in points[r % len(points):] + points[:r % len(points)]:
            trial_like = {"throughput": steady[p]["throughput"], "measured_s": steady[p]["measured_s"] / args.factor}
            tcfg = trial_config(cfg, values_of(space, p))
            runs.setdefault(p, []).append(figures(jobs.run(reference_config(tcfg, trial_like, args.factor))))
        print(f"    round {r + 1}/{args.rounds} done, load average {load_avg():.2f}", flush=True)


def _today(before: Figures, fs: List[Figures]) -> Optional[Figures]:
    """A reference from today's runs (those that did not fail): their mean, range and samples."""
    got = [f for f in fs if f["throughput"]]
    if not got:
        return None
    return {**before, "runs": len(got), "resettled": time.strftime("%Y-%m-%d %H:%M"),
            **{k: statistics.fmean(f[k] for f in got) for k in ("throughput", "utilization")},
            "utilization_range": [min(f["utilization"] for f in got), max(f["utilization"] for f in got)],
            "throughput_range": [min(f["throughput"] for f in got), max(f["throughput"] for f in got)],
            "samples": [[f["throughput"], f["utilization"]] for f in got]}


def ceiling(steady: Dict[Point, Figures], floor: float) -> Optional[Tuple[float, float]]:
    """The split-half ceiling: the configs with per-run samples (resettled) split by run into two
    halves; the best by one half scored by the other (both ways, every split of the runs into equal
    halves); (median, worst). A tuner that had measured every config with half the references'
    runs would score this: the bench cannot tell picks apart more finely than it. None when fewer
    than two configs have four or more runs."""
    sampled = {p: f["samples"] for p, f in steady.items() if len(f.get("samples") or []) >= 4}
    if len(sampled) < 2:
        return None
    n = min(len(s) for s in sampled.values())
    rest = {p: f for p, f in steady.items() if p not in sampled}
    out: List[float] = []
    for half in itertools.combinations(range(n), n // 2):
        other = [i for i in range(n) if i not in half]
        a, b = ({p: {**steady[p], **_mean([sampled[p][i] for i in idx])} for p in sampled} for idx in (half, other))
        for x, y in ((a, b), (b, a)):
            pick = objective_best({**rest, **x}, floor)
            out.append(quality({**rest, **y}, pick, floor))
    return statistics.median(out), min(out)


def _mean(samples: List[List[float]]) -> Figures:
    return {"throughput": statistics.fmean(s[0] for s in samples), "utilization": statistics.fmean(s[1] for s in samples)}


# -- part default -----------------------------------------------------------------------------
def side_by_side(jobs: Jobs, arms: Dict[str, Tuple[Config, Figures]], rounds: int, factor: float) -> Dict[str, Figures]:
    """Each arm's reference run once per round, order rotated every round; mean figures of the
    runs that did not fail."""
    names = list(arms)
    runs: Dict[str, List[Figures]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n].append(figures(jobs.run(reference_config(*arms[n], factor))))
    out: Dict[str, Figures] = {}
    for n, fs in runs.items():
        got = [f for f in fs if f["throughput"]] or fs[:1]  # a failed run (zeros) counts only when all failed
        out[n] = {k: statistics.fmean(f[k] for f in got) for k in ("throughput", "utilization")}
    return out


def held_points(space: SearchSpace, steady: Dict[Point, Figures]) -> Dict[Point, Figures]:
    """The grid points `space` can reach: those that train the global batch it holds (all when free).
    A held space's pick is judged against the best at that batch (the default holds it with adamw,
    frees it with sgd)."""
    if space.global_batch is None:
        return dict(steady)
    return {p: f for p, f in steady.items() if p[0] * p[2] * space.world == space.global_batch}


def default_part(name: str, spec: Dict[str, Any], args: argparse.Namespace, tmp: Path) -> None:
    if name in load(args.cache).get("default", {}).get(args.label, {}):
        return
    space_spec = space_of(spec, args.smoke)
    grid = grid_of(space_spec)
    grid_cfg = compose_config([*base(spec, tmp), *space_overrides(space_spec)])
    steady, floor = steady_of(load(args.cache), name, args.factor, grid), grid_cfg.tune.throughput_floor
    if len(steady) < len(grid):
        print(f"\n== {name} default: the grid is not measured yet ({len(steady)}/{len(grid)}): run --part grid first")
        return
    n = DEFAULT_TRIALS[args.smoke]
    sname = f"zoo-{name}-{args.label}-default-{time.time_ns()}"
    overrides = [*base(spec, tmp), "tune.sampler=guided", f"tune.n_trials={n}", f"tune.study_name={sname}"]
    cfg = compose_config(overrides)
    space = SearchSpace(cfg)
    held = held_points(space, steady)
    if not held:
        print(f"\n== {name} default: no grid point trains the global batch {space.global_batch} that the default "
              "space holds: not scored")
        return
    print(f"\n== {name} default space ({args.label}): {space.grid_size()} configs (global batch "
          f"{space.global_batch or 'free'}), {n} guided trials, scored against {len(held)} grid points, "
          f"load average {load_avg():.2f}", flush=True)
    rec, best = run(sname, overrides, tmp)
    gbest = objective_best(held, floor)
    out: Dict[str, Any] = {**rec, "values": None, "grid_best": list(gbest), "held": space.global_batch, "ratio": 0.0}
    if best:
        values = best["values"]
        gvalues = values_of(SearchSpace(grid_cfg), gbest)
        arms = {"grid": (trial_config(grid_cfg, gvalues), {"throughput": steady[gbest]["throughput"],
                                                           "measured_s": steady[gbest]["measured_s"] / args.factor})}
        if values != gvalues:
            arms["pick"] = (trial_config(cfg, values), {"throughput": best.get("throughput") or 0.0,
                                                        "measured_s": best.get("measured_s") or 1.0})
        jobs = Jobs(tmp, f"{name}-default-steady")
        try:
            measured = side_by_side(jobs, arms, DEFAULT_ROUNDS, args.factor)
        finally:
            jobs.close()
        measured.setdefault("pick", measured["grid"])
        ratio = quality(measured, "pick", floor)  # type: ignore[arg-type]
        out.update(values=values, steady=measured, ratio=ratio,
                   thr_ratio=measured["pick"]["throughput"] / measured["grid"]["throughput"]
                   if measured["grid"]["throughput"] else 0.0)
        knobs = " ".join(f"{k.split('.')[-1]}={v}" for k, v in values.items() if v is not None)
        print(f"    pick {knobs}: "
              f"steady thr {measured['pick']['throughput']:.1f}/s util {measured['pick']['utilization']:.3f}; grid-best "
              f"{fmt(gbest)}: thr {measured['grid']['throughput']:.1f}/s util {measured['grid']['utilization']:.3f}; "
              f"ratio {ratio:.3f}; study {rec['wall_s']:.0f}s; load {load_avg():.2f}; path {', '.join(rec['path'])}", flush=True)
    store(args.cache, ["default", args.label, name], out)


# -- part score -------------------------------------------------------------------------------
def med_worst(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3f}/{min(xs):.3f}" if xs else "-"


def score_part(args: argparse.Namespace, names: List[str]) -> bool:
    data = load(args.cache)
    labels = list(dict.fromkeys([*data.get("studies", {}), *data.get("default", {})]))  # in the order stored
    rows = [["task", "label", *(f"{s} score med/worst (thr)" for s in SAMPLERS), "guided noise-aware",
             "ceiling", "default ratio", "guided wall", "measured", "load grid/studies"]]
    fails: Dict[str, List[str]] = {f"{label}: {what}": [] for label in labels for what in CHECKS}
    missing: Dict[str, List[str]] = {key: [] for key in fails}  # no figures to judge
    judged = dict.fromkeys(fails, 0)
    overall: Dict[str, Dict[str, float]] = {label: {} for label in labels}
    noisy: Dict[str, Dict[str, float]] = {label: {} for label in labels}  # guided, scored within the references' spread
    for name, label in itertools.product(names, labels):
        spec = TASKS[name]
        grid = grid_of(space_of(spec, args.smoke))
        steady = steady_of(data, name, args.factor, grid)
        studies = data.get("studies", {}).get(label, {}).get(name, {})
        dflt = data.get("default", {}).get(label, {}).get(name)
        if not steady or not (studies or dflt):
            continue
        floor = compose_config(spec["overrides"]).tune.throughput_floor
        cells, med, worst = [], {}, {}
        for s in SAMPLERS:
            recs = list(studies.get(s, {}).values())
            scores = [score(steady, tuple(r["pick"]) if r["pick"] else None, floor) for r in recs]
            q, t = [x[0] for x in scores], [x[1] for x in scores]
            cells.append(f"{med_worst(q)} ({med_worst(t)})" if recs else "-")
            if recs:
                med[s], worst[s] = statistics.median(q), min(q)
        guided = list(studies.get("guided", {}).values())
        aware = [noise_aware(steady, tuple(r["pick"]) if r["pick"] else None, floor) for r in guided]
        if aware:
            noisy[label][name] = statistics.median(aware)
        share = statistics.median(r["measured_s"] / r["wall_s"] for r in guided) if guided else None
        gload = data.get("grid", {}).get(f"{name} x{args.factor:g}", {}).get("load", [])
        sload = [r["load"] for recs in studies.values() for r in recs.values()]
        partial = "" if len(steady) == len(grid) else f" [grid {len(steady)}/{len(grid)}]"
        top = ceiling(steady, floor)
        rows.append([name + partial, label, *cells, med_worst(aware), f"{top[0]:.3f}/{top[1]:.3f}" if top else "-",
                     f"{dflt['ratio']:.3f}" + ("" if "held" in dflt else " (free)") if dflt else "-",
                     f"{statistics.median(r['wall_s'] for r in guided):.0f}s" if guided else "-",
                     f"{100 * share:.0f}%" if share is not None else "-",
                     f"{max(gload, default=float('nan')):.1f}/{statistics.median(sload) if sload else float('nan'):.1f}"])
        g = med.get("guided")
        overall[label][name] = g if g is not None else float("nan")
        verdicts = {  # what -> (met, what to print when not), or None: nothing to judge
            "guided median": None if g is None else (g >= TARGET_MEDIAN, f"{g:.3f}" + (
                f" (ceiling {top[0]:.3f})" if top else "")),
            "guided worst seed": None if g is None else (worst["guided"] >= TARGET_WORST, f"{worst['guided']:.3f}" + (
                f" (ceiling {top[1]:.3f})" if top else "")),
            **{f"guided >= {s}": None if g is None or s not in med else (g >= med[s], f"guided {g:.3f} < {s} {med[s]:.3f}")
               for s in ("tpe", "random")},
            "default-space ratio": None if not dflt else (dflt["ratio"] >= TARGET_DEFAULT, f"{dflt['ratio']:.3f}"),
            "measured share": None if share is None else (share >= TARGET_SHARE, f"{100 * share:.0f}%"),
        }
        for what, verdict in verdicts.items():
            judged[f"{label}: {what}"] += verdict is not None
            if verdict is None:
                missing[f"{label}: {what}"].append(name)
            elif not verdict[0]:
                fails[f"{label}: {what}"].append(f"{name} {verdict[1]}")
    print(f"\n== bench_zoo scores (cache {args.cache}, references x{args.factor:g}); score = the objective's rule on "
          "steady-state figures vs the steady grid-best, (thr) = steady throughput / the grid's best; ceiling = "
          "the best by half the resettled references' runs, scored by the other half (median/worst over splits)")
    if len(rows) == 1:
        print("nothing to score: run --part grid and studies (or default) first")
        return False
    print(table(rows))
    for label, per in overall.items():
        known = {n: q for n, q in per.items() if q == q}
        if known:
            low = min(known, key=lambda n: known[n])
            print(f"{label}: guided median over tasks {statistics.median(known.values()):.3f}, worst task {low} "
                  f"{known[low]:.3f}")
        aware = noisy[label]
        if aware:
            low = min(aware, key=lambda n: aware[n])
            print(f"{label}: noise-aware (the references' own spread): median over tasks "
                  f"{statistics.median(aware.values()):.3f}, worst task {low} {aware[low]:.3f}")
    print(f"targets: guided median >= {TARGET_MEDIAN} and worst seed >= {TARGET_WORST} on every task; guided >= tpe "
          f"and >= random; default-space ratio >= {TARGET_DEFAULT}; measured share >= {100 * TARGET_SHARE:.0f}%")
    for what, bad in fails.items():
        unknown = f" (not measured: {', '.join(missing[what])})" if missing[what] else ""
        status = "NOT met: " + ", ".join(bad) if bad else ("met" if judged[what] else "-")
        print(f"  {what}: {status}{unknown}")
    return not any(fails.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, TASKS, "tasks")
    ap.add_argument("--part", choices=PARTS, nargs="*", default=list(PARTS))
    ap.add_argument("--cache", type=Path, default=None, help="JSON file (default outputs/bench_zoo.json)")
    ap.add_argument("--label", default="current", help="studies are stored under this name (e.g. before / after)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--samplers", choices=SAMPLERS, nargs="*", default=list(SAMPLERS))
    ap.add_argument("--rounds", type=int, default=4, help="part resettle: runs of each config, interleaved")
    ap.add_argument("--factor", type=float, default=5.0, help="reference length: x the trial's measured samples")
    ap.add_argument("--smoke", action="store_true", help="4-point spaces, a 4-trial default study: a check that all runs")
    ap.add_argument("--tune", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for the studies (e.g. tune.pruner=interval: the label then names that variant)")
    args = ap.parse_args()
    args.cache = (args.cache or ROOT / "outputs" / f"bench_zoo{'_smoke' if args.smoke else ''}.json").resolve()
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    names = [n for n in TASKS if args.only is None or n in args.only]

    measure = [p for p in PARTS[:-1] if p in args.part]
    start = time.monotonic()
    if measure:
        tmp = prepare("bench_zoo-")
        print(f"bench_zoo: parts {' '.join(measure)}, label {args.label}, {args.seeds} seeds, samplers "
              f"{' '.join(args.samplers)}, reference x{args.factor:g}{', smoke' if args.smoke else ''}; {os.cpu_count()} "
              f"CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; cache {args.cache}; output {tmp}",
              flush=True)
        parts = {"grid": grid_part, "studies": studies_part, "default": default_part, "resettle": resettle_part}

        def bench(name: str, spec: Dict[str, Any]) -> Dict[str, Any]:
            for p in measure:
                parts[p](name, spec, args, tmp)
            return {}

        run_workloads(args.only, args.keep, tmp, bench, TASKS)
        print(f"\nmeasured in {time.monotonic() - start:.0f}s, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    else:
        os.chdir(ROOT)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    if "score" in args.part:
        return 0 if score_part(args, names) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
