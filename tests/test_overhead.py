"""The loop's own cost (bench/bench_overhead.py measures it in time; these hold what it is made of):
a step of the default job does the tensor work of a hand-written step and nothing more, the meter
turns its clock readings into the same figures, and a window's figures are not aggregated again
when no other rank takes part."""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any, Dict, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orchestrator.measure.phases import COMPUTE, DATA, OPTIMIZER
from orchestrator.runtime import loop as loop_mod
from orchestrator.runtime import clocks as clocks_mod
from orchestrator.runtime import meter as meter_mod
from orchestrator.runtime import state as state_mod
from orchestrator.runtime import windows as windows_mod
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.clocks import CpuClocks
from orchestrator.runtime.meter import StepMeter
from orchestrator.runtime.step import Stepper
from orchestrator.schema import to_config

from .conftest import compose_dict

DEFAULT_JOB = ["backend=single", "backend.device=cpu", "tracking.enabled=false", "trainer.max_steps=20",
               "trainer.save_model=false"]


class Ops(TorchDispatchMode):
    """The aten operators run while it is on, counted by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_does_the_tensor_work_of_a_hand_written_step(monkeypatch):
    """Steps of the default job past its warmup (no FLOP counter, no noise probe): an unlogged one runs
    the operators of a hand-written step (batch, forward, loss, backward, SGD step, zero_grad) and no
    other; a logged one only adds the detach of the loss it hands to the log."""
    cfg = to_config(compose_dict(DEFAULT_JOB))
    assert cfg.trainer.log_every == 10 and cfg.measure.warmup_steps == 5 and cfg.measure.noise_scale
    by_step: Dict[int, Counter] = {}
    real = Stepper.__call__

    def recorded(self: Stepper, run: Any) -> tuple:
        step = run.step
        with Ops() as mode:
            out = real(self, run)
        by_step[step] = mode.ops
        return out

    monkeypatch.setattr(Stepper, "__call__", recorded)
    adapter = Adapter(cfg)
    adapter.setup()
    loop_mod.train(cfg, adapter)

    # the same step written by hand, on the same pieces
    model = loop_mod.build_model(cfg)
    opt = loop_mod.build_optimizer(cfg, model)
    loader = iter(torch.utils.data.DataLoader(loop_mod.build_dataset(cfg), batch_size=cfg.data.batch_size,
                                              shuffle=True))
    next(loader)  # the epoch's first batch draws its order
    with Ops() as mode:
        x, y = next(loader)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    hand = mode.ops
    assert hand["aten::addmm"] == 1 and hand["aten::stack"] == 2  # the forward, the batch's collate
    assert by_step[12] == hand  # unlogged
    assert by_step[9] - hand == Counter({"aten::detach": 1}) and not hand - by_step[9]  # logged: (9 + 1) % 10


def test_a_window_alone_is_the_jobs_window_without_aggregating_it(monkeypatch):
    """Without all-reduced windows (one rank, no stop rule, no window_s, no loader autotune) a
    window's job figures are its own: job_window, the ranks' aggregate, is not called per window."""
    def refuse(ranks: List[Any]) -> Any:
        raise AssertionError("job_window called for a window no other rank shares")

    monkeypatch.setattr(state_mod, "job_window", refuse)
    cfg = to_config(compose_dict(DEFAULT_JOB + ["measure.window_steps=2", "measure.warmup_steps=1"]))
    adapter = Adapter(cfg)
    adapter.setup()
    res = loop_mod.train(cfg, adapter)
    assert len(res.windows) >= 9 and res.meter["throughput"] > 0


class Clocks:
    """The meter's three clocks, moved by hand: wall (perf_counter), the process's CPU time and the
    loop thread's."""

    def __init__(self, monkeypatch: Any) -> None:
        self.wall = self.cpu = self.thread = 100.0
        monkeypatch.setattr(meter_mod, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(clocks_mod, "process_time", lambda: self.cpu)
        monkeypatch.setattr(clocks_mod, "thread_time", lambda: self.thread)

    def spend(self, wall: float, cpu: float, thread: float) -> None:
        self.wall += wall
        self.cpu += cpu
        self.thread += thread


def test_the_meter_turns_its_clock_readings_into_the_windows_figures(monkeypatch):
    """Each phase's wall time, the process's CPU time in it (the data phase's: the loop thread's,
    with no loader workers), the loop thread's CPU time in the busy phases and utilization over the
    window's wall time, read off the clocks at the marks; a DDP hook splits backward into compute and
    comm; a pause (an evaluation) is no phase's and no window's."""
    clocks = Clocks(monkeypatch)
    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, nvml=False)
    m.start()

    def step(hook: bool = False) -> Any:
        clocks.spend(1.0, 0.5, 0.25)
        m.mark(DATA)
        clocks.spend(2.0, 3.0, 1.5)  # forward and backward, with intra-op threads
        if hook:
            m.comm_hook_fired()  # the last bucket handed to the all-reduce
            clocks.spend(0.5, 0.125, 0.0625)
        m.mark(COMPUTE)
        clocks.spend(1.0, 1.0, 0.75)
        m.mark(OPTIMIZER)
        return m.end_step(samples=4)

    warm = step()
    assert warm is not None and warm.warmup
    assert step() is None
    m.pause()
    clocks.spend(7.0, 7.0, 7.0)  # an evaluation
    m.resume()
    win = step(hook=True)
    m.close()
    assert win is not None and not win.warmup and win.steps == 2 and win.samples == 8
    assert win.phases_s == {"other": 0.0, "data": 2.0, "h2d": 0.0, "compute": 4.0, "comm": 0.5, "optimizer": 2.0}
    assert win.phases_cpu_s == {"other": 0.0, "data": 0.5, "h2d": 0.0, "compute": 6.0, "comm": 0.125,
                                "optimizer": 2.0}
    assert win.wall_s == 8.5 and win.busy_cpu_s == 4.5
    assert win.utilization == pytest.approx(4.5 / 8.5)


def test_one_rank_on_one_thread_reads_the_process_cpu_off_the_loop_threads_clock(monkeypatch):
    """One rank, one torch thread, no loader workers: each phase's CPU time is the loop thread's
    (the process's clock is not read); a window closes with one pass over its marks for wall time
    and one for CPU time."""
    clocks = Clocks(monkeypatch)
    passes = Counter()
    real_by_phase = windows_mod.by_phase

    def by_phase(*args: Any) -> Any:
        passes["by_phase"] += 1
        return real_by_phase(*args)

    monkeypatch.setattr(windows_mod, "by_phase", by_phase)
    monkeypatch.setattr(clocks_mod, "process_time", lambda: pytest.fail("the process's clock was read"))
    monkeypatch.setattr(meter_mod.torch, "get_num_threads", lambda: 1)
    m = StepMeter(torch.device("cpu"), window_steps=1, warmup_steps=1, nvml=False, one_process=True)
    m.start()
    wins = []
    for _ in range(2):
        clocks.spend(1.0, 0.5, 0.25)
        m.mark(DATA)
        clocks.spend(2.0, 3.0, 1.5)
        m.mark(COMPUTE)
        clocks.spend(1.0, 1.0, 0.75)
        m.mark(OPTIMIZER)
        wins.append(m.end_step(samples=4))
    m.close()
    win = wins[-1]
    assert win is not None and not win.warmup
    assert win.phases_cpu_s == {"other": 0.0, "data": 0.25, "h2d": 0.0, "compute": 1.5, "comm": 0.0,
                                "optimizer": 0.75}
    assert win.busy_cpu_s == 2.25 and win.utilization == pytest.approx(2.25 / 4.0)
    assert passes["by_phase"] == 2 * len(wins)


def test_on_fast_steps_the_clocks_are_read_on_a_sample_and_the_cpu_figures_estimated_from_it(monkeypatch):
    """A CPU-time reading is a system call (ten times a perf_counter reading). Once a window says a
    step lasts 100 us, the clocks are read at the marks of pairs of consecutive steps, 0.5 to 1.5 x
    clock_every apart at random (a fixed place, the steps after a window's close, is not like the
    rest on a contended host), every window holding a pair; each phase's CPU time is its wall time
    times the CPU over wall time of its read spans: here, where every step spends alike, the true
    figures."""
    clocks = Clocks(monkeypatch)
    reads = Counter()
    real_read = CpuClocks.read

    def read(self: CpuClocks, mark: int) -> None:
        reads[m.steps] += 1
        real_read(self, mark)

    monkeypatch.setattr(CpuClocks, "read", read)
    every = clocks_mod.clock_every(100e-6, cuda=False)
    assert every > 4
    window = 4 * every
    m = StepMeter(torch.device("cpu"), window_steps=window, warmup_steps=1, nvml=False)
    m.start()
    wins = []
    for _ in range(1 + 6 * window):
        clocks.spend(10e-6, 5e-6, 10e-6)
        m.mark(DATA)
        clocks.spend(70e-6, 140e-6, 63e-6)
        m.mark(COMPUTE)
        clocks.spend(20e-6, 20e-6, 18e-6)
        m.mark(OPTIMIZER)
        win = m.end_step(samples=4)
        if win is not None:
            wins.append(win)
    m.close()
    assert [w.steps for w in wins] == [1] + [window] * 6 and wins[0].warmup
    first, later = range(1, 1 + window), range(1 + window, 1 + 6 * window)
    assert all(reads[s] == 3 for s in first)  # every step read until a measured window gave the step time
    sampled = [s for s in later if reads[s]]
    starts = [s for s in sampled if s - 1 not in sampled]
    assert all(s + 1 in sampled for s in starts[:-1]) and all(reads[s] == 3 for s in sampled)  # pairs of steps
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= every // 2 and max(gaps) <= every + every // 2 and len(set(gaps)) > 1
    assert len(sampled) < len(later) / 4
    assert all(any(w.first_step <= s < w.first_step + w.steps - 1 for s in starts) for w in wins[2:])
    for win in wins[1:]:
        assert win.phases_cpu_s == pytest.approx({"other": 0.0, "data": 10e-6 * window, "h2d": 0.0,
                                                  "compute": 140e-6 * window, "comm": 0.0, "optimizer": 20e-6 * window})
        assert win.busy_cpu_s == pytest.approx(81e-6 * window)
        assert win.utilization == pytest.approx(81 / 100)


def test_the_clocks_cadence_counts_the_readings_a_step_takes():
    """Reading the clocks costs per reading: a step that reads two clocks at each of its marks, or
    has more marks, is read half as often; a window's marks a step and the clocks a mark are what
    the meter counts. Pairs never fall further apart than a window allows."""
    one = clocks_mod.clock_every(375e-6, cuda=False, readings=3)
    assert one == math.ceil(2 * 3 * clocks_mod.CLOCK_READ_S / (clocks_mod.CLOCK_SHARE * 375e-6))
    assert clocks_mod.clock_every(375e-6, cuda=False, readings=6) == min(2 * one, clocks_mod.MAX_CLOCK_EVERY)
    assert clocks_mod.clock_every(375e-6, cuda=False, window_steps=31, readings=6) == 20
    assert clocks_mod.clock_every(375e-6, cuda=True) == 1
    clocks = CpuClocks(cuda=False, inproc=True, threads=2, one_process=False)  # both clocks, three marks a step
    assert clocks.per_mark == 2
    assert clocks.next_window(marks=1 + 3 * 100, step_s=375e-6, window_steps=1000, steps=100)
    assert clocks.every == clocks_mod.clock_every(375e-6, cuda=False, readings=6)
    alone = CpuClocks(cuda=False, inproc=True, threads=1, one_process=True)  # the loop thread's clock is the process's
    assert alone.per_mark == 1
    alone.next_window(marks=1 + 3 * 100, step_s=375e-6, window_steps=1000, steps=100)
    assert alone.every == one


@pytest.mark.parametrize("threads, want", [(1, {"thread": 3}), (2, {"process": 3, "thread": 3})])
def test_a_step_of_the_default_job_reads_each_cpu_clock_once_a_mark(monkeypatch, threads, want):
    """A step of the default job, one rank with no loader workers, that reads the CPU clocks reads
    them once at each of its three marks: on one torch thread only the loop thread's (the process's
    CPU is that thread's), on more the process's too."""
    reads = Counter()

    def counted(name: str, clock: Any) -> Any:
        def read() -> float:
            reads[name] += 1
            return clock()
        return read

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # nothing in the run changes it back
    monkeypatch.setattr(clocks_mod, "process_time", counted("process", clocks_mod.process_time))
    monkeypatch.setattr(clocks_mod, "thread_time", counted("thread", clocks_mod.thread_time))
    per_step: Dict[int, Counter] = {}
    real = Stepper.__call__

    def recorded(self: Stepper, run: Any) -> tuple:
        before = Counter(reads)
        out = real(self, run)
        per_step[run.step - 1] = Counter(reads) - before
        return out

    monkeypatch.setattr(Stepper, "__call__", recorded)
    cfg = to_config(compose_dict(DEFAULT_JOB))
    adapter = Adapter(cfg)
    adapter.setup()
    try:
        loop_mod.train(cfg, adapter)
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads_before)
    assert len(per_step) == 20
    assert all(c == Counter(want) for c in per_step.values()), per_step


def test_an_unlogged_step_of_the_default_job_calls_only_the_step_and_its_marks(monkeypatch):
    """Past the warmup, a step that logs nothing and closes no window runs these of the
    orchestrator's Python functions and no other: the step, its update, the loss, three marks
    (here, before a measured window gave the step time, each reading the CPU clocks) and the step's end. Hooks that act every log_every steps (the noise scale's reads) are not
    called in between, and the optimizer steps without the adapter's pass-through."""
    cfg = to_config(compose_dict(DEFAULT_JOB))
    assert cfg.trainer.log_every == 10 and cfg.measure.window_steps == 20 and cfg.measure.noise_scale
    segments: List[Counter] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or "/orchestrator/" not in frame.f_code.co_filename:
            return
        name = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        if name == "step.py:__call__":
            segments.append(Counter())
        if segments:
            segments[-1][name] += 1

    adapter = Adapter(cfg)
    adapter.setup()
    sys.setprofile(profile)
    try:
        loop_mod.train(cfg, adapter)
    finally:
        sys.setprofile(None)
    assert len(segments) == 20
    want = Counter({"step.py:__call__": 1, "step.py:update": 1, "batch.py:cross_entropy": 1, "meter.py:mark": 3,
                    "clocks.py:read": 3, "meter.py:end_step": 1})
    for step in (11, 12, 13, 14, 15, 16, 17):  # none logs, closes a window or is the noise scale's
        assert segments[step] == want, (step, segments[step])


@pytest.mark.parametrize("queue", [0, 4])
def test_a_pause_reads_the_loader_workers_cpu_only_where_the_loader_has_workers(monkeypatch, queue):
    """An evaluation's pause reads the CPU spent meanwhile, to leave it out of the input cost. The
    loader workers' live CPU is read through psutil's children(), which walks every process in /proc
    (about a millisecond): only where the loader has workers (the ended ones are in the kernel's
    reaped-children account, read either way)."""
    from orchestrator.runtime import samplers as samplers_mod

    live: List[bool] = []
    real = samplers_mod.cpu_snapshot

    def snapshot(scan: bool = True) -> Any:
        live.append(scan)
        return real(scan)

    monkeypatch.setattr(samplers_mod, "cpu_snapshot", snapshot)
    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, nvml=False, queue=queue)
    m.start()
    m.pause()
    m.resume()
    m.close()
    assert live == [bool(queue)] * 2
