"""Measured load of one rank: where each step's time goes, utilization, memory.

The loop calls `mark(phase)` at the end of each phase: a `perf_counter()` on CPU, a recorded CUDA
event on CUDA (phases are read off the device timeline, so a host that runs ahead of the device
does not inflate them). Marks become durations only at the end of each window of `window_steps`
steps (one synchronize per window), so a step costs a few list appends. The phases tile the step's
wall time (their shares add up to 1): other (bookkeeping), data (waiting for the next batch), h2d,
compute (forward + backward, exposed all-reduce wait excluded), comm (exposed communication:
DDP's wait for the last gradient bucket, Horovod's synchronize) and optimizer (step, zero_grad).

utilization: on CUDA the mean NVML `utilization.gpu` of the rank's device over the window (`nvml`);
on CPU (`cpu-time`) the CPU time the loop's own thread got in its compute and optimizer phases over
the window's wall time. Starving the step cannot raise it: a loader worker that takes a core
stretches the busy phases' wall time, not the loop's CPU time. The input pipeline's cost is split
into CPU (the workers' CPU time per item, psutil; without workers the data phase's) and waiting.

Warmup ends in steady state: after `warmup_steps` steps and once the loader's pre-filled queue
(`queue` = num_workers x prefetch_factor micro-batches) has been read; `rewarm()` starts a new one.
Every epoch pays its restart (new workers refilling the queue), and the figures include it. With
workers an epoch's pre-made tail runs several times the steady rate and its restart waits, so
epochs shorter than EPOCH_WINDOWS windows are measured in windows of whole epochs, and a
measurement that stops on its own (`StopRule`) spans whole epochs (`steps_to_whole_epochs`).
Windows span whole loader rounds (`round_steps`): workers deliver in bursts, and a window ending
inside one counts batches ready at once. Estimates and stop rules are orchestrator/measure's.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from itertools import islice
from time import perf_counter, process_time, thread_time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..measure.phases import BUSY, COMM, COMPUTE, OTHER, PHASES
from ..measure.results import Window
from ..measure.stats import estimate, estimate_of

EPOCH_WINDOWS = 4  # an epoch shorter than this many windows is measured in windows of whole epochs
PAUSED = -1  # a mark's phase: the time before it is no phase's (a window's first mark; the end of a pause)


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


def cpu_snapshot() -> Dict[str, float]:
    """CPU seconds so far of this process and of its child processes (the loader's workers: the
    live ones read through psutil, the ended ones from the kernel's reaped-children account)."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    workers = own.children_user + own.children_system
    try:
        children = me.children(recursive=True)
    except psutil.Error:
        children = []
    for c in children:
        try:
            t = c.cpu_times()
            workers += t.user + t.system
        except psutil.Error:  # ended meanwhile: it is in the reaped account next time
            pass
    return {"process": time.process_time(), "workers": workers}


def cores_per_rank() -> int:
    """The cores this rank may use: its CPU affinity shared by the ranks on its node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def by_phase(phases: List[int], at: List[Any],
             elapsed: Optional[Callable[[Any, Any], float]] = None) -> Dict[str, float]:
    """Each phase's time (or CPU time) from readings `at` taken at the marks, whose phases are
    `phases`: mark i ends a span of phases[i] that began at mark i - 1, of `elapsed(at[i - 1],
    at[i])` seconds (default: the difference). PAUSED spans are no phase's (the accumulator's last
    slot, index -1, takes them and is left out)."""
    acc = [0.0] * (len(PHASES) + 1)
    spans = zip(islice(phases, 1, None), at, islice(at, 1, None))
    if elapsed is None:
        for p, a, b in spans:
            acc[p] += b - a
    else:
        for p, a, b in spans:
            acc[p] += elapsed(a, b)
    return dict(zip(PHASES, acc))


@dataclass
class StepMeter:
    device: torch.device
    window_steps: int = 10
    warmup_steps: int = 5  # at least this many steps of warmup
    queue: int = 0  # micro-batches the loader pre-fills (num_workers x prefetch_factor), read before measuring
    round_steps: int = 1  # windows last a multiple of this many steps: one round of the loader's workers
    epoch_steps: int = 0  # optimizer steps an epoch (0: not known): short epochs are measured whole
    nvml: bool = True
    memory_cap_mb: float = 0.0  # CPU: the per-job resident high-water may not pass this (0: no cap)
    # every COMPUTE mark is followed by the OPTIMIZER mark, none between (one process, one micro-batch
    # a step, no exposed communication: runtime/step.py): the loop thread's CPU time is not read at the
    # COMPUTE mark, as only its sum over the two busy phases is a figure
    optimizer_follows_compute: bool = False
    windows: List[Window] = field(default_factory=list)
    warmup_windows: List[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.sampler: Optional[NvmlSampler] = None
        self.source = "cuda-busy" if self.cuda else "cpu-time"
        if self.cuda and self.nvml:
            try:
                self.sampler = NvmlSampler(self.device)
                self.source = "nvml"
            except Exception as exc:  # no NVML (e.g. no driver library): say so, fall back
                print(f"[meter] NVML unavailable ({exc}); utilization falls back to the busy fraction")
                self.source = "cuda-busy"
        # one entry a mark in each list: the phase it ended (PAUSED: none), its time (perf_counter on
        # CPU, a recorded CUDA event on CUDA), and on CPU the process's CPU time (phases' CPU time)
        self._phases: List[int] = []
        self._toks: List[Any] = []
        self._cpu_on = not self.cuda
        self._cpu: List[float] = []
        # the loop's own thread's CPU time at each mark: on CPU its busy phases' share is the
        # utilization, and with no loader workers its data phase is the loader's own CPU (the
        # process's would add the intra-op threads' spin-waits meanwhile)
        self._inproc = self.queue == 0
        self._thread_on = not self.cuda or self._inproc
        self._thread_cpu: List[float] = []
        self._hook_cpu = self._hook_thread = 0.0
        self.threads = max(1, torch.get_num_threads())
        self._span0: Optional[Dict[str, float]] = None  # loader and process CPU when the measurement began
        self._span_samples = 0  # samples since then (measured, re-warm and partial windows alike)
        self._samples = 0
        self._tokens = self._padded = 0
        self._step = 0
        self._window_first = 0
        self._wall0 = 0.0
        self._hook_token: Any = None
        self._events: List[Any] = []
        self._warming = True
        self._micro = 0  # micro-batches read since the iterator (re)started
        self._window_want = self.window_steps  # steps asked for; windows last whole_rounds() of it
        self._window_len = self.whole_rounds(self.window_steps)
        self._warm_why = "start"
        self._epochs = 0  # epochs ended since the window began
        self._aligned = False  # the window began with an epoch (windows of whole epochs)
        self._whole = False  # windows were whole epochs at a resize in this measured span: they stay so (whole_epochs)
        self._epoch_first = 0  # the step the current epoch began after
        self._measure_first = 0  # the step the last warmup ended at: the measured span begins there
        self._stop_at = 0  # a window ends at this step (the measured span's end: `stop_at`)
        self.warmups: List[Dict[str, Any]] = []  # one per warmup: where it ended and why
        self._paused: Optional[tuple] = None  # (marks, perf_counter, CPU snapshot) at pause()
        self._pauses: List[tuple] = []  # the window's paused intervals (perf_counter): no phase holds them
        self._paused_cpu = {"process": 0.0, "workers": 0.0}  # CPU spent paused since the span began
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # this job's peak, not the process's
            self.memory: Optional[MemorySampler] = None
            self.start_mem_mb = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            self.memory = MemorySampler()
            self.start_mem_mb = self.memory.peak_mb

    # -- hot path: a mark reads each of its clocks once and appends, nothing more ---------------
    def _token(self) -> Any:
        if self.cuda:
            ev = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return perf_counter()

    def _add_mark(self, phase: int) -> None:
        """A mark of `phase` now, outside the hot path (a window's first mark, a pause's end)."""
        self._phases.append(phase)
        self._toks.append(self._token())
        if self._cpu_on:
            self._cpu.append(process_time())
        if self._thread_on:
            self._thread_cpu.append(thread_time())

    def start(self) -> None:
        """Call once before the first step."""
        self._wall0 = perf_counter()
        self._add_mark(PAUSED)

    def mark(self, phase: int) -> None:
        """Phase `phase` (DATA, COMPUTE, ...) ended now; it began at the previous mark."""
        tok = self._token() if self.cuda else perf_counter()
        if self._hook_token is not None and phase == COMPUTE:
            phase = self._split_at_hook()
        self._phases.append(phase)
        self._toks.append(tok)
        if self._cpu_on:
            self._cpu.append(process_time())
        if self._thread_on:
            thread = self._thread_cpu
            thread.append(thread[-1] if phase == COMPUTE and self.optimizer_follows_compute else thread_time())

    def _split_at_hook(self) -> int:
        """DDP: the last gradient bucket was handed to the all-reduce at the hook's token; compute
        ended there, and the rest of backward was waiting for communication (returns COMM)."""
        self._phases.append(COMPUTE)
        self._toks.append(self._hook_token)
        if self._cpu_on:
            self._cpu.append(self._hook_cpu)
        if self._thread_on:
            self._thread_cpu.append(self._hook_thread)
        self._hook_token = None
        return COMM

    def pause(self) -> None:
        """From here to `resume()` (an evaluation at a step's end) the time is nobody's: no phase
        or window holds it, nor the CPU time the input cost reads; marks made meanwhile (FSDP's
        collectives in the evaluation's forward) are dropped. Only between steps."""
        cpu0 = cpu_snapshot()
        self.mark(OTHER)
        self._paused = (len(self._phases), perf_counter(), cpu0)

    def resume(self) -> float:
        """The step after the pause begins now; returns the seconds paused."""
        assert self._paused is not None, "resume() without pause()"
        n, t0, cpu0 = self._paused
        self._paused = None
        cpu1 = cpu_snapshot()
        for k in self._paused_cpu:
            self._paused_cpu[k] += cpu1[k] - cpu0[k]
        if self.cuda:
            self._events.extend(self._toks[n:])
        del self._phases[n:], self._toks[n:], self._cpu[n:], self._thread_cpu[n:]
        self._add_mark(PAUSED)  # the time before this mark is no phase's
        t1 = perf_counter()
        self._pauses.append((t0, t1))
        return t1 - t0

    def comm_hook_fired(self) -> None:
        """Called from a DDP comm hook each time a bucket is launched; the last one wins."""
        self._hook_token = self._token()
        if not self.cuda:
            self._hook_cpu, self._hook_thread = process_time(), thread_time()

    def add_tokens(self, tokens: int, padded: int) -> None:
        """The step's real tokens and the positions computed (called only for batches with a mask)."""
        self._tokens += tokens
        self._padded += padded

    def end_step(self, samples: int, micro: int = 1) -> Optional[Window]:
        """Close a step of `micro` micro-batches; returns the window it completed, if any (a
        warmup window when this step ended the warmup: `window.warmup`)."""
        self._samples += samples
        self._span_samples += samples
        self._step += 1
        if self._warming:
            self._micro += micro
            if self._step >= self.warmup_steps and self._micro > self.queue:
                return self._end_warmup()
            return None
        if ((self._step - self._window_first >= self._window_len or self._step == self._stop_at)
                and not self.whole_epochs()):  # windows of whole epochs end at the epoch's end
            return self._close_window(warmup=False)
        return None

    def steps_to_whole_epochs(self) -> int:
        """Steps until the measured span (from the last warmup's end) holds a whole number of
        epochs, each phase of an epoch once per epoch: its pre-made tail and its restart alike. 0
        when it does, and where the epoch's ends do not differ from its middle: epochs not known, no
        loader workers (no queue made ahead). With windows of whole epochs the estimate holds whole
        epochs once windows began with one (`_aligned`); when windows became whole epochs only now
        (a short step time lengthened them mid-epoch), the steps to that epoch's end, which closes
        the epoch's windows as partial; otherwise a stop rule met on the fast pre-made batches that
        made that switch would end the measurement short of the epoch."""
        if not self.epoch_steps or not self.queue or self._warming:
            return 0
        if self.whole_epochs():
            return 0 if self._aligned else (-(self._step - self._epoch_first) % self.epoch_steps or self.epoch_steps)
        return -(self._step - self._measure_first) % self.epoch_steps

    @property
    def steps(self) -> int:
        """Steps ended so far (warmup included)."""
        return self._step

    def stop_at(self, step: int) -> None:
        """End a window at `step` (the measured span's end), whatever its length; with windows of
        whole epochs the epoch's end ends it instead (`epoch_end`)."""
        self._stop_at = step

    def whole_epochs(self) -> int:
        """Epochs a window lasts when windows are whole epochs (an epoch is shorter than
        EPOCH_WINDOWS windows), else 0. A window of part of a short epoch would read either its
        restart or none of it: windows would spread by the restart's cost, and a measurement that
        stops mid-epoch would miss its share. Once they are whole epochs in a measured span they
        stay so until the next warmup, whatever the step time makes of the window length: a whole
        epoch's window holds the restart, whose slow steps shorten the next windows, and back in
        windows of a few steps the epoch's pre-made tail lengthens them again. Flipping so, the
        measured span might never hold whole epochs when the stop rule is met, and the measurement
        would run on far past its cap (trainer.max_measure_s)."""
        if not self.epoch_steps:
            return 0
        if self.epoch_steps >= EPOCH_WINDOWS * self._window_len and not self._whole:
            return 0
        return max(1, round(self._window_len / self.epoch_steps))

    def epoch_end(self) -> Optional[Window]:
        """The epoch's last step ended. With windows of whole epochs, the window ends here once it
        holds its epochs; returns it. The window that began after the warmup, mid-epoch, ends at
        the first epoch end as a partial one (it holds no restart: left out of the estimate while
        whole ones exist). The next epoch's restart (the workers' start and first batches) falls
        in the next window, as in a long run.
        Windows closed earlier in that stretch, before the step time made windows whole epochs
        (the first `resize`), are partial too: they hold the epoch's tail without its restart, the
        workers idle and their last batches ready. Counted as full, a short tail window alone can
        be the estimate of a run that ends mid-epoch, at several times the run's whole rate."""
        per = self.whole_epochs()
        began, self._epoch_first = self._epoch_first, self._step
        if not per or self._warming:
            return None
        if not self._aligned:
            for win in reversed(self.windows):
                if win.partial or win.first_step < began:
                    break
                win.partial = True
        if self._step == self._window_first:  # nothing since the warmup or the last window
            self._aligned, self._epochs = True, 0
            return None
        self._epochs += 1
        if not self._aligned or self._epochs >= per:
            win = self._close_window(warmup=False, partial=not self._aligned)
            self._aligned = True
            return win
        return None

    def _end_warmup(self) -> Window:
        win = self._close_window(warmup=True)
        if self._span0 is None:  # the loader's cost is read over the steady span from here
            self._span0 = cpu_snapshot()
            self._span_samples = 0
            self._paused_cpu = dict.fromkeys(self._paused_cpu, 0.0)
        start = win.first_step if self.warmups else 0
        # what held the warmup this long: the loader's queue when it outlasted warmup_steps
        binding = "queue" if self.warmups or self._step > max(self.warmup_steps, 1) else "warmup_steps"
        self.warmups.append({"why": self._warm_why, "from_step": start, "until_step": self._step,
                             "steps": self._step - start, "micro_batches": self._micro, "ended_by": binding})
        self._warming, self._measure_first = False, self._step
        return win

    def rewarm(self, why: str) -> Optional[Window]:
        """A new loader's queue is filled (loader_autotune) or the steps just run were not steady
        (the profiler): measure again only after a new warmup. A partial measured window is
        closed first (it was steady); returns it."""
        win = None
        if not self._warming and self._step > self._window_first:
            win = self._close_window(warmup=False, partial=True)
        self._warm_why = why if not self._warming else f"{self._warm_why}+{why}"
        self._warming, self._micro, self._whole = True, 0, False
        return win

    def resize(self, step_time_s: float, window_s: float, at_most: int = 0) -> None:
        """Windows of `window_s` seconds (whole steps, at least one, at most `at_most` if given) at
        this step time; until the first resize, and with window_s=0, windows are window_steps steps (whole
        rounds of the loader's workers in both cases, so `at_most` may be passed by less than a round)."""
        if window_s > 0 and step_time_s > 0:
            self._whole = self._whole or (not self._warming and self.whole_epochs() > 0)  # they stay so
            steps = max(1, math.ceil(window_s / step_time_s))
            self._window_want = min(steps, at_most) if at_most else steps
            self._window_len = self.whole_rounds(self._window_want)

    def whole_rounds(self, steps: int) -> int:
        """`steps` rounded up to whole rounds of the loader's workers (`round_steps`)."""
        r = max(1, self.round_steps)
        return max(r, math.ceil(steps / r) * r)

    def set_round(self, round_steps: int) -> None:
        """The loader changed (loader_autotune): windows of whole rounds of the new one."""
        self.round_steps = round_steps
        self._window_len = self.whole_rounds(self._window_want)

    def fit_epoch(self, steps: int) -> None:
        """An epoch is `steps` optimizer steps (0: not known): see whole_epochs()."""
        self.epoch_steps = steps

    def check_memory(self) -> None:
        """Raise when this job's resident high-water passed the cap (CPU; checked per window)."""
        if self.memory is not None and self.memory_cap_mb and self.memory.peak_mb > self.memory_cap_mb:
            raise MemoryError(f"out of memory: this rank's resident memory reached {self.memory.peak_mb:.0f} MB "
                              f"(loader workers included) > trainer.memory_cap_mb={self.memory_cap_mb:g}")

    # -- window resolution (off the hot path) -------------------------------------------------
    def _close_window(self, warmup: bool, partial: bool = False) -> Window:
        wall1 = perf_counter()
        marks, toks = self._phases, self._toks
        if self.cuda:
            toks[-1].synchronize()
            phases = by_phase(marks, toks, lambda a, b: a.elapsed_time(b) / 1000.0)
            self._events.extend(tok for tok in toks[:-1] if tok is not toks[-1])
            cpu = dict.fromkeys(PHASES, 0.0)
        else:
            phases, cpu = by_phase(marks, toks), by_phase(marks, self._cpu)
            del self._cpu[:-1]
        # the loop thread's CPU time per phase (only its busy phases' sum and its data phase are read)
        loop = by_phase(marks, self._thread_cpu) if self._thread_on else dict.fromkeys(PHASES, 0.0)
        del self._thread_cpu[:-1]
        if self._thread_on and self._inproc:
            cpu["data"] = loop["data"]
        pauses, self._pauses = self._pauses, []
        wall = wall1 - self._wall0 - sum(b - a for a, b in pauses)
        busy = sum(phases[p] for p in BUSY)
        total = sum(phases.values())
        util: Optional[float] = None
        sm: Optional[float] = None
        if self.sampler is not None:
            util = self.sampler.mean(self._wall0, wall1, skip=pauses)
            if self.sampler.gpm:
                sm = self.sampler.mean(self._wall0, wall1, self.sampler.sm_samples, skip=pauses)
        if util is None and not self.cuda:  # the cores' share the training work got
            util = min(1.0, sum(loop[p] for p in BUSY) / wall) if wall > 0 else 0.0
        if util is None:
            util = busy / total if total > 0 else 0.0
        steps = self._step - self._window_first
        win = Window(
            index=len(self.windows), first_step=self._window_first, steps=steps, samples=self._samples,
            wall_s=wall, phases_s=phases, utilization=util, t_start=self._wall0, t_end=wall1, sm_active=sm,
            warmup=warmup, partial=partial, phases_cpu_s=cpu if not self.cuda or self._inproc else None,
            busy_cpu_s=sum(loop[p] for p in BUSY) if not self.cuda else None,
            tokens=self._tokens, padded_tokens=self._padded,
        )
        (self.warmup_windows if warmup else self.windows).append(win)
        # the next window starts where this one ended
        del marks[:-1], toks[:-1]
        marks[0] = PAUSED
        self._window_first = self._step
        self._epochs, self._aligned = 0, False
        self._samples = 0
        self._tokens = self._padded = 0
        self._wall0 = wall1
        return win

    def flush(self) -> None:
        """Close a partial last window (steps after the last full one)."""
        if self._step > self._window_first and not self._warming:
            self._close_window(warmup=False, partial=True)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        if self.memory is not None:
            self.memory.sample()
            self.memory.close()

    # -- summary --------------------------------------------------------------------------------
    def warmup_summary(self) -> Dict[str, Any]:
        """How long warmup took and why (result.json's `warmup`)."""
        first = self.warmups[0] if self.warmups else None
        out: Dict[str, Any] = {"min_steps": self.warmup_steps, "queue_micro_batches": self.queue,
                               "steps": first["until_step"] if first else self._step, "finished": first is not None}
        out["epochs_per_window"] = self.whole_epochs()  # 0: windows of steps (epoch restarts fall in them)
        if first is not None and first["why"] != "start":  # e.g. start+profiler: read again after profiling
            out["after"] = first["why"].split("+", 1)[1]
        if first is None:
            out["why"] = (f"the run ended after {self._step} steps, still in warmup (needs >= {self.warmup_steps} "
                          f"steps and > {self.queue} micro-batches)")
        elif first["ended_by"] == "queue":
            out["why"] = (f"the loader's pre-filled queue ({self.queue} micro-batches) was read after "
                          f"{first['until_step']} steps, past the {self.warmup_steps} warmup steps")
        else:
            out["why"] = f"{self.warmup_steps} warmup steps (the loader's queue of {self.queue} micro-batches was read)"
        if "after" in out:
            out["why"] += f"; the queue was read again after the {out['after']}'s steps"
        rewarms = self.warmups[1:]
        if rewarms:
            out["rewarmed"] = [{k: w[k] for k in ("why", "from_step", "steps")} for w in rewarms]
            out["rewarm_steps"] = sum(w["steps"] for w in rewarms)
        return out

    def _input_cost(self, used: List[Window]) -> Dict[str, Any]:
        """Per item delivered: the loader's CPU seconds (its workers', or with none the data
        phase's own CPU time), the data phase's wall seconds, the training process's CPU seconds
        and the busy phases' CPU seconds; with the cores and threads the rank runs on. What the
        job model (orchestrator/jobmodel.py) predicts other loader settings from."""
        samples = sum(w.samples for w in used)
        out: Dict[str, Any] = {"cores": cores_per_rank(), "threads": self.threads, "workers_cpu_s": None,
                               "data_wall_s": sum(w.phases_s["data"] for w in used) / samples if samples else None}
        if self._span0 is not None and self._span_samples:
            now, paused = cpu_snapshot(), self._paused_cpu
            out["workers_cpu_s"] = max(0.0, now["workers"] - self._span0["workers"] - paused["workers"]) / self._span_samples
            out["process_cpu_s"] = max(0.0, now["process"] - self._span0["process"] - paused["process"]) / self._span_samples
        cpu_wins = [w for w in used if w.phases_cpu_s is not None]
        n = sum(w.samples for w in cpu_wins)
        if n:
            out["data_cpu_s"] = sum(w.phases_cpu_s["data"] for w in cpu_wins) / n  # type: ignore[index]
            if not self.cuda:
                out["busy_cpu_s"] = sum(w.busy_cpu_s or 0.0 for w in cpu_wins) / n
                # the training process's CPU outside the data wait (its threads' spin-waits during the
                # wait are left out: they yield to workers that need the cores)
                out["consume_cpu_s"] = sum(w.phases_cpu_s[p] for w in cpu_wins for p in PHASES  # type: ignore[index]
                                           if p != "data") / n
                out["busy_wall_s"] = sum(w.phases_s[p] for w in cpu_wins for p in BUSY) / n
        return out

    def summary(self) -> Dict[str, Any]:
        base = {"warmup": self.warmup_summary(), **memory_stats(self.device, self.memory, self.memory_cap_mb),
                "start_mem_mb": self.start_mem_mb}
        wins = self.windows or self.warmup_windows  # a run shorter than its warmup: say so
        if not wins:
            return {"measured_steps": 0, "utilization_source": self.source, **base}
        # The figures a long run delivers: every measured (full) window's time, samples and phases
        # summed, so utilization is busy time over measured time and the breakdown's shares tile it.
        # A median over windows reads one mode of bursty windows: a loader whose workers finish
        # together alternates windows that find batches ready with windows that wait, and its median
        # window shows neither the wait nor the idle device (batch 128, 8 workers: median
        # utilization 0.91 and data share 0.09, over its measured time 0.60 and 0.40).
        used = [w for w in wins if not w.partial] or wins
        wall = sum(w.wall_s for w in used)
        steps = sum(w.steps for w in used)
        totals = {p: sum(w.phases_s[p] for w in used) for p in PHASES}
        tiled = sum(totals.values())
        per_step = {p: totals[p] / steps for p in PHASES}
        step_time = wall / steps
        shares = {p: totals[p] / tiled if tiled > 0 else 0.0 for p in PHASES}
        util = estimate([w.utilization for w in used], weights=[w.wall_s for w in used])["mean"]
        utils = [w.utilization for w in wins]
        thr = [w.throughput for w in wins]
        sm_wins = [w for w in used if w.sm_active is not None]
        return {
            "busy_frac": shares["compute"] + shares["optimizer"],
            "input_cost": self._input_cost(used),
            "measured_steps": sum(w.steps for w in wins),
            "warmup_excluded": bool(self.windows),
            "windows": len(wins),
            "utilization": util,
            "utilization_spread": [min(utils), max(utils)],
            "utilization_source": self.source,
            "throughput": sum(w.samples for w in used) / wall if wall > 0 else 0.0,
            "throughput_spread": [min(thr), max(thr)],
            "step_time_s": step_time,
            "phase_s": per_step,
            "data_wait_frac": shares["data"],
            "h2d_frac": shares["h2d"],
            "compute_frac": shares["compute"],
            "comm_frac": shares["comm"],
            "optimizer_frac": shares["optimizer"],
            "other_frac": shares["other"],
            # the three device figures side by side (docs/measurement.md)
            "nvml_util": util if self.source == "nvml" else None,
            "nvml_util_source": "nvml utilization.gpu" if self.source == "nvml" else "absent: no NVML device",
            "sm_active": estimate([w.sm_active for w in sm_wins], weights=[w.wall_s for w in sm_wins])["mean"]
            if sm_wins else None,
            "sm_active_source": self.sampler.sm_source if self.sampler is not None else "absent: no NVML device",
            "estimate": estimate_of(self.windows),
            **token_figures(used, wall),
            **base,
        }


def token_figures(used: List[Window], wall: float) -> Dict[str, Any]:
    """Real tokens/s (padding excluded) and the share of the positions computed that were padding,
    over the measured windows; None for batches without an attention_mask."""
    tokens, padded = sum(w.tokens for w in used), sum(w.padded_tokens for w in used)
    if not padded:
        return {"tokens_per_s": None, "padding_frac": None}
    return {"tokens_per_s": tokens / wall if wall > 0 else 0.0, "padding_frac": 1.0 - tokens / padded}


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
