"""A measured model of the job's throughput over batch size, loader workers and accumulation.

Every run measures, per item delivered (runtime/summary.py, `input_cost`), the loader's CPU time,
the data phase's wall time and the training process's time outside the data wait. From one or
more runs this module fits, per rank: load_cpu (a loader's CPU seconds per item), load_wait (its
seconds per item without a CPU: storage, network), consume (the training process's seconds per
item at batch b and accumulation a, beta + alpha / b + gamma / (a b) by non-negative least
squares), consume_cpu (the CPU it burns meanwhile) and handoff (a batch's hand-off from a worker:
costs.py's round trip, or the least data wait per batch a run with workers saw). It predicts a
config's per-rank item rate as the slowest of these (Plumber, MLSys 2022; tf.data's AUTOTUNE):

  workers = 0   1 / (load_cpu + load_wait + consume0)           the loop does both in turn
  producers     w / (load_cpu + load_wait)                       w workers in parallel
  consumer      1 / (consume + handoff / b)
  cpu budget    cores / (load_cpu + consume_cpu + handoff / b)   workers and trainer share the cores

(consume0: fitted to the runs without workers when they outnumber its terms, else consume scaled by
their compute's time over the same with workers). A run that kept the cores full counts its wait
for cores once, in the cpu budget; a step that waited under HANDOFF_MARGIN hand-offs per batch kept
up with its workers. The rates combine as a soft minimum (close rates lose a little to queueing),
anchored to the runs: each prediction is scaled by the measured / modelled rate of the nearest run.
A loader that waits gets workers beyond the cores; one that computes gets what the cores leave.
Each prediction has a relative uncertainty: the runs' noise, the fit's residuals, and how far the
config lies from what was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np

SOFTMIN_P = 4.0  # the soft minimum's power: two equal rates give 0.84 of either
BASE_NOISE = 0.05  # the least relative uncertainty of any prediction
PER_DOUBLING = 0.12  # added per doubling of batch away from the nearest measured batch
UNSEEN_WAIT = 0.25  # workers predicted with no measurement of the loader's wait
CORES_FULL = 0.8  # a run whose loader and training process kept this share of the cores busy was cpu-bound
MAX_ANCHOR = 2.0  # the most a measured run corrects the model near it (either way)
HANDOFF_MARGIN = 2.0  # a step that waited under this many hand-offs per batch was not waiting on its workers


@dataclass
class Run:
    """One measured config, per rank."""

    batch: int
    workers: int
    accum: int
    rate: float  # items per second per rank
    rel_se: float
    consume: float  # training process seconds per item (outside the data wait)
    consume_cpu: Optional[float]  # its CPU seconds per item
    busy_cpu: Optional[float]  # the loop thread's CPU seconds per item in compute + optimizer (cpu-time utilization)
    load_cpu: Optional[float]
    load_wait: Optional[float]  # None: not seen (workers that kept up hide it)
    data_wait: float  # seconds per item the training process waited for data

    @classmethod
    def of(cls, values: Dict[str, Any], figures: Dict[str, Any], world: int) -> Optional["Run"]:
        """From a trial's values and its measured job figures (merge.merge / trial_metrics)."""
        cost = figures.get("input_cost") or {}
        thr, step = figures.get("throughput"), figures.get("step_time_s")
        if not thr or not step:
            return None
        b, w = int(values["data.batch_size"]), int(values.get("data.num_workers") or 0)
        a = int(values.get("trainer.accumulation_steps") or 1)
        rate = thr / max(1, world)
        data_frac = figures.get("data_wait_frac") or 0.0
        per_item = 1.0 / rate
        consume = per_item * (1 - data_frac)
        data_wall = cost.get("data_wall_s", per_item * data_frac)
        if w == 0:
            # in process the data phase is the loader itself: one thread, so its CPU is at most its wall
            load_cpu = min(cost.get("data_cpu_s", data_wall), data_wall) if "data_cpu_s" in cost else None
            load_wait = max(0.0, data_wall - load_cpu) if load_cpu is not None else None
        else:
            load_cpu = cost.get("workers_cpu_s")
            # workers that kept the step waiting ran flat out: w items per (cpu + wait) each; unless
            # the cores were busy throughout, when what they waited for was a core (cpu-bound)
            load_wait = None
            consume_cpu, threads = cost.get("consume_cpu_s"), cost.get("threads")
            cores_busy = rate * ((load_cpu or 0.0) + (consume_cpu or consume)) / (cost.get("cores") or 1)
            if load_cpu is not None and data_frac >= 0.15 and cores_busy < CORES_FULL:
                load_wait = max(0.0, w * per_item - load_cpu)
            if cores_busy >= CORES_FULL and consume_cpu and threads:
                # the training process waited for cores its workers held: its own time is at most
                # its CPU spread over its threads (the cpu budget, not the consumer, bound this run)
                consume = min(consume, consume_cpu / threads)
        return cls(b, w, a, rate, float(figures.get("rel_se") or BASE_NOISE), consume, cost.get("consume_cpu_s"),
                   cost.get("busy_cpu_s"), load_cpu, load_wait, per_item * data_frac)


@dataclass
class Prediction:
    throughput: float  # job samples/s
    rel_unc: float  # relative uncertainty (about one standard error)
    utilization: Optional[float]  # cpu-time utilization, when the runs measured it
    bound: str  # which rate binds: loader, loop, consumer, cpu

    @property
    def hi(self) -> float:
        return self.throughput * (1 + 2 * self.rel_unc)

    @property
    def lo(self) -> float:
        return self.throughput * max(0.0, 1 - 2 * self.rel_unc)


@dataclass
class JobModel:
    runs: List[Run]
    world: int = 1
    cores: float = 1.0
    threads: float = 1.0
    handoff: Callable[[int], float] = lambda b: 1e-3  # seconds per batch of b items
    coef: np.ndarray = field(default_factory=lambda: np.zeros(3))
    cpu_ratio: float = 1.0
    busy_ratio: Optional[float] = None
    residual: float = 0.0
    inproc_factor: float = 1.0  # the training process's time without workers / with them, as measured
    inproc_coef: Optional[np.ndarray] = None  # its own fit, when runs without workers outnumber its terms
    inproc_residual: float = 0.0
    anchors: List[tuple] = field(default_factory=list)  # (run, its measured rate / the model's)
    # load_cpu / load_wait per item of the same job measured elsewhere (another world size or machine:
    # tune.warm_start), used where these runs do not show them
    loader_prior: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def fit(cls, runs: Iterable[Run], world: int = 1, cores: float = 1.0, threads: float = 1.0,
            handoff: Optional[Callable[[int], float]] = None,
            loader_prior: Optional[Dict[str, float]] = None) -> Optional["JobModel"]:
        runs = [r for r in runs if r is not None]
        if not runs:
            return None
        m = cls(runs, world, cores, threads, handoff or (lambda b: 1e-3), loader_prior=dict(loader_prior or {}))
        m.runs = [m._kept_up(r) for r in runs]
        m._fit_consume()
        m.anchors = [(r, min(MAX_ANCHOR, max(1 / MAX_ANCHOR, r.rate / m._raw_rate(r.batch, r.workers, r.accum))))
                     for r in runs]
        return m

    def _kept_up(self, r: Run) -> Run:
        """The run, without the loader wait `Run.of` inferred when the step waited no longer per batch
        than about a hand-off: that wait is the hand-off itself, which more workers do not shorten.
        A hand-off costs about 1.4 ms on 2 cores; read as workers running flat out, such a wait
        would put a loader wait per item many times the loader's CPU on every item, and every
        larger batch would be predicted below the floor."""
        if r.workers > 0 and r.load_wait is not None and r.data_wait * r.batch < HANDOFF_MARGIN * self.handoff(r.batch):
            return replace(r, load_wait=None)
        return r

    # -- the fit --------------------------------------------------------------------------------
    @staticmethod
    def _features(b: float, a: float, used: List[int]) -> List[float]:
        full = [1.0, 1.0 / b, 1.0 / (a * b)]
        return [full[i] for i in used]

    @property
    def fitted(self) -> List[Run]:
        """The runs the training process's cost is fitted to: those with loader workers when there
        are any. Without workers the loop loads in between steps, and its compute comes back to
        threads that went to sleep during the load and to cold caches (on a loaded machine it can
        take many times the same step's time with workers); fitted together, that difference
        passes for a per-step cost and every prediction follows it."""
        with_workers = [r for r in self.runs if r.workers > 0]
        return with_workers or self.runs

    def _fit_consume(self) -> None:
        """consume(b, a) = beta + alpha / b + gamma / (a b), with only the terms the runs can tell
        apart (one batch: a per-item cost; two: plus a per-micro-batch cost; accumulation varied at
        one batch: plus a per-step cost). In-process runs (no workers) beside runs with workers get
        a fit of their own when they measured two configs or more and outnumber its terms
        (`inproc_coef`), else keep their factor on the workers' fit (`inproc_factor`)."""
        runs = self.fitted
        self.coef, self.residual, _ = self._fit(runs)
        ratios = [r.consume_cpu / r.consume for r in runs if r.consume_cpu is not None and r.consume > 0]
        self.cpu_ratio = float(np.median(ratios)) if ratios else 1.0
        busy = [r.busy_cpu / r.consume for r in runs if r.busy_cpu is not None and r.consume > 0]
        self.busy_ratio = float(np.median(busy)) if busy else None
        inproc = [r for r in self.runs if r.workers == 0]
        if runs is self.runs or not inproc:
            return
        coef, residual, spare = self._fit(inproc)
        if len({(r.batch, r.accum) for r in inproc}) >= 2 and spare:
            # the loop's own shape over batch and accumulation: without it, runs without workers
            # are predicted from a run with workers times a factor, so every batch and accumulation
            # without workers reads alike. Only with more runs than terms: three terms through
            # three runs that each read +-15% fit their noise exactly (a fresh process's first
            # trial, up to 30% low, would bend the fit to "smaller batches are slower")
            self.inproc_coef, self.inproc_residual = coef, residual
            return
        factors = [r.consume / self.consume(r.batch, r.accum) for r in inproc if self.consume(r.batch, r.accum) > 0]
        self.inproc_factor = float(np.median(factors)) if factors else 1.0

    def _fit(self, runs: List[Run]) -> tuple:
        """(coefficients, relative rms residual, whether there were more runs than terms) of consume
        over `runs`: non-negative least squares on the terms `runs` can tell apart."""
        from scipy.optimize import nnls

        batches = {r.batch for r in runs}
        steps = {(r.batch, r.accum) for r in runs}
        used = [0] + ([1] if len(batches) > 1 else []) + ([2] if len(steps) > len(batches) else [])
        if len(used) == 1 and len(steps) > 1:  # one batch, several accumulations
            used = [0, 2]
        x = np.array([self._features(r.batch, r.accum, used) for r in runs])
        y = np.array([r.consume for r in runs])
        scale = y.mean()
        sol, _ = nnls(x / scale, y / scale)
        coef = np.zeros(3)
        coef[used] = sol
        pred = x @ sol
        spare = len(runs) > len(used)
        residual = float(np.sqrt(np.mean(((pred - y) / y) ** 2))) if spare else 0.0
        return coef, residual, spare

    def consume(self, b: int, a: int) -> float:
        return float(np.dot(self.coef, [1.0, 1.0 / b, 1.0 / (a * b)]))

    def consume_inproc(self, b: int, a: int) -> float:
        """The training process's seconds per item when it loads its own data (no workers)."""
        if self.inproc_coef is not None:
            return float(np.dot(self.inproc_coef, [1.0, 1.0 / b, 1.0 / (a * b)]))
        return self.inproc_factor * self.consume(b, a)

    def _loader(self, name: str) -> Optional[float]:
        """A loader figure as workers see it: from runs with workers when there are (a worker runs
        torch with one thread; in the training process the same transform may run on several
        threads, or wait for them, and cost another amount), else from the in-process runs."""
        seen = [getattr(r, name) for r in self.runs if r.workers > 0 and getattr(r, name) is not None]
        seen = seen or [getattr(r, name) for r in self.runs if getattr(r, name) is not None]
        return float(np.median(seen)) if seen else self.loader_prior.get(name)

    @property
    def load_cpu(self) -> Optional[float]:
        return self._loader("load_cpu")

    @property
    def load_wait(self) -> Optional[float]:
        """The loader's wait per item: the least of what the runs with workers imply and what a run
        without workers measured directly. A run with workers whose step waited is read as its
        workers running flat out, and all of that wait goes to the loader; where the wait came from
        elsewhere (8 workers contending for 2 cores) that reads about ten times the wait a run
        without workers measures, and every config with fewer workers would be predicted several
        times under its steady rate and held back (`predicted_below`). Too low a wait only has its
        config measured, where the run corrects it; too high a one is never looked at again."""
        workers = self._loader("load_wait")
        seen = [r.load_wait for r in self.runs if r.workers == 0 and r.load_wait is not None]
        direct = float(np.median(seen)) if seen else None
        return min((w for w in (workers, direct) if w is not None), default=None)

    @property
    def inproc_load(self) -> Optional[float]:
        """Seconds per item the loop itself spent loading, in runs without workers."""
        seen = [r.data_wait for r in self.runs if r.workers == 0]
        return float(np.median(seen)) if seen else None

    # -- predictions ----------------------------------------------------------------------------
    def rates(self, b: int, w: int, a: int) -> Dict[str, float]:
        """Per-rank item rates of each stage at this config (items/s)."""
        consume = max(self.consume(b, a), 1e-9)
        load_cpu = self.load_cpu or 0.0
        load_wait = self.load_wait
        if load_wait is None:  # workers always kept up: assume the loader's time is what was seen waiting
            load_wait = max([r.data_wait for r in self.runs if r.workers == 0] + [0.0])
            load_wait = max(0.0, load_wait - load_cpu)
        load = max(load_cpu + load_wait, 1e-9)
        if w == 0:
            inproc = self.inproc_load
            return {"loop": 1.0 / ((inproc if inproc is not None else load) + max(self.consume_inproc(b, a), 1e-9))}
        hand = self.handoff_s(b) / b
        return {"loader": w / load, "consumer": 1.0 / (consume + hand),
                "cpu": self.cores / max(load_cpu + self.cpu_ratio * consume + hand, 1e-9)}

    def handoff_s(self, b: int) -> float:
        """Seconds the training process spends per batch taking it from a worker: the host's
        measured round trip (costs.py: one worker, no queue to hide behind), or less where runs
        with workers waited less than that per batch (their queue hid most of it)."""
        seen = [r.data_wait * r.batch for r in self.runs if r.workers > 0]
        return min([self.handoff(b)] + seen)

    def _raw_rate(self, b: int, w: int, a: int, rates: Optional[Dict[str, float]] = None) -> float:
        """The model's per-rank rate before it is anchored to the runs: the soft minimum of the stages'."""
        rates = rates if rates is not None else self.rates(b, w, a)
        return sum(r ** -SOFTMIN_P for r in rates.values()) ** (-1 / SOFTMIN_P)

    def anchor(self, b: int, w: int, a: int) -> float:
        """The measured / modelled rate of the run nearest to this config (in doublings of batch and
        of workers + 1, half for accumulation): a measured config is predicted as measured, and its
        neighbours carry the same correction. Unanchored, the stages' soft minimum can read a run
        below its own measurement (two close rates lose 16% to it), and then its neighbours fall
        under the floor of the very run they resemble, and a grid's best could be held back."""
        if not self.anchors:
            return 1.0

        def far(r: Run) -> float:
            return (abs(math.log2(b / r.batch)) + abs(math.log2((w + 1) / (r.workers + 1)))
                    + 0.5 * abs(math.log2(a / r.accum)))

        dist = [(far(r), k) for r, k in self.anchors]
        near = min(d for d, _ in dist)
        return float(np.median([k for d, k in dist if d == near]))

    def predict(self, b: int, w: int, a: int) -> Prediction:
        rates = self.rates(b, w, a)
        rate = self._raw_rate(b, w, a, rates) * self.anchor(b, w, a)
        bound = min(rates, key=rates.__getitem__)
        unc = max(BASE_NOISE, float(np.median([r.rel_se for r in self.runs])),
                  self.inproc_residual if w == 0 and self.inproc_coef is not None else self.residual)
        # unmeasured batch sizes and accumulations: a per-micro-batch and a per-step cost (>= 0) the
        # runs could not tell apart may make a larger one faster, rarely a smaller one
        up = min(max(0.0, math.log2(b / r.batch)) + 0.5 * max(0.0, math.log2(a / r.accum)) for r in self.runs)
        down = min(max(0.0, math.log2(r.batch / b)) for r in self.runs)
        unc += PER_DOUBLING * (min(up, 3.0) + 0.5 * min(down, 3.0))
        if w > 0 and self.load_wait is None and not any(r.workers == 0 for r in self.runs):
            unc += UNSEEN_WAIT
        if w == 0 and not any(r.workers == 0 for r in self.runs):
            # never measured without workers: the loop's own loading, and what the workers (idle
            # ones too) took from the training process's cores, are both guesses
            unc += UNSEEN_WAIT
        if w not in {r.workers for r in self.runs}:
            unc += 0.05 * min(abs(math.log2((w + 1) / (r.workers + 1))) for r in self.runs)
        util = None
        if self.busy_ratio is not None:  # the loop thread's busy CPU per second: in process, the loop's own consume
            consume = self.consume_inproc(b, a) if w == 0 else self.consume(b, a)
            util = min(1.0, rate * self.busy_ratio * consume)
        return Prediction(rate * self.world, unc, util, bound)

    def best_workers(self, b: int, a: int, top: int) -> int:
        """The fewest workers (0..top) within 2% of the best predicted rate at this batch."""
        preds = {w: self.predict(b, w, a).throughput for w in range(top + 1)}
        best = max(preds.values())
        return min(w for w, p in preds.items() if p >= 0.98 * best)

    def explain(self) -> str:
        """One line of what the model rests on, for advice and reasons."""
        parts = []
        if self.load_cpu is not None:
            parts.append(f"loader CPU {1e3 * self.load_cpu:.3f} ms/item")
        if self.load_wait is not None:
            parts.append(f"loader wait {1e3 * self.load_wait:.3f} ms/item")
        parts.append(f"training process {1e3 * self.consume(self.runs[-1].batch, self.runs[-1].accum):.3f} ms/item")
        parts.append(f"{self.cores:g} core(s) per rank")
        return ", ".join(parts)


def runs_of(trials: Iterable[Any], world: int) -> List[Run]:
    """The measured runs of a study's completed trials (their values and stored figures)."""
    out = []
    for tr in trials:
        a = tr.user_attrs
        if tr.state.name != "COMPLETE" or "values" not in a or "throughput" not in a:
            continue
        run = Run.of(a["values"], a, world)
        if run is not None:
            out.append(run)
    return out
