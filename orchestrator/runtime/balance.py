"""`parallelism.balance=speed`: each rank's share of the global batch set by its measured speed.

With an even split every step waits for the slowest rank. Here the global micro-batch (batch_size x
world size) is split by the ranks' measured work per sample, so they finish together, and the math
stays that of the even split:

- `ShareSampler` (a batch sampler) cuts each epoch's order into the same global micro-batches as the
  even split's `DistributedSampler` + `DataLoader` (same permutation of seed + epoch, same padding or
  truncation), and hands rank r the r-th contiguous piece of each, sized by the current shares. Every
  sample is in exactly one rank's piece, in an order set by the seed and the shares.
- Each rank's loss is weighted by `weight()` = world x its share of that global micro-batch. The
  adapters average gradients over ranks (DDP's all-reduce, Horovod's Average, and any adapter that
  averages, such as FSDP's reduce-scatter), so the average of the weighted gradients is their sum
  weighted by share: the even split's update over the same samples, up to float order.
- `Balancer` measures, per closed window after warmup, each rank's own work (window time minus its
  exposed communication wait, as the load report's imbalance) and samples; one small all-reduce
  every MIN_WINDOWS windows (once the shares settled, every so many as keep it under EXCHANGE_BUDGET
  of the time) carries them, so every rank decides the same. When the 95% interval of some rank's
  called-for / current share over the last windows lies wholly outside 1 +-
  `TOLERANCE` (a drift beyond the tolerance *and* the window-to-window noise,
  +-15-30% on a busy CPU), the shares are set from the pooled speeds, from the next global
  micro-batch no rank has drawn yet (workers draw ahead): each is split one way on every rank.

An adapter provides `rank`, `world_size`, `all_reduce_sum` and gradients averaged over ranks (DDP
and Horovod do; an FSDP adapter gets balancing through the same hooks).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils.data import Sampler

from ..measure.stats import estimate

POOL_WINDOWS = 30  # the windows at the current shares a decision rests on (the latest; more when exchanged at once)
MIN_WINDOWS = 3  # ... at least: one window says nothing about its noise
EXCHANGE_BUDGET = 0.005  # the ranks exchange their figures every few windows, so that this costs <= 0.5% of the time
MAX_EVERY = 50  # ... but at least every this many windows
TOLERANCE = 0.1  # re-balance when the shares the speeds call for differ from the current ones by more (relative)


def split(total: int, weights: Sequence[float]) -> List[int]:
    """`total` samples over the ranks in proportion to `weights`: whole samples, at least one each,
    largest remainders first (ties to the lower rank)."""
    n = len(weights)
    if total < n:
        raise ValueError(f"cannot split {total} samples over {n} ranks with at least one each")
    s = float(sum(weights))
    raw = [total * w / s for w in weights] if s > 0 else [total / n] * n
    sizes = [max(1, math.floor(r)) for r in raw]
    while sum(sizes) > total:  # the floor of 1 can overshoot: take from the most over-served
        i = max((i for i in range(n) if sizes[i] > 1), key=lambda i: (sizes[i] - raw[i], -i))
        sizes[i] -= 1
    while sum(sizes) < total:
        i = max(range(n), key=lambda i: (raw[i] - sizes[i], -i))
        sizes[i] += 1
    return sizes


class ShareSampler(Sampler[List[int]]):
    """Batch sampler of one rank: its piece of every global micro-batch (see the module's doc).
    `sizes` are the ranks' micro-batch sizes (summing to batch_size x world); `set_sizes` changes
    them from a given micro-batch of the epoch on; a new epoch starts with the latest."""

    def __init__(self, n: int, rank: int, world: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                 sizes: Optional[Sequence[int]] = None) -> None:
        self.n, self.rank, self.world = n, rank, world
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.global_batch = batch_size * world
        self.epoch = 0
        # DistributedSampler's shard arithmetic, then the DataLoader's batching of each shard
        per_rank = math.ceil((n - world) / world) if drop_last and n % world else math.ceil(n / world)
        self.total = per_rank * world
        self.batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        self.sizes = list(sizes) if sizes is not None else split(self.global_batch, [1.0] * world)
        self._check(self.sizes)
        self.schedule: List[tuple] = [(0, self.sizes)]  # (first micro-batch of the epoch, sizes)
        self.issued = 0  # micro-batches of this epoch handed out so far

    def _check(self, sizes: Sequence[int]) -> None:
        if len(sizes) != self.world or sum(sizes) != self.global_batch or min(sizes) < 1:
            raise ValueError(f"shares {list(sizes)} do not split a global batch of {self.global_batch} over "
                             f"{self.world} ranks (one sample or more each)")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_sizes(self, sizes: Sequence[int], from_batch: int) -> None:
        """Use `sizes` from micro-batch `from_batch` of this epoch on (and for later epochs). No
        rank may have drawn that micro-batch yet: the caller passes the most any rank drew."""
        self._check(sizes)
        if from_batch < self.issued:
            raise RuntimeError(f"shares changed from micro-batch {from_batch}, but {self.issued} were drawn already")
        self.sizes = list(sizes)
        self.schedule.append((from_batch, self.sizes))

    def __len__(self) -> int:
        return self.batches

    def order(self) -> List[int]:
        """The epoch's order, padded or truncated: DistributedSampler's recipe, before sharding."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        if not self.drop_last:
            pad = self.total - len(idx)
            idx += (idx * math.ceil(pad / len(idx)))[:pad] if pad > 0 else []
        return idx[:self.total]

    def global_size(self, k: int) -> int:
        """Samples in global micro-batch k of the epoch (only the last one can be short)."""
        return min(self.global_batch, self.total - k * self.global_batch)

    def sizes_at(self, k: int) -> List[int]:
        """The ranks' pieces of global micro-batch k."""
        sizes = next(s for first, s in reversed(self.schedule) if first <= k)
        size = self.global_size(k)
        return sizes if size == self.global_batch else split(size, sizes)

    def __iter__(self):
        self.schedule, self.issued = [(0, self.sizes)], 0  # an epoch starts with the latest shares
        idx, g = self.order(), self.global_batch
        for k in range(self.batches):
            sizes = self.sizes_at(k)
            start = k * g + sum(sizes[:self.rank])
            self.issued = k + 1
            yield idx[start:start + sizes[self.rank]]

    def weight(self, n_local: int, k: int) -> float:
        """The factor on this rank's mean loss for global micro-batch k of `n_local` samples here:
        world x its share of the micro-batch (1.0 exactly for an even split)."""
        return self.world * n_local / self.global_size(k)


class Balancer:
    """Decides the shares from measured speeds (collectively: every rank the same); keeps the
    history, the speeds and the step times the load report shows."""

    def __init__(self, sampler: ShareSampler, adapter: Any, tolerance: float, step: int = 0,
                 resumed: Optional[Sequence[int]] = None) -> None:
        self.sampler, self.adapter, self.tolerance = sampler, adapter, tolerance
        self.world, self.rank = adapter.world_size, adapter.rank
        if resumed is not None:
            sampler.set_sizes(resumed, 0)
        self.history: List[Dict[str, Any]] = [{"step": step, "sizes": list(sampler.sizes),
                                               "why": "resumed from the checkpoint" if resumed else "even split"}]
        self.recent: List[Dict[str, Any]] = []  # measured windows at the current shares
        self.step_times: List[List[float]] = [[]]  # job step time per window, per period of shares
        self.speeds: Optional[List[float]] = None
        self.spent_s = 0.0  # time in on_window (the all-reduce and the decision): its own cost
        self.pending: List[tuple] = []  # this rank's windows since the last exchange: (own s, samples, step s)
        self.every = MIN_WINDOWS  # windows between exchanges
        self.last_cost_s = 0.0  # what this rank's last exchange took

    @property
    def shares(self) -> List[float]:
        return [s / self.sampler.global_batch for s in self.sampler.sizes]

    def on_window(self, wall_s: float, comm_s: float, samples: int, steps: int, step: int) -> bool:
        """A full measured window closed (every rank at the same step); True when the shares changed."""
        t0 = time.perf_counter()
        try:
            self.pending.append((wall_s - comm_s, float(samples), wall_s / steps))
            return self._exchange(step) if len(self.pending) >= self.every else False
        finally:
            self.spent_s += time.perf_counter() - t0

    def _exchange(self, step: int) -> bool:
        """One all-reduce of the windows since the last one (and what the last one cost, and the
        micro-batches drawn), then the decision, the same on every rank."""
        w, r, n = self.world, self.rank, len(self.pending)
        vec = [0.0] * ((3 * n + 2) * w)
        for j, figures in enumerate(self.pending):
            for f, value in enumerate(figures):
                vec[(3 * j + f) * w + r] = value
        vec[3 * n * w + r], vec[(3 * n + 1) * w + r] = self.last_cost_s, self.sampler.issued
        t0 = time.perf_counter()
        tot = self.adapter.all_reduce_sum(vec)
        self.last_cost_s = time.perf_counter() - t0
        g, sizes = self.sampler.global_batch, self.sampler.sizes
        busy = []  # the ranks' mean own time per window: what the exchange's cost is weighed against
        for j in range(n):
            own, done, step_s = (tot[(3 * j + f) * w:(3 * j + f + 1) * w] for f in range(3))
            self.step_times[-1].append(max(step_s))
            busy.append(sum(own) / w)
            if min(own) > 0:
                speeds = [k / t for k, t in zip(done, own)]  # per window and rank: called-for share / current
                self.recent.append({"own": own, "samples": done,
                                    "drift": [g * v / sum(speeds) / s for v, s in zip(speeds, sizes)]})
        self.pending = []
        del self.recent[:-max(POOL_WINDOWS, MAX_EVERY)]  # a long run keeps what a decision can use
        # settled, the next exchange comes after enough windows that it costs <= EXCHANGE_BUDGET of
        # the time; after a change, or while undecided, after MIN_WINDOWS more
        cost = max(tot[3 * n * w:(3 * n + 1) * w])
        self.every = MIN_WINDOWS
        spaced = max(MIN_WINDOWS, min(MAX_EVERY, math.ceil(cost / (EXCHANGE_BUDGET * statistics.fmean(busy)))))
        pooled = self.recent[-max(POOL_WINDOWS, n):]
        if not pooled:
            return False
        self.speeds = [sum(x["samples"][i] for x in pooled) / sum(x["own"][i] for x in pooled) for i in range(w)]
        if len(pooled) < MIN_WINDOWS:
            return False
        tol = self.tolerance
        intervals = [estimate([x["drift"][i] for x in pooled]).interval for i in range(w)]
        drifted = [i for i, iv in enumerate(intervals) if iv and (iv[0] > 1 + tol or iv[1] < 1 - tol)]
        new = split(g, self.speeds)
        if not drifted or new == sizes:
            # settled: every rank's interval within the tolerance (or no whole-sample split does better)
            if drifted or all(iv and 1 - tol <= iv[0] and iv[1] <= 1 + tol for iv in intervals):
                self.every = spaced
            return False
        self.sampler.set_sizes(new, int(max(tot[(3 * n + 1) * w:])))  # the next micro-batch nobody drew yet
        worst = max(drifted, key=lambda i: abs(sum(intervals[i]) / 2 - 1))
        lo, hi = intervals[worst]
        self.history.append({"step": step, "sizes": new,
                             "why": f"rank {worst}'s called-for share / current {lo:.2f}..{hi:.2f} (95%) is outside "
                                    f"1 +- {tol:g}", "speeds": [round(v, 3) for v in self.speeds]})
        self.recent = []
        self.step_times.append([])
        return True

    def summary(self) -> Dict[str, Any]:
        """result.json's `balance`: shares, speeds (samples/s of own work, per rank), each rank's
        own work per window at the current shares, and the job's step time at the first shares
        (the even split, unless resumed) vs the current ones."""
        now = statistics.median(self.step_times[-1]) if self.step_times[-1] else None
        first = self.step_times[0]
        even, source = None, None
        if self.history[0]["why"] == "even split" and first:
            even, source = statistics.median(first), "measured"
        elif now is not None and self.speeds:  # the slowest rank's own work at each split, scaled
            g = self.sampler.global_batch
            slowest = lambda sizes: max(s / v for s, v in zip(sizes, self.speeds))  # noqa: E731
            even, source = now * slowest([g / self.world] * self.world) / slowest(self.sampler.sizes), "predicted"
        cur = self.recent  # the exchanged windows at the current shares (a change starts them afresh)
        return {
            "mode": "speed", "tolerance": self.tolerance, "global_batch": self.sampler.global_batch,
            "sizes": list(self.sampler.sizes), "shares": self.shares, "speeds": self.speeds,
            # each rank's own work (window time less its communication wait) per window at these shares:
            # what imbalance is judged on once balanced (windows at the earlier split are not these ranks' load)
            "own_window_s": [statistics.fmean(x["own"][i] for x in cur) for i in range(self.world)] if cur else None,
            "windows_at_shares": len(cur),
            "step_time_s": now, "even_step_time_s": even, "even_step_time_source": source,
            "speedup": even / now if even and now else None,
            "changes": len(self.history) - 1, "history": self.history, "spent_s": self.spent_s,
        }
