"""What a rank reads of its device and host besides its step's clocks: the GPU's utilization
(NVML, sampled in a thread), the rank's resident memory with its loader workers' (sampled in a
thread: a kept-alive rank reports each job's own peak), the CPU time of the process and its
workers, the cores it may use, and the job's memory figures. The step meter (runtime/meter.py)
starts and reads them per window and at the end of the job.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


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

    def mean(self, t0: float, t1: float, samples: Optional[List[tuple[float, float]]] = None,
             skip: List[tuple] = ()) -> Optional[float]:
        """Mean over [t0, t1] less the intervals `skip` (the meter's pauses) as a fraction, of
        utilization.gpu (or `samples`, the SM activity);
        windows come in order, so older samples are dropped (the list stays one window long, and a
        kept-alive rank's next job starts with its own sampler)."""
        samples = self.samples if samples is None else samples
        keep = next((i for i, (t, _) in enumerate(samples) if t >= t0), len(samples))
        if keep > 1:
            del samples[:keep - 1]  # one before t0 stays: the nearest sample of a short window
        vals = [u for t, u in samples if t0 <= t <= t1 and not any(a <= t <= b for a, b in skip)]
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


class MemorySampler:
    """Per-job high-water of this rank's resident memory on CPU, loader workers included: the
    rank's RSS plus each child process's unique memory (USS: what a forked worker adds; its RSS
    would count again the pages it shares with the rank). The rank is sampled at `hz` in a daemon
    thread from the job's start, so a kept-alive rank reports each job's own peak (ru_maxrss is
    the process's lifetime peak); the workers, whose USS costs ~2 ms each to read, every
    `children_every`-th sample. 2 Hz, not more: at 10 Hz the thread's psutil calls contend with
    the training loop for the GIL and cost ~9% of a 0.35 ms step (bench/bench_overhead.py)."""

    def __init__(self, hz: float = 2.0, children_every: int = 4) -> None:
        import psutil

        self._proc = psutil.Process()
        self._psutil = psutil
        self._period, self._children_every = 1.0 / hz, children_every
        self._children_mb = 0.0
        self._n = 0
        self.peak_mb = 0.0
        self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> float:
        """Sample now; returns the current figure (MB) and raises the high-water."""
        psutil = self._psutil
        if self._n % self._children_every == 0:
            total = 0
            try:
                children = self._proc.children(recursive=True)
            except psutil.Error:
                children = []
            for c in children:
                try:
                    total += c.memory_full_info().uss
                except psutil.Error:
                    pass
            self._children_mb = total / 2**20
        self._n += 1
        mb = self._proc.memory_info().rss / 2**20 + self._children_mb
        self.peak_mb = max(self.peak_mb, mb)
        return mb

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sample()
            except Exception:  # a vanished worker, /proc trouble: the next sample will do
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def cpu_snapshot(live: bool = True) -> Dict[str, float]:
    """CPU seconds so far of this process and of its child processes (the loader's workers: the
    live ones read through psutil, which walks every process in /proc, about a millisecond, only
    where `live` ones may run; the ended ones from the kernel's reaped-children account)."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    workers = own.children_user + own.children_system
    try:
        children = me.children(recursive=True) if live else []
    except psutil.Error:
        children = []
    for c in children:
        try:
            t = c.cpu_times()
            workers += t.user + t.system
        except psutil.Error:  # ended meanwhile: it is in the reaped account next time
            pass
    return {"process": time.process_time(), "workers": workers}


class CpuSpan:
    """CPU seconds of this process and of its children (the loader's workers) over a span (the
    steady one: from the first warmup's end), its pauses (evaluations) left out. `workers()`: the
    loader has workers now (without, only ended ones are read: cpu_snapshot's `live`)."""

    def __init__(self, workers: Callable[[], bool] = lambda: True) -> None:
        self.workers = workers
        self.start: Optional[Dict[str, float]] = None  # cpu_snapshot() when the span began
        self.paused = {"process": 0.0, "workers": 0.0}  # CPU spent paused since then

    def snapshot(self) -> Dict[str, float]:
        return cpu_snapshot(self.workers())

    def begin(self) -> None:
        self.start = self.snapshot()
        self.paused = dict.fromkeys(self.paused, 0.0)

    def add_pause(self, cpu0: Dict[str, float]) -> None:
        """A pause that began at the snapshot() `cpu0` ends now."""
        cpu1 = self.snapshot()
        for k in self.paused:
            self.paused[k] += cpu1[k] - cpu0[k]

    def per_sample(self, samples: int) -> Optional[Dict[str, float]]:
        """The span's CPU seconds so far per sample of `samples`; None before it began or without samples."""
        if self.start is None or not samples:
            return None
        now = self.snapshot()
        return {k: max(0.0, now[k] - self.start[k] - self.paused[k]) / samples for k in ("workers", "process")}


def cores_per_rank() -> int:
    """The cores this rank may use: its CPU affinity shared by the ranks on its node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def model_state_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """MB of parameters, their gradients (one each, counted whether or not held now) and the
    optimizer's state that this rank holds: its own shards of sharded (DTensor) ones."""
    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = sum(local(p) for p in model.parameters())
    state = sum(local(v) for s in optimizer.state.values() for v in s.values())
    return (2 * params + state) / 2**20


def memory_stats(device: torch.device, sampler: Optional[MemorySampler] = None, cap_mb: float = 0.0) -> Dict[str, Any]:
    """This job's peak memory: the CUDA allocator's (its peak was reset when the job started) on
    GPU; on CPU the sampled resident high-water of the rank and its loader workers, against the
    host's memory or `cap_mb` (trainer.memory_cap_mb) when less: what the diagnosis sizes batches by."""
    if device.type == "cuda":
        return {
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "reserved_mem_mb": torch.cuda.max_memory_reserved(device) / 2**20,
            "device_mem_mb": torch.cuda.get_device_properties(device).total_memory / 2**20,
            "mem_source": "cuda-allocator",
            "memory_summary": torch.cuda.memory_summary(device, abbreviated=True),
        }
    import psutil

    rss = psutil.Process(os.getpid()).memory_info().rss / 2**20
    peak = max(sampler.peak_mb, rss) if sampler is not None else rss
    total = psutil.virtual_memory().total / 2**20
    return {"peak_mem_mb": peak, "reserved_mem_mb": rss, "device_mem_mb": min(total, cap_mb) if cap_mb > 0 else total,
            "mem_source": "rss"}


def utilization_sampler(device: torch.device, nvml: bool = True) -> Tuple[Optional[NvmlSampler], str]:
    """The sampler of this device's utilization and the meter's utilization source: `nvml` on CUDA
    where NVML answers, else `cuda-busy` (the busy phases' share); `cpu-time` on CPU (no sampler:
    the loop thread's CPU time is read at the marks)."""
    if device.type != "cuda":
        return None, "cpu-time"
    if not nvml:
        return None, "cuda-busy"
    try:
        return NvmlSampler(device), "nvml"
    except Exception as exc:  # no NVML (e.g. no driver library): say so, fall back
        print(f"[meter] NVML unavailable ({exc}); utilization falls back to the busy fraction")
        return None, "cuda-busy"


def start_memory(device: torch.device) -> Tuple[Optional[MemorySampler], float]:
    """Start this job's memory account: on CUDA the allocator's peak is reset (this job's peak, not
    the process's) and nothing is sampled; on CPU a MemorySampler. Returns it and the MB held now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return None, torch.cuda.memory_allocated(device) / 2**20
    memory = MemorySampler()
    return memory, memory.peak_mb


def check_memory(memory: Optional[MemorySampler], cap_mb: float) -> None:
    """Raise when this job's resident high-water (`memory`, CPU) passed `cap_mb` (0: no cap)."""
    if memory is not None and cap_mb and memory.peak_mb > cap_mb:
        raise MemoryError(f"out of memory: this rank's resident memory reached {memory.peak_mb:.0f} MB "
                          f"(loader workers included) > trainer.memory_cap_mb={cap_mb:g}")


def close_samplers(sampler: Optional[NvmlSampler], memory: Optional[MemorySampler]) -> None:
    """Stop the job's samplers; the memory's high-water takes a last sample first."""
    if sampler is not None:
        sampler.close()
    if memory is not None:
        memory.sample()
        memory.close()
