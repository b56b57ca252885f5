"""Loader autotune (`trainer.loader_autotune`): the DataLoader's `num_workers` and `prefetch_factor`
tuned while the run trains, as tf.data's AUTOTUNE does for its pipelines, by hill climbing.

Every `trainer.loader_autotune_every` steps (`at_step`) it looks at the last MIN_WINDOWS windows at
the current settings (the meter warms up again after each change: a new queue is never measured):

  input-bound     every one of those windows waits on input >= diagnose.INPUT_BOUND of its step:
                  the diagnosis (diagnose.py) says which step up is worth trying, weighing the
                  measured worker hand-off cost (costs.py): more workers (sized from the data wait
                  when there are none yet, doubled otherwise, at most tune.max_workers), then a
                  deeper prefetch queue. A move that would pass trainer.memory_cap_mb is not tried.
  idle input      data wait <= NEAR_ZERO_WAIT with more than MANY_WORKERS workers: half the workers
                  (memory and CPU given back).

A tried setting is measured for at least MIN_WINDOWS windows (its loader's warmup excluded) against
the trailing windows before it, and kept when its throughput rose by more than the noise (a step
up) or did not fall by more than it (a step down); the noise is the 95% interval of the difference
of the two means. An undecided trial goes on, up to TRIAL_WINDOWS windows. A refused setting is
reverted and not tried again for COOLDOWN turns, twice as long after each refusal. A trial open
when the run ends is kept only if its windows measured it better (`finish`); else the settings
before it are the ones `tuned/loader.yaml` keeps.

Decisions are rank 0's, on the job's all-reduced figures, broadcast (every rank switches at the
same step), recorded as LoaderEvents (rundir.py): MLflow's `loader/*`, the console, the report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..costs import handoff_s
from ..diagnose import INPUT_BOUND, Handoff, diagnose
from ..rundir import LoaderEvent
from ..schema import Config, DataConfig
from ..measure.results import Estimate
from ..measure.stats import MIN_WINDOWS, estimate

NEAR_ZERO_WAIT = 0.02  # input wait share below which workers are idle
MANY_WORKERS = 2  # a step down is tried only above this many workers
COOLDOWN = 4  # turns a refused setting waits before it is tried again (doubling per refusal)
WORKER_MB_GUESS = 150.0  # memory of one worker process before any was measured (a forked torch process)
MEMORY_HEADROOM = 0.9  # a step up must keep the predicted memory below this share of the cap
BASE_WINDOWS = 2 * MIN_WINDOWS  # at most this many windows make the baseline of a trial
TRIAL_WINDOWS = 3 * MIN_WINDOWS  # an undecided trial ends after this many windows
SETTLED_NOISE = 0.05  # a trial whose noise is below this share of the baseline is decided

SHARES = ("data", "h2d", "compute", "comm", "optimizer", "other")


@dataclass(frozen=True)
class LoaderSettings:
    """What the autotuner turns: workers and their queue depth (None: torch's default, 2)."""

    num_workers: int
    prefetch_factor: Optional[int] = None

    @classmethod
    def of(cls, d: DataConfig) -> "LoaderSettings":
        return cls(d.num_workers, d.prefetch_factor)

    def data(self, d: DataConfig) -> DataConfig:
        """`d` with these settings; a loader given workers by the tuner keeps them across epochs."""
        workers = self.num_workers > 0
        persistent = workers and (d.persistent_workers or d.num_workers == 0)
        return dataclasses.replace(d, num_workers=self.num_workers,
                                   prefetch_factor=self.prefetch_factor if workers else None,
                                   persistent_workers=persistent)

    @property
    def effective_prefetch(self) -> int:
        """Batches queued per worker (0 without workers): what MLflow's loader/prefetch_factor shows."""
        return (self.prefetch_factor or 2) if self.num_workers > 0 else 0

    def as_dict(self) -> Dict[str, Any]:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor}

    @property
    def text(self) -> str:
        pf = "" if self.num_workers == 0 else f", prefetch_factor={self.effective_prefetch}"
        return f"num_workers={self.num_workers}{pf}"


@dataclass
class Trial:
    previous: LoaderSettings
    candidate: LoaderSettings
    kind: str  # up | down
    base: Estimate  # the throughput's before
    reason: str


def _half_width(est: Estimate) -> float:
    """Half the 95% interval of an estimate (infinite with too few windows to know the spread)."""
    return (est.interval[1] - est.mean) if est.interval and est.mean is not None else math.inf


def current_memory_mb() -> tuple:
    """(this rank's resident MB with its loader workers' unique memory, MB per worker or 0)."""
    import psutil

    proc = psutil.Process()
    children = 0.0
    n = 0
    for c in proc.children(recursive=True):
        try:
            children += c.memory_full_info().uss / 2**20
            n += 1
        except psutil.Error:
            pass
    return proc.memory_info().rss / 2**20 + children, (children / n if n else 0.0)


class LoaderTuner:
    """One per rank; rank 0 decides. `emit` records an event (rank 0: the event log and console)."""

    def __init__(self, cfg: Config, settings: LoaderSettings, *, rank: int, world_size: int, device: str,
                 item_bytes: int, emit: Callable[[LoaderEvent], None], handoff: Handoff = handoff_s,
                 all_reduce_sum: Callable[[list], list] = list, memory: Callable[[], tuple] = current_memory_mb) -> None:
        self.cfg, self.settings, self.rank, self.world = cfg, settings, rank, world_size
        self.device, self.item_bytes, self.emit, self.handoff = device, item_bytes, emit, handoff
        self.all_reduce_sum, self.memory = all_reduce_sum, memory
        self.initial = settings
        self.throughputs: List[float] = []  # job-level, per measured window at the current settings
        self.shares: List[Dict[str, float]] = []  # this rank's phase shares of those windows
        self.step_times: List[float] = []
        self.trial: Optional[Trial] = None
        self.refused: Dict[LoaderSettings, tuple] = {}  # setting -> (not before step, refusals)
        self.events: List[LoaderEvent] = []
        self.t0 = time.perf_counter()

    @property
    def settled(self) -> LoaderSettings:
        """The settings the run keeps (during a trial, those it reverts to): what checkpoints store."""
        return self.trial.previous if self.trial is not None else self.settings

    def add(self, job_throughput: float, phases_s: Dict[str, float], steps: int) -> None:
        """A full measured window closed at the current settings."""
        total = sum(phases_s.values()) or 1.0
        self.throughputs.append(job_throughput)
        self.shares.append({p: phases_s.get(p, 0.0) / total for p in SHARES})
        self.step_times.append(total / max(1, steps))

    def record(self, step: int, action: str, settings: LoaderSettings, before: LoaderSettings, reason: str,
               throughput_before: Optional[float] = None, throughput_after: Optional[float] = None,
               noise: Optional[float] = None) -> None:
        ev = LoaderEvent(type="loader", step=step, action=action, num_workers=settings.num_workers,
                         prefetch_factor=settings.prefetch_factor, effective_prefetch=settings.effective_prefetch,
                         from_workers=before.num_workers, from_prefetch=before.prefetch_factor, reason=reason,
                         throughput_before=throughput_before, throughput_after=throughput_after, noise=noise,
                         t_s=time.perf_counter() - self.t0)
        self.events.append(ev)
        self.emit(ev)

    # -- the turn every loader_autotune_every steps (every rank calls it at the same step) --------------
    def at_step(self, step: int) -> Optional[LoaderSettings]:
        """Returns the settings to switch to now, or None; the same on every rank."""
        job = self._job_figures()
        new = self._decide(step, job) if self.rank == 0 else None
        if self.world > 1:  # rank 0's decision, broadcast: the others add zeros
            code = [1.0, float(new.num_workers), float(new.prefetch_factor or 0)] if new is not None else [0.0] * 3
            got = self.all_reduce_sum(code if self.rank == 0 else [0.0] * 3)
            new = LoaderSettings(int(got[1]), int(got[2]) or None) if got[0] > 0.5 else None
        if new is not None:
            self.settings = new
            self.throughputs, self.shares, self.step_times = [], [], []
        return new

    def _job_figures(self) -> Dict[str, Any]:
        """The last MIN_WINDOWS windows' shares (mean, and the least input wait of a window) and
        memory, averaged over the ranks (memory: the largest rank's)."""
        last = self.shares[-MIN_WINDOWS:]
        n = len(last)
        mean = {p: sum(s[p] for s in last) / n if n else 0.0 for p in SHARES}
        least_input = min((s["data"] + s["h2d"] for s in last), default=0.0)
        step_time = sum(self.step_times[-MIN_WINDOWS:]) / n if n else 0.0
        mem = self.memory() if self.cfg.trainer.memory_cap_mb > 0 else (0.0, 0.0)
        local = [float(n), least_input, step_time, *(mean[p] for p in SHARES)]
        if self.world > 1:
            slots = [0.0] * (2 * self.world)
            slots[2 * self.rank: 2 * self.rank + 2] = mem
            summed = self.all_reduce_sum(local + slots)
            local = [v / self.world for v in summed[:len(local)]]
            mem = (max(summed[len(local)::2]), max(summed[len(local) + 1::2]))
        keys = ["windows", "least_input", "step_time_s", *(f"{p}_frac" for p in SHARES)]
        job = dict(zip(keys, local))
        job["data_wait_frac"] = job.pop("data_frac")
        job["memory_mb"], job["worker_mb"] = mem
        return job

    def _decide(self, step: int, job: Dict[str, Any]) -> Optional[LoaderSettings]:
        if len(self.throughputs) < MIN_WINDOWS or job["windows"] < MIN_WINDOWS - 0.5:
            return None  # not steady yet (a new loader's warmup, a new epoch's), or too little to go by
        if self.trial is not None:
            return self._judge(step)
        regime = self._regime()
        if len(regime) < MIN_WINDOWS:
            return None  # the load just changed: wait until it is steady
        base = estimate(regime)
        inp = job["data_wait_frac"] + job["h2d_frac"]
        if job["least_input"] >= INPUT_BOUND:
            move = self._step_up(step, job)
            if move is None:
                return None
            candidate, reason = move
            kind = "up"
        elif inp <= NEAR_ZERO_WAIT and self.settings.num_workers > MANY_WORKERS:
            candidate = dataclasses.replace(self.settings, num_workers=self.settings.num_workers // 2)
            if self._refused(candidate, step):
                return None
            reason = (f"input wait is {100 * inp:.1f}% of the step (<= {100 * NEAR_ZERO_WAIT:.0f}%) with "
                      f"{self.settings.num_workers} workers: fewer give memory and CPU back")
            kind = "down"
        else:
            return None
        self.trial = Trial(self.settings, candidate, kind, base, reason)
        self.record(step, "try", candidate, self.settings, reason, throughput_before=base.mean)
        return candidate

    def _regime(self) -> List[float]:
        """The baseline: the trailing windows (at most BASE_WINDOWS) at the current load, i.e. within
        a factor of 2 of the last MIN_WINDOWS' median (an older load, before a jump, is left out)."""
        recent = sorted(self.throughputs[-MIN_WINDOWS:])
        median = recent[len(recent) // 2]
        out: List[float] = []
        for v in reversed(self.throughputs[-BASE_WINDOWS:]):
            if not median / 2 <= v <= 2 * median:
                break
            out.append(v)
        return out[::-1]

    def _judge(self, step: int) -> LoaderSettings | None:
        """Keep or revert the tried setting once the windows at it say so: a step up is kept as soon
        as its gain passes the noise, a step down reverted as soon as its loss does; undecided, the
        trial goes on to TRIAL_WINDOWS windows (then a step up is reverted, a step down kept)."""
        trial = self.trial
        assert trial is not None
        keep, before, after, noise, said = self._verdict(trial)
        done = len(self.throughputs) >= TRIAL_WINDOWS or noise <= SETTLED_NOISE * before
        if not done and keep != (trial.kind == "up"):  # undecided: a step up not yet past the noise, a step down not yet below it
            return None
        self.trial = None
        if keep:
            self.record(step, "keep", trial.candidate, trial.previous, said, before, after, noise)
            self.refused.pop(trial.candidate, None)
            return None  # already in place
        n = self.refused.get(trial.candidate, (0, 0))[1] + 1
        wait = COOLDOWN * 2 ** (n - 1) * self.cfg.trainer.loader_autotune_every
        self.refused[trial.candidate] = (step + wait, n)
        self.record(step, "revert", trial.previous, trial.candidate,
                    f"{said}; {trial.candidate.text} not tried again for {wait} steps", before, after, noise)
        return trial.previous

    def _verdict(self, trial: Any) -> tuple:
        """(keep, before, after, noise, why in words) of a trial on its windows so far: a step up is
        kept when its gain passes the noise, a step down when its loss does not."""
        got = estimate(self.throughputs[-TRIAL_WINDOWS:])
        noise = math.hypot(_half_width(trial.base), _half_width(got))
        before, after = trial.base.mean, got.mean
        gain = after - before
        keep = gain > noise if trial.kind == "up" else gain >= -noise
        why = {(True, True): "throughput rose by more than the noise",
               (True, False): "throughput did not rise by more than the noise",
               (False, True): "throughput did not fall by more than the noise",
               (False, False): "throughput fell by more than the noise"}[(trial.kind == "up", keep)]
        change = f"{before:.1f} -> {after:.1f} samples/s ({100 * gain / before:+.0f}%), noise +-{noise:.1f}"
        return keep, before, after, noise, f"{why}: {change}"

    def finish(self, step: int) -> None:
        """The run ended: a trial still open is kept when its windows measured it better (a step up
        past the noise, a step down not below it, on at least MIN_WINDOWS windows), else reverted;
        either is recorded, so the summary's `final` and tuned/loader.yaml say which (rank 0)."""
        trial = self.trial
        if trial is None or self.rank != 0:
            return
        n = len(self.throughputs)
        if n >= MIN_WINDOWS:
            keep, before, after, noise, said = self._verdict(trial)
        else:
            keep, before, after, noise = False, trial.base.mean, None, None
            said = f"too few windows to judge: {n} measured window{'s' if n != 1 else ''} at it, fewer than {MIN_WINDOWS}"
        self.trial = None
        ended = f"the run ended during the trial: {said}"
        if keep:
            self.record(step, "keep", trial.candidate, trial.previous, ended, before, after, noise)
            return
        self.settings = trial.previous
        self.record(step, "revert", trial.previous, trial.candidate,
                    f"{ended}; {trial.previous.text} is the setting to keep", before, after, noise)

    def _refused(self, candidate: LoaderSettings, step: int) -> bool:
        until = self.refused.get(candidate)
        return until is not None and step < until[0]

    def _step_up(self, step: int, job: Dict[str, Any]) -> Optional[tuple]:
        """(settings, why) of the first step up the diagnosis advises that is not refused and fits
        the memory cap; None when there is none."""
        cfg = dataclasses.replace(self.cfg, data=self.settings.data(self.cfg.data))
        figures = {**job, "item_bytes": self.item_bytes, "world_size": self.world, "per_rank": [{"device": self.device}]}
        diag = diagnose(figures, cfg, None, self.handoff)
        if diag.verdict != "input-bound":
            return None
        cap = self.cfg.trainer.memory_cap_mb
        for move in diag.moves:
            if "data.num_workers" in move.set:
                candidate = dataclasses.replace(self.settings, num_workers=int(move.set["data.num_workers"]))
            elif "data.prefetch_factor" in move.set and self.settings.num_workers > 0:
                candidate = dataclasses.replace(self.settings, prefetch_factor=int(move.set["data.prefetch_factor"]))
            else:
                continue  # a larger batch changes the math: not the autotuner's to turn
            if candidate == self.settings:
                continue
            added = candidate.num_workers - self.settings.num_workers
            if cap > 0 and added > 0:
                per_worker = job["worker_mb"] or WORKER_MB_GUESS
                room = int((MEMORY_HEADROOM * cap - job["memory_mb"]) // per_worker)
                if room < added:
                    if room < 1:
                        continue
                    candidate = dataclasses.replace(candidate, num_workers=self.settings.num_workers + room)
            if self._refused(candidate, step):
                continue
            return candidate, f"input-bound ({diag.reason}); {move.why}"
        return None

    def summary(self) -> Dict[str, Any]:
        """What result.json keeps: the settings at the start and end, and every event (call
        `finish` first: an open trial is kept or reverted)."""
        return {"initial": self.initial.as_dict(), "final": self.settled.as_dict(), "events": list(self.events)}
