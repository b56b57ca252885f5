"""ddp vs fsdp, side by side: peak memory per rank and step time of a transformer LM of about
200 MB of fp32 parameters on 2 ranks (CPU here: gloo, memory = each rank's resident high-water).

Both backends run the same job (AdamW, batch 2 x 64 tokens per rank, fsdp's units the
transformer layers found by its default policy), interleaved --rounds times (ddp first in odd
rounds, fsdp first in even ones). Per rank: peak memory (the meter's figure, the process's ~300 MB
of torch and libraries included), model state (parameters + gradients + optimizer state held),
step time and exposed communication. Target: fsdp's peak per rank <= 0.65 x ddp's.

    .venv/bin/python -m bench.bench_fsdp [--rounds 2] [--d-model 512] [--layers 16] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from bench.lib import prepare, table
from orchestrator.app import run_job
from orchestrator.compose import compose_config
from orchestrator.runtime.loop import build_model

TARGET = 0.65


def overrides(args: argparse.Namespace, backend: str) -> list:
    return ["experiment=transformer_lm", f"model.args.d_model={args.d_model}", f"model.args.n_layers={args.layers}",
            f"model.args.n_heads={args.d_model // 64}", f"data.batch_size={args.batch}", f"backend={backend}",
            "parallelism.nproc_per_node=2", f"trainer.max_steps={args.steps}", "measure.warmup_steps=3",
            "measure.window_steps=3", "tracking.enabled=false", "trainer.save_model=false"]


def run(args: argparse.Namespace, backend: str, tmp: Path, n: int) -> dict:
    r = run_job(compose_config(overrides(args, backend)), tmp / f"{backend}-{n}", echo=False)
    ranks = r["per_rank"]
    return {"peak": max(p["peak_mem_mb"] for p in ranks), "peaks": [p["peak_mem_mb"] for p in ranks],
            "state": max(p["model_state_mb"] for p in ranks), "step": r["step_time_s"], "comm": r["comm_frac"]}


def spread(values: list, fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    tmp = prepare("bench_fsdp-")
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(compose_config(overrides(args, "ddp"))).parameters())
    print(f"bench_fsdp: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}; "
          f"transformer d_model {args.d_model} x {args.layers} layers: {params / 1e6:.1f} M parameters, "
          f"{4 * params / 2**20:.0f} MB fp32")
    runs: dict = {"ddp": [], "fsdp": []}
    for n in range(args.rounds):
        for backend in (("ddp", "fsdp") if n % 2 == 0 else ("fsdp", "ddp")):
            runs[backend].append(run(args, backend, tmp, n))
            r = runs[backend][-1]
            print(f"  round {n + 1} {backend:4}: peak per rank {', '.join(f'{p:.0f}' for p in r['peaks'])} MB, "
                  f"model state {r['state']:.0f} MB, step {1000 * r['step']:.0f} ms, comm {100 * r['comm']:.0f}%",
                  flush=True)
    rows = [["backend", "peak per rank MB", "model state MB", "step time ms", "exposed comm"]]
    for backend, rs in runs.items():
        rows.append([backend, spread([r["peak"] for r in rs], "{:.0f}"), spread([r["state"] for r in rs], "{:.0f}"),
                     spread([1000 * r["step"] for r in rs], "{:.0f}"), spread([100 * r["comm"] for r in rs], "{:.0f}%")])
    # ratios within a round (the two jobs ran back to back), then their median
    peak = [f["peak"] / d["peak"] for d, f in zip(runs["ddp"], runs["fsdp"])]
    step = [f["step"] / d["step"] for d, f in zip(runs["ddp"], runs["fsdp"])]
    print("\n== bench_fsdp results (median over rounds, min-max in brackets)")
    print(table(rows))
    ok = statistics.median(peak) <= TARGET
    print(table([["figure", "measured", "target", "met"],
                 ["fsdp / ddp peak memory per rank", spread(peak, "{:.2f}"), f"<= {TARGET}", "yes" if ok else "NO"],
                 ["fsdp / ddp step time", spread(step, "{:.2f}"), "(reported)", ""]]))
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
