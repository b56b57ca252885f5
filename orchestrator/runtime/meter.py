"""Measured load of one rank: where each step's time goes, utilization, memory.

The loop calls `mark(phase)` at the end of each phase. A mark is a `perf_counter()` on CPU and
a recorded CUDA event on CUDA, so on a GPU the phases are read off the *device* timeline (a
host that runs ahead of the device does not inflate the figures). Marks are resolved into
durations only at the end of each window of `window_steps` steps (one synchronize per window),
which keeps the per-step cost to a few list appends.

Phases of a step (they tile the step's wall time, so the shares add up to 1):
  other      bookkeeping between steps (logging, progress)
  data       waiting for the DataLoader's next batch
  h2d        host-to-device copies
  compute    forward + backward (exposed DDP all-reduce wait excluded)
  comm       exposed communication: DDP's wait for the last gradient bucket, Horovod's synchronize
  optimizer  optimizer step and zero_grad

utilization: on CUDA, the mean NVML `utilization.gpu` of this rank's device over the window
(source `nvml`, sampled by a background thread); elsewhere the busy fraction
(compute + optimizer) / wall (source `cpu-busy`).
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

PHASES = ("other", "data", "h2d", "compute", "comm", "optimizer")
OTHER, DATA, H2D, COMPUTE, COMM, OPTIMIZER = range(len(PHASES))  # what `mark` takes
BUSY = ("compute", "optimizer")


class NvmlSampler:
    """Samples NVML `utilization.gpu` of one device at `hz` in a daemon thread, and where NVML's
    GPU performance monitoring (GPM, Hopper and newer) is supported, SM activity: the share of
    time the SMs were busy between two samples (`NVML_GPM_METRIC_SM_UTIL`)."""

    source = "nvml"

    def __init__(self, device: torch.device, hz: float = 20.0) -> None:
        import pynvml  # nvidia-ml-py; imported here so CPU runs never need it

        self._nvml = pynvml
        pynvml.nvmlInit()
        try:  # honours CUDA_VISIBLE_DEVICES: torch index -> NVML index
            index = torch.cuda._get_nvml_device_index(device)  # type: ignore[attr-defined]
        except Exception:
            index = device.index or 0
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._period = 1.0 / hz
        self.samples: List[tuple[float, float]] = []
        self.sm_samples: List[tuple[float, float]] = []
        try:
            self.gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(self._handle).isSupportedDevice)
            self.sm_source = "nvml-gpm" if self.gpm else "absent: this GPU has no NVML GPM (Hopper and newer)"
        except Exception as exc:  # an older driver or library
            self.gpm, self.sm_source = False, f"absent: NVML GPM unavailable ({type(exc).__name__})"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _sm_util(self, prev: Any, cur: Any) -> float:
        nvml = self._nvml
        req = nvml.c_nvmlGpmMetricsGet_t()
        req.version = nvml.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = 1
        req.sample1, req.sample2 = prev, cur
        req.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        nvml.nvmlGpmMetricsGet(req)
        return float(req.metrics[0].value)

    def _run(self) -> None:
        nvml, prev = self._nvml, None
        if self.gpm:
            try:
                prev = nvml.nvmlGpmSampleGet(self._handle, nvml.nvmlGpmSampleAlloc())
            except Exception as exc:
                self.gpm, self.sm_source = False, f"absent: NVML GPM sampling failed ({type(exc).__name__})"
        while not self._stop.is_set():
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                self.samples.append((time.perf_counter(), float(util)))
                if prev is not None:
                    cur = nvml.nvmlGpmSampleGet(self._handle, nvml.nvmlGpmSampleAlloc())
                    self.sm_samples.append((time.perf_counter(), self._sm_util(prev, cur)))
                    nvml.nvmlGpmSampleFree(prev)
                    prev = cur
            except Exception:  # a transient NVML error must not kill training
                pass
            self._stop.wait(self._period)
        if prev is not None:
            try:
                nvml.nvmlGpmSampleFree(prev)
            except Exception:
                pass

    def mean(self, t0: float, t1: float, samples: Optional[List[tuple[float, float]]] = None) -> Optional[float]:
        """Mean of the samples in [t0, t1] as a fraction (utilization.gpu, or `samples`)."""
        samples = self.samples if samples is None else samples
        vals = [u for t, u in samples if t0 <= t <= t1]
        if not vals:  # window shorter than the sampling period: nearest sample
            near = [u for t, u in samples if t <= t1]
            return near[-1] / 100.0 if near else None
        return statistics.fmean(vals) / 100.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


@dataclass
class Window:
    index: int
    first_step: int
    steps: int
    samples: int
    wall_s: float
    phases_s: Dict[str, float]
    utilization: float
    t_start: float  # perf_counter, for timelines
    t_end: float
    sm_active: Optional[float] = None  # NVML GPM SM activity (Hopper and newer)

    @property
    def throughput(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def share(self, phase: str) -> float:
        total = sum(self.phases_s.values())
        return self.phases_s[phase] / total if total > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {
            "index": self.index, "first_step": self.first_step, "steps": self.steps, "samples": self.samples,
            "wall_s": self.wall_s, "throughput": self.throughput, "utilization": self.utilization,
            "phases_s": self.phases_s, "t_start": self.t_start, "t_end": self.t_end, "sm_active": self.sm_active,
        }


@dataclass
class StepMeter:
    device: torch.device
    window_steps: int = 10
    warmup_steps: int = 5
    nvml: bool = True
    windows: List[Window] = field(default_factory=list)
    warmup_windows: List[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.sampler: Optional[NvmlSampler] = None
        self.source = "cpu-busy"
        if self.cuda and self.nvml:
            try:
                self.sampler = NvmlSampler(self.device)
                self.source = "nvml"
            except Exception as exc:  # no NVML (e.g. no driver library): say so, fall back
                print(f"[meter] NVML unavailable ({exc}); utilization falls back to the busy fraction")
                self.source = "cuda-busy"
        self._marks: List[tuple[int, Any]] = []  # (phase index, token)
        self._step_ends: List[int] = []  # index into _marks where each step ended
        self._samples = 0
        self._step = 0
        self._window_first = 0
        self._wall0 = 0.0
        self._hook_token: Any = None
        self._events: List[Any] = []

    # -- hot path: a few hundred nanoseconds a mark ------------------------------------------
    def _token(self) -> Any:
        if self.cuda:
            ev = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """Call once before the first step."""
        self._wall0 = time.perf_counter()
        self._marks.append((-1, self._token()))

    def mark(self, phase: int) -> None:
        """Phase `phase` (DATA, COMPUTE, ...) ended now; it began at the previous mark."""
        tok = time.perf_counter() if not self.cuda else self._token()
        if self._hook_token is not None and phase == COMPUTE:
            # DDP: the last gradient bucket was handed to the all-reduce at _hook_token; the rest
            # of backward was waiting for communication.
            self._marks.append((COMPUTE, self._hook_token))
            self._hook_token = None
            phase = COMM
        self._marks.append((phase, tok))

    def comm_hook_fired(self) -> None:
        """Called from a DDP comm hook each time a bucket is launched; the last one wins."""
        self._hook_token = self._token()

    @property
    def in_warmup(self) -> bool:
        return self._step <= self.warmup_steps

    def end_step(self, samples: int) -> Optional[Window]:
        """Close a step; returns the window it completed, if any."""
        self._samples += samples
        self._step += 1
        if self._step == self.warmup_steps or (
            self._step > self.warmup_steps and (self._step - self.warmup_steps) % self.window_steps == 0
        ):
            return self._close_window(warmup=self._step <= self.warmup_steps)
        return None

    # -- window resolution (off the hot path) -------------------------------------------------
    def _close_window(self, warmup: bool) -> Window:
        wall1 = time.perf_counter()
        marks = self._marks
        phases = dict.fromkeys(PHASES, 0.0)
        if self.cuda:
            marks[-1][1].synchronize()
            for (_, a), (p, b) in zip(marks[:-1], marks[1:]):
                phases[PHASES[p]] += a.elapsed_time(b) / 1000.0
            self._events.extend(tok for _, tok in marks[:-1] if tok is not marks[-1][1])
        else:
            for (_, a), (p, b) in zip(marks[:-1], marks[1:]):
                phases[PHASES[p]] += b - a
        wall = wall1 - self._wall0
        busy = sum(phases[p] for p in BUSY)
        total = sum(phases.values())
        util: Optional[float] = None
        sm: Optional[float] = None
        if self.sampler is not None:
            util = self.sampler.mean(self._wall0, wall1)
            if self.sampler.gpm:
                sm = self.sampler.mean(self._wall0, wall1, self.sampler.sm_samples)
        if util is None:
            util = busy / total if total > 0 else 0.0
        steps = self._step - self._window_first
        win = Window(
            index=len(self.windows), first_step=self._window_first, steps=steps, samples=self._samples,
            wall_s=wall, phases_s=phases, utilization=util, t_start=self._wall0, t_end=wall1, sm_active=sm,
        )
        (self.warmup_windows if warmup else self.windows).append(win)
        # the next window starts where this one ended
        last = marks[-1]
        self._marks = [(-1, last[1])]
        self._window_first = self._step
        self._samples = 0
        self._wall0 = wall1
        return win

    def flush(self) -> None:
        """Close a partial last window (steps after the last full one)."""
        if self._step > self._window_first and self._step > self.warmup_steps:
            self._close_window(warmup=False)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()

    # -- summary --------------------------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        wins = self.windows or self.warmup_windows  # a run shorter than its warmup: say so
        if not wins:
            return {"measured_steps": 0, "utilization_source": self.source}
        steps = sum(w.steps for w in wins)
        # The breakdown comes from one real window, the one of median step time: its phases tile
        # its wall time, so shares add up to 1 and per-step phases to the step time (medians
        # taken phase by phase would not), and a window hit by a stall elsewhere does not count.
        med = sorted(wins, key=lambda w: w.wall_s / w.steps)[(len(wins) - 1) // 2]
        per_step = {p: med.phases_s[p] / med.steps for p in PHASES}
        step_time = med.wall_s / med.steps
        utils = [w.utilization for w in wins]
        thr = [w.throughput for w in wins]
        shares = {p: med.share(p) for p in PHASES}
        sm = [w.sm_active for w in wins if w.sm_active is not None]
        return {
            "measured_steps": steps,
            "warmup_excluded": bool(self.windows),
            "windows": len(wins),
            "utilization": statistics.median(utils),
            "utilization_spread": [min(utils), max(utils)],
            "utilization_source": self.source,
            "throughput": statistics.median(thr),
            "throughput_spread": [min(thr), max(thr)],
            "step_time_s": step_time,
            "phase_s": per_step,
            "data_wait_frac": shares["data"],
            "h2d_frac": shares["h2d"],
            "compute_frac": shares["compute"],
            "comm_frac": shares["comm"],
            "optimizer_frac": shares["optimizer"],
            "other_frac": shares["other"],
            # the three device figures side by side (README, "What is measured")
            "nvml_util": statistics.median(utils) if self.source == "nvml" else None,
            "nvml_util_source": "nvml utilization.gpu" if self.source == "nvml" else "absent: no NVML device",
            "sm_active": statistics.median(sm) if sm else None,
            "sm_active_source": self.sampler.sm_source if self.sampler is not None else "absent: no NVML device",
            **memory_stats(self.device),
        }


def memory_stats(device: torch.device) -> Dict[str, Any]:
    """Peak memory: the CUDA allocator on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "reserved_mem_mb": torch.cuda.max_memory_reserved(device) / 2**20,
            "device_mem_mb": torch.cuda.get_device_properties(device).total_memory / 2**20,
            "mem_source": "cuda-allocator",
            "memory_summary": torch.cuda.memory_summary(device, abbreviated=True),
        }
    import psutil

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_mem_mb": peak_kb / 1024.0, "reserved_mem_mb": psutil.Process().memory_info().rss / 2**20,
            "device_mem_mb": psutil.virtual_memory().total / 2**20, "mem_source": "rss"}
