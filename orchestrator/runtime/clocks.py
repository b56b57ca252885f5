"""The CPU clocks the step meter (runtime/meter.py) reads at its marks: which ones a rank reads, and
on which steps. A reading is a system call (about ten times a `perf_counter()`); on fast steps they
are read at the marks of pairs of consecutive steps, `every` steps apart on average, so that they
cost at most CLOCK_SHARE of the step, and a window's CPU figures are estimated from those steps
(runtime/windows.py, cpu_by_phase). The pairs fall at random (0.5 to 1.5 x `every` apart): steps at
a fixed place are not like the others where the host is contended (the two after a window's close
got 12-15% less CPU per wall second than the rest, beside another job on 2 cores)."""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from time import process_time, thread_time
from typing import Dict, List, Optional, Tuple

# one clock reading costs about this in the loop: the system call (about 0.6 us alone) and what it
# costs the step's code after it (three readings a step slow a 360 us step by about 7 us)
CLOCK_READ_S = 2.5e-6
CLOCK_SHARE = 0.001
MAX_CLOCK_EVERY = 64


def cpu_clocks(cuda: bool, inproc: bool, threads: int, one_process: bool) -> Tuple[bool, bool, bool]:
    """Which CPU clocks a mark reads: (the process's, the loop thread's, the process's CPU is the
    loop thread's). On CPU the process's gives each phase's CPU time; the loop thread's gives
    utilization (its busy phases' share) and, with no loader workers (`inproc`), the data phase's
    CPU, the loader's own (the process's would add the intra-op threads' spin-waits meanwhile). One
    rank (`one_process`) on one torch thread without loader workers: the process's CPU in a phase is
    its loop thread's, whose clock alone is read."""
    thread_is_process = not cuda and inproc and threads == 1 and one_process
    return not cuda and not thread_is_process, not cuda or inproc, thread_is_process


def clock_every(step_s: float, cuda: bool, window_steps: int = 0, readings: float = 3.0) -> int:
    """The clocks are read at the marks of two steps in this many (1: every step), so that reading
    them (`readings` a step that reads them) costs at most CLOCK_SHARE of a step of `step_s` seconds;
    few enough that a window of `window_steps` (if given) holds a pair whatever the gaps. On CUDA
    every step: its phases are the device's, and the loop thread's clock (read without loader
    workers) costs little beside them."""
    if cuda or step_s <= 0:
        return 1
    every = max(1, min(MAX_CLOCK_EVERY, math.ceil(2 * readings * CLOCK_READ_S / (CLOCK_SHARE * step_s))))
    return min(every, max(1, 2 * (window_steps - 1) // 3)) if window_steps else every


class CpuClocks:
    """The readings of a window: `at`, the indices of the marks read; `cpu`, the process's CPU time
    there (the loop thread's list where that is the process's); `thread`, the loop thread's."""

    def __init__(self, cuda: bool, inproc: bool, threads: int, one_process: bool) -> None:
        self.cuda = cuda
        self.cpu_on, self.thread_on, cpu_is_thread = cpu_clocks(cuda, inproc, threads, one_process)
        self.on = self.cpu_on or self.thread_on  # any clock to read
        self.per_mark = int(self.cpu_on) + int(self.thread_on)  # readings a mark takes
        self.every = 1  # two steps in this many read them (clock_every)
        self.at: List[int] = []
        self.thread: List[float] = []
        self.cpu: List[float] = self.thread if cpu_is_thread else []
        self._random = random.Random(0)
        # each phase's CPU over wall time in the last window that read it, for a window that did not
        # (runtime/windows.py, cpu_by_phase): the process's clock and the loop thread's
        self.known_cpu: Dict[int, float] = {}
        self.known_thread: Dict[int, float] = {}

    def read(self, mark: int) -> None:
        """The clocks at mark `mark`, now."""
        self.at.append(mark)
        if self.cpu_on:
            self.cpu.append(process_time())
        if self.thread_on:
            self.thread.append(thread_time())

    def now(self) -> Optional[Tuple[float, float]]:
        """Both clocks now, for a mark made later (a DDP hook's, on CPU: backward runs on the loop's thread)."""
        return None if self.cuda else (process_time(), thread_time())

    def add(self, mark: int, readings: Tuple[float, float]) -> None:
        """Readings taken earlier (`now`) for mark `mark`."""
        self.at.append(mark)
        if self.cpu_on:
            self.cpu.append(readings[0])
        if self.thread_on:
            self.thread.append(readings[1])

    def drop_from(self, mark: int) -> None:
        """Forget the readings at marks from `mark` on (marks dropped: a pause's)."""
        kept = bisect_left(self.at, mark)
        del self.at[kept:], self.cpu[kept:]
        if self.thread is not self.cpu:
            del self.thread[kept:]

    def gap(self) -> int:
        """Steps from one read pair of steps to the next: 0.5 to 1.5 x `every`, at random."""
        return max(2, self._random.randint(self.every // 2, self.every + self.every // 2)) if self.every > 1 else 0

    def next_window(self, marks: int, step_s: Optional[float], window_steps: int, steps: int = 0) -> bool:
        """A window of `marks` marks over `steps` steps closed: its last mark begins the next window,
        with its readings if it has them; `step_s`, its step time (None: not a measured window), and
        its marks a step set `every` for the next windows, of `window_steps`. True where `every` changed."""
        last = bool(self.at) and self.at[-1] == marks - 1
        cut = -1 if last else None
        del self.at[:cut], self.cpu[:cut]
        if self.thread is not self.cpu:
            del self.thread[:cut]
        if last:
            self.at[0] = 0
        every = self.every
        if step_s is not None and self.on:
            per_step = (marks - 1) / steps if steps > 0 else 3.0
            self.every = clock_every(step_s, self.cuda, window_steps, per_step * self.per_mark)
        return self.every != every
