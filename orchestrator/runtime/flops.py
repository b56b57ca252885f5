"""Model FLOPs utilization (MFU): the model's useful FLOPs per second over the device's peak, as
PaLM defines it and nanoGPT and torchtitan log it. For a fixed model it moves with samples/s, so
unlike a busy fraction it cannot be raised by wasting work.

FLOPs per sample are counted once per run with `torch.utils.flop_counter.FlopCounterMode` around
the run's first step, a warmup step that is never measured: the real forward + backward of every
micro-batch (matmuls, convolutions, attention: the operators with a FLOP formula; elementwise
work is not counted, as in the papers), divided by the samples in it. It costs no extra compute
and touches no RNG. (Counting on the meta device instead would import torch._dynamo, ~1 s per
process.) The first layer computes no input gradient, so a Linear(in, out) costs 4 x in x out
per sample, not the 6N of the rule of thumb.

Peak FLOP/s: a table of dense tensor-core/SIMT peaks by GPU name and dtype (NVIDIA datasheets,
dense, i.e. without 2:4 sparsity), `measure.peak_tflops` to override, and on CPU a short matmul
measurement at the rank's thread count (orchestrator/costs.py, cached per host). An unknown
device reports no MFU rather than a guess.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

# Dense peak TFLOP/s by dtype. Sources: NVIDIA data sheets (A100 40/80GB, H100 SXM/PCIe/NVL, H200,
# L4, A10, V100 SXM2/PCIe); tf32 and bf16/fp16 are tensor-core figures without sparsity, fp32 the
# SIMT figure. Matched by substring of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: Dict[str, Dict[str, float]] = {
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # SXM5
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # SXM; the NVL part is lower
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "A10G": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},  # AWS's A10 variant: A10 figures
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "V100-PCIE": {"fp32": 14.0, "fp16": 112.0},  # no bf16, no tf32
    "V100": {"fp32": 15.7, "fp16": 125.0},  # SXM2
}


def dtype_name(amp: bool, amp_dtype: torch.dtype, device: torch.device) -> str:
    """The dtype the matmuls run in: the autocast dtype, else fp32 (tf32 when CUDA allows it)."""
    if amp:
        return "bf16" if amp_dtype is torch.bfloat16 else "fp16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak(device_name: str, dtype: str) -> Dict[str, Any]:
    """{"flops", "source"} from PEAK_TFLOPS for a GPU's name (as CUDA reports it)."""
    for key, peaks in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            if dtype in peaks:
                return {"flops": peaks[dtype] * 1e12, "source": f"table: {key} {dtype} dense"}
            return {"flops": None, "source": f"unknown peak: {key} has no {dtype} figure"}
    return {"flops": None, "source": f"unknown peak for '{device_name}' (set measure.peak_tflops)"}


def peak_flops(device: torch.device, dtype: str, override_tflops: float = 0.0) -> Dict[str, Any]:
    """{"flops": peak FLOP/s or None, "source": where it came from} for one rank's device."""
    if override_tflops:
        return {"flops": override_tflops * 1e12, "source": f"measure.peak_tflops={override_tflops:g}"}
    if device.type == "cuda":
        return table_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        from ..costs import cpu_peak_flops

        measured = cpu_peak_flops(dtype, torch.get_num_threads())
        return {"flops": measured["flops"], "source": measured["source"]}
    return {"flops": None, "source": f"unknown peak for device type {device.type} (set measure.peak_tflops)"}


_REGISTERED = False


def _register_cpu_attention() -> None:
    """PyTorch's counter has formulas for the CUDA attention kernels but not for the CPU flash
    kernel that `scaled_dot_product_attention` runs on CPU: register the same formulas for it."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    try:
        if forward is not None:
            fc.register_flop_formula(forward)(
                lambda query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs:
                fc.sdpa_flop_count(query_shape, key_shape, value_shape))
        if backward is not None:
            fc.register_flop_formula(backward)(
                lambda grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs:
                fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))
    except Exception:  # a newer torch that already counts them
        pass


class StepCounter:
    """FLOPs of one real training step (forward + backward of every micro-batch), counted with
    `FlopCounterMode` around that step: no extra compute, no copy of the model, no RNG consumed.
    The loop counts its first step, which is warmup (never measured)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        _register_cpu_attention()
        self.mode = FlopCounterMode(display=False)

    def __enter__(self) -> "StepCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    def per_sample(self, samples: int) -> Dict[str, Any]:
        """{"flops": FLOPs per sample or None, "reason"}."""
        total = self.mode.get_total_flops()
        if not total or not samples:
            return {"flops": None, "reason": "not counted: no operator with a FLOP formula ran (a model the counter "
                                             "cannot see into, e.g. custom kernels)"}
        return {"flops": total / samples, "reason": "FlopCounterMode over the first (warmup) step"}


def mfu_figures(flops: Dict[str, Any], samples_per_s: Optional[float], device: torch.device, amp: bool,
                amp_dtype: torch.dtype, peak_tflops: float = 0.0) -> Dict[str, Any]:
    """A rank's MFU and what it rests on: FLOPs per sample, the peak and their sources."""
    dtype = dtype_name(amp, amp_dtype, device)
    peak = peak_flops(device, dtype, peak_tflops) if flops["flops"] else {"flops": None, "source": "-"}
    value = None
    if flops["flops"] and samples_per_s and peak["flops"]:
        value = flops["flops"] * samples_per_s / peak["flops"]
    source = (f"{flops['reason']}; peak {peak['flops'] / 1e12:.3g} TFLOP/s ({peak['source']})" if value is not None
              else flops["reason"] if not flops["flops"] else peak["source"])
    return {"mfu": value, "mfu_source": source, "flops_per_sample": flops["flops"], "peak_flops": peak["flops"],
            "mfu_dtype": dtype}
