"""MFU on CPU: does it move the way model FLOPs utilization must, and what does counting cost?

1. transformer_lm at batch 8 and at batch 64 (single process, steady-state runs, interleaved
   --rounds times): mfu must rise with the batch (larger matmuls use more of the peak), and
   mfu / throughput must be the same for both (the FLOPs per sample do not depend on the batch).
2. The cost of counting, once per run: for every shipped model at its preset's batch, the first
   step counted under FlopCounterMode minus the same step uncounted (median of 5 each,
   in process); target under 1 s.

    .venv/bin/python -m bench.bench_mfu [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lib import prepare, table
from orchestrator.app import run_job
from orchestrator.compose import compose_config
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.flops import StepCounter
from orchestrator.runtime.loop import build_dataset, build_loader, build_model, loss_fn

PRESETS = ("linear_classifier", "mlp_accumulation", "linear_regression", "input_bound", "transformer_lm", "comm_heavy")


def steady_mfu(batch: int, tmp: Path, n: int) -> dict:
    cfg = compose_config(["experiment=transformer_lm", f"data.batch_size={batch}", "tracking.enabled=false",
                       "trainer.save_model=false", "trainer.epochs=1000", f"trainer.max_steps={max(40, 2400 // batch)}",
                       f"measure.warmup_steps={max(10, 240 // batch)}", f"measure.window_steps={max(4, 240 // batch)}"])
    r = run_job(cfg, tmp / f"b{batch}-{n}", echo=False)
    return {"mfu": r["mfu"], "throughput": r["throughput"]}


def counting_cost(preset: str) -> float:
    cfg = compose_config([f"experiment={preset}", "tracking.enabled=false", "sim.read_latency_ms=0"])
    adapter = Adapter(cfg)
    adapter.setup()
    model = build_model(cfg)
    x, y = next(iter(build_loader(cfg, build_dataset(cfg), adapter)))
    criterion = loss_fn(cfg.model.loss)

    def step(counted: bool) -> float:
        t0 = time.perf_counter()
        if counted:
            with StepCounter() as counter:
                criterion(model(x), y).backward()
            counter.per_sample(x.shape[0])
        else:
            criterion(model(x), y).backward()
        model.zero_grad()
        return time.perf_counter() - t0

    step(False)
    plain = statistics.median(step(False) for _ in range(5))
    with_counter = statistics.median(step(True) for _ in range(5))
    return with_counter - plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = prepare("bench_mfu-")
    print(f"bench_mfu: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    runs: dict = {8: [], 64: []}
    for n in range(args.rounds):
        for batch in runs:
            runs[batch].append(steady_mfu(batch, tmp, n))
            print(f"  round {n + 1} batch {batch}: mfu {100 * runs[batch][-1]['mfu']:.2f}%  "
                  f"thr {runs[batch][-1]['throughput']:.0f}/s", flush=True)
    med = {b: statistics.median(r["mfu"] for r in v) for b, v in runs.items()}
    per_thr = {b: statistics.median(r["mfu"] / r["throughput"] for r in v) for b, v in runs.items()}
    rows = [["figure", "measured", "target", "met"]]
    ok = [med[64] > med[8], abs(per_thr[64] / per_thr[8] - 1) < 0.01]
    rounds = {b: ", ".join(f"{100 * r['mfu']:.2f}" for r in v) for b, v in runs.items()}
    rows.append(["transformer_lm mfu, batch 8 -> 64",
                 f"{100 * med[8]:.2f}% -> {100 * med[64]:.2f}% ({med[64] / med[8]:.2f}x; rounds {rounds[8]} / "
                 f"{rounds[64]})", "rises", "yes" if ok[0] else "NO"])
    rows.append(["mfu per sample/s, batch 64 / batch 8", f"{per_thr[64] / per_thr[8]:.4f}", "1 (FLOPs per sample fixed)",
                 "yes" if ok[1] else "NO"])
    for preset in PRESETS:
        cost = counting_cost(preset)
        ok.append(cost < 1.0)
        rows.append([f"counting cost, {preset}", f"{1000 * cost:.1f} ms", "< 1 s", "yes" if cost < 1.0 else "NO"])
    print("\n== bench_mfu results")
    print(table(rows))
    print(f"\nload average {os.getloadavg()[0]:.2f}; targets met: {sum(ok)}/{len(ok)}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
