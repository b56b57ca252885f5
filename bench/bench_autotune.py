"""Loader autotune under a load change (issue 15): a dataset whose per-item latency jumps from 0 to
3 ms at the middle step of the run, on CPU, one process, seed 000's model.

  tuner    a study (mode=tune, objective throughput, num_workers 0..tune.max_workers and
           prefetch_factor) on the load after the jump: the best fixed setting it finds
  A        data.num_workers=0, no autotune
  B        data.num_workers=0, trainer.loader_autotune=true
  C        the tuner's best fixed setting, no autotune

A, B, C run interleaved, --rounds times. Figures per round: the second half's throughput (samples
over wall time from the jump to the end, every window counted: warmups after switches and epochs,
the trials the autotune reverts), B / A and B / C; and for B, the seconds from the jump until its
throughput stays within 0.9 of C's (the median of 3 windows from there on, to the end) and the
autotune's events, and B / C from there to the end. Targets: B / C >= 0.9 once adapted, reached
within 30 s of the change.

    .venv/bin/python -m bench.bench_autotune [--rounds 2] [--steps 1200] [--trials 8]

About 5 minutes on 2 idle cores; other load makes every figure noisier (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from bench.lib import ROOT, table
from orchestrator.app import run_job
from orchestrator.compose import compose_config
from orchestrator.merge import load_rank_results
from orchestrator.tune.study import run_study

LATENCY_MS = 3.0
COMMON = ["tracking.enabled=false", "trainer.save_model=false", "trainer.epochs=1000", "measure.window_steps=10",
          "trainer.log_every=100", "data.args.size=4096", "data.batch_size=32", "tune.max_workers=4"]


def second_half(run_dir: Path, jump: int) -> Dict[str, Any]:
    """Samples over wall time from the jump on (windows tile the run: warmups included), the
    windows from there, and the moment of the jump (perf_counter, interpolated in its window)."""
    wins = sorted(load_rank_results(run_dir)[0].to_dict()["windows_detail"], key=lambda w: w["t_start"])
    at = next(w for w in wins if w["first_step"] + w["steps"] > jump)
    t_jump = at["t_start"] + (jump - at["first_step"]) / at["steps"] * (at["t_end"] - at["t_start"])
    after = [w for w in wins if w["first_step"] >= jump]
    samples = sum(w["samples"] for w in after) + at["samples"] * (at["first_step"] + at["steps"] - jump) / at["steps"]
    wall = wins[-1]["t_end"] - t_jump
    return {"throughput": samples / wall, "windows": after, "t_jump": t_jump, "wall_s": wall}


def reached(half: Dict[str, Any], target: float) -> float:
    """Seconds from the jump until the throughput stays at `target` or more: the first window from
    which the median of every 3 consecutive full windows is >= target (inf: never)."""
    full = [w for w in half["windows"] if not w["warmup"] and not w["partial"]]
    for i, w in enumerate(full):
        rest = [statistics.median(x["throughput"] for x in full[j:j + 3]) for j in range(i, max(i + 1, len(full) - 2))]
        if rest and min(rest) >= target:
            return w["t_start"] - half["t_jump"]
    return float("inf")


def best_fixed(tmp: Path, trials: int) -> Dict[str, Any]:
    cfg = compose_config([*COMMON, "mode=tune", f"sim.read_latency_ms={LATENCY_MS}", f"tune.n_trials={trials}",
                       "tune.objective=throughput", f"tune.storage=sqlite:///{tmp}/optuna.db", "tune.warm_start=off", "~tune.space.batch_size",
                       "~tune.space.accumulation_steps", "~tune.space.pin_memory", "tune.extend_edges=false"])
    summary = run_study(cfg, tmp / "study", echo=False)
    values = summary["best"]["values"]
    return {k: v for k, v in values.items() if k.startswith("data.")}


def run(tmp: Path, name: str, overrides: Sequence[str]) -> Path:
    run_dir = tmp / name
    run_job(compose_config([*COMMON, *overrides]), run_dir, echo=False, plots=False)
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--every", type=int, default=50, help="trainer.loader_autotune_every")
    args = ap.parse_args()
    os.chdir(ROOT)
    jump = args.steps // 2
    load = [f"trainer.max_steps={args.steps}", f"sim.latency_jump_at={jump}", f"sim.latency_after_ms={LATENCY_MS}"]
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench_autotune_") as d:
        tmp = Path(d)
        t0 = time.monotonic()
        best = best_fixed(tmp, args.trials)
        print(f"tuner's best fixed setting on the post-jump load ({time.monotonic() - t0:.0f} s): {best}")
        fixed = [f"{k}={'null' if v is None else v}" for k, v in best.items()]
        if best.get("data.num_workers", 0) > 0:
            fixed.append("data.persistent_workers=true")
        configs = {"A": ["data.num_workers=0"],
                   "B": ["data.num_workers=0", "trainer.loader_autotune=true", f"trainer.loader_autotune_every={args.every}"],
                   "C": fixed}
        rows = [["round", "A 0 workers", "B autotune", "C best fixed", "B / A", "B / C", "B reached 0.9 C after",
                 "B from there / C", "B final"]]
        ratios: Dict[str, List[float]] = {"B/A": [], "B/C": [], "reach": [], "B adapted/C": []}
        for r in range(args.rounds):
            halves: Dict[str, Dict[str, Any]] = {}
            for name in ("ABC" if r % 2 == 0 else "CBA"):
                halves[name] = second_half(run(tmp, f"{name}{r}", [*load, *configs[name]]), jump)
            res = json.loads((tmp / f"B{r}" / "result.json").read_text())["loader_autotune"]
            reach = reached(halves["B"], 0.9 * halves["C"]["throughput"])
            thr = {k: h["throughput"] for k, h in halves.items()}
            ratios["B/A"].append(thr["B"] / thr["A"])
            ratios["B/C"].append(thr["B"] / thr["C"])
            ratios["reach"].append(reach)
            t_reach = halves["B"]["t_jump"] + reach
            adapted = [w for w in halves["B"]["windows"] if w["t_start"] >= t_reach]
            adapted_thr = (sum(w["samples"] for w in adapted) / sum(w["wall_s"] for w in adapted)) if adapted else 0.0
            ratios["B adapted/C"].append(adapted_thr / thr["C"])
            rows.append([str(r), f"{thr['A']:.0f}/s", f"{thr['B']:.0f}/s", f"{thr['C']:.0f}/s", f"{thr['B'] / thr['A']:.2f}",
                         f"{thr['B'] / thr['C']:.2f}", f"{reach:.1f} s", f"{adapted_thr / thr['C']:.2f}",
                         json.dumps(res["final"])])
            for ev in res["events"]:
                if ev["action"] != "start":
                    print(f"  round {r} B step {ev['step']} (t={ev['t_s']:.1f}s): {ev['action']} workers={ev['num_workers']} "
                          f"prefetch={ev['prefetch_factor']} before={ev['throughput_before']} after={ev['throughput_after']}")
        print(table(rows))
        for k, v in ratios.items():
            print(f"{k}: median {statistics.median(v):.2f}, min {min(v):.2f}, max {max(v):.2f}")
        print(f"targets: B / C >= 0.9 after adapting ({'met' if min(ratios['B adapted/C']) >= 0.9 else 'NOT met'}; "
              f"over the whole second half, the jump's detection included: {statistics.median(ratios['B/C']):.2f}), "
              f"reached within 30 s ({'met' if max(ratios['reach']) <= 30 else 'NOT met'})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
