"""Peak memory over batch size, fitted to a study's trials: which batches will not fit before any
is launched.

A trial's memory record (`memory_record`, from its result's ranks) holds its peak (on CPU the
resident high-water of the rank and its workers, against trainer.memory_cap_mb or the host's
memory; on GPU the allocator's peak, against the device's memory), its memory when the training
loop began (the model built, no step taken) and the model's state (parameters, their gradients,
the optimizer's state); on CPU only for trials without loader workers (the peak counts their
memory, which does not grow with the batch). A micro-batch's activations grow with the batch; the
rest does not:

    peak(b) = fixed + per_item * b

fitted by least squares over the trials' batch sizes when there are two or more, else from one
trial with fixed = its start + its model state (the gradients and the optimizer's state come with
the first step; the parameters, counted twice, make it predict less memory, never more). A batch
whose predicted peak is over the limit is not launched. The prediction errs low, toward launching:
on CPU the peak is sampled twice a second and a short trial's true high-water falls between samples
(one batch's peak reads about 10% apart in separate runs); on GPU the allocator's peak is exact
but the device runs out before it reaches the device's memory (the CUDA context, the cache's
fragments). A batch predicted just under the limit can so run out of memory, at the cost of a
trial of the budget and a restart of the ranks (seconds).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple


def memory_record(per_rank: Optional[List[Dict[str, Any]]], workers: int = 0) -> Optional[Dict[str, float]]:
    """The memory figures of a measured job (its ranks' figures: JobResult.per_rank) that the fit needs, from the rank
    with the largest peak; None when a figure is missing (an old result, a rank that did not say),
    and on CPU for a job with loader workers: its peak counts their memory, which the batch does
    not grow (a fit to it would hold back batches that fit)."""
    ranks = [r for r in per_rank or [] if r.get("peak_mem_mb")]
    if not ranks:
        return None
    r = max(ranks, key=lambda r: r["peak_mem_mb"])
    if workers and r.get("mem_source") != "cuda-allocator":
        return None
    keys = {"peak_mb": "peak_mem_mb", "start_mb": "start_mem_mb", "state_mb": "model_state_mb", "limit_mb": "device_mem_mb"}
    out = {k: r.get(v) for k, v in keys.items()}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in out.values()) or out["limit_mb"] <= 0:
        return None
    return {k: float(v) for k, v in out.items()}


def fit(points: List[Tuple[int, Dict[str, float]]]) -> Optional[Tuple[float, float, str]]:
    """(fixed MB, MB per item, how) from (batch, memory record) pairs; None when nothing grows."""
    if not points:
        return None
    batches = sorted({b for b, _ in points})
    if len(batches) >= 2:
        xs = [float(b) for b, _ in points]
        ys = [m["peak_mb"] for _, m in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if slope > 0:
            return my - slope * mx, slope, f"fitted to batches {', '.join(map(str, batches))}"
    # one batch (or no growth between them): the largest per-item growth over the trials' own fixed part
    slopes = [((m["peak_mb"] - m["start_mb"] - m["state_mb"]) / b, b, m) for b, m in points if b > 0]
    per_item, b, m = max(slopes, key=lambda s: s[0])
    if per_item <= 0:
        return None
    return m["start_mb"] + m["state_mb"], per_item, (f"batch {b}'s {m['peak_mb']:.0f} MB over its "
                                                     f"{m['start_mb'] + m['state_mb']:.0f} MB before the first step")


def first_over(points: List[Tuple[int, Dict[str, float]]]) -> Optional[Tuple[int, str]]:
    """(the smallest batch predicted not to fit, why), or None."""
    got = fit(points)
    if got is None:
        return None
    fixed, per_item, how = got
    limit = min(m["limit_mb"] for _, m in points)
    b = math.floor((limit - fixed) / per_item) + 1  # the least b with fixed + per_item * b > limit
    if b <= max(bb for bb, _ in points):  # a measured batch fits: it ran
        return None
    return b, (f"predicted peak memory {fixed + per_item * b:.0f} MB at batch {b} ({fixed:.0f} MB + "
               f"{per_item:.2f} MB an item, {how}) is over the {limit:.0f} MB limit")


__all__ = ["first_over", "fit", "memory_record"]
