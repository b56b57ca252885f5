"""The gradient noise scale of a run (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A), estimated from pairs of squared gradient norms at two batch sizes.

A gradient averaged over B samples has E|G_B|^2 = |G|^2 + tr(Sigma)/B, where G is the true
gradient and Sigma the per-sample gradient covariance. Two batch sizes (B_small < B_big) of the
same step give unbiased estimates of both:

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

Each step's pair is very noisy; the run's B_simple = tr(Sigma) / |G|^2 is the ratio of their means
over the steps estimated, and its 95% interval is Fieller's for a ratio of means, from the means of
consecutive blocks of steps (so a noise scale that drifts as the model trains widens it). The noise
scale grows as the loss falls (|G|^2 shrinks), so the whole run's ratio leans on its first steps;
`b_late` is the same ratio over the steps of the run's second half (by step number), where they
hold MIN_LATE pairs: the noise scale the job trains at now. Pure arithmetic on floats: the ranks'
runtime (runtime/noise.py) measures the norms."""

from __future__ import annotations

import math
import statistics
from typing import List, Optional, Tuple

from .results import NoiseScale
from .stats import t95

MAX_BLOCKS = 32  # the interval's blocks of consecutive steps: at most 2x this many are kept
MIN_STEPS = 2  # fewer steps estimated: no B_simple (one pair says next to nothing, and has no interval)
MIN_LATE = 4  # pairs in the run's second half needed for b_late


def unbiased(small_sq: float, big_sq: float, b_small: float, b_big: float) -> Tuple[float, float]:
    """(|G|^2, tr(Sigma)) of one pair: squared norms of the gradient averaged over `b_small` and
    over `b_big` samples of the same step. Either may come out negative (a noisy pair)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"noise scale: needs 0 < batch_small < batch_big, got {b_small} and {b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def both_parts(first_sq: float, rest_sq: float, big_sq: float, b_first: float, b_big: float) -> Tuple[float, float]:
    """(|G|^2, tr(Sigma)) of a big batch split in two disjoint parts (b_first and b_big - b_first
    samples) whose squared norms are both known: the mean of the two parts' `unbiased` estimates.
    With equal parts |G|^2 = G_1.G_2 and tr(Sigma) = b/2 |G_1 - G_2|^2: the parts' own norms,
    which carry one batch's noise, cancel (one part's alone leaves (|G_2|^2 - |G_1|^2) / 2 in
    |G|^2's estimate: zero mean, but several times |G|^2 where the noise scale is far above the batch)."""
    g2_a, trace_a = unbiased(first_sq, big_sq, b_first, b_big)
    g2_b, trace_b = unbiased(rest_sq, big_sq, b_big - b_first, b_big)
    return (g2_a + g2_b) / 2, (trace_a + trace_b) / 2


def fieller(num: List[float], den: List[float]) -> Tuple[Optional[float], Optional[float]]:
    """95% interval of mean(num) / mean(den) from paired samples (Fieller's theorem); (None, None)
    with fewer than 2 pairs or where the denominator's mean is not clearly above 0 (unbounded)."""
    k = len(num)
    if k < 2:
        return None, None
    n_bar, d_bar = statistics.fmean(num), statistics.fmean(den)
    v_n, v_d = statistics.variance(num) / k, statistics.variance(den) / k
    cov = sum((a - n_bar) * (b - d_bar) for a, b in zip(num, den)) / (k - 1) / k
    t = t95(k - 1)
    if d_bar <= 0 or t * t * v_d >= d_bar * d_bar:
        return None, None
    r = n_bar / d_bar
    g = t * t * v_d / (d_bar * d_bar)
    disc = v_n - 2 * r * cov + r * r * v_d - g * (v_n - (cov * cov / v_d if v_d > 0 else 0.0))
    half = t / d_bar * math.sqrt(max(disc, 0.0))
    centre = r - (g * cov / v_d if v_d > 0 else 0.0)
    return (centre - half) / (1 - g), (centre + half) / (1 - g)


class NoiseEstimator:
    """Accumulates the per-step estimates of a run in blocks of consecutive steps (each block the
    sums of |G|^2 and tr(Sigma) over its steps); when there are more than 2 x MAX_BLOCKS blocks,
    neighbours merge and the block doubles. Memory stays bounded however long the run."""

    def __init__(self, method: str, batch_small: int = 0, batch_big: int = 0) -> None:
        self.method, self.batch_small, self.batch_big = method, batch_small, batch_big
        self.blocks: List[List[float]] = []  # [sum |G|^2, sum tr(Sigma), steps, first step number]
        self.block_steps = 1
        self.n = 0
        self.last_step = 0

    def add(self, small_sq: float, big_sq: float, b_small: float, b_big: float, step: int = 0,
            rest_sq: Optional[float] = None) -> bool:
        """One step's pair (`step`: its number in the run); False (left out) when a norm is not finite (an AMP step that overflowed)
        or the two batch sizes are equal (the epoch's last step of one micro-batch). `rest_sq`: where
        known, the squared norm of the gradient over the big batch's other b_big - b_small samples
        (`halves`' second half): both parts' estimates are averaged (see `both_parts`)."""
        norms = (small_sq, big_sq) if rest_sq is None else (small_sq, big_sq, rest_sq)
        if not all(math.isfinite(v) for v in norms) or not 0 < b_small < b_big:
            return False
        g2, trace = (unbiased(small_sq, big_sq, b_small, b_big) if rest_sq is None
                     else both_parts(small_sq, rest_sq, big_sq, b_small, b_big))
        if not self.blocks or self.blocks[-1][2] >= self.block_steps:
            self.blocks.append([0.0, 0.0, 0, step])
        last = self.blocks[-1]
        last[0], last[1], last[2] = last[0] + g2, last[1] + trace, last[2] + 1
        self.n += 1
        self.last_step = step
        if not self.batch_small:
            self.batch_small, self.batch_big = int(b_small), int(b_big)
        if len(self.blocks) > 2 * MAX_BLOCKS:
            pairs = zip(self.blocks[0::2], self.blocks[1::2])
            self.blocks = [[a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3]] for a, b in pairs]
            self.block_steps *= 2
        return True

    def result(self) -> NoiseScale:
        """The run's estimate: B_simple (None while |G|^2's mean is not above 0, or fewer than
        MIN_STEPS steps were estimated: not measurable yet), its interval (None where unbounded),
        the means of |G|^2 and tr(Sigma)."""
        out = NoiseScale(method=self.method, n=self.n, batch_small=self.batch_small, batch_big=self.batch_big)
        if not self.n:
            return out
        out.g2 = sum(b[0] for b in self.blocks) / self.n
        out.trace_sigma = sum(b[1] for b in self.blocks) / self.n
        if out.g2 <= 0 or self.n < MIN_STEPS:
            return out
        out.b_simple = out.trace_sigma / out.g2
        full = [b for b in self.blocks if b[2] == self.block_steps] or self.blocks
        lo, hi = fieller([b[1] / b[2] for b in full], [b[0] / b[2] for b in full])
        out.lo, out.hi = (None if lo is None else max(lo, 0.0)), hi
        out.b_late, out.late_from, out.late_lo, out.late_hi = self.late()
        return out

    def late(self) -> Tuple[Optional[float], int, Optional[float], Optional[float]]:
        """(B_simple over the blocks that start in the second half of the run's steps, the first step
        they cover, its 95% interval's ends as the whole run's, None where unbounded); (None, 0,
        None, None) with fewer than MIN_LATE pairs there or |G|^2's mean not above 0."""
        half = self.last_step / 2
        late = [b for b in self.blocks if b[3] >= half and b[3] > 0]
        n = sum(b[2] for b in late)
        g2 = sum(b[0] for b in late)
        if n < MIN_LATE or g2 <= 0:
            return None, 0, None, None
        lo, hi = fieller([b[1] / b[2] for b in late], [b[0] / b[2] for b in late])
        return sum(b[1] for b in late) / g2, int(late[0][3]), (None if lo is None else max(lo, 0.0)), hi


def efficiency(m: float, m0: float, b_noise: Optional[float]) -> float:
    """E(M) = (B + M0) / (B + M): what a sample at global batch `m` >= `m0` is worth against one at
    `m0` (B the gradient noise scale; Pollux's statistical efficiency). Without a noise scale, the
    worst case: a larger batch buys nothing (B = 0: M0/M). A batch below the user's counts 1, as in
    Pollux, whose batch never goes below the user's: the formula's gain there rests wholly on B, and
    a B measured early in training (a trial's) is below the B the job trains at later."""
    if m <= m0:
        return 1.0
    if b_noise is None:
        return m0 / m
    b = max(0.0, float(b_noise))
    return (b + m0) / (b + m)
