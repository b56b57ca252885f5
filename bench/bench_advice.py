"""Does the advice hold? Every shipped workload's own first move, followed once, measured side by
side with the config it was given for, on CPU.

For each workload below: a steady-state run of the config as shipped (A) writes its load report;
its diagnosis's first move (`moves[0]`, the overrides the report prints first) gives config B.
A and B are then measured in interleaved rounds (A B A B ...), each run long enough to be steady
state: its step count is sized from a short calibration run to about --seconds of measured time,
with a warmup of 10% of the steps (at least 30, far past any DataLoader's pre-filled queue).

Figures per workload: the verdict, the move, B / A throughput (median of rounds) with the min-max
of the per-round ratios, and A's own round-to-round spread (the noise). Targets (issue 11 item 0):
no advice makes a workload slower (B / A >= 1 - noise), and the default job's advice improves it
(B / A > 1 + noise). A workload whose diagnosis has no move (nothing to turn) is reported as such.

    .venv/bin/python -m bench.bench_advice [--rounds 3] [--seconds 6] [--only linear_classifier ...]

About 6-8 minutes on 2 idle cores; other load on the machine makes every figure noisier (the
load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from bench.lib import add_run_args, prepare, run_workloads, table
from orchestrator.app import JobFailed, run_job
from orchestrator.compose import compose_config

WORKLOADS: Dict[str, List[str]] = {
    "linear_classifier": ["experiment=linear_classifier"],  # the default job (article 000)
    "mlp_accumulation": ["experiment=mlp_accumulation"],  # article 001
    "linear_regression": ["experiment=linear_regression"],  # article 002
    "input_bound": ["experiment=input_bound"],
    "transformer_lm": ["experiment=transformer_lm"],
    "comm_heavy": ["experiment=comm_heavy", "backend=ddp", "parallelism.nproc_per_node=2"],
}
COMMON = ["tracking.enabled=false", "trainer.epochs=1000000", "trainer.save_model=false"]


def override(key: str, value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


class Bench:
    def __init__(self, tmp: Path, seconds: float) -> None:
        self.tmp, self.seconds, self.n = tmp, seconds, 0

    def run(self, overrides: Sequence[str]) -> Dict[str, Any]:
        self.n += 1
        run_dir = self.tmp / f"{self.n:04d}"
        try:
            return run_job(compose_config([*COMMON, *overrides]), run_dir, echo=False) | {"run_dir": str(run_dir)}
        except JobFailed as exc:
            print(f"    FAILED: {str(exc).splitlines()[0]}", flush=True)
            return {"throughput": 0.0, "run_dir": str(run_dir)}

    def steady(self, overrides: Sequence[str]) -> List[str]:
        """Overrides that make a run of this config steady state and about `seconds` long."""
        probe = self.run([*overrides, "trainer.max_steps=40", "measure.warmup_steps=10", "measure.window_steps=10"])
        step = probe.get("step_time_s") or 0.01
        steps = int(min(4000, max(100, self.seconds / step)))
        warmup = max(30, steps // 10)
        return [*overrides, f"trainer.max_steps={steps + warmup}", f"measure.warmup_steps={warmup}",
                f"measure.window_steps={max(5, steps // 20)}"]


def spread(values: List[float]) -> float:
    return max(values) / min(values) - 1 if values and min(values) > 0 else float("nan")


def bench_workload(b: Bench, name: str, overrides: List[str], rounds: int) -> Dict[str, Any]:
    print(f"\n== {name} ({' '.join(overrides)}), load average {os.getloadavg()[0]:.2f}", flush=True)
    a_cfg = b.steady(overrides)
    first = b.run(a_cfg)
    report = json.loads((Path(first["run_dir"]) / "load_report.json").read_text())
    diag = report["diagnosis"]
    print(f"  {diag['verdict']}: {diag['reason']}", flush=True)
    if not diag.get("moves"):
        print(f"  no move advised ({'; '.join(diag['advice']) or 'nothing'})", flush=True)
        return {"name": name, "verdict": diag["verdict"], "move": None}
    move = diag["moves"][0]
    print(f"  first move: {move['set']}\n    why: {move['why']}", flush=True)
    b_cfg = b.steady([*overrides, *(override(k, v) for k, v in move["set"].items())])
    a_thr, b_thr = [first["throughput"]], []
    for r in range(rounds):
        if r:
            a_thr.append(b.run(a_cfg)["throughput"])
        b_thr.append(b.run(b_cfg)["throughput"])
        print(f"    round {r + 1}/{rounds}: A {a_thr[-1]:.0f}/s  B {b_thr[-1]:.0f}/s  "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    ratios = [y / x for x, y in zip(a_thr, b_thr) if x > 0]
    return {"name": name, "verdict": diag["verdict"], "move": move["set"],
            "a": statistics.median(a_thr), "b": statistics.median(b_thr),
            "ratio": statistics.median(b_thr) / statistics.median(a_thr) if statistics.median(a_thr) else float("nan"),
            "ratios": ratios, "noise": spread(a_thr)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run (steady state)")
    add_run_args(ap, WORKLOADS)
    args = ap.parse_args()
    tmp = prepare("bench_advice-", [f"rounds {args.rounds}", f"~{args.seconds:g}s per run"])
    start = time.monotonic()
    bench = Bench(tmp, args.seconds)
    results = run_workloads(args.only, args.keep, tmp,
                            lambda name, overrides: bench_workload(bench, name, overrides, args.rounds), WORKLOADS)

    rows = [["workload", "verdict", "first move", "A thr/s", "B thr/s", "B / A (rounds)", "A noise", "target", "met"]]
    verdicts = []
    for r in results.values():
        if r["move"] is None:
            rows.append([r["name"], r["verdict"], "none advised", "", "", "", "", "", "-"])
            continue
        noise = r["noise"] if r["noise"] == r["noise"] else 0.0
        default = r["name"] == "linear_classifier"
        ok = r["ratio"] > 1 + noise if default else r["ratio"] >= 1 - noise
        verdicts.append(ok)
        rows.append([r["name"], r["verdict"], " ".join(override(k, v) for k, v in r["move"].items()),
                     f"{r['a']:.0f}", f"{r['b']:.0f}",
                     f"{r['ratio']:.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})", f"{100 * noise:.0f}%",
                     "> 1 + noise" if default else ">= 1 - noise", "yes" if ok else "NO"])
    print("\n== bench_advice results (throughput: medians of interleaved steady-state runs)")
    print(table(rows))
    print(f"\ntotal {time.monotonic() - start:.0f}s; load average {os.getloadavg()[0]:.2f}; "
          f"targets met: {sum(verdicts)}/{len(verdicts)}")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
