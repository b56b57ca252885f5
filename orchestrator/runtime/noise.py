"""Measuring the gradient noise scale while the job trains (measure.noise_scale; the estimator is
measure/noise.py, the method is docs/measurement.md's "Gradient noise scale").

Each estimated step gives a pair of squared gradient norms at two batch sizes:

- `ranks` (several ranks: ddp, fsdp, horovod): each rank's own gradient before the all-reduce
  (DDP's communication hook sees every bucket; Horovod each gradient as its allreduce starts;
  FSDP each group's unsharded gradient before its reduce-scatter) at the local batch, and the
  averaged gradient after it at the global batch. Costs a norm of the gradients twice.
- `accumulation` (one rank, trainer.accumulation_steps > 1): the first micro-batch's gradient and
  the accumulated one.
- `halves` (one rank, single or dp, no accumulation): the step runs its batch as two halves (the
  same gradient: each half's loss weighs by its share); each half's gradient and the whole's. The
  first half's is kept (a copy of the gradients, on these steps only) so that the second half's
  is the accumulated one less it: with both halves' norms, their own noise cancels in |G|^2's
  estimate (measure.noise.both_parts); over a few pairs, one half's alone reads low.

The steps estimated are the warmup's (never measured) and every measure.noise_every-th; a tuning
trial with `halves` estimates its warmup's steps only (its windows are short: a step that costs
half as much again would stand out in one and widen the trial's interval).

measure.noise_every=0: the cadence follows the estimates' measured cost. The step reads the clock
around each estimated step past the warmup and the ordinary steps just before and after it (no
other step); from the medians of the last TIMED_TRIPLES such triples, an estimated step's extra time
is its own and the next step's (where part of its cost spills) less twice the step before it, and
the cadence is the one (`cadence`) at which that extra is NOISE_BUDGET of the step time. The next
estimated step comes `every` after the last. One rank re-decides after each timed triple; with
several ranks (`ranks`) every rank must estimate the same steps, so the ranks' medians ride in the
all-reduce the pairs are read with (`flush`, the same step on every rank) and every rank decides
from their maxima, the same figures. Until MIN_TRIPLES triples are timed (and, with several ranks,
until the first read) the cadence is EVERY, or HALVES_EVERY with `halves`.

The norms stay on the device (one fused `_foreach_norm` per measurement, or one norm per DDP bucket;
no sync); they are squared and summed, read, and averaged over the ranks in one all-reduce, at a
logged step (which syncs for its loss anyway) once FLUSH_AT pairs wait, and at the run's end."""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..measure.noise import NoiseEstimator
from ..measure.results import NoiseScale
from ..schema import BackendName, Balance, Config, Mode
from .dist import norms
from .state import Hook, Run

FLUSH_AT = 32  # pairs waiting on the device before a logged step reads them
EVERY = 8  # measure.noise_every=0, until the estimates' cost is timed: every 8th step is estimated...
HALVES_EVERY = 50  # ... and every 50th with `halves` (a second forward and backward and a copy of the gradients)
NOISE_BUDGET = 0.01  # measure.noise_every=0: the estimated steps' extra time is about 1% of the step time
# the cadence's bounds: every 2nd step at most, so the steps next to an estimated one are ordinary
# ones to time it against; every 1000th at least, so a run of a few thousand steps still estimates
# some steps past its warmup and re-decides the cadence now and then
MIN_EVERY, MAX_EVERY = 2, 1000
TIMED_TRIPLES = 15  # the cadence rests on the medians of the last 15 timed triples: a step's wall time varies +-15-30%
MIN_TRIPLES = 3  # ... once 3 are timed (one is mostly the host's noise)
TIMED_FLOOR = 0.5  # an estimated step's time read under this share of an ordinary step's is the host's noise


def cadence(t_estimated: float, t_ordinary: float, default: int) -> int:
    """Steps between the estimated ones so that an estimated step's extra wall time over an
    ordinary step's is NOISE_BUDGET of the step time, within [MIN_EVERY, MAX_EVERY]; `default`
    while either time is unknown (<= 0)."""
    if t_estimated <= 0 or t_ordinary <= 0:
        return default
    extra = max(0.0, t_estimated - t_ordinary)
    return max(MIN_EVERY, min(MAX_EVERY, math.ceil(extra / (NOISE_BUDGET * t_ordinary))))


def method_for(cfg: Config, world_size: int) -> Tuple[Optional[str], str]:
    """(method, '') for this run, or (None, why it is not measured)."""
    name = cfg.backend.name
    if not cfg.measure.noise_scale:
        return None, "measure.noise_scale=false"
    if world_size > 1:
        if cfg.parallelism.balance is Balance.speed:
            return None, "not measured with parallelism.balance=speed (the ranks' batches differ)"
        return "ranks", ""
    if name is BackendName.fsdp:
        return None, "not measured with backend=fsdp on one rank"
    if cfg.trainer.accumulation_steps > 1:
        return "accumulation", ""
    if name in (BackendName.single, BackendName.dp):
        return "halves", ""
    return None, f"not measured with backend={name.value} on one rank without accumulation"


class NoiseProbe:
    """One rank's side: this step's norms of the gradient's parts (buckets, parameters) from the
    adapter's hooks or the step, the steps' pairs waiting on the device, and the run's estimator.
    A step adds a norm per part (one fused op), nothing else on the device; squaring and summing
    happen for all the waiting pairs at once, when they are read."""

    def __init__(self, method: str, world_size: int, big_div: int, every: int, scaler: Any = None,
                 auto: bool = False, rank: int = 0) -> None:
        self.method, self.world, self.big_div, self.every, self.scaler = method, world_size, big_div, every, scaler
        self.auto, self.rank = auto, rank  # auto: the cadence follows the measured cost (measure.noise_every=0)
        self.next_at = sys.maxsize  # the next estimated step past the warmup (`plan`, `begin`)
        self.last_at = -1  # the last one
        self.before = self.after = -1  # auto: the ordinary steps timed around the next and the last
        self.ref: Tuple[int, float] = (-1, 0.0)  # the last step timed before an estimated one, its s
        self.t_estimated = 0.0
        self.timings: List[Tuple[float, float, float]] = []  # the last timed triples: before, estimated, after (s)
        self.extra: Optional[float] = None  # the extra time the cadence was set by, over an ordinary step's
        self.fed = method != "ranks"  # ranks: the adapter sets it once its hooks feed this probe
        self.active = False  # this step is estimated (the step sets it; the adapter's hooks read it)
        self.small: List[torch.Tensor] = []  # this step's: the parts' norms of the small-batch gradient
        self.big: List[torch.Tensor] = []
        self.rest: List[torch.Tensor] = []  # `halves`: the parts' norms of the second half's gradient
        self.kept: List[torch.Tensor] = []  # `halves`: the first half's gradients (weighted), until the second's
        self.weight, self.b_small, self.weight_rest = 1.0, 0, 1.0
        self.norms: List[torch.Tensor] = []  # the waiting pairs' norms, in order
        self.pending: List[Tuple[int, int, int, float, float, Optional[torch.Tensor], int, int, int]] = []
        self.estimator = NoiseEstimator(method)
        self._params: Optional[List[nn.Parameter]] = None

    # -- what the hooks and the step call ------------------------------------------------------
    def add_small(self, norms: List[torch.Tensor]) -> None:
        self.small.extend(norms)  # one list operation: safe from a communication thread's callback

    def add_big(self, norms: List[torch.Tensor]) -> None:
        self.big.extend(norms)

    def grads(self, model: nn.Module) -> List[torch.Tensor]:
        if self._params is None:
            self._params = list(model.parameters())
        return [p.grad for p in self._params if p.grad is not None]

    def grad_norms(self, model: nn.Module) -> List[torch.Tensor]:
        return norms(self.grads(model))

    def first_part(self, model: nn.Module, n_part: int, weight: float) -> None:
        """After the first micro-batch's (or half's) backward, whose loss weighed `weight`: its own
        gradient is the accumulated one over `weight`. `halves` keeps a copy for `second_part`."""
        grads = self.grads(model)
        self.small.extend(norms(grads))
        self.weight, self.b_small = weight, n_part
        if self.method == "halves":
            self.kept = [g.detach().clone() for g in grads]

    def second_part(self, model: nn.Module, weight: float) -> None:
        """`halves`, after the second half's backward, whose loss weighed `weight`: its own gradient
        is the accumulated one less the first half's (kept), over `weight`."""
        grads, kept, self.kept = self.grads(model), self.kept, []
        if len(grads) != len(kept):  # a parameter only the second half reached: its sizes differ
            return
        self.rest.extend(norms(torch._foreach_sub(grads, kept)))
        self.weight_rest = weight  # its size is the big batch less the first half

    def end_step(self, model: nn.Module, samples: int, step: int = 0) -> None:
        """After the gradients are synchronized, before clipping: close step `step`'s pair."""
        if not self.small:
            self.big.clear()
            self.rest.clear()
            return
        if self.method == "ranks":
            b_small, b_big = samples, samples * self.world
        else:
            b_small, b_big = self.b_small, samples
        if not self.big:  # the averaged gradient's norm, where no hook saw it (not DDP)
            self.big.extend(self.grad_norms(model))
        small, big, rest, self.small, self.big, self.rest = self.small, self.big, self.rest, [], [], []
        if big:
            scale = getattr(self.scaler, "_scale", None)  # AMP fp16: the gradients are scaled by it
            scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else None  # updated in place later
            self.pending.append((len(small), len(big), len(rest), self.weight, self.weight_rest, scale,
                                 b_small, b_big, step))
            self.norms += small + big + rest

    # -- reading them ---------------------------------------------------------------------------
    def squared(self) -> List[float]:
        """The waiting pairs' squared norms, |G_small|^2, |G_big|^2 and the second half's |G_rest|^2
        (0 where not measured) for each, this rank's."""
        flat = torch.stack(self.norms).square()
        slots: List[int] = []
        for i, (n_small, n_big, n_rest, *_) in enumerate(self.pending):
            slots += [3 * i] * n_small + [3 * i + 1] * n_big + [3 * i + 2] * n_rest
        sums = torch.zeros(3 * len(self.pending), dtype=flat.dtype, device=flat.device)
        values = sums.index_add_(0, torch.tensor(slots, device=flat.device), flat).tolist()
        scales = [p[5] for p in self.pending if p[5] is not None]
        scale_sq = iter(torch.stack(scales).double().square().tolist()) if scales else None
        for i, (_, _, _, weight, weight_rest, scale, *_) in enumerate(self.pending):
            div = next(scale_sq) if scale is not None and scale_sq is not None else 1.0
            values[3 * i] /= weight * weight * div
            values[3 * i + 1] /= div
            values[3 * i + 2] /= weight_rest * weight_rest * div
        return values

    def flush(self, adapter: Any) -> None:
        """Read the pairs waiting (every rank at the same step: with several ranks, one all-reduce
        averages the ranks' own gradients' norms, and sums FSDP's shards of the averaged one)."""
        if not self.pending:  # the same on every rank: every rank closes a pair at the same steps
            return
        values = self.squared()
        if self.world > 1:
            timed = self.rank_timings() if self.auto else []
            values = adapter.all_reduce_sum(values + timed)
            if timed:
                self.agree(values[len(values) - len(timed):])
        for i, (_, _, n_rest, *_, b_small, b_big, step) in enumerate(self.pending):
            small, big, rest = values[3 * i], values[3 * i + 1], values[3 * i + 2]
            if self.world > 1:
                small, big = small / self.world, big / self.big_div
            self.estimator.add(small, big, b_small, b_big, step, rest_sq=rest if n_rest else None)
        self.pending.clear()
        self.norms.clear()

    def result(self) -> NoiseScale:
        out = self.estimator.result()
        out.every, out.extra = self.every, self.extra
        return out

    # -- the cadence ----------------------------------------------------------------------------
    def plan(self, first: int) -> None:
        """The step loop's start: past the warmup (from step `first`), the steps estimated are the
        multiples of `every` until the cadence changes (none with every=0)."""
        self.next_at = -(-first // self.every) * self.every if self.every > 0 else sys.maxsize
        self.before = self.next_at - 1 if self.auto and self.next_at > first else -1

    def begin(self, step: int) -> bool:
        """Step `step` is estimated (the first at or past next_at); the next comes `every` steps
        later. True where it is timed (measure.noise_every=0), with the steps next to it."""
        self.active, self.last_at, self.next_at = True, step, step + self.every
        if self.auto:
            self.after, self.before = step + 1, self.next_at - 1
        return self.auto

    def timed(self, step: int, seconds: float) -> None:
        """Step `step`'s wall time: an estimated step's, the step's before it (the ordinary step
        it is weighed against: far from the last estimated one) or after it (where part of its cost
        spills: the caches, the allocator). With one rank each complete triple re-decides the
        cadence; several ranks decide when they `flush`."""
        if self.active:
            self.t_estimated = seconds
            return
        if step == self.after and self.ref[0] == self.last_at - 1:
            self.timings.append((self.ref[1], self.t_estimated, seconds))
            del self.timings[:-TIMED_TRIPLES]
            if self.world == 1 and len(self.timings) >= MIN_TRIPLES:
                self.decide(*self.medians())
        if step == self.before:  # also the step after the last one where every=2
            self.ref = (step, seconds)

    def medians(self) -> Tuple[float, float]:
        """(an estimated step's wall time with what spills onto the next step, an ordinary step's),
        from the medians of the timed triples; the first at least TIMED_FLOOR of the second (on a busy
        host a slow step before can outweigh the two after it: no extra, but timed all the same)."""
        before, est, after = (statistics.median(t[i] for t in self.timings) for i in range(3))
        return max(est + after - before, TIMED_FLOOR * before), before

    def decide(self, t_estimated: float, t_ordinary: float) -> None:
        """The cadence from these figures; the next estimated step `every` after the last (the next
        step where that has passed)."""
        self.every = cadence(t_estimated, t_ordinary, self.every)
        self.extra = max(0.0, t_estimated - t_ordinary) / t_ordinary
        self.next_at, self.before = self.last_at + self.every, self.last_at + self.every - 1

    def rank_timings(self) -> List[float]:
        """This rank's figures in its slots of 2 x world floats (0 elsewhere, and before MIN_TRIPLES):
        summed over the ranks, every rank's figures."""
        slots = [0.0] * (2 * self.world)
        if len(self.timings) >= MIN_TRIPLES:
            slots[self.rank], slots[self.world + self.rank] = self.medians()
        return slots

    def agree(self, slots: List[float]) -> None:
        """The ranks' summed slots: the cadence from the slowest rank's figures, once every rank has
        them (the same vector on every rank: the same cadence)."""
        est, ordinary = slots[:self.world], slots[self.world:]
        if min(est) > 0 and min(ordinary) > 0:
            self.decide(max(est), max(ordinary))


class NoiseHook(Hook):
    """Reads the probe's pairs at logged steps (their loss already synced) and puts the run's
    `noise_scale` (measure.results.NoiseScale) into the rank's result."""

    def __init__(self, probe: Optional[NoiseProbe], log_every: int, method: str = "halves") -> None:
        self.probe, self.log_every, self.method = probe, log_every, method
        self.after_every = log_every  # it reads the pairs at logged steps only

    def after_step(self, run: Run) -> bool:
        probe = self.probe
        if probe is None or len(probe.pending) < FLUSH_AT or run.step % self.log_every:
            return False
        probe.flush(run.adapter)
        return True

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        if self.probe is None:
            out["noise_scale"] = NoiseScale(method=self.method).as_dict()
            return
        self.probe.flush(run.adapter)
        out["noise_scale"] = self.probe.result().as_dict()


def check_fed(run: Run, hook: Optional[NoiseHook]) -> None:
    """After the adapter installed its hooks: a `ranks` probe that nothing feeds (FSDP internals
    that differ in this torch) measures nothing; say so once."""
    probe = run.noise
    if hook is None or probe is None or probe.fed:
        return
    if run.adapter.rank == 0:
        print(f"[noise] the gradient noise scale is not measured: backend={run.cfg.backend.name.value} "
              "gives no hook on each rank's gradient before its reduction here")
    hook.probe = run.noise = None


def noise_hook(run: Run) -> Optional[NoiseHook]:
    """The run's noise-scale hook (its probe on run.noise), or None when measure.noise_scale is off.
    A method the run cannot use says why once, and the result carries an empty estimate."""
    cfg, adapter = run.cfg, run.adapter
    if not cfg.measure.noise_scale:
        return None
    method, why = method_for(cfg, adapter.world_size)
    if method is None:
        if adapter.rank == 0:
            print(f"[noise] the gradient noise scale is {why}")
        return NoiseHook(None, cfg.trainer.log_every, "ranks" if adapter.world_size > 1 else "halves")
    shard = cfg.parallelism.shard_size or adapter.world_size
    big_div = adapter.world_size // shard if cfg.backend.name is BackendName.fsdp else adapter.world_size
    every = cfg.measure.noise_every or (HALVES_EVERY if method == "halves" else EVERY)
    auto = not cfg.measure.noise_every  # the cadence follows the measured cost
    if method == "halves" and cfg.mode is Mode.tune:  # a trial's short windows: a slower step is an outlier
        every, auto = 0, False  # its warmup's steps only
    run.noise = NoiseProbe(method, adapter.world_size, big_div, every, run.scaler, auto=auto, rank=adapter.rank)
    return NoiseHook(run.noise, cfg.trainer.log_every, method)
