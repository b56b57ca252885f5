"""The job model (orchestrator/jobmodel.py) on synthetic measurements, the advice that reads from
it, and the cpu-time utilization it rests on."""

from __future__ import annotations

import time

import pytest

from orchestrator.diagnose import diagnose
from orchestrator.jobmodel import JobModel, Run
from orchestrator.measure.phases import COMPUTE, DATA, OPTIMIZER
from orchestrator.runtime.meter import StepMeter

HANDOFF = lambda b: 1e-3  # noqa: E731  seconds per batch


def _run(b: int, w: int, rate: float, data_frac: float, cost: dict, a: int = 1) -> Run:
    values = {"data.batch_size": b, "data.num_workers": w, "trainer.accumulation_steps": a}
    run = Run.of(values, {"throughput": rate, "step_time_s": b * a / rate, "data_wait_frac": data_frac,
                          "input_cost": cost, "rel_se": 0.03}, world=1)
    assert run is not None
    return run


def test_a_loader_that_waits_gets_workers_beyond_the_cores():
    """5 ms of storage wait and 0.1 ms of CPU per item, 0.1 ms of training per item, 2 cores: one
    run without workers. Sleeping workers cost no CPU, so the model asks for as many as the cap
    allows (the loader's rate grows with each), and predicts about 8x the rate with 8 of them."""
    per_item = 5.1e-3 + 0.1e-3
    run = _run(32, 0, 1 / per_item, 5.1 / 5.2, {"data_wall_s": 5.1e-3, "data_cpu_s": 0.1e-3,
                                              "consume_cpu_s": 0.1e-3, "cores": 2, "threads": 2})
    model = JobModel.fit([run], cores=2, threads=2, handoff=HANDOFF)
    assert model.load_wait == pytest.approx(5.0e-3) and model.load_cpu == pytest.approx(0.1e-3)
    assert model.best_workers(32, 1, top=8) == 8
    now, then = model.predict(32, 0, 1), model.predict(32, 8, 1)
    assert now.throughput == pytest.approx(1 / per_item, rel=0.01)
    assert 6 < then.throughput / now.throughput < 9 and then.bound == "loader"


def test_a_loader_that_computes_gets_what_the_cores_leave():
    """4 workers on 2 cores, each item 2 ms of worker CPU and 1 ms of training CPU: the cores, not
    the workers, bound the job (2 cores / 3 ms = 667 items/s), so fewer workers do as well."""
    run = _run(32, 4, 600.0, 0.3, {"workers_cpu_s": 2e-3, "consume_cpu_s": 1.1e-3, "data_wall_s": 0.5e-3,
                                   "cores": 2, "threads": 2})
    model = JobModel.fit([run], cores=2, threads=2, handoff=HANDOFF)
    assert model.predict(32, 4, 1).bound == "cpu"
    assert model.best_workers(32, 1, top=8) < 4
    assert model.predict(32, 8, 1).throughput < 1.05 * model.predict(32, 4, 1).throughput  # more do not pay


def test_the_fit_separates_per_batch_from_per_item_cost():
    """Training time per item = 0.1 ms + 2 ms per micro-batch: runs at batch 16 and 64 recover it,
    and the prediction at batch 256 (never measured) is within 5% of the truth."""
    truth = lambda b: 1e-4 + 2e-3 / b  # noqa: E731
    runs = [_run(b, 0, 1 / truth(b), 0.0, {"data_wall_s": 0.0, "data_cpu_s": 0.0}) for b in (16, 64)]
    model = JobModel.fit(runs, cores=2, threads=2, handoff=HANDOFF)
    assert model.predict(256, 0, 1).throughput == pytest.approx(1 / truth(256), rel=0.05)
    assert model.predict(256, 0, 1).rel_unc > model.predict(64, 0, 1).rel_unc  # farther from what was measured


def test_advice_reads_the_job_model(make_cfg):
    """The diagnosis sizes workers from the model: beyond the cores for a loader that waits, fewer
    than now for one whose workers take the training process's cores."""
    step = 32 * 5.2e-3
    waits = {"data_wait_frac": 5.1 / 5.2, "h2d_frac": 0.0, "comm_frac": 0.0, "compute_frac": 0.1 / 5.2,
             "optimizer_frac": 0.0, "peak_mem_mb": 100.0, "world_size": 1, "step_time_s": step, "throughput": 32 / step,
             "item_bytes": 4000, "per_rank": [{"device": "cpu"}],
             "input_cost": {"data_wall_s": 5.1e-3, "data_cpu_s": 0.1e-3, "consume_cpu_s": 0.1e-3, "cores": 2,
                            "threads": 2}}
    handoff = lambda n, b: {"seconds": 1e-3, "source": "test"}  # noqa: E731
    d = diagnose(waits, make_cfg(), device_mem_mb=None, handoff=handoff)
    assert d.verdict == "input-bound" and d.moves[0].set["data.num_workers"] == 8, d.moves
    assert "mostly waits" in d.moves[0].why and "job model" in d.moves[0].why
    computes = {**waits, "data_wait_frac": 0.35, "compute_frac": 0.65, "step_time_s": 32 / 600, "throughput": 600.0,
                "input_cost": {"workers_cpu_s": 2e-3, "consume_cpu_s": 1.1e-3, "data_wall_s": 0.5e-3, "cores": 2,
                               "threads": 2}}
    d = diagnose(computes, make_cfg("data.num_workers=4"), device_mem_mb=None, handoff=handoff)
    assert d.verdict == "input-bound" and d.moves[0].set["data.num_workers"] < 4, d.moves
    assert "share the cores" in d.moves[0].why


def _meter_window(busy: callable) -> object:
    import torch

    meter = StepMeter(torch.device("cpu"), window_steps=4, warmup_steps=1, nvml=False)
    meter.start()
    win = None
    for _ in range(5):
        meter.mark(DATA)
        busy()
        meter.mark(COMPUTE)
        meter.mark(OPTIMIZER)
        win = meter.end_step(1) or win
    meter.close()
    return win


def test_cpu_utilization_counts_the_cpu_the_training_process_got():
    """A compute phase that waits (its core taken by someone else, here a sleep) is busy by wall
    time but got no CPU: its cpu-time utilization is near 0, a working one the share of a core it got."""
    def spin():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.005:
            pass

    waited, worked = _meter_window(lambda: time.sleep(0.005)), _meter_window(spin)
    assert waited.share("compute") > 0.8 and worked.share("compute") > 0.8  # both busy by wall time
    # what the loop got of a core (a loaded machine gives the spin less than all of one)
    assert waited.utilization < 0.1 < worked.utilization
    assert worked.utilization == pytest.approx(worked.busy_cpu_s / worked.wall_s)


def test_guided_next_config_chases_throughput_then_utilization_within_the_floor(make_cfg):
    """The model's next config: while some config may beat the best measured throughput, the one
    whose predicted top is highest; then (utilization objective) the one predicted to keep up with
    the floor whose utilization may beat the busiest that keeps up; nothing when neither pays."""
    from orchestrator.jobmodel import Prediction
    from orchestrator.tune.proposals import Proposals
    from orchestrator.tune.space import SearchSpace

    def proposals(*overrides: str) -> Proposals:
        cfg = make_cfg(*overrides)
        return Proposals(SearchSpace(cfg), cfg.tune, "sqlite://", "s", lambda _: None, cfg)

    done = [{"throughput": 1000.0, "utilization": 0.30}]
    faster = (Prediction(1100.0, 0.05, 0.30, "loader"), {"data.batch_size": 64})
    busier = (Prediction(900.0, 0.05, 0.45, "loader"), {"data.batch_size": 16})
    slower = (Prediction(700.0, 0.05, 0.60, "loader"), {"data.batch_size": 8})
    util = proposals()
    assert util._next([faster, busier, slower], done)[1] == {"data.batch_size": 64}
    pick = util._next([busier, slower], done)  # nothing faster: the busiest that keeps up (not the slow one)
    assert pick[1] == {"data.batch_size": 16} and "utilization 45%" in pick[2]
    assert util._next([slower], done) is None
    assert proposals("tune.objective=throughput")._next([busier, slower], done) is None


def test_runs_without_workers_do_not_bend_the_fit_of_those_with_workers():
    """The loop's compute after an in-process load runs 3x slower (threads that slept through the
    load, cold caches) than the same step with workers. Fitted together, that difference passed
    for a per-step cost, and accumulation 2 was predicted much faster than 1. The fit uses the runs
    with workers; the in-process run keeps its own factor for predictions without workers."""
    truth = lambda b: 1e-4 + 2e-3 / b  # noqa: E731  seconds per item with workers
    wait, cost = 1e-3, {"workers_cpu_s": 0.05e-3, "consume_cpu_s": 0.1e-3, "cores": 2, "threads": 2}
    runs = [_run(b, 8, 1 / (truth(b) + 0.1 * truth(b)), 0.1 / 1.1, cost) for b in (32, 64)]
    slow = 3 * truth(32)
    runs.append(_run(32, 0, 1 / (wait + slow), wait / (wait + slow), {"data_wall_s": wait, "data_cpu_s": 0.05e-3,
                                                                         "consume_cpu_s": 0.1e-3, "cores": 2, "threads": 2}))
    model = JobModel.fit(runs, cores=2, threads=2, handoff=lambda b: 0.0)
    assert model.consume(64, 2) == pytest.approx(truth(64), rel=0.05)  # no per-step cost invented
    assert model.predict(64, 8, 2).throughput == pytest.approx(model.predict(64, 8, 1).throughput, rel=0.05)
    assert model.predict(32, 0, 1).throughput == pytest.approx(1 / (wait + slow), rel=0.05)


def test_runs_without_workers_keep_their_own_shape():
    """Four in-process runs whose loop pays 3 ms an optimizer step (gamma) beside one run with
    workers: the in-process runs are fitted on their own, so accumulation 2 without workers is
    predicted faster than 1 (one factor on the single run with workers would make every batch and
    accumulation without workers read alike)."""
    truth = lambda b, a: 2e-4 + 3e-3 / (a * b)  # noqa: E731  seconds per item without workers
    wait = 1e-5
    cost = {"data_wall_s": wait, "data_cpu_s": wait, "consume_cpu_s": 2e-4, "cores": 2, "threads": 2}
    runs = [_run(b, 0, 1 / (wait + truth(b, a)), wait / (wait + truth(b, a)), cost, a=a)
            for b, a in ((128, 1), (256, 1), (256, 2), (64, 1))]
    runs.append(_run(256, 2, 1 / 6e-4, 0.0, {"workers_cpu_s": 1e-5, "consume_cpu_s": 6e-4, "cores": 2, "threads": 2}))
    model = JobModel.fit(runs, cores=2, threads=2, handoff=lambda b: 0.0)
    want = 1 / (wait + truth(64, 2))
    assert model.predict(64, 0, 2).throughput == pytest.approx(want, rel=0.05)
    assert model.predict(64, 0, 2).throughput > 1.07 * model.predict(64, 0, 1).throughput  # truth: 1.10x
    assert model.predict(256, 2, 1).throughput == pytest.approx(1 / 6e-4, rel=0.05)  # the workers' fit is its own


def test_a_config_without_workers_never_measured_keeps_its_chance():
    """Only runs with workers: a config without them gets the unseen regime's wider interval (its
    in-process loading and what the workers took from the cores were never measured), so the
    model does not rule it out on a guess."""
    cost = {"workers_cpu_s": 0.01e-3, "consume_cpu_s": 0.5e-3, "cores": 2, "threads": 2}
    runs = [_run(32, w, 900.0, 0.2, cost) for w in (1, 2)]  # the workers' wait was seen
    model = JobModel.fit(runs, cores=2, threads=2, handoff=HANDOFF)
    assert model.load_wait is not None
    assert model.predict(32, 0, 1).rel_unc >= model.predict(32, 1, 1).rel_unc + 0.25
    measured = JobModel.fit([*runs, _run(32, 0, 700.0, 0.3, {"data_wall_s": 0.4e-3, "data_cpu_s": 0.01e-3})],
                            cores=2, threads=2, handoff=HANDOFF)
    assert measured.predict(32, 0, 1).rel_unc < 0.2


def test_a_measured_config_is_predicted_as_measured_and_anchors_its_neighbours():
    """A run whose CPU budget allows just the rate it reached (the soft minimum with the stages
    near it reads less): anchored, the model predicts it as measured, and its neighbour at
    the other accumulation (the same loader, the same per-item cost) keeps up with it; unanchored,
    the neighbour's top fell below the measured run's floor and a sampler's proposal of it was held
    back."""
    per = 1 / 14000.0
    w8 = _run(64, 8, 14000.0, 0.0, {"workers_cpu_s": per, "consume_cpu_s": per, "cores": 2, "threads": 2}, a=2)
    w0 = _run(32, 0, 2000.0, 0.8, {"data_wall_s": 0.4e-3, "data_cpu_s": 0.05e-3, "consume_cpu_s": 0.1e-3,
                                   "cores": 2, "threads": 2})
    model = JobModel.fit([w0, w8], cores=2, threads=2, handoff=lambda b: 0.0)
    assert model.predict(64, 8, 2).throughput == pytest.approx(14000.0, rel=1e-6)
    assert model.predict(32, 0, 1).throughput == pytest.approx(2000.0, rel=1e-6)
    assert model.predict(64, 8, 1).hi > 0.95 * 14000.0
    model.anchors = []  # the stages alone read the run below its own measurement
    assert model.predict(64, 8, 2).throughput < 0.95 * 14000.0


def test_the_workers_edge_widens_only_where_the_job_model_sees_a_gain(make_cfg):
    """A best trial at the space's most workers with an input-bound verdict: extend_edges widens
    the workers when the study's job model predicts a gain there (a loader that waits on storage),
    and says why not when the cores bind (a loader that computes, 4 workers on 2 cores)."""
    import optuna

    from orchestrator.tune.proposals import Proposals
    from orchestrator.tune.space import SearchSpace

    cfg = make_cfg("tune.sampler=guided")
    proposals = Proposals(SearchSpace(cfg), cfg.tune, "sqlite://", "s", lambda _: None, cfg)

    def best_of(rate: float, data_frac: float, cost: dict) -> tuple:
        study = optuna.create_study(direction="maximize")
        values = {"data.batch_size": 32, "data.num_workers": 4, "trainer.accumulation_steps": 1}
        study.add_trial(optuna.trial.create_trial(value=1.0, params={}, distributions={}, user_attrs={
            "values": values, "throughput": rate, "utilization": 0.3, "step_time_s": 32 / rate,
            "data_wait_frac": data_frac, "input_cost": cost, "rel_se": 0.03}))
        return study, study.trials[0]

    waits = best_of(780.0, 0.9, {"workers_cpu_s": 0.1e-3, "consume_cpu_s": 0.1e-3, "cores": 2, "threads": 2})
    assert proposals._more_workers(*waits, {"value": 6}) == {"value": 6}
    computes = best_of(600.0, 0.3, {"workers_cpu_s": 2e-3, "consume_cpu_s": 1.1e-3, "data_wall_s": 0.5e-3,
                                    "cores": 2, "threads": 2})
    why = proposals._more_workers(*computes, {"value": 6})["capped"]
    assert why.startswith("the job model predicts") and "with 6 workers" in why and "cpu-bound" in why


def test_a_wait_of_one_hand_off_per_batch_is_not_the_loader_waiting():
    """The zoo's compute task at b8 w2 a1: the step waited 17% of its time for data, 1.5 ms a batch,
    about one hand-off (1.4 ms at b8), with 0.15 ms of loader CPU per item. The workers kept up: no
    loader wait is inferred, and a larger batch (fewer hand-offs per item) is predicted faster, not
    held back by a loader that waits 2 ms on every item."""
    cost = {"busy_cpu_s": 0.000775, "consume_cpu_s": 0.00147, "cores": 2, "data_cpu_s": 0.000487,
            "data_wall_s": 0.000188, "threads": 2, "workers_cpu_s": 0.000151}
    run = _run(8, 2, 900.4, 0.169, cost)
    assert run.load_wait is not None  # alone, the run reads as workers running flat out
    model = JobModel.fit([run], cores=2, threads=2, handoff=lambda b: 1.4e-3)
    assert model.load_wait is None
    assert model.predict(64, 1, 1).throughput > model.predict(8, 2, 1).throughput
    # a wait of several hand-offs a batch is still the loader's
    slow = _run(8, 2, 450.0, 0.6, {**cost, "data_wall_s": 1.33e-3})
    assert JobModel.fit([slow], cores=2, threads=2, handoff=lambda b: 1.4e-3).load_wait is not None


def test_a_training_process_that_waited_for_cores_is_not_a_slow_consumer():
    """The zoo's cpu_transform: b32 w0 a1 (591/s) and b64 w4 a2 (564/s), 2 ms of loader CPU per
    item on 2 cores. With 4 workers the training process's time outside the data wait was 1.45
    ms/item, 5x its time without workers: it waited for the cores its workers held. Taken as its
    own cost, the consumer stage (623/s) and the cpu budget (571/s) would both bound 2 workers, and
    their soft minimum put b32 w2 a1 at 492/s (its steady figure: 616/s). The budget alone bounds it;
    without workers the loop's utilization is predicted from its own consume, as measured."""
    w0 = _run(32, 0, 591.1, 0.8425, {"busy_cpu_s": 0.000255, "consume_cpu_s": 0.000467, "cores": 2, "threads": 2,
                                      "data_cpu_s": 0.001424, "data_wall_s": 0.001426})
    w4 = _run(64, 4, 563.8, 0.1849, {"busy_cpu_s": 0.000686, "consume_cpu_s": 0.001352, "cores": 2, "threads": 2,
                                      "data_wall_s": 0.000328, "workers_cpu_s": 0.001992}, a=2)
    model = JobModel.fit([w0, w4], cores=2, threads=2, handoff=lambda b: 2e-3)
    two = model.predict(32, 2, 1)
    assert two.bound == "cpu" and two.throughput > 0.9 * 563.8
    assert model.predict(32, 0, 1).utilization == pytest.approx(591.1 * 0.000255, rel=0.1)
    assert two.utilization > 2 * model.predict(32, 0, 1).utilization  # workers leave the loop its compute


def test_a_wait_measured_without_workers_bounds_the_one_workers_imply():
    """The zoo's storage_0p1 (0.1 ms of storage an item, 2 cores), as one study measured it: b32
    without workers waited 0.16 ms an item for its data, loaded in process; b64 with 8 workers
    waited 10% of its step, which read as workers running flat out puts 1.4 ms of storage wait on
    each item. With that wait, 2 workers at b64 would be predicted at 1,100/s (steady: 7,600/s, the
    grid's second best) and held back as unable to keep up. The direct measurement bounds it."""
    cost = {"cores": 2, "threads": 2}
    inproc = _run(32, 0, 3208.0, 0.65, {**cost, "data_wall_s": 0.202e-3, "data_cpu_s": 0.038e-3,
                                          "consume_cpu_s": 0.2e-3})
    eight = _run(64, 8, 5335.0, 0.54, {**cost, "workers_cpu_s": 0.134e-3, "consume_cpu_s": 0.15e-3,
                                        "data_wall_s": 0.101e-3})
    assert eight.load_wait == pytest.approx(8 / 5335.0 - 0.134e-3, rel=0.01)  # 1.37 ms: the flat-out reading
    model = JobModel.fit([inproc, eight], cores=2, threads=2, handoff=HANDOFF)
    assert model.load_wait == pytest.approx(inproc.load_wait) and inproc.load_wait < 0.2e-3
    two = model.predict(64, 2, 1)
    assert two.bound != "loader" and two.hi > 5335.0  # it may beat the best measured: worth a trial
    # without a run that loaded in process, the workers' reading is all there is
    assert JobModel.fit([eight], cores=2, threads=2, handoff=HANDOFF).load_wait == pytest.approx(eight.load_wait)
