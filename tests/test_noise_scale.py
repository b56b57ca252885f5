"""The gradient noise scale (measure/noise.py, runtime/noise.py): the estimator against a linear
regression whose gradient noise is known in closed form, and real runs (2 DDP ranks, and
gradient accumulation in one process, and halves) against an offline measurement of the same
model by the large/small-batch method."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time

import pytest
import torch

from orchestrator.app import run_job
from orchestrator.load_report import noise_line
from orchestrator.measure.noise import MAX_BLOCKS, NoiseEstimator, fieller, unbiased
from orchestrator.measure.results import JobResult, NoiseScale
from orchestrator.runtime.dist import Adapter
from orchestrator.rundir import rank_paths
from orchestrator.runtime.noise import (EVERY, HALVES_EVERY, MAX_EVERY, MIN_EVERY, MIN_TRIPLES, NOISE_BUDGET, TIMED_TRIPLES,
                                        NoiseProbe, cadence)
from orchestrator.runtime.step import Stepper
from orchestrator.runtime.loop import build_dataset, build_model, loss_fn, seed_everything, train
from orchestrator.schema import ConfigError
from orchestrator.tracking import noise_metrics

from .conftest import compose_dict


# -- the estimator against a known answer ------------------------------------------------------
def regression_truth(delta: torch.Tensor, noise_sd: float) -> tuple:
    """y = w*.x + e, x ~ N(0, I_d), e ~ N(0, s^2), loss (w.x - y)^2 / 2 at w = w* + delta: the
    per-sample gradient is (delta.x - e) x, its mean delta, and E|g|^2 = |delta|^2 (d + 2) + s^2 d,
    so |G|^2 = |delta|^2 and tr(Sigma) = |delta|^2 (d + 1) + s^2 d."""
    d, g2 = delta.numel(), float(delta @ delta)
    return g2, g2 * (d + 1) + noise_sd ** 2 * d


def regression_grad(delta: torch.Tensor, noise_sd: float, b: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(b, delta.numel(), generator=gen, dtype=torch.float64)
    e = noise_sd * torch.randn(b, generator=gen, dtype=torch.float64)
    return ((x @ delta - e)[:, None] * x).mean(0)


def test_unbiased_estimators_converge_to_the_regressions_true_noise():
    gen = torch.Generator().manual_seed(0)
    delta = 0.3 * torch.randn(8, generator=gen, dtype=torch.float64)
    noise_sd, b_small, b_big = 1.0, 4, 16
    true_g2, true_trace = regression_truth(delta, noise_sd)
    est = NoiseEstimator("halves")
    for _ in range(4000):
        small = regression_grad(delta, noise_sd, b_small, gen)
        rest = regression_grad(delta, noise_sd, b_big - b_small, gen)
        big = (b_small * small + (b_big - b_small) * rest) / b_big  # the small batch is part of the big one
        assert est.add(float(small @ small), float(big @ big), b_small, b_big)
    got = est.result()
    assert got.n == 4000 and (got.batch_small, got.batch_big, got.method) == (4, 16, "halves")
    assert got.g2 == pytest.approx(true_g2, rel=0.1)
    assert got.trace_sigma == pytest.approx(true_trace, rel=0.05)
    truth = true_trace / true_g2
    assert got.b_simple == pytest.approx(truth, rel=0.12)
    assert got.lo < truth < got.hi and got.hi / got.lo < 1.6  # the interval covers it, and is informative
    assert len(est.blocks) <= 2 * MAX_BLOCKS  # memory bounded: blocks merged


def short_runs_median(both: bool, runs: int = 300, pairs: int = 8) -> float:
    """The median B_simple of `runs` short runs of `pairs` halves steps each (those measurable), on a
    regression whose noise scale is far above the batch (late in training: |G|^2 lost in the noise
    of one batch), from the first half's norm only or from both halves'."""
    gen = torch.Generator().manual_seed(2)
    got = []
    for _ in range(runs):
        est = NoiseEstimator("halves")
        for step in range(pairs):
            first, second = (regression_grad(TINY_DELTA, 1.0, 16, gen) for _ in range(2))
            big = (first + second) / 2
            rest = float(second @ second) if both else None
            est.add(float(first @ first), float(big @ big), 16, 32, step, rest_sq=rest)
        if est.result().b_simple is not None:
            got.append(est.result().b_simple)
    return statistics.median(got)


TINY_DELTA = torch.full((64,), 0.06, dtype=torch.float64)  # |G|^2 0.23, tr(Sigma) 79: B 344 at a batch of 32


def test_a_short_run_of_halves_reads_the_noise_scale_from_both_halves():
    """A few pairs whose |G|^2 is small against one batch's noise: the ratio of means, taken where
    |G|^2's mean came out above 0, reads low (a noisy denominator that is kept only when positive
    is kept mostly when it is too large). Both halves' norms (|G|^2 = G_1.G_2) halve its noise."""
    g2, trace = regression_truth(TINY_DELTA, 1.0)
    truth = trace / g2
    assert short_runs_median(both=False) < 0.55 * truth  # the first half's norm alone: ~2x low
    assert truth / 1.5 < short_runs_median(both=True) < 1.5 * truth


def test_both_halves_by_hand():
    """|G|^2 = G_1.G_2 and tr(Sigma) = k/2 |G_1 - G_2|^2 from two halves of k samples, given the
    squared norms of the first half, of the second and of the whole."""
    g1, g2_ = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 4.0])
    big = (g1 + g2_) / 2
    est = NoiseEstimator("halves")
    assert est.add(float(g1 @ g1), float(big @ big), 8, 16, rest_sq=float(g2_ @ g2_))
    assert est.blocks[0][:2] == pytest.approx([float(g1 @ g2_), 4 * float((g1 - g2_) @ (g1 - g2_))])
    assert not est.add(1.0, 1.0, 8, 16, rest_sq=float("nan"))  # an AMP overflow in the second half


def test_the_late_estimate_follows_a_noise_scale_that_grows_as_the_model_trains():
    """A regression whose mean gradient shrinks 4x halfway (the loss falls): B_simple grows.
    The whole run's ratio of means leans on the first half; b_late reads the second half's."""
    gen = torch.Generator().manual_seed(1)
    delta = 0.5 * torch.randn(8, generator=gen, dtype=torch.float64)
    est = NoiseEstimator("halves")
    truths = []
    for step in range(0, 4000):
        d = delta if step < 2000 else delta / 2
        small = regression_grad(d, 1.0, 4, gen)
        big = (4 * small + 12 * regression_grad(d, 1.0, 12, gen)) / 16
        est.add(float(small @ small), float(big @ big), 4, 16, step)
        if step in (0, 3999):
            g2, tr = regression_truth(d, 1.0)
            truths.append(tr / g2)
    got = est.result()
    early, late = truths
    assert late > 2 * early
    assert got.b_late == pytest.approx(late, rel=0.2) and got.late_from >= 1999
    assert got.late_lo < late < got.late_hi and got.late_lo > got.hi  # its interval covers it, above the whole run's
    assert got.b_simple < 0.6 * late  # the whole run's: between the two, nearer the first half's
    assert "over the run's second half" in noise_line(got.as_dict())
    few = NoiseEstimator("halves")
    for step in (0, 1, 2, 3, 100):  # the warmup's steps and one more: one pair in the second half
        few.add(5.0, 2.0, 2, 8, step)
    assert few.result().b_simple is not None and few.result().b_late is None and few.result().late_lo is None


def test_one_pair_by_hand_and_what_is_left_out():
    # |G_small|^2 = 5 at 2 samples, |G_big|^2 = 2 at 8: |G|^2 = (16 - 10) / 6, tr = 3 / (1/2 - 1/8)
    assert unbiased(5.0, 2.0, 2, 8) == pytest.approx((1.0, 8.0))
    with pytest.raises(ValueError, match="batch_small < batch_big"):
        unbiased(1.0, 1.0, 8, 8)
    est = NoiseEstimator("accumulation")
    assert not est.add(float("inf"), 1.0, 2, 8) and not est.add(1.0, 1.0, 4, 4)  # an AMP overflow; one micro-batch
    assert est.result() == NoiseScale(method="accumulation")  # nothing estimated: all None, n 0
    est.add(5.0, 2.0, 2, 8)
    one = est.result()
    assert one.n == 1 and one.g2 == pytest.approx(1.0) and one.b_simple is None  # one step: not measurable yet


def test_not_measurable_while_the_mean_gradient_is_lost_in_the_noise():
    est = NoiseEstimator("ranks")
    est.add(5.0, 2.0, 2, 8)  # |G|^2 (16 - 10) / 6 = 1
    est.add(9.0, 0.0, 2, 8)  # |G|^2 (0 - 18) / 6 = -3: the mean is -1
    got = est.result()
    assert got.g2 is not None and got.g2 <= 0
    assert (got.b_simple, got.lo, got.hi) == (None, None, None)
    assert "not measurable yet" in noise_line(got.as_dict())


def test_fieller_interval_of_a_ratio():
    assert fieller([1.0], [1.0]) == (None, None)  # one block: no spread
    assert fieller([1.0, 2.0, 3.0], [-1.0, 1.0, 0.5]) == (None, None)  # denominator not clearly above 0
    lo, hi = fieller([10.0, 12.0, 11.0, 9.0], [1.0, 1.1, 0.9, 1.0])
    assert lo < 10.5 < hi


def test_noise_scale_record_round_trips_in_the_job_result():
    ns = NoiseScale(b_simple=100.0, lo=50.0, hi=200.0, g2=1.0, trace_sigma=100.0, n=7, method="ranks",
                    batch_small=8, batch_big=16, b_late=150.0, late_from=40, late_lo=90.0, late_hi=None,
                    every=12, extra=0.11)
    d = ns.as_dict()
    assert list(d) == ["b_simple", "lo", "hi", "g2", "trace_sigma", "n", "method", "batch_small", "batch_big",
                       "b_late", "late_from", "late_lo", "late_hi", "every", "extra"]
    older = {k: v for k, v in d.items() if k not in ("every", "extra")}  # a record without them
    assert (NoiseScale.from_dict(older).every, NoiseScale.from_dict(older).extra) == (0, None)
    assert "(one in 12 past the warmup: an estimated step costs +11% of a step, ~0.9% of the step time)" in (
        noise_line(d))
    job = JobResult.from_dict({"status": "FINISHED", "noise_scale": d})
    assert job.noise_scale == ns and job.to_dict()["noise_scale"] == d
    assert noise_metrics(JobResult(noise_scale=ns, steps=3)) == [("noise_scale", 100.0, 3), ("noise_scale_lo", 50.0, 3),
                                                             ("noise_scale_hi", 200.0, 3),
                                                             ("noise_scale_late", 150.0, 3),
                                                             ("noise_scale_late_lo", 90.0, 3)]


def test_noise_every_rejects_a_bad_value():
    from orchestrator.schema import to_config

    with pytest.raises(ConfigError, match=r"^measure.noise_every: must be an integer >= 0"):
        to_config(compose_dict(["measure.noise_every=-1"]))


# -- runs against an offline measurement -------------------------------------------------------
# a small softmax regression with teacher labels; lr so small that the weights stay where the
# offline measurement takes them (the initial ones)
WORKLOAD = ["data.args.size=2048", "data.args.features=50", "model.args.in_features=50", "trainer.lr=1e-6",
            "trainer.epochs=1", "trainer.save_model=false"]


def offline_noise_scale(cfg) -> float:
    """B_simple of the initial model over the whole dataset: the per-sample gradients' trace of
    covariance over the squared norm of their mean (torch.func, one vmap)."""
    from torch.func import functional_call, grad, vmap

    seed_everything(cfg.trainer.seed)
    model = build_model(cfg)
    ds = build_dataset(cfg)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.tensor([int(ds[i][1]) for i in range(len(ds))])
    params = {k: v.detach() for k, v in model.named_parameters()}
    criterion = loss_fn(cfg.model.loss)

    def one(p, xi, yi):
        return criterion(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per.values()], dim=1).double()
    mean = flat.mean(0)
    trace = float(((flat - mean) ** 2).sum(1).mean())
    return trace / float(mean @ mean)


def within_2x(got: dict, want: float) -> None:
    assert got["b_simple"] is not None, got
    assert want / 2 <= got["b_simple"] <= 2 * want, (got, want)


@pytest.mark.parametrize("backend", ["ddp", "fsdp", pytest.param("horovod", marks=pytest.mark.slow)])
def test_two_ranks_measure_the_noise_scale_from_their_gradients(make_cfg, tmp_path, backend):
    """Each rank's gradient before the reduction (DDP's communication hook, FSDP's unsharded
    gradients before the reduce-scatter, Horovod's allreduce as it starts) against the averaged one."""
    cfg = make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", "data.batch_size=16", *WORKLOAD)
    result = run_job(cfg, tmp_path, echo=False)
    got = result["noise_scale"]
    # 64 steps: fewer than the 32 estimated steps the ranks read their pairs at before the run's end,
    # so the cadence stays the default; the end's read times it (extra) and decides it
    estimated = [s for s in range(result["steps"]) if s < cfg.measure.warmup_steps or s % EVERY == 0]
    assert (got["method"], got["batch_small"], got["batch_big"], got["n"]) == ("ranks", 16, 32, len(estimated))
    assert got["extra"] is not None and MIN_EVERY <= got["every"] <= MAX_EVERY
    assert json.loads(rank_paths(tmp_path, 1)["result"].read_text())["noise_scale"] == got  # the ranks agree
    within_2x(got, offline_noise_scale(cfg))
    assert json.loads((tmp_path / "result.json").read_text())["noise_scale"] == got
    assert "Gradient noise scale" in (tmp_path / "load_report.md").read_text()
    from mlflow.tracking import MlflowClient

    run = MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"])
    assert run.data.metrics["noise_scale"] == pytest.approx(got["b_simple"])
    assert run.data.tags["noise_scale_method"].startswith("ranks (16 vs 32 samples")


@pytest.mark.parametrize("extra, method, small, big", [
    (["trainer.accumulation_steps=4", "data.batch_size=16", "measure.noise_every=1"], "accumulation", 16, 64),
    (["measure.noise_every=2", "data.batch_size=64"], "halves", 32, 64),
])
def test_one_process_measures_the_noise_scale(make_cfg, extra, method, small, big):
    cfg = make_cfg(*WORKLOAD, *extra)
    adapter = Adapter(cfg)
    adapter.setup()
    got = train(cfg, adapter).meter["noise_scale"]
    assert (got["method"], got["batch_small"], got["batch_big"]) == (method, small, big)
    assert got["n"] >= 16
    within_2x(got, offline_noise_scale(cfg))


def test_halves_give_the_same_update_as_the_whole_batch(make_cfg):
    """A step of two halves is the whole batch's step (each half's loss weighs by its share)."""
    digests = []
    for on in ("true", "false"):
        cfg = make_cfg(*WORKLOAD, "trainer.lr=0.1", "trainer.max_steps=6", "measure.noise_every=1",
                       "data.batch_size=33", f"measure.noise_scale={on}")
        adapter = Adapter(cfg)
        adapter.setup()
        res = train(cfg, adapter)
        digests.append({k: v.clone() for k, v in res.model.state_dict().items()})
        assert ("noise_scale" in res.meter) == (on == "true")
    for k in digests[0]:
        assert torch.allclose(digests[0][k], digests[1][k], atol=1e-6), k


def test_off_is_off(make_cfg):
    cfg = make_cfg(*WORKLOAD, "trainer.max_steps=4", "measure.noise_scale=false")
    adapter = Adapter(cfg)
    adapter.setup()
    res = train(cfg, adapter)
    assert "noise_scale" not in res.meter and math.isfinite(res.final_loss)


def test_a_tuning_trial_estimates_halves_on_its_warmup_steps_only(make_cfg):
    """A trial's windows are short: a step of two halves would stand out in one."""
    counts = {}
    for mode in ("run", "tune"):
        cfg = make_cfg(*WORKLOAD, f"mode={mode}", "measure.warmup_steps=3", "trainer.max_steps=12",
                       "measure.noise_every=4")
        adapter = Adapter(cfg)
        adapter.setup()
        counts[mode] = train(cfg, adapter).meter["noise_scale"]["n"]
    assert counts == {"run": 5, "tune": 3}  # the warmup's steps 0, 1, 2; in a run also steps 4 and 8


def test_the_probe_divides_out_weights_and_the_loss_scale():
    """AMP fp16: the gradients the probe sees are scaled by the GradScaler's scale (read when the
    step closes: the scaler updates it in place later); the first micro-batch's by its weight."""
    from types import SimpleNamespace

    from orchestrator.runtime.noise import NoiseProbe

    scaler = SimpleNamespace(_scale=torch.tensor(4.0))
    probe = NoiseProbe("accumulation", 1, 1, 1, scaler)
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[4.0, 0.0]])  # the first of 2 micro-batches: weight 1/2, scale 4
    probe.active = True
    probe.first_part(model, 8, 0.5)
    model.weight.grad = torch.tensor([[0.0, 12.0]])
    probe.end_step(model, 16)
    scaler._scale.fill_(1024.0)  # the scaler's update after the step
    probe.flush(Adapter.__new__(Adapter))
    assert probe.estimator.n == 1 and probe.estimator.batch_small == 8
    small, big = 16.0 / 0.25 / 16.0, 144.0 / 16.0  # |G_small|^2 = 4, |G_big|^2 = 9
    g2, trace = unbiased(small, big, 8, 16)
    assert probe.estimator.blocks[0][:2] == pytest.approx([g2, trace])


def test_the_probe_reads_both_halves_of_a_halves_step():
    """`halves`: the second half's gradient is the accumulated one less the first half's (kept when
    the first half closes), each over its weight and the loss scale; the pair gets both halves."""
    from types import SimpleNamespace

    from orchestrator.runtime.noise import NoiseProbe

    scaler = SimpleNamespace(_scale=torch.tensor(4.0))
    probe = NoiseProbe("halves", 1, 1, 1, scaler)
    model = torch.nn.Linear(2, 1, bias=False)
    g1, g2_ = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 4.0])  # the halves' own gradients, 8 samples each
    probe.active = True
    model.weight.grad = (4.0 * 0.5 * g1)[None]  # after the first half's backward: weight 1/2, scale 4
    probe.first_part(model, 8, 0.5)
    model.weight.grad += (4.0 * 0.5 * g2_)[None]  # the second half's backward accumulates
    probe.second_part(model, 0.5)
    probe.end_step(model, 16)
    probe.flush(Adapter.__new__(Adapter))
    assert probe.estimator.n == 1
    assert probe.estimator.blocks[0][:2] == pytest.approx([float(g1 @ g2_), 4 * float((g1 - g2_) @ (g1 - g2_))])
    assert probe.estimator.batch_small == 8 and probe.estimator.batch_big == 16


# -- the cadence (measure.noise_every=0) ---------------------------------------------------------
def test_the_cadence_holds_the_estimates_extra_time_to_the_budget():
    assert NOISE_BUDGET == 0.01
    assert cadence(1.5, 1.0, 8) == 50  # +50% of a step: one step in 50 costs 1%
    assert cadence(1.4449, 1.0, 8) == 45  # rounded up: at most the budget
    assert cadence(0.002, 0.001, 50) == 100  # twice a step's time: one in 100
    assert cadence(1.0151, 1.0, 50) == 2
    assert cadence(1.0, 1.0, 50) == cadence(0.9, 1.0, 50) == MIN_EVERY  # no dearer than a step
    assert cadence(100.0, 1.0, 8) == MAX_EVERY
    assert cadence(0.0, 1.0, 8) == 8 and cadence(1.0, 0.0, 50) == 50  # not timed yet: the default


def drive(probe: NoiseProbe, first: int, steps: int, seconds) -> list:
    """Steps 0..steps-1 as Stepper runs them (warmup to `first`): the estimated steps past the
    warmup, each timed step's `seconds(step, role)` handed to the probe (role: 'estimated',
    'after' the last estimated step, else 'other')."""
    probe.plan(first)
    estimated = []
    for step in range(steps):
        if step >= probe.next_at:
            timed = probe.begin(step)
            estimated.append(step)
        else:
            probe.active = step < first
            timed = step in (probe.before, probe.after)
        if timed:
            role = "estimated" if probe.active else "after" if step == probe.last_at + 1 else "other"
            probe.timed(step, seconds(step, role))
    return estimated


def test_one_rank_spaces_its_estimates_by_their_timed_cost():
    """A step before each estimated one, the estimated one and the one after (where part of its
    cost spills) are timed; from 3 triples on, their medians set the cadence, the next estimate
    `every` after the last."""
    probe = NoiseProbe("halves", 1, 1, HALVES_EVERY, auto=True)
    cost = {"estimated": 2.0, "after": 1.5, "other": 1.0}  # an estimated step costs 1.5 steps more: one in 150

    def seconds(step: int, role: str) -> float:
        if step == 100 and role == "estimated":
            return 50.0  # a stall: the median passes over it
        return cost[role] if step < 1000 else {"estimated": 1.25, "after": 1.0, "other": 1.0}[role]

    estimated = drive(probe, 2, 3000, seconds)
    assert estimated[:5] == [50, 100, 150, 300, 450]  # the default until 3 triples; then 150 after the last
    assert estimated[-1] - estimated[-2] == 25 and probe.every == 25  # +25% of a step from step 1000
    assert len(probe.timings) == TIMED_TRIPLES and probe.extra == pytest.approx(0.25)
    assert probe.result().every == 25 and probe.result().extra == pytest.approx(0.25)
    free = NoiseProbe("accumulation", 1, 1, EVERY, auto=True)  # estimates that cost nothing: every 2nd step
    estimated = drive(free, 5, 100, lambda step, role: 1.0)
    assert estimated[:4] == [8, 16, 24, 26] and estimated[-1] == 98 and free.every == MIN_EVERY
    assert len(free.timings) == TIMED_TRIPLES  # each step between two estimates is the one's after, the next's before
    assert free.extra == 0.0


def test_an_explicit_cadence_estimates_its_multiples_untimed():
    probe = NoiseProbe("halves", 1, 1, 4)
    assert drive(probe, 6, 30, lambda step, role: pytest.fail("timed")) == [8, 12, 16, 20, 24, 28]
    tune = NoiseProbe("halves", 1, 1, 0)  # a tuning trial's halves: the warmup only
    assert drive(tune, 3, 30, lambda step, role: pytest.fail("timed")) == []


class ThreadRanks:
    """all_reduce_sum over threads standing for ranks: each gets the element-wise sum of all."""

    def __init__(self, world: int) -> None:
        self.barrier, self.got, self.world = threading.Barrier(world), {}, world

    def adapter(self, rank: int):
        outer = self

        class One:
            def all_reduce_sum(self, values: list) -> list:
                outer.got[rank] = values
                outer.barrier.wait()
                total = [sum(v) for v in zip(*(outer.got[r] for r in range(outer.world)))]
                outer.barrier.wait()
                return total

        return One()


def ranks_flush(timings: list) -> list:
    """Two `ranks` probes, each with a pair waiting and its own timed triples, read at once after
    step 300 (the last estimated step 248)."""
    ranks = ThreadRanks(2)
    probes = [NoiseProbe("ranks", 2, 2, EVERY, auto=True, rank=r) for r in range(2)]
    for probe, triples in zip(probes, timings):
        probe.timings, probe.last_at, probe.next_at = list(triples), 248, 256
        probe.pending.append((1, 1, 0, 1.0, 1.0, None, 4, 8, 8))
        probe.norms += [torch.tensor(2.0), torch.tensor(1.0)]
    threads = [threading.Thread(target=p.flush, args=(ranks.adapter(r),)) for r, p in enumerate(probes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(p.estimator.n == 1 for p in probes)
    return probes


def test_several_ranks_decide_the_same_cadence_from_the_slowest_ranks_figures():
    """Each rank's medians ride in the pairs' all-reduce; every rank decides from the maxima."""
    probes = ranks_flush([[(1.0, 1.095, 1.0)] * 3, [(1.05, 1.2, 1.1)] * 3])  # before, estimated, after
    assert cadence(1.095, 1.0, EVERY) == 10  # rank 0's own figures
    assert [p.every for p in probes] == [cadence(1.25, 1.05, EVERY)] * 2 == [20, 20]  # rank 1's: 1.2 + 1.1 - 1.05
    assert probes[0].extra == probes[1].extra == pytest.approx(0.2 / 1.05)
    assert [p.next_at for p in probes] == [268, 268]  # 20 after the last (the step loop takes the next past it)
    # a rank with fewer than MIN_TRIPLES timed triples: nobody decides (the default stays, on both)
    probes = ranks_flush([[(1.0, 2.0, 1.0)] * 3, [(1.0, 2.0, 1.0)] * (MIN_TRIPLES - 1)])
    assert [(p.every, p.extra, p.next_at) for p in probes] == [(EVERY, None, 256)] * 2
    # a rank whose step before each estimated one was slowed (a busy host) more than the two after it
    # took: timed all the same, no extra, the densest cadence (its medians would otherwise read < 0)
    probes = ranks_flush([[(1.0, 1.0, 1.0)] * 3, [(3.0, 1.0, 1.0)] * 3])
    assert [(p.every, p.extra) for p in probes] == [(MIN_EVERY, 0.0)] * 2


def slowed_steps(monkeypatch, ordinary_s: float, estimated_s: float) -> None:
    """Every step past the first sleeps `ordinary_s` in its update; an estimated one `estimated_s`."""
    real = Stepper.update

    def update(self: Stepper, run, samples: int) -> None:
        time.sleep(estimated_s if self.noise is not None and self.noise.active else ordinary_s)
        real(self, run, samples)

    monkeypatch.setattr(Stepper, "update", update)


def run_halves(make_cfg, steps: int, *extra: str) -> dict:
    cfg = make_cfg(*WORKLOAD, "measure.warmup_steps=2", f"trainer.max_steps={steps}", "trainer.epochs=20",
                   "trainer.log_every=50", *extra)
    adapter = Adapter(cfg)
    adapter.setup()
    return train(cfg, adapter).meter["noise_scale"]


def test_expensive_estimated_steps_are_spaced_to_cost_about_the_budget(make_cfg, monkeypatch):
    """Estimated steps that take 5 ms more than a ~5 ms step: one in ~100 holds them to ~1% (a
    busy host's sleeps overshoot: the measured extra may read half or 1.6x the true one)."""
    slowed_steps(monkeypatch, 0.005, 0.010)
    got = run_halves(make_cfg, 420)
    assert got["method"] == "halves" and got["extra"] == pytest.approx(1.0, abs=0.6)
    assert 40 <= got["every"] <= 200
    assert got["extra"] / got["every"] == pytest.approx(NOISE_BUDGET, rel=0.3)
    # the warmup's 2, then every 50th until 3 are timed (50, 100, 150), then one in 40-200 to step 419
    assert 2 + 3 + 1 <= got["n"] <= 2 + 3 + 7, got


def test_estimated_steps_that_cost_nothing_get_the_densest_cadence(make_cfg, monkeypatch):
    """Estimated steps no dearer than the others (their sleep 6 ms shorter covers their own work,
    and a busy host's hiccups in the medians of the timed steps)."""
    slowed_steps(monkeypatch, 0.008, 0.002)
    got = run_halves(make_cfg, 200)
    assert (got["every"], got["extra"]) == (MIN_EVERY, 0.0)
    assert got["n"] >= 2 + 3 + 20  # every 2nd step from step 152 (24 of them)


def test_an_explicit_noise_every_is_kept_and_not_timed(make_cfg, monkeypatch):
    slowed_steps(monkeypatch, 0.0, 0.010)
    got = run_halves(make_cfg, 60, "measure.noise_every=4")
    assert (got["every"], got["extra"]) == (4, None)
    assert got["n"] == len([s for s in range(60) if s < 2 or s % 4 == 0])


@pytest.mark.slow  # 6 s; the ranks' agreement is test_several_ranks_decide_..., both ranks' records test_two_ranks_measure_...
def test_two_ranks_agree_on_the_cadence_they_decide_mid_run(make_cfg, tmp_path):
    """320 steps: the ranks read 32 estimated steps (with the cadence's figures) before the end, and
    decide; the run ends (a cadence that differed between ranks would hang their reads) with the
    same record on both."""
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2", "data.batch_size=16", *WORKLOAD,
                   "trainer.epochs=5")
    result = run_job(cfg, tmp_path, echo=False)
    got = result["noise_scale"]
    assert result["steps"] == 320 and got["extra"] is not None and MIN_EVERY <= got["every"] <= MAX_EVERY
    assert json.loads(rank_paths(tmp_path, 1)["result"].read_text())["noise_scale"] == got
    assert got["n"] >= 32  # read mid-run: the warmup's step 0 and every 8th to step 248, then at its cadence
