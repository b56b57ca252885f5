"""The meter is honest: an injected read latency shows up as data wait of the right size, the
shares tile the step, and warmup is excluded."""

from __future__ import annotations

import math
import time

import pytest
import torch

from orchestrator.runtime.dist import Adapter
from orchestrator.measure.phases import COMM, COMPUTE, DATA, H2D, OPTIMIZER, PHASES
from orchestrator.runtime.meter import StepMeter
from orchestrator.runtime.loop import train
from orchestrator.schema import to_config

from .conftest import TINY, compose_dict

LAT_MS, BATCH = 3.0, 4


def run(cfg):
    a = Adapter(cfg)
    a.setup()
    return train(cfg, a).meter


@pytest.fixture(scope="module")
def latency_runs():
    def make(*overrides):
        return to_config(compose_dict(TINY + ["tracking.enabled=false", *overrides]))

    common = ["experiment=transformer_lm", "data.args.size=256", f"data.batch_size={BATCH}", "trainer.max_steps=26",
              "measure.warmup_steps=2", "measure.window_steps=8"]
    return {
        "slow": run(make(*common, f"sim.read_latency_ms={LAT_MS}")),
        "fast": run(make(*common, "sim.read_latency_ms=0")),
        "workers": run(make(*common, f"sim.read_latency_ms={LAT_MS}", "data.num_workers=2",
                            "data.persistent_workers=true")),
    }


def test_injected_latency_is_data_wait(latency_runs):
    slow = latency_runs["slow"]
    expected_s = BATCH * LAT_MS / 1000  # num_workers=0: the loop itself sleeps through every read
    assert 0.95 * expected_s <= slow["phase_s"]["data"] <= 1.5 * expected_s + 0.002, slow["phase_s"]
    # the share is that wait over the measured step, and it lands near the expected share
    expected_share = expected_s / slow["step_time_s"]
    assert slow["data_wait_frac"] == pytest.approx(expected_share, abs=0.08)
    assert slow["utilization_source"] == "cpu-time"


@pytest.mark.perf
def test_no_latency_no_wait(latency_runs):
    fast, slow = latency_runs["fast"], latency_runs["slow"]
    # the wait's share depends on the step time (the transformer's step is 30-130 ms on 2 cores): halved at least
    assert fast["data_wait_frac"] < 0.5 * slow["data_wait_frac"]
    assert fast["utilization"] > slow["utilization"]
    assert fast["phase_s"]["data"] < 0.5 * slow["phase_s"]["data"]


@pytest.mark.perf
def test_workers_hide_latency(latency_runs):
    assert latency_runs["workers"]["phase_s"]["data"] < 0.75 * latency_runs["slow"]["phase_s"]["data"]


def test_shares_tile_the_step(latency_runs):
    for m in latency_runs.values():
        per_step = sum(m["phase_s"].values())
        assert per_step == pytest.approx(m["step_time_s"], rel=0.01)
        for p in PHASES:  # each share is its phase's part of the step's wall time
            share = m[f"{p}_frac" if p != "data" else "data_wait_frac"]
            assert share == pytest.approx(m["phase_s"][p] / m["step_time_s"], abs=0.01), p
        assert 0.0 <= m["utilization"] <= 1.0
        assert m["peak_mem_mb"] > 0 and m["mem_source"] == "rss"


def test_meter_windows_exclude_warmup():
    m = StepMeter(torch.device("cpu"), window_steps=3, warmup_steps=2)
    m.start()
    for i in range(11):
        time.sleep(0.02 if i < 2 else 0.001)  # slow warmup steps must not count
        m.mark(DATA)
        m.mark(H2D)
        m.mark(COMPUTE)
        m.mark(COMM)
        m.mark(OPTIMIZER)
        m.end_step(samples=4)
    m.flush()
    s = m.summary()
    assert len(m.warmup_windows) == 1
    assert [w.steps for w in m.windows] == [3, 3, 3]
    assert s["measured_steps"] == 9 and s["warmup_excluded"]
    assert s["phase_s"]["data"] < 0.01
    assert s["throughput"] == pytest.approx(4 / s["step_time_s"], rel=0.2)


def test_ddp_hook_splits_backward_into_compute_and_comm():
    m = StepMeter(torch.device("cpu"), window_steps=1, warmup_steps=0)
    m.start()
    m.mark(DATA)
    time.sleep(0.02)  # backward computing
    m.comm_hook_fired()  # last bucket handed to the all-reduce
    time.sleep(0.03)  # waiting for it
    m.mark(COMPUTE)
    m.mark(OPTIMIZER)
    m.end_step(samples=1)
    s = m.summary()
    assert s["phase_s"]["compute"] == pytest.approx(0.02, abs=0.01)
    assert s["phase_s"]["comm"] == pytest.approx(0.03, abs=0.01)


def _steps(m, n, sleep_s=0.0):
    for _ in range(n):
        if sleep_s:
            time.sleep(sleep_s)
        m.mark(DATA)
        m.mark(COMPUTE)
        m.mark(OPTIMIZER)
        m.end_step(samples=4)


def test_warmup_reads_the_loader_queue_and_rewarms_after_a_restart():
    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, queue=3)
    m.start()
    _steps(m, 4)  # 1 warmup step asked for, but 3 pre-filled micro-batches + 1 must be read first
    assert len(m.warmup_windows) == 1 and m.warmup_windows[0].steps == 4 and not m.windows
    _steps(m, 3)  # one window of 2, one step into the next
    partial = m.rewarm("loader")  # a new loader (loader_autotune): its queue is full again
    assert partial is not None and partial.partial and partial.steps == 1
    _steps(m, 4)
    assert len(m.warmup_windows) == 2 and m.warmup_windows[1].steps == 4
    _steps(m, 2)
    m.close()
    s = m.summary()
    assert [w.steps for w in m.windows] == [2, 1, 2]
    assert s["estimate"]["windows"] == 2  # the partial window is left out of the estimate
    w = s["warmup"]
    assert w["steps"] == 4 and w["queue_micro_batches"] == 3 and "queue" in w["why"]
    assert w["rewarmed"] == [{"why": "loader", "from_step": 7, "steps": 4}]


def test_estimate_and_stop_rule():
    from orchestrator.measure.stats import StopRule, estimate

    e = estimate([100.0, 110.0, 90.0, 100.0])
    assert e.mean == pytest.approx(100.0) and e.windows == 4
    assert e.rel_se == pytest.approx(8.165 / 2 / 100, rel=1e-3)
    lo, hi = e.interval
    assert lo < 100 < hi and hi - 100 == pytest.approx(100 - lo)
    rule = StopRule(rel_precision=0.05, min_s=1.0, max_s=10.0)
    assert [rule.add(t, 0.3) for t in (100, 101, 99, 100)] == [None, None, None, "precision"]  # 4 windows, 1.2 s
    # a 4.1% standard error over 4 windows: within 5%, but its t interval (+-13%) is not within 1.96 x 5%
    few = StopRule(rel_precision=0.05)
    assert [few.add(t, 0.1) for t in (100, 110, 90, 100)] == [None] * 4
    assert [few.add(t, 0.1) for t in (110, 90, 100, 100)][-1] == "precision"  # 8 windows: +-6.8%
    # weighted by wall time: all samples / all time (300/s for 1 s and 100/s for 3 s -> 150/s)
    w = estimate([300.0, 100.0], 4.0, weights=[1.0, 3.0])
    assert w.mean == pytest.approx(150.0) and estimate([300.0, 100.0]).mean == pytest.approx(200.0)
    noisy = StopRule(rel_precision=0.01, min_s=0.0, max_s=1.0)
    assert [noisy.add(t, 0.3) for t in (50, 150, 60, 140)][-1] == "max_measure_s"
    # one window longer than the cap (a loader round of a large batch) is not the end: a second
    # gives the figure a spread, so it has an interval and cannot pass for exact
    long = StopRule(rel_precision=0.05, min_s=1.0, max_s=2.0)
    assert [long.add(t, 7.0) for t in (100, 130)] == [None, "max_measure_s"]
    assert estimate(long.throughputs, weights=long.walls).interval is not None


def test_windows_span_whole_rounds_of_a_bursty_loader():
    # 4 workers fed together deliver together: one step in 4 waits a cycle (40 ms), the next three
    # find their batches ready. Windows of 3 steps would read 0 or 1 cycles; whole rounds read 1.
    from orchestrator.measure.plan import loader_round

    m = StepMeter(torch.device("cpu"), window_steps=3, warmup_steps=1, round_steps=4)
    m.start()
    for i in range(1 + 4 * 6):
        if i % 4 == 1:
            time.sleep(0.04)
        m.mark(DATA)
        m.mark(COMPUTE)
        m.end_step(samples=4)
    m.flush()
    assert [w.steps for w in m.windows] == [4] * 6
    assert m.summary()["estimate"]["mean"] == pytest.approx(16 / 0.04, rel=0.15)
    m.resize(step_time_s=0.01, window_s=0.05, at_most=2)  # 5 steps at most 2 -> one round
    assert m.whole_rounds(5) == 8 and m._window_len == 4
    cfg = to_config(compose_dict(TINY + ["data.num_workers=4", "trainer.accumulation_steps=2"]))
    assert loader_round(cfg) == 2  # 2 steps of 2 micro-batches hand over one batch from each of 4 workers


@pytest.mark.perf
def test_figures_are_those_of_the_measured_time_not_of_the_median_window():
    # A bursty loader: windows alternate between batches ready (20 ms compute a step) and waiting
    # (60 ms for data, then 20 ms compute). 3 ready windows of 5: a median reads utilization 1 and no
    # data wait; over the measured time the device is busy 200 of 440 ms and waits 240. The compute
    # spins (utilization on CPU counts the CPU time the training process got, one thread here).
    def spin(s: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < s:
            pass

    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1)
    m.threads = 1
    m.start()
    _steps(m, 1)  # warmup
    for k in range(5):
        for _ in range(2):
            if k % 2:
                time.sleep(0.06)
            m.mark(DATA)
            spin(0.02)
            m.mark(COMPUTE)
            m.mark(OPTIMIZER)
            m.end_step(samples=4)
    m.flush()
    s = m.summary()
    assert [w.steps for w in m.windows] == [2] * 5
    # utilization: the CPU the loop got over the measured time (a loaded machine gives the spin
    # less than a whole core, so compare with what the windows recorded, not with 200/440)
    got = sum(w.busy_cpu_s for w in m.windows) / sum(w.wall_s for w in m.windows)
    assert s["utilization"] == pytest.approx(got, rel=0.02)
    ready = sorted(w.utilization for w in m.windows)[2]  # the median window: a ready one (3 of 5)
    assert s["utilization"] < 0.75 * ready  # the median window reads about 440/200 = 2.2x too busy
    assert s["data_wait_frac"] == pytest.approx(240 / 440, rel=0.15)
    assert s["throughput"] == pytest.approx(40 / 0.44, rel=0.15)
    assert s["step_time_s"] == pytest.approx(0.044, rel=0.15)
    assert sum(s["phase_s"].values()) == pytest.approx(s["step_time_s"], rel=0.02)


def test_loop_warmup_is_steady_and_epoch_restarts_are_measured():
    # 2 workers x prefetch 4 = 8 queued micro-batches; accumulation 2: ceil(9 / 2) = 5 warmup steps
    cfg = to_config(compose_dict(TINY + ["tracking.enabled=false", "data.args.size=320", "data.batch_size=16",
                                         "data.num_workers=2", "data.prefetch_factor=4", "trainer.accumulation_steps=2",
                                         "trainer.epochs=3", "measure.window_steps=2"]))
    from orchestrator.measure.plan import steady_warmup_steps

    assert steady_warmup_steps(cfg) == 5
    a = Adapter(cfg)
    a.setup()
    res = train(cfg, a)
    w = res.meter["warmup"]
    assert w["steps"] == 5 and w["min_steps"] == 1 and "queue" in w["why"]
    measured = [x for x in res.windows if not x.warmup]
    assert measured[0].first_step == 5
    # 10 steps an epoch, 5 windows of 2: each new epoch's restart (its workers start and refill the
    # queue while the step waits) is part of the steady state, measured in the window it falls in
    assert not w.get("rewarmed") and w["epochs_per_window"] == 0
    assert [(x.first_step, x.steps) for x in measured if not x.partial] == [(s, 2) for s in range(5, 29, 2)]


def test_short_epochs_are_measured_in_windows_of_whole_epochs():
    # 160 / 16 = 10 steps an epoch, windows of 20 steps: 2 epochs a window, each with its restart;
    # after the warmup (3 steps: 1 worker x prefetch 2 + 1) the rest of its epoch is a partial window
    res = train_tiny("data.args.size=160", "data.batch_size=16", "data.num_workers=1", "data.prefetch_factor=2",
                     "trainer.epochs=6", "measure.window_steps=20")
    assert res.meter["warmup"]["epochs_per_window"] == 2 and res.meter["warmup"]["steps"] == 3
    assert [(x.first_step, x.steps) for x in full_windows(res)] == [(10, 20), (30, 20)]
    assert [(x.first_step, x.steps) for x in res.windows if x.partial] == [(3, 7), (50, 10)]
    assert res.meter["estimate"]["windows"] == 2  # the whole ones


def test_a_run_shorter_than_an_epoch_is_still_measured():
    # 4 steps an epoch, 3 steps in all: the steps after the warmup are one partial window, and the
    # figures come from it (nothing else was measured)
    res = train_tiny("data.args.size=64", "data.batch_size=16", "trainer.max_steps=3", "measure.window_steps=20")
    assert res.meter["warmup"]["epochs_per_window"] == 5 and res.meter["measured_steps"] == 2
    assert res.meter["throughput"] > 0 and res.meter["estimate"]["windows"] == 1


def test_an_epoch_restart_is_measured_in_the_next_window():
    """Meter alone, 4 steps an epoch, windows of 4: a window is an epoch; the 50 ms an epoch's
    iterator takes to start (before its first step's data arrives) is in the window it starts."""
    m = StepMeter(torch.device("cpu"), window_steps=4, warmup_steps=1, epoch_steps=4)
    m.start()
    for epoch in range(4):
        if epoch:
            time.sleep(0.05)  # the new iterator's workers start
        _steps(m, 4)
        m.epoch_end()
    assert [w.steps for w in m.warmup_windows] == [1] and [(w.steps, w.partial) for w in m.windows] == [
        (3, True), (4, False), (4, False), (4, False)]  # the rest of the warmup's epoch, then whole epochs
    assert all(w.wall_s >= 0.05 and w.phases_s["data"] >= 0.045 for w in m.windows[1:])


def test_a_window_closed_before_windows_became_whole_epochs_is_partial():
    """Meter alone, 16 steps an epoch. The first window after the warmup closes by its length (4
    steps); then the step time makes windows longer (resize) and the epoch shorter than
    EPOCH_WINDOWS of them: windows become whole epochs. That first window held the epoch's tail
    (the workers' last batches ready, no restart): it is partial, as the rest of its epoch. A run
    that ends before a whole epoch was measured reads all of its measured steps, the next epoch's
    restart included, not the tail alone (a short tail window alone can read several times the
    run's rate)."""
    m = StepMeter(torch.device("cpu"), window_steps=4, warmup_steps=1, epoch_steps=16)
    m.start()
    _steps(m, 5)  # the warmup's step, then a window of 4 steps (16 >= 4 windows of 4: not whole epochs)
    assert m.whole_epochs() == 0 and [(w.first_step, w.steps, w.partial) for w in m.windows] == [(1, 4, False)]
    m.resize(step_time_s=0.001, window_s=0.005)  # windows of 5 steps: the epoch is shorter than 4 of them
    assert m.whole_epochs() == 1
    _steps(m, 11)
    m.epoch_end()
    time.sleep(0.2)  # the next epoch's workers start
    _steps(m, 6)  # and the run ends mid-epoch
    m.flush()
    assert [(w.first_step, w.steps, w.partial) for w in m.windows] == [(1, 4, True), (5, 11, True), (16, 6, True)]
    measured = sum(w.wall_s for w in m.windows)
    assert m.summary()["throughput"] == pytest.approx(4 * 21 / measured)  # every measured step, over their time
    assert m.summary()["estimate"]["measured_s"] == pytest.approx(measured)


def test_a_measurement_can_end_where_its_span_holds_whole_epochs():
    """Meter alone, 20 steps an epoch, a queue of 2 micro-batches: the warmup ends at step 3 and the
    measured span begins there. After 4 measured steps, 16 more make an epoch; `stop_at` ends a
    window at that step though windows are longer. Without loader workers there is no pre-made tail
    to pay for and the span may end anywhere."""
    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, queue=2, epoch_steps=20)
    m.start()
    _steps(m, 7)
    assert m.steps == 7 and m.steps_to_whole_epochs() == 16
    m.resize(step_time_s=0.001, window_s=0.005)  # windows of 5 steps (an epoch is 4 of them: not whole epochs)
    m.stop_at(m.steps + m.steps_to_whole_epochs())
    _steps(m, 16)
    assert [(w.first_step, w.steps) for w in m.windows] == [(3, 2), (5, 2), (7, 5), (12, 5), (17, 5), (22, 1)]
    assert m.steps_to_whole_epochs() == 0
    _steps(m, 3)
    assert m.steps_to_whole_epochs() == 17
    inproc = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, queue=0, epoch_steps=20)
    inproc.start()
    _steps(inproc, 7)
    assert inproc.steps_to_whole_epochs() == 0
    # a window's short step time makes windows whole epochs mid-epoch: on to that epoch's end (its
    # windows then partial), and from there the windows, whole epochs, end where an epoch does
    flip = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, queue=2, epoch_steps=20)
    flip.start()
    _steps(flip, 7)
    flip.resize(step_time_s=0.001, window_s=0.008)  # windows of 8 steps: an epoch is shorter than 4
    assert flip.whole_epochs() == 1 and flip.steps_to_whole_epochs() == 13
    _steps(flip, 13)
    flip.epoch_end()
    assert flip.steps_to_whole_epochs() == 0 and all(w.partial for w in flip.windows)


def test_windows_that_became_whole_epochs_stay_so_until_the_next_warmup():
    """Meter alone, 16 steps an epoch, a queue of 2. A short step time makes windows whole epochs;
    the next epoch's window holds its restart, and its slow steps shorten the windows again (to 2
    steps: the epoch is 8 of them). Windows stay whole epochs, so the measured span holds whole
    epochs at every window's end and a stop there ends the measurement. Flipping back, they would
    close inside the epoch and put the stop off from epoch to epoch, far past the time cap. A new
    warmup starts afresh."""
    m = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=1, queue=2, epoch_steps=16)
    m.start()
    _steps(m, 3)  # the warmup ends at step 3, mid-epoch
    m.resize(step_time_s=0.001, window_s=0.008)  # windows of 8 steps: an epoch is shorter than 4 of them
    _steps(m, 13)
    m.epoch_end()  # the rest of the warmup's epoch: a partial window
    _steps(m, 16)
    m.epoch_end()  # a whole epoch
    m.resize(step_time_s=0.01, window_s=0.02)  # its restart's slow steps: windows of 2 steps
    assert m.whole_epochs() == 1 and m.steps_to_whole_epochs() == 0
    _steps(m, 16)
    m.epoch_end()
    assert [(w.first_step, w.steps, w.partial) for w in m.windows] == [(3, 13, True), (16, 16, False), (32, 16, False)]
    m.rewarm("loader")
    assert m.whole_epochs() == 0


def test_a_measurement_that_cannot_reach_whole_epochs_stops_within_twice_its_cap(monkeypatch):
    """Whatever keeps a measured span from holding whole epochs, the measurement ends once it has
    gone on SPAN_EPOCHS_OF_CAP x its cap past the stop rule: here the span never holds them."""
    from orchestrator.runtime.loop import SPAN_EPOCHS_OF_CAP

    monkeypatch.setattr(StepMeter, "steps_to_whole_epochs", lambda self: 1)
    res = train_tiny("data.args.size=320", "data.batch_size=16", "data.num_workers=1", "trainer.epochs=200",
                     "measure.window_steps=2", "measure.rel_precision=0.001", "measure.max_measure_s=0.2")
    assert res.meter["stopped_by"] == "max_measure_s"
    longest = max(w.wall_s for w in full_windows(res))
    assert res.meter["estimate"]["measured_s"] <= (1 + SPAN_EPOCHS_OF_CAP) * 0.2 + 2 * longest
    assert res.steps < 200 * 20


@pytest.mark.parametrize("workers", [0, 1])
def test_a_trial_with_loader_workers_measures_whole_epochs(workers):
    """A measurement that stops on its own (measure.rel_precision, loose here: met after the
    fewest windows, 8 steps) goes on, with loader workers, to a whole epoch of 20 steps: the epoch's
    tail, made ahead by the workers and run with the cores free, is measured with the restart that
    pays for it. Without workers it stops as soon as the rule is met."""
    res = train_tiny("data.args.size=320", "data.batch_size=16", f"data.num_workers={workers}", "trainer.epochs=50",
                     "measure.window_steps=2", "measure.rel_precision=0.5", "measure.max_measure_s=30")
    assert res.meter["stopped_by"] == "precision" and res.steps_per_epoch == 20
    assert res.meter["measured_steps"] == 20 if workers else res.meter["measured_steps"] < 20


def train_tiny(*overrides):
    """The tiny job with these overrides, trained in this process, no tracking: its result."""
    cfg = to_config(compose_dict(TINY + ["tracking.enabled=false", "measure.warmup_steps=1", *overrides]))
    a = Adapter(cfg)
    a.setup()
    return train(cfg, a)


def full_windows(res):
    return [w for w in res.windows if not w.warmup and not w.partial]


def test_a_one_step_epoch_of_many_micro_batches_is_measured():
    # 64 samples, batch 8 x accumulation 8: one optimizer step an epoch, 8 micro-batches, a queue of
    # 2 (1 worker); re-warming at every epoch would never leave a step to measure
    res = train_tiny("data.args.size=64", "data.batch_size=8", "data.num_workers=1", "trainer.accumulation_steps=8",
                     "trainer.epochs=12", "measure.window_steps=2")
    assert res.steps == 12 and res.meter["warmup"]["epochs_per_window"] == 2  # windows of 2 steps: 2 epochs
    assert len(full_windows(res)) >= 4


def test_short_epochs_without_workers_are_measured_whole():
    # 64 samples / batch 16 = 4 steps an epoch, no workers, windows of 4: re-warming at every epoch
    # once left 3 steps, every 4-step window was cut short and none entered the estimate
    res = train_tiny("data.args.size=64", "data.batch_size=16", "data.num_workers=0", "trainer.epochs=10",
                     "measure.window_steps=4")
    assert res.steps == 40 and res.meter["warmup"]["epochs_per_window"] == 1 and not res.meter["warmup"].get("rewarmed")
    assert len(full_windows(res)) == 9 and all(w.steps == 4 for w in full_windows(res))


@pytest.mark.perf
def test_profiler_teardown_is_not_measured(monkeypatch, tmp_path):
    from orchestrator.runtime import loop

    slow = 0.4
    real_stop = loop.Profiler.stop

    def slow_stop(self):
        if self.running:
            time.sleep(slow)  # a long trace export
        real_stop(self)

    monkeypatch.setattr(loop.Profiler, "stop", slow_stop)
    cfg = to_config(compose_dict(TINY + ["tracking.enabled=false", "trainer.max_steps=20", "measure.warmup_steps=2",
                                         "measure.profile_steps=3", "measure.window_steps=3"]))
    a = Adapter(cfg)
    a.setup()
    res = train(cfg, a, trace_path=tmp_path / "trace.json")
    measured = [x for x in res.windows if not x.warmup]
    assert measured and all(x.wall_s < slow for x in measured), [x.wall_s for x in measured]
    assert res.meter["warmup"]["after"] == "profiler" and res.meter["warmup"]["steps"] == 6  # 2 + 3 profiled + 1 after the teardown
    assert res.meter["profile"]["top_ops"]


def test_summary_warns_when_nothing_was_measured(make_cfg, tmp_path):
    from orchestrator.app import run_job
    from orchestrator.merge import measurement_warning

    # the command: one epoch of 4096 / 64 = 64 steps ends inside the 100-step warmup
    result = run_job(make_cfg("data.batch_size=64", "trainer.max_steps=600", "measure.warmup_steps=100",
                              "tracking.enabled=false"), tmp_path, echo=False)
    assert result["status"] == "FINISHED" and not result.get("measured_steps")
    warning = measurement_warning(result)
    assert warning.startswith("nothing was measured") and "trainer.epochs" in warning and "64 steps" in warning
    enough = {**result, "measured_steps": 40, "estimate": {"windows": 8}}
    assert measurement_warning(enough) == ""
    assert "trainer.epochs" in measurement_warning({**result, "measured_steps": 4, "estimate": {"windows": 2}})


def test_the_interval_uses_students_t_at_every_window_count():
    """The 95% interval's t quantile is scipy's at every count of windows (a hand-written table
    stopped at 31 and jumped from 2.04 to the normal 1.96: 40 windows read 4% narrower than 30)."""
    from orchestrator.measure.stats import estimate

    def half(n: int) -> float:
        values = [1.0 + (-1) ** i * 0.1 for i in range(n)]
        est = estimate(values)
        return (est.interval[1] - est.mean) / (est.rel_se * est.mean)

    assert half(5) == pytest.approx(2.776, abs=1e-3)
    assert half(32) == pytest.approx(2.040, abs=1e-3)
    assert half(41) == pytest.approx(2.021, abs=1e-3)  # the table's 1.96 here


def test_a_memory_cap_is_the_memory_the_diagnosis_sizes_batches_by():
    """With trainer.memory_cap_mb on CPU, the memory a rank can use is the cap, not the host's RAM:
    against the host's RAM the diagnosis would read "peak memory is 3% of the device, so twice the
    batch fits" under a cap that the doubled batch passes."""
    import psutil

    cap = 256.0
    capped = StepMeter(torch.device("cpu"), memory_cap_mb=cap).summary()
    free = StepMeter(torch.device("cpu")).summary()
    assert capped["device_mem_mb"] == cap
    assert free["device_mem_mb"] == pytest.approx(psutil.virtual_memory().total / 2**20)


def test_round_drift_is_the_part_of_a_rounds_runs_that_they_share():
    """Interleaved rounds: every config's run of a round ran on the machine as it was then. Three
    configs, the last two rounds 30% slower for all: the drift is that factor (centred over the
    rounds), the runs divided by it are steady and keep the configs' ratios; a round with one run
    has nothing to share (factor 1)."""
    from orchestrator.measure.stats import round_drift

    pace = {0: 1.0, 1: 1.0, 2: 0.7, 3: 0.7}
    runs = {c: {r: true * f for r, f in pace.items()} for c, true in (("a", 1000.0), ("b", 950.0), ("c", 900.0))}
    drift = round_drift(runs)
    assert drift[0] / drift[2] == pytest.approx(1 / 0.7) and drift[0] == pytest.approx(drift[1])
    assert math.prod(drift.values()) == pytest.approx(1.0)  # centred: the level stays
    steady = {c: {round(v / drift[r], 6) for r, v in per.items()} for c, per in runs.items()}
    assert all(len(v) == 1 for v in steady.values())
    assert steady["a"].pop() / steady["b"].pop() == pytest.approx(1000 / 950)
    assert round_drift({"a": {0: 1000.0, 1: 700.0}, "b": {0: 950.0}})[1] == 1.0
    assert round_drift({}) == {}


def test_a_run_far_under_its_configs_other_runs_is_the_disturbed_one():
    """The host's other load only slows a run: a run under half the median of its config's other
    runs is the disturbed one (of two, the slower), and the rest are kept, down to 0.61 of it (about
    the lowest an undisturbed run reads on the benchmark tasks)."""
    from orchestrator.measure.stats import disturbed

    runs = {"b16": {0: 283.0, 1: 1451.0, 2: 1440.0, 3: 1402.0}, "b64": {0: 1425.0, 1: 1474.0, 2: 1460.0},
            "pair": {0: 456.0, 1: 1396.0}, "slow round": {0: 0.62 * 1000.0, 1: 1000.0}, "once": {0: 10.0}}
    assert disturbed(runs) == {("b16", 0), ("pair", 0)}
    assert disturbed({"two of three": {0: 300.0, 1: 283.0, 2: 1451.0}}) == {("two of three", 0), ("two of three", 1)}
    assert disturbed({}) == set()


def test_runs_of_one_config_combine_as_runs_not_as_windows():
    """The confirmation's runs of a config: each run counts once, a disturbed one (slow, so it measured
    longest) neither outweighs the others nor narrows the interval, and from 3 runs it is outvoted."""
    from orchestrator.measure.results import Estimate
    from orchestrator.measure.stats import combine

    def run(mean, windows, measured_s):
        return Estimate(mean=mean, rel_se=0.03, windows=windows, measured_s=measured_s)

    steady, disturbed = [run(1617.0, 5, 0.9), run(1650.0, 5, 0.8)], run(855.0, 12, 2.4)
    two = combine([steady[0], disturbed])
    assert two.mean == pytest.approx((1617 + 855) / 2)  # not pulled toward the run with more windows
    assert two.interval[1] > 1617  # the pair's spread, not its 17 windows: the leader may still be this config
    three = combine([*steady, disturbed])
    assert three.mean == 1617.0 and three.windows == 22 and three.measured_s == pytest.approx(4.1)
    assert combine([steady[0]]).mean == 1617.0


def test_nothing_is_imported_inside_a_ranks_measured_span():
    """A rank imports before its job what the job's measurement will need: a module first imported
    inside the measured span (scipy.special at the first stop check: 0.4 s) counts as the step's
    "other" time and makes the first job on fresh ranks (a study's trial 0, the user's config) read
    idler and slower than it runs. A fresh interpreter, as a rank's."""
    import subprocess
    import sys

    from .conftest import ROOT

    script = """
import sys
from orchestrator.rank import _warm_imports
from orchestrator.runtime import meter
from tests.test_measurement import train_tiny
_warm_imports()
at = {}
end = meter.StepMeter._end_warmup
def ended(self):
    at.setdefault("warm", set(sys.modules))
    return end(self)
meter.StepMeter._end_warmup = ended
res = train_tiny("measure.window_steps=2", "measure.rel_precision=0.5", "measure.max_measure_s=30", "trainer.epochs=50")
assert res.meter["stopped_by"] == "precision", res.meter["stopped_by"]
print(sorted(m for m in set(sys.modules) - at["warm"] if not m.startswith("_")))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_warning_says_what_ended_the_run():
    """A run cut by trainer.max_steps is not said to have run its epochs ("ended after 100 steps
    (2 epochs of 64 steps)" was a contradiction)."""
    from orchestrator.merge import measurement_warning

    cut = {"steps": 100, "measured_steps": 95, "estimate": {"windows": 1}, "steps_per_epoch": 64, "epochs": 2,
           "warmup": {"steps": 5}}
    said = measurement_warning(cut)
    assert "the run ended after 100 steps, its trainer.max_steps (an epoch is 64 steps); raise trainer.max_steps" in said
    assert "2 epochs" not in said
    whole = {**cut, "steps": 128}
    assert "the run ended after 128 steps (2 epochs of 64 steps); raise trainer.epochs" in measurement_warning(whole)


def test_a_plain_runs_windows_last_a_second_on_fast_steps_and_it_still_has_several():
    """A plain run that leaves measure.window_steps unset measures in windows of a second (whole
    steps) where 20 steps are shorter, which costs it a window's bookkeeping a second instead of
    every 20 steps; at most an eighth of its steps, and where windows that long would be whole
    epochs of a run of fewer than 8 epochs, a quarter of an epoch. A run that sets window_steps,
    tunes its loader or balances its shares as it goes (they decide on a few windows) keeps windows
    of window_steps."""
    from orchestrator.runtime.windows import plain_window_cap

    base = ["backend=single", "backend.device=cpu", "tracking.enabled=false", "trainer.save_model=false"]
    assert to_config(compose_dict(base)).measure.window_s == 1.0
    for fixed in (["measure.window_steps=20"], ["trainer.loader_autotune=true"], ["mode=tune"]):
        assert to_config(compose_dict(base + fixed)).measure.window_s != 1.0, fixed
    assert plain_window_cap(20, 2555, 128, 8) == 319  # 20 epochs: windows of whole epochs, 8 or more
    assert plain_window_cap(20, 379, 128, 8) == 32  # 3 epochs: a quarter of an epoch, not whole epochs
    assert plain_window_cap(20, 123, 128, 8) == 20  # the quick start: never under window_steps
    assert plain_window_cap(20, 10_000, 0, 8) == 1250
    windows = {}
    for name, extra in (("default", []), ("set", ["measure.window_steps=20"])):
        cfg = to_config(compose_dict(base + ["trainer.max_steps=384", "trainer.epochs=3", *extra]))
        a = Adapter(cfg)
        a.setup()
        windows[name] = train(cfg, a).windows
    full = [w for w in windows["default"] if not w.warmup and not w.partial]
    assert [w.steps for w in full[:1]] == [20]  # the first: the step time not known yet
    assert {w.steps for w in full[1:]} == {32} and len(full) >= 8
    assert {w.steps for w in windows["set"] if not w.warmup and not w.partial} == {20}
