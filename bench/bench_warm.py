"""Warm starts: how soon a second study of a job finds what the first one found.

Per task of the zoo (bench/zoo), every study a real one in one Optuna storage, the global batch held
at the user's (`tune.global_batch=user`: goodput is then samples/s, so a steady reference's samples/s
scores a pick exactly):
  A  a cold study (`tune.warm_start=off`, --trials trials): its pick, its wall time;
  B  after a change the fingerprint leaves alone (`trainer.lr` halved, 2x the epochs), a study with
     the default `tune.warm_start=auto`, --after trials: it starts from A;
  C  the same job on 2 DDP ranks (another world size: a partial match), warm, --after trials;
  D  a cold study at 2 ranks (--trials trials): the best C is scored against.
Scoring, as in the zoo: steady-state reference runs (bench.lib.reference_config) of A's and D's
picks and of the best config B and C had after each of their trials (by the study's own ranking of
its trials so far), interleaved; B "reaches" after trial k when the steady samples/s of its best
after k trials is >= 0.97 x that of A's pick; its time is its wall time to the end of that trial
over A's whole wall time. C likewise against D's pick.

Targets (issue: warm starts): B reaches 0.97 in <= 2 trials and <= 30% of A's wall time; C in <= 3
trials. Time on 2 cores: 5-8 minutes a task and seed.

The cache (--cache, outputs/bench_warm.json) keeps each task's results by seed (`--seed`, the
studies' tune.seed): a task and seed cached is not run again, so seeds add up over calls. An entry
of the older form (one result a task, no seeds) was run with seed 0 and reads as seed 0. The table
gives per task the median and the worst over the seeds cached ("never" is the worst there is), and
how many seeds met every target.

    .venv/bin/python -m bench.bench_warm --only storage_1 cpu_transform
    .venv/bin/python -m bench.bench_warm --only short_epochs --seed 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

import optuna

from bench.lib import TARGET_QUALITY, Jobs, figures, prepare, reference_config, study, verdict
from bench.zoo import TASKS as ZOO
from orchestrator.compose import compose_config
from orchestrator.tune.launch import trial_config

TASKS = ("storage_1", "storage_0p1", "cpu_transform", "short_epochs")
REFERENCE_S = 4.0
KNOB_KEYS = ("data.batch_size", "data.num_workers", "trainer.accumulation_steps", "data.prefetch_factor")


def space(name: str) -> List[str]:
    """The zoo's space for the task (categorical), as bench_target composes it."""
    keys = {"batch_size": "data.batch_size", "num_workers": "data.num_workers",
            "accumulation_steps": "trainer.accumulation_steps"}
    return [f"tune.space.{k}={{key: {keys[k]}, type: categorical, choices: {list(v)}}}"
            for k, v in ZOO[name]["space"].items()] + ["~tune.space.prefetch_factor", "~tune.space.pin_memory"]


def best_after(trials: List[Any], k: int) -> Optional[Dict[str, Any]]:
    """The values of the best of the first k trials by the study's value (the trials it measured)."""
    done = [tr for tr in trials[:k] if tr.state.name == "COMPLETE" and tr.values]
    return max(done, key=lambda tr: tr.values[0]).user_attrs["values"] if done else None


def key_of(values: Dict[str, Any]) -> str:
    return " ".join(f"{k.split('.')[-1]}={values.get(k)}" for k in KNOB_KEYS if k in values)


def steady(jobs: Jobs, cfg: Any, values: Dict[str, Any], seen: Dict[str, float], rounds: int) -> float:
    """Mean steady samples/s of `values` over `rounds` reference runs (cached by config in `seen`)."""
    key = key_of(values)
    if key not in seen:
        tcfg = trial_config(cfg, values)
        about = {"throughput": 1000.0, "measured_s": REFERENCE_S}  # ~REFERENCE_S x 1000 samples after its warmup
        got = [figures(jobs.run(reference_config(tcfg, about, 1.0)))["throughput"] for _ in range(rounds)]
        seen[key] = sum(got) / len(got)
    return seen[key]


def reach(ref_cfg: Any, pick: Dict[str, Any], warm: Dict[str, Any], jobs: Jobs, seen: Dict[str, float],
          rounds: int) -> Dict[str, Any]:
    """The first trial after which the warm study's best scores >= TARGET_QUALITY of `pick`, and the
    warm study's wall time from its call to the end of that trial."""
    top = steady(jobs, ref_cfg, pick, seen, rounds)
    t0 = warm["called"]
    for k in range(1, len(warm["trials"]) + 1):
        best = best_after(warm["trials"], k)
        if best is None:
            continue
        score = steady(jobs, ref_cfg, best, seen, rounds) / top if top else 0.0
        if score >= TARGET_QUALITY:
            end = warm["trials"][k - 1].datetime_complete
            return {"trials": k, "score": score, "wall_s": (end - t0).total_seconds() if end and t0 else None}
    return {"trials": None, "score": None, "wall_s": None}


def timed_study(label: str, overrides: List[str], here: Path) -> Dict[str, Any]:
    called = datetime.now()  # Optuna stamps trials with the local datetime.now()
    return {**study(label, overrides, here), "called": called}


def one(name: str, args: argparse.Namespace, tmp: Path) -> Dict[str, Any]:
    here = tmp / name
    base = [*ZOO[name]["overrides"], "mode=tune", "tracking.enabled=false", f"tune.storage=sqlite:///{here}/optuna.db",
            "tune.global_batch=user", f"tune.seed={args.seed}", *space(name)]
    lr = compose_config(base).trainer.lr
    ddp = ["backend=ddp", "parallelism.nproc_per_node=2"]
    a = timed_study("A", [*base, "tune.warm_start=off", f"tune.n_trials={args.trials}"], here)
    b = timed_study("B", [*base, f"trainer.lr={lr / 2}", "trainer.epochs=2", f"tune.n_trials={args.after}"], here)
    c = timed_study("C", [*base, *ddp, f"tune.n_trials={args.after}"], here)
    d = timed_study("D", [*base, *ddp, "tune.warm_start=off", f"tune.n_trials={args.trials}"], here)
    out: Dict[str, Any] = {"A_wall_s": a["wall_s"], "D_wall_s": d["wall_s"],
                           "B_warm": b["summary"].get("warm_start"), "C_warm": c["summary"].get("warm_start")}
    jobs = Jobs(here, "refs")
    try:
        seen: Dict[str, float] = {}
        out["B"] = reach(compose_config(base), a["summary"]["pick_values"], b, jobs, seen, args.rounds)
        seen2: Dict[str, float] = {}
        out["C"] = reach(compose_config([*base, *ddp]), d["summary"]["pick_values"], c, jobs, seen2, args.rounds)
    finally:
        jobs.close()
    out["steady"] = {"1 rank": seen, "2 ranks": seen2}
    return out


def by_seed(entry: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A task's cache entry as {seed: result}; an entry of the older form (one result, no seeds) was
    run with seed 0."""
    return entry["seeds"] if "seeds" in entry else {"0": entry}


def figures_of(r: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """One seed's figures: B's and C's trials to 0.97 (None: never), B's wall time over A's, and
    whether it met every target (1 or 0)."""
    b, c = r["B"], r["C"]
    share = b["wall_s"] / r["A_wall_s"] if b["wall_s"] is not None else None
    ok = (b["trials"] is not None and b["trials"] <= 2 and share is not None and share <= 0.30
          and c["trials"] is not None and c["trials"] <= 3)
    return {"A_wall_s": r["A_wall_s"], "B": b["trials"], "share": share, "C": c["trials"], "met": float(ok)}


def median_worst(values: List[Optional[float]]) -> tuple:
    """The median and the worst (the largest) of `values`, None (never) above every number."""
    key = [float("inf") if v is None else v for v in values]
    med, worst = statistics.median_low(key), max(key)
    return (None if med == float("inf") else med), (None if worst == float("inf") else worst)


def _cell(values: List[Optional[float]], fmt: str) -> str:
    med, worst = median_worst(values)

    def one(v: Optional[float]) -> str:
        return "never" if v is None else fmt.format(v)
    return one(med) if len(values) == 1 else f"{one(med)} / {one(worst)}"


def report(results: Dict[str, Dict[str, Any]]) -> int:
    """Per task: the seeds cached, and the median / worst over them of each figure."""
    rows = [["task", "seeds", "A wall s", "B: trials to 0.97", "B wall / A's", "B from", "C: trials to 0.97 (2 ranks)",
             "C from", "met"]]
    failed = 0
    for name, entry in results.items():
        seeds = by_seed(entry)
        figs = [figures_of(r) for r in seeds.values()]
        met = int(sum(f["met"] or 0 for f in figs))
        failed += met < len(figs)
        first = next(iter(seeds.values()))
        rows.append([name, ",".join(sorted(seeds, key=int)), _cell([f["A_wall_s"] for f in figs], "{:.0f}"),
                     _cell([f["B"] for f in figs], "{:.0f}"), _cell([f["share"] for f in figs], "{:.0%}"),
                     (first["B_warm"] or {}).get("match", "cold"), _cell([f["C"] for f in figs], "{:.0f}"),
                     (first["C_warm"] or {}).get("match", "cold"), f"{met} of {len(figs)}"])
    legend = ("median / worst over the seeds cached (one seed: its figure); B: after a change of learning rate and "
              "epochs (the same fingerprint); C: on 2 ranks (a partial match); targets: B <= 2 trials and <= 30% of A's "
              "wall time, C <= 3 trials; met: the seeds that met every target")
    return verdict(rows, legend, failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=TASKS)
    ap.add_argument("--trials", type=int, default=6, help="the cold studies' trials")
    ap.add_argument("--after", type=int, default=3, help="the warm studies' trials")
    ap.add_argument("--rounds", type=int, default=2, help="steady reference runs per config")
    ap.add_argument("--seed", type=int, default=0, help="the studies' tune.seed; the cache keeps each seed's results")
    ap.add_argument("--cache", type=Path, default=Path("outputs/bench_warm.json"))
    args = ap.parse_args()
    tmp = prepare("bench_warm_")
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    for name in args.only or TASKS:
        seeds = by_seed(cache[name]) if name in cache else {}
        if str(args.seed) not in seeds:
            print(f"== {name} seed {args.seed}", flush=True)
            seeds[str(args.seed)] = one(name, args, tmp)
            cache[name] = {"seeds": seeds}
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            args.cache.write_text(json.dumps(cache, indent=1, default=str))
    return report({n: r for n, r in cache.items() if not args.only or n in args.only})


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sys.exit(main())
