"""What bounds a job, and what to change: thresholds on the measured shares, advice in knobs.

A step's wall time is tiled by its phases (see runtime/meter.py), so the shares say where the
time went. The verdict is the first rule that holds, in this order:

  memory-bound          peak memory >= MEMORY_FULL of the device (CUDA total / host RAM):
                        nothing larger fits, whatever the other shares say
  input-bound           data wait + host-to-device >= INPUT_BOUND of the step
  communication-bound   exposed communication >= COMM_BOUND of the step
  compute-bound         otherwise (compute + optimizer dominate)

Imbalance: a rank whose own work per step (step time minus its communication wait) exceeds the
fastest rank's by more than STRAGGLER_SPREAD is named as the straggler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .schema import BackendName, Config

INPUT_BOUND = 0.30
COMM_BOUND = 0.30
MEMORY_FULL = 0.90
STRAGGLER_SPREAD = 0.20


@dataclass
class Diagnosis:
    verdict: str  # input-bound | communication-bound | compute-bound | memory-bound
    reason: str
    advice: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "advice": self.advice}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(job: Dict[str, Any], cfg: Config, device_mem_mb: Optional[float]) -> Diagnosis:
    """`job` is the merged result (report.merge); `device_mem_mb` the memory one rank can use."""
    d, t, p = cfg.data, cfg.trainer, cfg.parallelism
    inp = job.get("data_wait_frac", 0.0) + job.get("h2d_frac", 0.0)
    comm = job.get("comm_frac", 0.0)
    busy = job.get("compute_frac", 0.0) + job.get("optimizer_frac", 0.0)
    cuda = str((job.get("per_rank") or [{}])[0].get("device", "cpu")).startswith("cuda")
    peak = job.get("peak_mem_mb") or 0.0
    mem_share = peak / device_mem_mb if device_mem_mb else 0.0

    if mem_share >= MEMORY_FULL:
        advice = [f"lower data.batch_size to {max(1, d.batch_size // 2)} and raise trainer.accumulation_steps to "
                  f"{t.accumulation_steps * 2} (same global batch, half the activations)"]
        if not t.amp:
            advice.append("turn on trainer.amp=true (bf16/fp16 activations take half the memory)")
        return Diagnosis("memory-bound", f"peak memory {peak:.0f} MB is {_pct(mem_share)} of the {device_mem_mb:.0f} MB "
                                         f"available (>= {_pct(MEMORY_FULL)})", advice)

    if inp >= INPUT_BOUND:
        advice = []
        more = max(2, 2 * d.num_workers) if d.num_workers else 2
        advice.append(f"raise data.num_workers from {d.num_workers} to {more}"
                      + (" and set data.persistent_workers=true" if not d.persistent_workers else ""))
        if d.num_workers and (d.prefetch_factor or 2) < 4:
            advice.append(f"raise data.prefetch_factor from {d.prefetch_factor or 2} to 4")
        if cuda and not d.pin_memory:
            advice.append("turn on data.pin_memory=true (faster, asynchronous host-to-device copies)")
        if job.get("h2d_frac", 0.0) > job.get("data_wait_frac", 0.0):
            advice.append("host-to-device copies dominate the input time: pin memory and keep inputs compact "
                          "(uint8 images, converted on the device)")
        advice.append(f"or try a larger data.batch_size ({d.batch_size * 2}): per-batch overheads amortize")
        return Diagnosis("input-bound", f"the step waits on input {_pct(inp)} of the time (data {_pct(job.get('data_wait_frac', 0))}, "
                                        f"h2d {_pct(job.get('h2d_frac', 0))}; >= {_pct(INPUT_BOUND)})", advice)

    if comm >= COMM_BOUND and job.get("world_size", 1) > 1:
        advice = [f"raise trainer.accumulation_steps from {t.accumulation_steps} to {t.accumulation_steps * 4} "
                  "(one all-reduce per optimizer step)",
                  f"or a larger data.batch_size ({d.batch_size * 4}): more compute per all-reduce"]
        if cfg.backend.name is BackendName.horovod and not cfg.backend.fp16_compression:
            advice.append("turn on backend.fp16_compression=true (half the bytes on the wire)")
        if not t.amp and cuda:
            advice.append("turn on trainer.amp=true (shorter compute leaves less to overlap, but bf16 grads halve traffic)")
        if p.nnodes > 1:
            advice.append("check the inter-node network: fewer, larger nodes communicate less")
        return Diagnosis("communication-bound", f"exposed communication is {_pct(comm)} of the step (>= {_pct(COMM_BOUND)})",
                         advice)

    advice = []
    if not t.amp:
        advice.append("turn on trainer.amp=true (bf16 where supported)")
    if mem_share and mem_share < 0.5:
        advice.append(f"memory allows a larger data.batch_size ({d.batch_size * 2}) for better kernel efficiency")
    advice.append("the device is the limit: a faster model (fused ops, torch.compile) or more ranks")
    return Diagnosis("compute-bound", f"compute + optimizer take {_pct(busy)} of the step; input {_pct(inp)}, "
                                      f"communication {_pct(comm)}", advice)


def straggler_note(job: Dict[str, Any]) -> Optional[str]:
    imb = job.get("imbalance") or {}
    if imb.get("straggler_rank") is None:  # named by report.merge only past STRAGGLER_SPREAD
        return None
    return (f"rank {imb['straggler_rank']} is a straggler: its own work per step is {_pct(imb['own_time_spread'])} above "
            f"the fastest rank's (> {_pct(STRAGGLER_SPREAD)}); the others wait for it in the all-reduce. Check its "
            "device, its data shard and what else runs on its host")
