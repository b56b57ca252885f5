"""The typed results (orchestrator/measure/results.py): one job figure per window for the stop
rule, the live log and the merge; result.json and rank files round-trip with their keys, and
files written before typed results (no schema_version) still load. In-process, no training."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest

from orchestrator.measure.results import (SCHEMA_VERSION, Estimate, JobResult, RankResult, Window, WindowFigures,
                                          job_window)
from orchestrator.measure.stats import estimate_of

OLD = Path(__file__).parent / "data" / "before_schema"  # a 2-rank ddp run's records, written before typed results


def rank_windows(rank: int, walls):
    """One rank's windows: 10 steps of 32 samples each, in `walls` seconds (rank 1 is slower)."""
    out = []
    for i, wall in enumerate(walls):
        phases = {"other": 0.01, "data": 0.1 * (rank + 1), "h2d": 0.0, "compute": wall - 0.21 - 0.1 * rank,
                  "comm": 0.05 + 0.05 * rank, "optimizer": 0.05}
        out.append(Window(index=i, first_step=10 + 10 * i, steps=10, samples=320, wall_s=wall, phases_s=phases,
                          utilization=0.5 + 0.1 * rank + 0.01 * i, t_start=float(i), t_end=float(i) + wall,
                          tokens=1000 * (rank + 1), padded_tokens=1500 * (rank + 1)))
    return out


WALLS = {0: [1.0, 1.1, 0.9, 1.0], 1: [1.2, 1.3, 1.25, 1.2]}


def expected_windows():
    ranks = [rank_windows(r, WALLS[r]) for r in (0, 1)]
    return ranks, [job_window([ranks[0][i].figures(), ranks[1][i].figures()]) for i in range(4)]


def test_job_window_sums_throughput_takes_the_slowest_step_and_averages_shares():
    a = WindowFigures(throughput=300.0, step_time_s=0.10, utilization=0.6, data_wait_frac=0.2, comm_frac=0.1,
                      wall_s=1.0, tokens_per_s=1000.0, step=20)
    b = WindowFigures(throughput=250.0, step_time_s=0.12, utilization=0.4, data_wait_frac=0.4, comm_frac=0.0,
                      wall_s=1.2, tokens_per_s=None, step=20)
    job = job_window([a, b])
    assert job.throughput == 550.0 and job.step_time_s == 0.12 and job.wall_s == 1.2 and job.step == 20
    assert job.utilization == pytest.approx(0.5) and job.data_wait_frac == pytest.approx(0.3)
    assert job.comm_frac == pytest.approx(0.05)
    assert job.tokens_per_s is None  # counted by one rank only: no job figure
    assert job_window([a, a]).tokens_per_s == 2000.0
    assert WindowFigures.unpacked(b.packed()) == WindowFigures(**{**b.__dict__, "step": 0})  # what the loop exchanges


def test_the_live_log_writes_one_point_a_second_of_short_windows():
    """Windows of a few milliseconds (20 steps of a sub-millisecond step) reach MLflow as one point
    per LiveLog.POINT_S of measured time, each pooling its windows' figures by their seconds (each
    rank's too); the pruner and the progress see every window; the job's end logs what is left."""
    from orchestrator.livelog import LiveLog

    logged, judged = [], []
    live = LiveLog(types.SimpleNamespace(log_metrics=logged.extend, uri="-"), 2,
                   monitor=lambda n, job: judged.append(job) and False)
    assert live.POINT_S == 1.0

    def fig(i: int, rank: int) -> WindowFigures:  # 250 windows of 10 ms: 2.5 s measured
        fast = i % 2 == 0  # alternate 100 and 300 samples/s (the job: 200 and 600)
        return WindowFigures(throughput=100.0 if fast else 300.0, step_time_s=0.001 if fast else 0.002,
                             utilization=0.5, data_wait_frac=0.1 + 0.1 * fast, comm_frac=0.0, wall_s=0.01,
                             step=20 * (i + 1))

    for i in range(250):
        live([(r, {"type": "window", **fig(i, r).__dict__}) for r in (0, 1)])
    live.close()
    assert len(judged) == 250
    job = [(v, step) for k, v, step in logged if k == "throughput"]
    rank1 = [(v, step) for k, v, step in logged if k == "rank1/throughput"]
    assert [step for _, step in job] == [2000, 4000, 5000] and [step for _, step in rank1] == [2000, 4000, 5000]
    assert all(v == pytest.approx(400.0) for v, _ in job) and all(v == pytest.approx(200.0) for v, _ in rank1)
    steps = dict((step, v) for k, v, step in logged if k == "step_time_s")
    assert steps[2000] == pytest.approx(1.0 / (50 / 0.001 * 0.01 + 50 / 0.002 * 0.01))  # seconds over steps
    assert dict((step, v) for k, v, step in logged if k == "data_wait_frac")[5000] == pytest.approx(0.15)


def test_the_stop_rule_the_live_log_and_the_merge_read_the_same_job_window():
    """Two ranks with different step times: the loop's all-reduced figures (what the stop rule,
    the window sizing and the loader autotune get), the live log's job points (MLflow and the
    pruner) and the merged result's windows (its estimates, the tuner's) are job_window's."""
    from orchestrator.livelog import LiveLog
    from orchestrator.merge import job_windows, merge
    from orchestrator.runtime.loop import Run

    ranks, want = expected_windows()

    # the loop: one all-reduce (sum) of each rank's figures in its own slots
    def loop_figures(i):
        sent = {}
        for r in (0, 1):  # what each rank contributes
            adapter = types.SimpleNamespace(world_size=2, rank=r, all_reduce_sum=lambda v, r=r: sent.setdefault(r, v))
            Run.job_figures(types.SimpleNamespace(collective=True, adapter=adapter), ranks[r][i])
        summed = [x + y for x, y in zip(sent[0], sent[1])]
        got = [Run.job_figures(types.SimpleNamespace(collective=True, adapter=types.SimpleNamespace(
            world_size=2, rank=r, all_reduce_sum=lambda v: list(summed))), ranks[r][i]) for r in (0, 1)]
        assert got[0] == got[1]  # every rank decides the same
        return got[0]

    for i, job in enumerate(want):
        got = loop_figures(i)
        for k in WindowFigures.PACKED:
            assert getattr(got, k) == pytest.approx(getattr(job, k)), (i, k)
    assert want[0].step_time_s == pytest.approx(0.12) and want[0].throughput == pytest.approx(320 / 1.0 + 320 / 1.2)

    # the live log: the ranks' window events (as the loop writes them) -> the job's MLflow points and the pruner
    logged, judged = [], []
    tracker = types.SimpleNamespace(log_metrics=logged.extend, uri="-")
    live = LiveLog(tracker, 2, monitor=lambda n, job: judged.append(job) and False)
    for i in range(4):
        live([(r, {"type": "window", **ranks[r][i].figures().__dict__}) for r in (1, 0)])
    assert len(judged) == 4
    assert not logged  # MLflow gets them in one batch (every LiveLog.FLUSH_S, and at the job's end)
    live.flush()
    for job, seen in zip(want, judged):
        assert seen == pytest.approx(job.metrics())
        assert set(seen) == {"throughput", "utilization", "data_wait_frac", "comm_frac", "step_time_s", "tokens_per_s"}
    assert ("step_time_s", pytest.approx(want[0].step_time_s), want[0].step) in logged

    # the merge: the job's windows and its estimates
    def rank_result(r):
        return RankResult(rank=r, steps=50, measured_steps=40, throughput=1.0, step_time_s=0.1, utilization=0.5,
                          phase_s={"comm": 0.0}, compute_frac=0.5, optimizer_frac=0.1, data_wait_frac=0.1,
                          h2d_frac=0.0, comm_frac=0.1, other_frac=0.2, peak_mem_mb=1.0,
                          windows_detail=ranks[r])
    merged = job_windows([rank_result(0), rank_result(1)])
    assert merged == want
    job = merge([rank_result(0), rank_result(1)])
    assert job.estimate == estimate_of(want)
    assert job.estimate.mean == pytest.approx(sum(w.throughput * w.wall_s for w in want) / sum(w.wall_s for w in want))
    assert job.utilization_estimate.mean == pytest.approx(
        sum(w.utilization * w.wall_s for w in want) / sum(w.wall_s for w in want))


def test_a_rank_result_round_trips_with_its_keys():
    ranks, _ = expected_windows()
    d = {"param_digest": "abc", "rank": 1, "steps": 50, "measured_steps": 40, "utilization": 0.5,
         "utilization_source": "cpu-time", "throughput": 300.0, "estimate": {"mean": 300.0, "rel_se": 0.01,
         "interval": [290.0, 310.0], "windows": 4, "measured_s": 4.0}, "tokens_per_s": None, "padding_frac": None,
         "warmup": {"steps": 5}, "windows_detail": [w.as_dict() for w in ranks[1]]}
    r = RankResult.from_dict(d)
    assert r.estimate.interval == (290.0, 310.0) and r.windows_detail == ranks[1] and r.extra["param_digest"] == "abc"
    out = r.to_dict()
    assert out["schema_version"] == SCHEMA_VERSION
    assert {k: v for k, v in out.items() if v is not None and k != "schema_version"} == {
        k: v for k, v in d.items() if v is not None}
    assert out["tokens_per_s"] is None and "tokens_per_s" in out  # a measured rank's null figures stay null
    unmeasured = RankResult.from_dict({"rank": 0, "steps": 3, "measured_steps": 0, "utilization_source": "cpu-time"})
    assert "throughput" not in unmeasured.to_dict() and "estimate" not in unmeasured.to_dict()


def test_records_written_before_typed_results_still_load(tmp_path):
    """A 2-rank ddp run's rank files and result.json as the version before typed results wrote
    them (no schema_version): they load, merge again to the same figures, and the tuner and a
    resume read them."""
    from orchestrator.merge import load_rank_results, merge
    from orchestrator.rundir import Status, read_json
    from orchestrator.sweep import collect
    from orchestrator.tune.study import trial_metrics

    run = tmp_path / "run"
    shutil.copytree(OLD, run)
    old = json.loads((run / "result.json").read_text())
    assert "schema_version" not in old and all("schema_version" not in json.loads(p.read_text())
                                              for p in (run / "ranks").glob("rank*.json"))
    job = JobResult.from_dict(read_json(run / "result.json"))
    assert job.status == Status.FINISHED and job.world_size == 2 and job.steps == old["steps"]
    assert isinstance(job.estimate, Estimate) and job.estimate.mean == old["estimate"]["mean"]
    assert job.to_dict() == {"schema_version": SCHEMA_VERSION, **old}  # every key kept, as it was

    ranks = load_rank_results(run)
    assert [r.rank for r in ranks] == [0, 1] and all(r.windows_detail for r in ranks)
    again = merge(ranks)
    for k in ("throughput", "utilization", "step_time_s", "data_wait_frac", "comm_frac", "measured_steps"):
        assert getattr(again, k) == pytest.approx(old[k]), k
    # every field the old merge kept, as it was; the fields added since read None where the old ranks lack them
    assert [{k: r[k] for k in old_r} for r, old_r in zip(again.per_rank, old["per_rank"])] == old["per_rank"]
    assert all(r["start_mem_mb"] is None for r in again.per_rank)
    assert again.estimate.windows == old["estimate"]["windows"]

    m = trial_metrics(old)  # what a study keeps of a trial
    assert m["throughput"] == old["estimate"]["mean"] and m["windows"] == old["estimate"]["windows"]
    assert m["throughput_lo"] == old["estimate"]["interval"][0]

    (tmp_path / "sweep" / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / ".hydra" / "overrides.yaml").write_text("[]\n")
    shutil.copy(run / "result.json", tmp_path / "sweep" / "0" / "result.json")
    row = collect(tmp_path / "sweep")[0]
    assert row["status"] == "FINISHED" and row["throughput"] == old["throughput"]

    failed = {"status": "FAILED", "run_dir": "/x", "mlflow_run_id": None, "error": "its process died"}
    assert JobResult.from_dict(failed).to_dict() == {"schema_version": SCHEMA_VERSION, **failed}


def test_the_parents_record_is_typed_and_written_as_result_json_always_was():
    """The parent's part of result.json (JobResult's Kept attributes): set as attributes, kept in the
    order set, a null it set written as null; the merged figures absorbed between them and the rest."""
    from orchestrator.rundir import Status

    job = JobResult(status=Status.RUNNING, backend="ddp")
    job.mlflow_run_id, job.run_dir, job.mlflow = None, "/x", None
    job.absorb(JobResult(world_size=2, steps=5, measured_steps=4, throughput=10.0, extra={"final_loss": 1.5}))
    job.wall_s, job.straggler = 2.0, None
    out = job.to_dict()
    assert list(out)[:6] == ["schema_version", "status", "backend", "mlflow_run_id", "run_dir", "mlflow"]
    assert out["mlflow_run_id"] is None and "straggler" in out and out["straggler"] is None
    assert out["world_size"] == 2 and out["throughput"] == 10.0 and out["utilization"] is None  # measured: null kept
    assert list(out)[-3:] == ["final_loss", "wall_s", "straggler"]
    back = JobResult.from_dict(out)
    assert back.run_dir == "/x" and back.wall_s == 2.0 and back.to_dict() == out
