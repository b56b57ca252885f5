"""A window's figures from the step meter's marks (runtime/meter.py): each phase's time off the
clock read at the marks (perf_counter on CPU, recorded CUDA events on CUDA), the CPU time of the
process and of the loop's own thread in each phase, and utilization (NVML's mean over the window,
the loop thread's busy CPU share on CPU, else the busy phases' share). Read once per window, off
the per-step path.
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any, Callable, Dict, List, Optional

from ..measure.phases import BUSY, PHASES
from ..measure.results import Window
from .clocks import CpuClocks
from .samplers import NvmlSampler

EPOCH_WINDOWS = 4  # an epoch shorter than this many windows is measured in windows of whole epochs
PAUSED = -1  # a mark's phase: the time before it is no phase's (a window's first mark; the end of a pause)


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


def _event_seconds(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1000.0


def cpu_by_phase(marks: List[int], toks: List[float], wall: Dict[str, float], at: List[int],
                 readings: List[float], known: Dict[int, float]) -> Dict[str, float]:
    """Each phase's CPU time from `readings` taken at the marks `at`. Read at every mark, their
    differences; read at a sample of the steps, each phase's wall time (`wall`) times its CPU over
    wall in the spans both of whose ends were read. `known` (by phase index) keeps those ratios: a
    phase no such span holds takes its last one (else the ratio of all of this window's read spans)."""
    if len(at) == len(marks):
        every = by_phase(marks, readings)
        known.update({k: every[name] / wall[name] for k, name in enumerate(PHASES) if wall[name] > 0})
        return every
    cpu = [0.0] * (len(PHASES) + 1)
    seen = [0.0] * (len(PHASES) + 1)
    for j in range(1, len(at)):
        i = at[j]
        if at[j - 1] == i - 1:
            p = marks[i]
            cpu[p] += readings[j] - readings[j - 1]
            seen[p] += toks[i] - toks[i - 1]
    all_cpu, all_seen = sum(cpu[:-1]), sum(seen[:-1])
    overall = all_cpu / all_seen if all_seen > 0 else 0.0
    for k in range(len(PHASES)):
        if seen[k] > 0:
            known[k] = cpu[k] / seen[k]
    return {name: wall[name] * known.get(k, overall) for k, name in enumerate(PHASES)}


def window_figures(marks: List[int], toks: List[Any], clocks: CpuClocks, *, cuda: bool, inproc: bool,
                   sampler: Optional[NvmlSampler], t0: float, t1: float, pauses: List[tuple]) -> Dict[str, Any]:
    """The figures of the window from `t0` to `t1` (perf_counter) less its `pauses`, whose marks'
    phases are `marks`, read at them: `toks` (times or CUDA events) and the CPU `clocks` (on CPU
    the process's; the loop thread's on CPU and without loader workers: `inproc`). Returns Window's
    wall_s, phases_s, phases_cpu_s, busy_cpu_s, utilization, sm_active."""
    if cuda:
        toks[-1].synchronize()
        phases = by_phase(marks, toks, _event_seconds)
        cpu = dict.fromkeys(PHASES, 0.0)
    else:
        phases = by_phase(marks, toks)
        cpu = cpu_by_phase(marks, toks, phases, clocks.at, clocks.cpu, clocks.known_cpu)
    # the loop thread's CPU time per phase (only its busy phases' sum and its data phase are read)
    thread_on = not cuda or inproc
    if clocks.cpu is clocks.thread:  # the process's CPU is the loop thread's (meter.StepMeter._cpu_is_thread)
        loop = dict(cpu)
    elif thread_on:  # (on CUDA read at every mark: toks are events)
        loop = cpu_by_phase(marks, toks, phases, clocks.at, clocks.thread, clocks.known_thread)
    else:
        loop = dict.fromkeys(PHASES, 0.0)
    if thread_on and inproc:
        cpu["data"] = loop["data"]
    wall = t1 - t0 - sum(b - a for a, b in pauses)
    util: Optional[float] = None
    sm: Optional[float] = None
    if sampler is not None:
        util = sampler.mean(t0, t1, skip=pauses)
        if sampler.gpm:
            sm = sampler.mean(t0, t1, sampler.sm_samples, skip=pauses)
    if util is None and not cuda:  # the cores' share the training work got
        util = min(1.0, sum(loop[p] for p in BUSY) / wall) if wall > 0 else 0.0
    if util is None:
        total = sum(phases.values())
        util = sum(phases[p] for p in BUSY) / total if total > 0 else 0.0
    return {"wall_s": wall, "phases_s": phases, "utilization": util, "sm_active": sm,
            "phases_cpu_s": cpu if not cuda or inproc else None,
            "busy_cpu_s": sum(loop[p] for p in BUSY) if not cuda else None}


# -- where windows end (the meter's schedule) ----------------------------------------------------
def whole_rounds(steps: int, round_steps: int) -> int:
    """`steps` rounded up to whole rounds of `round_steps` steps (one round of the loader's workers)."""
    r = max(1, round_steps)
    return max(r, math.ceil(steps / r) * r)


def plain_window_cap(window_steps: int, planned: int, epoch_steps: int, windows: int) -> int:
    """The most steps a plain run's windows of measure.window_s may last: its `planned` measured
    steps over `windows`, and where windows that long would be whole epochs (StepMeter.whole_epochs)
    and the run holds fewer than `windows` epochs, an EPOCH_WINDOWS-th of an epoch; at least
    `window_steps`."""
    cap = planned // windows
    if epoch_steps and epoch_steps < EPOCH_WINDOWS * cap and planned < windows * epoch_steps:
        cap = epoch_steps // EPOCH_WINDOWS
    return max(window_steps, cap)


def steps_to_whole_epochs(step: int, epoch_steps: int, per_window: int, aligned: bool, epoch_first: int,
                          measure_first: int) -> int:
    """Steps from `step` until the measured span (from `measure_first`, the last warmup's end)
    holds a whole number of epochs, each phase of an epoch once per epoch: its pre-made tail and its
    restart alike; 0 when it does. With windows of whole epochs (`per_window` > 0) the estimate holds
    whole epochs once windows began with one (`aligned`); when windows became whole epochs only now
    (a short step time lengthened them mid-epoch), the steps to that epoch's end (the epoch began
    after `epoch_first`), which closes the epoch's windows as partial; otherwise a stop rule met on
    the fast pre-made batches that made that switch would end the measurement short of the epoch."""
    if per_window:
        return 0 if aligned else (-(step - epoch_first) % epoch_steps or epoch_steps)
    return -(step - measure_first) % epoch_steps


def tail_partial(windows: List[Window], began: int) -> None:
    """Mark partial the measured windows that began at or after step `began` (the epoch's start),
    back to the last partial one: closed before the step time made windows whole epochs, they hold
    the epoch's tail without its restart, the workers idle and their last batches ready. Counted as
    full, a short tail window alone can be the estimate of a run that ends mid-epoch, at several
    times the run's whole rate."""
    for win in reversed(windows):
        if win.partial or win.first_step < began:
            break
        win.partial = True
