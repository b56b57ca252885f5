"""A rank's figures at the end of its job (result.json's per-rank `meter`), from the step meter's
windows (runtime/meter.py): the measured windows' time, samples and phases summed, the warmup's
length and cause, the input pipeline's cost per item, tokens and memory.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..measure.phases import BUSY, PHASES
from ..measure.results import Window
from ..measure.stats import estimate, estimate_of
from .samplers import cores_per_rank, memory_stats


def warmup_summary(meter: Any) -> Dict[str, Any]:
    """How long the StepMeter `meter`'s warmup took and why (result.json's `warmup`)."""
    first = meter.warmups[0] if meter.warmups else None
    queue, min_steps = meter.queue, meter.warmup_steps
    out: Dict[str, Any] = {"min_steps": min_steps, "queue_micro_batches": queue,
                           "steps": first["until_step"] if first else meter.steps, "finished": first is not None}
    out["epochs_per_window"] = meter.whole_epochs()  # 0: windows of steps (epoch restarts fall in them)
    if first is not None and first["why"] != "start":  # e.g. start+profiler: read again after profiling
        out["after"] = first["why"].split("+", 1)[1]
    if first is None:
        out["why"] = (f"the run ended after {meter.steps} steps, still in warmup (needs >= {min_steps} "
                      f"steps and > {queue} micro-batches)")
    elif first["ended_by"] == "queue":
        out["why"] = (f"the loader's pre-filled queue ({queue} micro-batches) was read after "
                      f"{first['until_step']} steps, past the {min_steps} warmup steps")
    else:
        out["why"] = f"{min_steps} warmup steps (the loader's queue of {queue} micro-batches was read)"
    if "after" in out:
        out["why"] += f"; the queue was read again after the {out['after']}'s steps"
    rewarms = meter.warmups[1:]
    if rewarms:
        out["rewarmed"] = [{k: w[k] for k in ("why", "from_step", "steps")} for w in rewarms]
        out["rewarm_steps"] = sum(w["steps"] for w in rewarms)
    return out


def warmup_record(earlier: List[Dict[str, Any]], why: str, first_step: int, step: int, min_steps: int,
                  micro: int) -> Dict[str, Any]:
    """The entry of a warmup that ended at `step` after `micro` micro-batches in the meter's
    `warmups` (after those `earlier`): the first began at step 0, a re-warm at `first_step` (its
    window's first step). What held it this long: the loader's queue when it outlasted `min_steps`."""
    start = first_step if earlier else 0
    binding = "queue" if earlier or step > max(min_steps, 1) else "warmup_steps"
    return {"why": why, "from_step": start, "until_step": step, "steps": step - start, "micro_batches": micro,
            "ended_by": binding}


def input_cost(used: List[Window], cuda: bool, threads: int, span_cpu: Optional[Dict[str, float]]) -> Dict[str, Any]:
    """Per item delivered: the loader's CPU seconds (its workers', or with none the data phase's own
    CPU time), the data phase's wall seconds, the training process's CPU seconds (`span_cpu`: per
    sample over the steady span) and the busy phases' CPU seconds; with the cores and `threads` the
    rank runs on. What the job model (orchestrator/jobmodel.py) predicts other loader settings from."""
    samples = sum(w.samples for w in used)
    out: Dict[str, Any] = {"cores": cores_per_rank(), "threads": threads, "workers_cpu_s": None,
                           "data_wall_s": sum(w.phases_s["data"] for w in used) / samples if samples else None}
    if span_cpu is not None:
        out["workers_cpu_s"], out["process_cpu_s"] = span_cpu["workers"], span_cpu["process"]
    cpu_wins = [w for w in used if w.phases_cpu_s is not None]
    n = sum(w.samples for w in cpu_wins)
    if n:
        out["data_cpu_s"] = sum(w.phases_cpu_s["data"] for w in cpu_wins) / n  # type: ignore[index]
        if not cuda:
            out["busy_cpu_s"] = sum(w.busy_cpu_s or 0.0 for w in cpu_wins) / n
            # the training process's CPU outside the data wait (its threads' spin-waits during the
            # wait are left out: they yield to workers that need the cores)
            out["consume_cpu_s"] = sum(w.phases_cpu_s[p] for w in cpu_wins for p in PHASES  # type: ignore[index]
                                       if p != "data") / n
            out["busy_wall_s"] = sum(w.phases_s[p] for w in cpu_wins for p in BUSY) / n
    return out


def summarize(meter: Any) -> Dict[str, Any]:
    """The StepMeter `meter`'s figures of the job. Every measured (full) window's time, samples and
    phases are summed, so utilization is busy time over measured time and the breakdown's shares
    tile it. A median over windows reads one mode of bursty windows: a loader whose workers finish
    together alternates windows that find batches ready with windows that wait, and its median
    window shows neither the wait nor the idle device (batch 128, 8 workers: median utilization
    0.91 and data share 0.09, over its measured time 0.60 and 0.40)."""
    base = {"warmup": warmup_summary(meter), **memory_stats(meter.device, meter.memory, meter.memory_cap_mb),
            "start_mem_mb": meter.start_mem_mb}
    wins = meter.windows or meter.warmup_windows  # a run shorter than its warmup: say so
    if not wins:
        return {"measured_steps": 0, "utilization_source": meter.source, **base}
    used = [w for w in wins if not w.partial] or wins
    wall = sum(w.wall_s for w in used)
    steps = sum(w.steps for w in used)
    totals = {p: sum(w.phases_s[p] for w in used) for p in PHASES}
    tiled = sum(totals.values())
    shares = {p: totals[p] / tiled if tiled > 0 else 0.0 for p in PHASES}
    util = estimate([w.utilization for w in used], weights=[w.wall_s for w in used]).mean
    utils, thr = [w.utilization for w in wins], [w.throughput for w in wins]
    return {
        "busy_frac": shares["compute"] + shares["optimizer"],
        "input_cost": input_cost(used, meter.cuda, meter.threads, meter.span_cpu()),
        "measured_steps": sum(w.steps for w in wins),
        "warmup_excluded": bool(meter.windows),
        "windows": len(wins),
        "utilization": util,
        "utilization_spread": [min(utils), max(utils)],
        "utilization_source": meter.source,
        "throughput": sum(w.samples for w in used) / wall if wall > 0 else 0.0,
        "throughput_spread": [min(thr), max(thr)],
        "step_time_s": wall / steps,
        "phase_s": {p: totals[p] / steps for p in PHASES},
        "data_wait_frac": shares["data"],
        **{f"{p}_frac": shares[p] for p in ("h2d", "compute", "comm", "optimizer", "other")},
        **device_figures(meter.source, meter.sampler, used, util),
        "estimate": estimate_of(meter.windows).as_dict(),
        **token_figures(used, wall),
        **base,
    }


def device_figures(source: str, sampler: Any, used: List[Window], util: float) -> Dict[str, Any]:
    """The three device figures side by side (docs/measurement.md): NVML's utilization.gpu, SM
    activity (NVML GPM) and their sources; `util` is the measured windows' utilization."""
    sm_wins = [w for w in used if w.sm_active is not None]
    return {
        "nvml_util": util if source == "nvml" else None,
        "nvml_util_source": "nvml utilization.gpu" if source == "nvml" else "absent: no NVML device",
        "sm_active": estimate([w.sm_active for w in sm_wins], weights=[w.wall_s for w in sm_wins]).mean
        if sm_wins else None,
        "sm_active_source": sampler.sm_source if sampler is not None else "absent: no NVML device",
    }


def token_figures(used: List[Window], wall: float) -> Dict[str, Any]:
    """Real tokens/s (padding excluded) and the share of the positions computed that were padding,
    over the measured windows; None for batches without an attention_mask."""
    tokens, padded = sum(w.tokens for w in used), sum(w.padded_tokens for w in used)
    if not padded:
        return {"tokens_per_s": None, "padding_frac": None}
    return {"tokens_per_s": tokens / wall if wall > 0 else 0.0, "padding_frac": 1.0 - tokens / padded}
