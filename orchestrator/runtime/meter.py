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
the window's wall time (its clock read at every step, or on fast steps on a sample of them:
runtime/clocks.py). Starving the step cannot raise it: a loader worker that takes a core stretches
the busy phases' wall time, not the loop's CPU time. The input pipeline's cost is split
into CPU (the workers' CPU time per item, psutil; without workers the data phase's) and waiting.

Warmup ends in steady state: after `warmup_steps` steps and once the loader's pre-filled queue
(`queue` = num_workers x prefetch_factor micro-batches) has been read; `rewarm()` starts a new one.
Every epoch pays its restart (new workers refilling the queue), and the figures include it. With
workers an epoch's pre-made tail runs several times the steady rate and its restart waits, so
epochs shorter than EPOCH_WINDOWS windows are measured in windows of whole epochs, and a
measurement that stops on its own (`StopRule`) spans whole epochs (`steps_to_whole_epochs`).
Windows span whole loader rounds (`round_steps`): workers deliver in bursts, and a window ending
inside one counts batches ready at once. Estimates and stop rules are orchestrator/measure's; the
samplers are runtime/samplers.py's, a window's figures runtime/windows.py's, the job's runtime/summary.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..measure.phases import COMM, COMPUTE, OTHER
from ..measure.results import Window
from .clocks import CpuClocks
from .samplers import (CpuSpan, MemorySampler, NvmlSampler, check_memory, close_samplers, cores_per_rank, cpu_snapshot,
                       memory_stats, model_state_mb, start_memory, utilization_sampler)
from .summary import summarize, token_figures, warmup_record
from .windows import EPOCH_WINDOWS, PAUSED, by_phase, steps_to_whole_epochs, tail_partial, whole_rounds, window_figures

__all__ = ["EPOCH_WINDOWS", "PAUSED", "MemorySampler", "NvmlSampler", "StepMeter", "by_phase", "cores_per_rank",
           "cpu_snapshot", "memory_stats", "model_state_mb", "token_figures"]


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
    one_process: bool = False  # the job's only rank: no communication thread spends the process's CPU
    max_window: int = 0  # resize() makes windows of at most this many steps (0: no cap)
    windows: List[Window] = field(default_factory=list)
    warmup_windows: List[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.sampler, self.source = utilization_sampler(self.device, self.nvml)
        # one entry a mark in each list: the phase it ended (PAUSED: none), its time (perf_counter on
        # CPU, a recorded CUDA event on CUDA)
        self._phases: List[int] = []
        self._toks: List[Any] = []
        self._inproc = self.queue == 0
        self.threads = max(1, torch.get_num_threads())
        # the CPU clocks, read at the marks of a sample of the steps on fast ones (runtime/clocks.py)
        self.clocks = CpuClocks(self.cuda, self._inproc, self.threads, self.one_process)
        self._clock = self.clocks.on  # this step's marks read them
        self._to_clock = 0  # steps until the next pair that reads them (CpuClocks.gap), with clocks.every > 1
        self._hook_cpu: Optional[Tuple[float, float]] = None
        self._span = CpuSpan(lambda: self.queue > 0)  # the process's and the loader's CPU over the steady span
        self._span_samples = 0  # samples in it (measured, re-warm and partial windows alike)
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
        self.memory: Optional[MemorySampler]
        self.memory, self.start_mem_mb = start_memory(self.device)

    # -- hot path: a mark reads each of its clocks once and appends, nothing more ---------------
    def _token(self) -> Any:
        if self.cuda:
            ev = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return perf_counter()

    def _add_mark(self, phase: int) -> None:
        """A mark of `phase` now, outside the hot path (a window's first mark, a pause's end): it
        reads the clocks whatever the step."""
        self._phases.append(phase)
        self._toks.append(self._token())
        if self.clocks.on:
            self.clocks.read(len(self._phases) - 1)

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
        if self._clock:
            self.clocks.read(len(self._phases) - 1)

    def _split_at_hook(self) -> int:
        """DDP: the last gradient bucket was handed to the all-reduce at the hook's token; compute
        ended there, and the rest of backward was waiting for communication (returns COMM)."""
        self._phases.append(COMPUTE)
        self._toks.append(self._hook_token)
        if self._hook_cpu is not None:  # read at the hook (on CPU, where backward runs on the loop's thread)
            self.clocks.add(len(self._phases) - 1, self._hook_cpu)
        elif self._clock:  # CUDA: the hook ran on autograd's thread; the loop thread's clock now
            self.clocks.read(len(self._phases) - 1)
        self._hook_token = self._hook_cpu = None
        return COMM

    def pause(self) -> None:
        """From here to `resume()` (an evaluation at a step's end) the time is nobody's: no phase
        or window holds it, nor the CPU time the input cost reads; marks made meanwhile (FSDP's
        collectives in the evaluation's forward) are dropped. Only between steps."""
        cpu0 = self._span.snapshot()
        self.mark(OTHER)
        self._paused = (len(self._phases), perf_counter(), cpu0)

    def resume(self) -> float:
        """The step after the pause begins now; returns the seconds paused."""
        assert self._paused is not None, "resume() without pause()"
        n, t0, cpu0 = self._paused
        self._paused = None
        self._span.add_pause(cpu0)
        if self.cuda:
            self._events.extend(self._toks[n:])
        del self._phases[n:], self._toks[n:]
        self.clocks.drop_from(n)
        self._add_mark(PAUSED)  # the time before this mark is no phase's
        t1 = perf_counter()
        self._pauses.append((t0, t1))
        return t1 - t0

    def comm_hook_fired(self) -> None:
        """Called from a DDP comm hook each time a bucket is launched; the last one wins."""
        self._hook_token = self._token()
        if self._clock:
            self._hook_cpu = self.clocks.now()

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
        if self.clocks.every > 1:  # the next step reads the clocks: a pair of steps, every clocks.gap() steps
            k = self._to_clock = self._to_clock - 1
            self._clock = k < 2
            if k <= 0:
                self._to_clock = self.clocks.gap()
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
        """Steps until the measured span (from the last warmup's end) holds a whole number of epochs
        (windows.steps_to_whole_epochs); 0 when it does or where an epoch's ends do not differ from
        its middle: epochs not known, no loader workers (no queue made ahead)."""
        if not self.epoch_steps or not self.queue or self._warming:
            return 0
        return steps_to_whole_epochs(self._step, self.epoch_steps, self.whole_epochs(), self._aligned,
                                     self._epoch_first, self._measure_first)

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
        stops mid-epoch would miss its share. Once whole epochs in a measured span, windows stay so
        until the next warmup, whatever the step time makes of their length (docs/measurement.md:
        else the span might never hold whole epochs when the stop rule is met)."""
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
        in the next window, as in a long run. Windows of its tail closed earlier are partial too
        (windows.tail_partial)."""
        per = self.whole_epochs()
        began, self._epoch_first = self._epoch_first, self._step
        if not per or self._warming:
            return None
        if not self._aligned:
            tail_partial(self.windows, began)
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
        if self._span.start is None:  # the loader's cost is read over the steady span from here
            self._span.begin()
            self._span_samples = 0
        self.warmups.append(warmup_record(self.warmups, self._warm_why, win.first_step, self._step, self.warmup_steps,
                                          self._micro))
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
        """Windows of `window_s` seconds (whole steps, at least one, at most `at_most` if given and
        `max_window` if set) at
        this step time; until the first resize, and with window_s=0, windows are window_steps steps (whole
        rounds of the loader's workers in both cases, so `at_most` may be passed by less than a round)."""
        if window_s > 0 and step_time_s > 0:
            self._whole = self._whole or (not self._warming and self.whole_epochs() > 0)  # they stay so
            steps = max(1, math.ceil(window_s / step_time_s))
            steps = min(steps, at_most) if at_most else steps
            self._window_want = min(steps, self.max_window) if self.max_window else steps
            self._window_len = self.whole_rounds(self._window_want)

    def whole_rounds(self, steps: int) -> int:
        """`steps` rounded up to whole rounds of the loader's workers (`round_steps`)."""
        return whole_rounds(steps, self.round_steps)

    def set_round(self, round_steps: int) -> None:
        """The loader changed (loader_autotune): windows of whole rounds of the new one."""
        self.round_steps = round_steps
        self._window_len = self.whole_rounds(self._window_want)

    def fit_epoch(self, steps: int) -> None:
        """An epoch is `steps` optimizer steps (0: not known): see whole_epochs()."""
        self.epoch_steps = steps

    def check_memory(self) -> None:
        """Raise when this job's resident high-water passed the cap (CPU; checked per window)."""
        check_memory(self.memory, self.memory_cap_mb)

    # -- window resolution (off the hot path) -------------------------------------------------
    def _close_window(self, warmup: bool, partial: bool = False) -> Window:
        wall1 = perf_counter()
        marks, toks = self._phases, self._toks
        pauses, self._pauses = self._pauses, []
        figures = window_figures(marks, toks, self.clocks, cuda=self.cuda, inproc=self._inproc, sampler=self.sampler,
                                 t0=self._wall0, t1=wall1, pauses=pauses)
        if self.cuda:  # the window's events are recorded again by the next marks
            self._events.extend(tok for tok in toks[:-1] if tok is not toks[-1])
        steps = self._step - self._window_first
        if self.clocks.next_window(len(marks), figures["wall_s"] / steps if steps and not warmup else None,
                                   self._window_len, steps):  # a new cadence: the next pair after a gap
            self._to_clock, self._clock = self.clocks.gap(), self.clocks.on and self.clocks.every == 1
        win = Window(index=len(self.windows), first_step=self._window_first, steps=self._step - self._window_first,
                     samples=self._samples, t_start=self._wall0, t_end=wall1, warmup=warmup, partial=partial,
                     tokens=self._tokens, padded_tokens=self._padded, **figures)
        (self.warmup_windows if warmup else self.windows).append(win)
        # the next window starts where this one ended
        del marks[:-1], toks[:-1]
        marks[0] = PAUSED
        self._window_first = self._step
        self._epochs, self._aligned = 0, False
        self._samples = self._tokens = self._padded = 0
        self._wall0 = wall1
        return win

    def flush(self) -> None:
        """Close a partial last window (steps after the last full one)."""
        if self._step > self._window_first and not self._warming:
            self._close_window(warmup=False, partial=True)

    def close(self) -> None:
        close_samplers(self.sampler, self.memory)

    # -- summary (runtime/summary.py) ------------------------------------------------------------
    def span_cpu(self) -> Optional[Dict[str, float]]:
        """CPU seconds per sample of the process and of the loader's workers over the steady span
        (from the first warmup's end, pauses left out); None before it or without samples."""
        return self._span.per_sample(self._span_samples)

    def summary(self) -> Dict[str, Any]:
        """This rank's figures of the job (result.json's per-rank `meter`)."""
        return summarize(self)
