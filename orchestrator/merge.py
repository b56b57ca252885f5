"""Per-rank results merged into one job result: totals, imbalance, straggler (the verdict on what
bounds the job is diagnose.py's)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .diagnose import STRAGGLER_SPREAD
from .measure.results import PER_RANK_FIELDS, JobResult, NoiseScale, RankResult, WindowFigures, job_window
from .measure.stats import MIN_WINDOWS, estimate_of
from .rundir import ranks_dir


def load_rank_results(run_dir: Path) -> List[RankResult]:
    """Every rank's rank<R>.json, by rank (files written before typed results load alike)."""
    out = [RankResult.from_dict(json.loads(path.read_text())) for path in ranks_dir(run_dir).glob("rank*.json")]
    return sorted(out, key=lambda r: r.rank)


def merge(ranks: List[RankResult]) -> JobResult:
    """Job-level figures: throughput summed over ranks, shares and utilization averaged, the
    slowest rank's step time, memory maxed (as measure.results.job_window does per window).
    Imbalance compares each rank's own work per step (step time minus the time it waited on the
    others in communication); the rank with the most is the straggler when it is more than
    STRAGGLER_SPREAD above the fastest."""
    if not ranks:
        return JobResult()
    first = ranks[0]
    job = JobResult(world_size=len(ranks), steps=max(r.steps for r in ranks), steps_per_epoch=first.steps_per_epoch,
                    per_rank=[{k: r.get(k) for k in PER_RANK_FIELDS} for r in ranks],
                    extra={k: first.get(k) for k in ("item_bytes", "final_loss", "first_loss")})
    # the same on every rank (same steps, same loader); loader_autotune: rank 0's
    job.extra.update({k: first.get(k) for k in ("warmup", "stopped_by", "epochs", "balance", "loader_autotune",
                                                 "target_on", "target_step") if first.get(k) is not None})
    for key in JobResult.VALIDATION:  # the same on every rank (runtime/evaluate.py all-reduces them)
        setattr(job, key, first.get(key))
    # where a rank's training time went: its loop's wall time and the warmup windows in it (the
    # slowest rank's; the ranks synchronise); the study's time breakdown reads them
    noise = first.get("noise_scale")  # the same on every rank: the ranks' norms are averaged in the run
    job.noise_scale = NoiseScale.from_dict(noise) if noise else None
    job.time_s = {"train": max(float(r.get("wall_s") or 0.0) for r in ranks),
                           "setup": max(float(r.get("setup_s") or 0.0) for r in ranks),
                           "warmup": max(sum(w.wall_s for w in r.windows_detail if w.warmup) for r in ranks)}
    measured = [r for r in ranks if r.measured_steps]
    if not measured:
        return job
    mean = lambda key: statistics.fmean(getattr(r, key) for r in measured)  # noqa: E731
    job.utilization, job.utilization_source = mean("utilization"), measured[0].utilization_source
    job.throughput = sum(r.throughput for r in measured)  # type: ignore[misc]
    job.step_time_s = max(r.step_time_s for r in measured)  # type: ignore[type-var]
    for key in ("data_wait_frac", "h2d_frac", "compute_frac", "comm_frac", "optimizer_frac", "other_frac"):
        setattr(job, key, mean(key))
    job.busy_frac = statistics.fmean(r.busy_frac if r.busy_frac is not None
                                     else r.compute_frac + r.optimizer_frac for r in measured)  # type: ignore[operator]
    job.peak_mem_mb = max(r.peak_mem_mb for r in measured)  # type: ignore[type-var]
    job.measured_steps = min(r.measured_steps for r in measured)
    job.tokens_per_s, job.padding_frac = _token_figures(measured)
    job.extra.update(input_cost=_input_cost(measured), warmup_excluded=all(r.get("warmup_excluded") for r in measured),
                     **_device_figures(measured))
    windows = job_windows(measured)
    job.estimate = estimate_of(windows)  # the throughput's mean over windows, its interval
    job.utilization_estimate = estimate_of(windows, "utilization")
    if job.tokens_per_s is not None and windows and all(w.tokens_per_s is not None for w in windows):
        job.tokens_estimate = estimate_of(windows, "tokens_per_s")  # real tokens/s (objective=tokens)
    job.imbalance = _imbalance(measured, job.balance)
    return job


def _imbalance(measured: List[RankResult], balance: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    own = {r.rank: r.step_time_s - r.phase_s["comm"] for r in measured}  # type: ignore[index,operator]
    utils = [r.utilization for r in measured]
    slowest = max(own, key=own.__getitem__) if len(measured) > 1 else None
    own_spread = _spread(list(own.values()))
    out = {
        "own_step_time_s": own,
        "own_time_spread": own_spread,
        "step_time_spread": _spread([r.step_time_s for r in measured]),  # type: ignore[misc]
        "utilization_spread": max(utils) - min(utils),  # type: ignore[type-var,operator]
        "slowest_rank": slowest,
        # a straggler is named only past the threshold: a few percent is noise, not a slow rank
        "straggler_rank": slowest if own_spread > STRAGGLER_SPREAD else None,
    }
    if balance:
        out.update(_at_shares(balance, len(measured)))
    return out


def _at_shares(balance: Dict[str, Any], world: int) -> Dict[str, Any]:
    """parallelism.balance=speed: the imbalance at the shares the run ended with. The whole run's
    own work per step mixes in the windows before the shares were set (a slow rank at the even
    split); a rank given the smaller share because it is slower per sample is no straggler when
    the ranks' own work per window at these shares is within STRAGGLER_SPREAD. Not measured at
    these shares (no window since the last change): no straggler is named."""
    own = balance.get("own_window_s")
    if not own or len(own) != world or max(own) <= 0:
        return {"at_shares": None, "straggler_rank": None}
    spread = _spread(own)
    slowest = max(range(world), key=own.__getitem__)
    return {"at_shares": {"shares": balance["shares"], "own_window_s": own, "own_time_spread": spread,
                          "slowest_rank": slowest, "windows": balance.get("windows_at_shares")},
            "straggler_rank": slowest if spread > STRAGGLER_SPREAD else None}


def _input_cost(measured: List[RankResult]) -> Dict[str, Any]:
    """The ranks' per-item input costs averaged (every rank loads its own share the same way)."""
    costs = [r.get("input_cost") or {} for r in measured]
    keys = {k for c in costs for k, v in c.items() if isinstance(v, (int, float))}
    return {k: statistics.fmean(c[k] for c in costs if isinstance(c.get(k), (int, float))) for k in sorted(keys)}


def _device_figures(measured: List[RankResult]) -> Dict[str, Any]:
    """mfu, nvml_util, sm_active for the job: the mean over ranks where every rank has the figure
    (otherwise None), each with rank 0's source."""
    out: Dict[str, Any] = {}
    for key in ("mfu", "nvml_util", "sm_active"):
        values = [r.get(key) for r in measured]
        out[key] = statistics.fmean(values) if values and all(v is not None for v in values) else None
        out[f"{key}_source"] = measured[0].get(f"{key}_source", "-")
    out["mfu_dtype"] = measured[0].get("mfu_dtype")
    out["flops_per_sample"] = measured[0].get("flops_per_sample")
    return out


def _token_figures(measured: List[RankResult]) -> Tuple[Optional[float], Optional[float]]:
    """Real tokens/s summed over ranks, and the job's padding share (of every position computed),
    where every rank counted tokens (dict batches with an attention_mask); else None."""
    rates = [(r.tokens_per_s, r.padding_frac) for r in measured]
    if not rates or any(t is None or p is None for t, p in rates):
        return None, None
    real = sum(t for t, _ in rates)  # type: ignore[misc]
    computed = sum(t / (1.0 - p) if p < 1.0 else 0.0 for t, p in rates)  # type: ignore[operator]
    return real, 1.0 - real / computed if computed > 0 else None


def job_windows(ranks: List[RankResult]) -> List[WindowFigures]:
    """The job's measured windows: window i is measure.results.job_window of every rank's window i
    (the ranks close windows at the same steps): throughput and real tokens/s summed, utilization
    the mean, the slowest rank's step and wall time."""
    per_rank = [r.window_figures() for r in ranks]
    n = min(len(ws) for ws in per_rank)
    return [job_window([ws[i] for ws in per_rank]) for i in range(n)]


def _spread(values: List[float]) -> float:
    return (max(values) - min(values)) / max(values) if values and max(values) > 0 else 0.0


# what each utilization source counts, in the summary beside the phases' shares of the step's wall time
UTILIZATION_WORDS = {
    "cpu-time": "the loop thread's CPU time in compute + optimizer over wall time",
    "nvml": "the GPU's busy share, NVML utilization.gpu",
    "cuda-busy": "the share of the step the GPU ran kernels, by CUDA events",
}


def summary_rows(result: Dict[str, Any]) -> List[tuple[str, str]]:
    """What the console shows at the end of a run."""
    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = [
        ("status", str(result.get("status"))),
        ("backend / world size", f"{result.get('backend')} / {result.get('world_size', '-')}"),
        ("steps (measured)", f"{result.get('steps', '-')} ({result.get('measured_steps', '-')})"),
        ("loss first -> last", f"{result.get('first_loss', float('nan')):.4g} -> {result.get('final_loss', float('nan')):.4g}"
         if result.get("final_loss") is not None else "-"),
        ("utilization", f"{pct(result.get('utilization'))} ({result.get('utilization_source', '-')}"
                        + (f": {UTILIZATION_WORDS[result['utilization_source']]})"
                           if result.get("utilization_source") in UTILIZATION_WORDS else ")")),
        ("mfu", f"{pct(result['mfu'])} of the {result.get('mfu_dtype')} peak" if result.get("mfu") is not None
         else f"- ({result.get('mfu_source', 'not measured')})"),
        *[(label, f"{pct(result[key])} ({result.get(key + '_source')})") for key, label in
          (("nvml_util", "nvml utilization.gpu"), ("sm_active", "SM active")) if result.get(key) is not None],
        ("throughput", f"{result['throughput']:.1f} samples/s" if result.get("throughput") else "-"),
        *([("real tokens/s", f"{result['tokens_per_s']:.0f} ({pct(result.get('padding_frac'))} of the positions "
                               f"computed were padding)")] if result.get("tokens_per_s") is not None else []),
        ("step time", f"{1000 * result['step_time_s']:.2f} ms" if result.get("step_time_s") else "-"),
        ("data wait / h2d", f"{pct(result.get('data_wait_frac'))} / {pct(result.get('h2d_frac'))}"),
        ("compute / comm / optimizer (of step time)", f"{pct(result.get('compute_frac'))} / {pct(result.get('comm_frac'))} / "
                                        f"{pct(result.get('optimizer_frac'))}"),
        ("peak memory", f"{result['peak_mem_mb']:.0f} MB" if result.get("peak_mem_mb") else "-"),
        ("bottleneck", str(result.get("bottleneck", "-"))),
        *validation_rows(result),
        *([("noise scale B_simple", _noise_cell(result["noise_scale"]))] if result.get("noise_scale") else []),
    ]
    bal = result.get("balance")
    imb = result.get("imbalance") or {}
    at = imb.get("at_shares")
    if bal:
        shares = " / ".join(f"{100 * x:.0f}%" for x in bal["shares"])
        speedup = f" ({bal['speedup']:.2f}x the even split)" if bal.get("speedup") else ""
        even = f"; own work per window at these shares within {pct(at['own_time_spread'])}" if at else ""
        rows.append(("shares (balance=speed)", shares + speedup + even))
    if imb.get("straggler_rank") is not None:
        spread = at["own_time_spread"] if bal and at else imb["own_time_spread"]
        rows.append(("imbalance / straggler", f"{pct(spread)} / rank {imb['straggler_rank']}"
                     + (" at the balanced shares" if bal and at else "")))
    return rows


def validation_rows(result: Dict[str, Any]) -> List[tuple[str, str]]:
    """The console's lines on validation (runtime/evaluate.py) and trainer.target_loss."""
    rows = []
    if result.get("val_loss") is not None:
        evals = result.get("evals") or [{}]
        metrics = "".join(f", {k} {v:.4g}" for k, v in (result.get("val_metrics") or {}).items())
        share = result.get("eval_frac")
        rows.append(("val loss", f"{result['val_loss']:.4g}{metrics} at step {evals[-1].get('step', '-')} "
                                 f"({len(evals)} evaluation{'s' if len(evals) != 1 else ''}"
                                 + (f", {100 * share:.1f}% of the loop's wall time)" if share is not None else ")")))
    if result.get("target_loss") is not None:
        on = "val loss" if result.get("target_on") == "val_loss" else "training loss"
        if result.get("target_reached"):
            rows.append(("target loss", f"{result['target_loss']:g} ({on}) reached at step {result.get('target_step')}"
                                        f" after {result['time_to_target_s']:.2f} s, "
                                        f"{result['samples_to_target']:.0f} samples"))
        else:
            rows.append(("target loss", f"{result['target_loss']:g} ({on}) not reached"))
    return rows
def _noise_cell(noise: Dict[str, Any]) -> str:
    b, lo, hi = noise.get("b_simple"), noise.get("lo"), noise.get("hi")
    how = f"{noise.get('method')}, {noise.get('n', 0)} steps"
    if b is None:
        return f"not measurable yet ({how})"
    return f"{b:.0f} samples" + (f" ({lo:.0f}-{hi:.0f}; {how})" if lo is not None and hi is not None else f" ({how})")


def measurement_warning(result: Dict[str, Any]) -> str:
    """One line when a finished run measured nothing or too little to go by, else ''."""
    steps, measured = result.get("steps"), result.get("measured_steps") or 0
    windows = (result.get("estimate") or {}).get("windows") or 0
    if steps is None or (measured and windows >= MIN_WINDOWS):
        return ""
    warm = result.get("warmup") or {}
    ran, raise_ = f"the run ended after {steps} steps", "trainer.epochs"
    per_epoch, n = result.get("steps_per_epoch"), result.get("epochs", 1)
    if per_epoch and steps < n * per_epoch:  # trainer.max_steps cut the run, not the epochs
        ran += f", its trainer.max_steps (an epoch is {per_epoch} steps)"
        raise_ = "trainer.max_steps (and trainer.epochs if the data runs out)"
    elif per_epoch:
        ran += f" ({n} epoch{'s' if n != 1 else ''} of {per_epoch} steps)"
    act = f"raise {raise_}"
    if result.get("stopped_by") == "target_loss":  # neither limit ended it
        ran, act = f"the run reached trainer.target_loss after {steps} steps", "a lower trainer.target_loss trains longer"
    if not measured:
        return (f"nothing was measured: {ran}, inside its warmup ({warm.get('min_steps', '?')} steps and the "
                f"loader's queue); {act} or lower measure.warmup_steps")
    return (f"only {windows} measured window{'s' if windows != 1 else ''} ({measured} step{'s' if measured != 1 else ''} after a "
            f"{warm.get('steps', '?')}-step warmup), the figures are rough: {ran}; {act}")
