"""How many `halves` pairs the gradient noise scale needs: the run's estimator on simulated
gradients whose noise scale is known.

Each simulated step draws the two halves' gradients of a batch of --batch samples around a fixed
true gradient G, with Gaussian per-sample noise of covariance Sigma = diag(i^-1.5) over --dims
parameters (a few directions carry most of the noise, as in a classifier's last layer); |G|^2 is
set so that B_simple = tr(Sigma) / |G|^2 is --ratios x the batch. The pairs go through the run's
own estimator (orchestrator/measure/noise.py: `NoiseEstimator`, the halves' both-parts estimate,
Fieller's interval over blocks of consecutive steps). Printed per ratio and number of pairs, over
--repeats runs: how often the estimate is within 2x of the truth, how often the 95% interval is
bounded, and how often a bounded one holds the truth.

What it says: the spread of a pair's |G|^2 estimate (the halves' gradients' dot product) grows
with the noise scale over the half batch, so the pairs needed for a figure within 2x grow with its
square; and a bounded interval, where the noise scale is far above the batch, is one whose |G|^2
came out high, so it holds the truth less often than 95% (unbounded ones hold it trivially).

    .venv/bin/python -m bench.bench_noise_sim [--repeats 400] [--pairs 26 80 320] [--ratios 3 10 30]
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List

import torch

from bench.lib import table
from orchestrator.measure.noise import NoiseEstimator


def one_run(pairs: int, ratio: float, batch: int, lam: torch.Tensor, gen: torch.Generator) -> Dict[str, float]:
    """One simulated run of `pairs` estimated steps: its B_simple and interval against the truth."""
    half = batch // 2
    trace = float(lam.sum())
    g = torch.zeros(len(lam), dtype=torch.float64)
    g[0] = math.sqrt(trace / (ratio * batch))  # |G|^2 such that B_simple = ratio x batch
    sd = (lam / half).sqrt()
    first = g + torch.randn(pairs, len(lam), generator=gen, dtype=torch.float64) * sd
    second = g + torch.randn(pairs, len(lam), generator=gen, dtype=torch.float64) * sd
    whole = (first + second) / 2
    est = NoiseEstimator("halves")
    for i in range(pairs):
        est.add(float(first[i] @ first[i]), float(whole[i] @ whole[i]), half, batch, step=i,
                rest_sq=float(second[i] @ second[i]))
    res = est.result()
    truth = ratio * batch
    return {"within": res.b_simple is not None and 0.5 <= res.b_simple / truth <= 2.0,
            "bounded": res.lo is not None and res.hi is not None,
            "holds": res.lo is not None and res.hi is not None and res.lo <= truth <= res.hi}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--pairs", type=int, nargs="*", default=[26, 80, 320])
    ap.add_argument("--ratios", type=float, nargs="*", default=[3, 10, 30], help="B_simple over the batch")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dims", type=int, default=200)
    args = ap.parse_args()
    lam = torch.tensor([(i + 1) ** -1.5 for i in range(args.dims)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    rows: List[List[str]] = [["B_simple / batch", "pairs", "within 2x", "interval bounded", "bounded ones holding the truth"]]
    for ratio in args.ratios:
        for pairs in args.pairs:
            runs = [one_run(pairs, ratio, args.batch, lam, gen) for _ in range(args.repeats)]
            bounded = sum(r["bounded"] for r in runs)
            rows.append([f"{ratio:g}", str(pairs), f"{sum(r['within'] for r in runs) / len(runs):.0%}",
                         f"{bounded / len(runs):.0%}",
                         f"{sum(r['holds'] for r in runs) / bounded:.0%}" if bounded else "-"])
    print(f"{args.repeats} simulated runs a cell, batch {args.batch} in two halves, {args.dims} parameters")
    print(table(rows))


if __name__ == "__main__":
    main()
