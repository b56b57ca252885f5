"""The statistics of a measurement: a figure's estimate from its windows (mean, standard error,
95% Student t interval), the union of several measurements of one config, and the stop rule that
ends a measurement once its estimate is precise enough. Pure arithmetic on numbers and window
records: the rank's meter (runtime/meter.py) records the windows, and the stop rule, the merge of
the ranks' results, balance, the loader autotune and the tuner all read their figures from here."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from .results import Estimate


@functools.lru_cache(maxsize=None)
def t95(dof: int) -> float:
    """The two-sided 95% Student t quantile at `dof` degrees of freedom (scipy's, imported on first
    use: a rank that never estimates does not pay for it)."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, 0.975))


def estimate(values: List[float], measured_s: float = 0.0, weights: Optional[List[float]] = None) -> Estimate:
    """A figure (throughput, utilization) estimated from its value per window (measure.results.Estimate):
    their `mean`, its relative standard error (`rel_se`, what `StopRule` holds to measure.rel_precision),
    a 95% `interval`, the `windows` used and their `measured_s`.

    With `weights` (the windows' wall times) the mean is weighted by them: for throughput that is
    all samples / all measured time, the figure a long run delivers. The plain mean of per-window
    rates overstates it whenever windows differ in length (1/T is convex: a short window that caught
    a burst of ready batches counts as much as a long one that waited); its standard error is the
    ratio estimator's (linearized: sd of w_i (v_i - mean) / mean(w))."""
    n = len(values)
    if n == 0:
        return _estimate(0, 0.0, 0.0, measured_s)
    if weights is None or n == 1 or sum(weights) <= 0:
        return _estimate(n, statistics.fmean(values), statistics.stdev(values) if n > 1 else 0.0, measured_s)
    total = sum(weights)
    mean = sum(w * v for w, v in zip(weights, values)) / total
    w_bar = total / n
    sd = math.sqrt(sum((w * (v - mean)) ** 2 for w, v in zip(weights, values)) / (n - 1)) / w_bar
    return _estimate(n, mean, sd, measured_s)


def _estimate(n: int, mean: float, sd: float, measured_s: float) -> Estimate:
    if n == 0:
        return Estimate(windows=0, measured_s=measured_s)
    if n == 1 or mean <= 0:
        return Estimate(mean=mean, windows=n, measured_s=measured_s)
    se = sd / math.sqrt(n)
    half = t95(n - 1) * se
    return Estimate(mean=mean, rel_se=se / mean, interval=(mean - half, mean + half), windows=n, measured_s=measured_s)


def estimate_of(windows: List[Any], key: str = "throughput") -> Estimate:
    """`estimate` of `key` over full measured windows (Window objects or their dicts); partial
    ones only when there is nothing else."""
    get = (lambda w, k: w[k]) if windows and isinstance(windows[0], dict) else getattr
    full = [w for w in windows if not get(w, "warmup") and not get(w, "partial")]
    full = full or [w for w in windows if not get(w, "warmup")]
    walls = [get(w, "wall_s") for w in full]
    return estimate([get(w, key) for w in full], float(sum(walls)), walls)


def combine(estimates: List[Estimate]) -> Estimate:
    """One `estimate` of a config from several runs of it (the confirmation's re-measurements),
    each run one observation, weighted alike: the runs' mean, from 3 runs their median; its
    standard error the larger of the runs' own (their windows') and the spread between the runs'
    means. Runs are not weighted by their windows: a slow, disturbed run measures until its time
    cap and so has the most windows, and would pull the mean toward it in a narrow interval."""
    parts = [e for e in estimates if e.windows and e.mean is not None]
    windows, measured_s = sum(e.windows for e in parts), sum(e.measured_s for e in parts)
    if not parts:
        return _estimate(0, 0.0, 0.0, measured_s)
    if len(parts) == 1:
        return dataclasses.replace(parts[0], measured_s=measured_s)
    k, means = len(parts), [e.mean for e in parts]
    mean = statistics.median(means) if k >= 3 else statistics.fmean(means)  # type: ignore[type-var,arg-type]
    within = math.sqrt(sum(((e.rel_se or 0.0) * m) ** 2 for e, m in zip(parts, means))) / k
    se = max(within, statistics.stdev(means) / math.sqrt(k))
    half = Z95 * se
    return Estimate(mean=mean, rel_se=se / mean if mean > 0 else None,
                    interval=(mean - half, mean + half) if mean > 0 else None, windows=windows, measured_s=measured_s)


def round_drift(runs: Dict[Any, Dict[int, float]], sweeps: int = 100) -> Dict[int, float]:
    """The factor by which the machine ran each round of interleaved runs faster or slower than
    its rounds' average: `runs` maps each config to its figure (throughput) per round, and a round's
    runs, made one after another, share the host's state of the moment (its other load, its clock,
    the caches). Fitted as log(figure) = config + round (alternating means, rounds centred), from
    rounds with at least two configs; a round with fewer gets 1. Dividing each run by its round's
    factor compares configs within rounds, as a blocked design does. On a shared 2-core host the
    rounds' common part can be about half of the runs' spread; a task whose noise is its runs' own
    gains little from it."""
    logs = {c: {r: math.log(v) for r, v in per.items() if v and v > 0} for c, per in runs.items()}
    logs = {c: per for c, per in logs.items() if per}
    rounds = sorted({r for per in logs.values() for r in per})
    shared = [r for r in rounds if sum(r in per for per in logs.values()) >= 2]
    drift = dict.fromkeys(rounds, 0.0)
    if not shared:
        return {r: 1.0 for r in rounds}
    for _ in range(sweeps):  # until it settles (rounds with other configs in them take a few sweeps)
        level = {c: statistics.fmean(v - drift[r] for r, v in per.items()) for c, per in logs.items()}
        fit = {r: statistics.fmean(per[r] - level[c] for c, per in logs.items() if r in per) for r in shared}
        centre = statistics.fmean(fit.values())
        new = {r: fit[r] - centre if r in fit else 0.0 for r in rounds}
        settled = max(abs(new[r] - drift[r]) for r in rounds) < 1e-9
        drift = new
        if settled:
            break
    return {r: math.exp(d) for r, d in drift.items()}


def disturbed(runs: Dict[Any, Dict[int, float]], below: float = 0.5) -> Set[Tuple[Any, int]]:
    """The (config, round) runs in `runs` (each config's figure per round, as in round_drift) that
    read under `below` x the median of the same config's other runs: runs that something else on the
    host slowed, to be left out of the config's figures and of the rounds' drift. The host's other
    load only ever slows a run, so of two runs far apart the slower is the suspect: while
    something else takes the CPU, a run can read a third of its config's other runs (its loop
    thread spinning in waits for a descheduled intra-op thread), and a pick among such runs goes to
    the config the disturbance spared. Undisturbed runs of one config on the benchmark tasks read
    no lower than about 0.6 of the median of its other runs, round-wide slowdowns included, so
    `below` = 0.5 leaves out only disturbed ones."""
    out: Set[Tuple[Any, int]] = set()
    for config, per in runs.items():
        for r, value in per.items():
            others = [v for q, v in per.items() if q != r and v and v > 0]
            if others and value is not None and value < below * statistics.median(others):
                out.add((config, r))
    return out


def with_run_noise(figs: Dict[str, Any], run_noise: float, runs: int = 1,
                   names: tuple = ("throughput", "utilization", "tokens_per_s")) -> Dict[str, Any]:
    """`figs` (a trial's or its confirmation runs' figures: `name`, `name_lo`, `name_hi`) with each
    95% interval widened by the noise of whole runs. A run's mean is off by about `run_noise`
    (relative standard deviation) beyond what the spread of its own windows shows: where its ranks
    and workers were placed, the caches, the machine's other load. The mean of `runs` runs is off
    by that over sqrt(runs). On a 2-core host a trial's figure and long runs of the same config
    differ by a log standard deviation of about 0.12, about three times what the trials' own
    intervals imply, so two configs can read in intervals that do not overlap and in the other
    order in long runs. A figure with one window (no interval of its own) gets one from the run
    noise alone."""
    if run_noise <= 0:
        return figs
    out = dict(figs)
    for name in names:
        mean = figs.get(name)
        if mean is None or mean <= 0:
            continue
        lo, hi = figs.get(f"{name}_lo"), figs.get(f"{name}_hi")
        se = (hi - lo) / (2 * Z95) if lo is not None and hi is not None else 0.0
        half = Z95 * math.hypot(se, run_noise * mean / math.sqrt(max(1, runs)))
        out[f"{name}_lo"], out[f"{name}_hi"] = mean - half, mean + half
    return out


MIN_WINDOWS = 4  # fewer windows say little about their own spread
MIN_SPREAD = 2  # windows before a measurement may end at its time cap: a spread, so an interval
Z95 = 1.96  # the normal 95% quantile: a relative standard error of p has a half width of Z95 x p (many windows)


@dataclass
class StopRule:
    """When a measurement may end (measure.rel_precision > 0, tuning trials): at least
    MIN_WINDOWS windows and `min_s` measured seconds, and the throughput's relative standard
    error over windows within `rel_precision`, judged on the 95% interval (Student t): its half
    width within 1.96 x rel_precision of the mean; or `max_s` measured seconds (0: no cap), once
    there are MIN_SPREAD windows.

    The cap waits for a second window: one window has no spread, and a figure without an interval
    passes for exact. Windows last whole rounds of the loader's workers, and a large batch with many
    workers has rounds longer than the cap (batch 512 with 6 workers of a CPU-heavy transform on 2
    cores: one 7 s window); with the cap at one window such a trial would come out of a study as
    exact, and its lucky window be picked over configs measured to +-10%.

    The t quantile matters for the few windows a short trial has: 4 windows that happen to agree
    give a small standard deviation by chance (two runs of one config, 4 windows of 0.1 s each, can
    read 20% apart, each "+-5%", from windows that spread 2x). Held to the
    interval, a noisy config is measured longer (about 12 windows at a 15% window spread) and a
    steady one still stops at 4. It is fed the job's figures of each window (results.job_window
    over the ranks' all-reduced figures, so every rank decides the same)."""

    rel_precision: float
    min_s: float = 0.0
    max_s: float = 0.0
    throughputs: List[float] = field(default_factory=list)
    walls: List[float] = field(default_factory=list)
    measured_s: float = 0.0
    reason: Optional[str] = None

    def add(self, throughput: float, wall_s: float) -> Optional[str]:
        """Record one window; returns why to stop now ('precision', 'max_measure_s') or None."""
        self.throughputs.append(throughput)
        self.walls.append(wall_s)
        self.measured_s += wall_s
        if self.max_s and self.measured_s >= self.max_s and len(self.throughputs) >= MIN_SPREAD:
            self.reason = "max_measure_s"
        elif len(self.throughputs) >= MIN_WINDOWS and self.measured_s >= self.min_s:
            est = estimate(self.throughputs, weights=self.walls)
            if est.interval is not None and est.interval[1] - est.mean <= Z95 * self.rel_precision * est.mean:  # type: ignore[operator]
                self.reason = "precision"
        return self.reason
