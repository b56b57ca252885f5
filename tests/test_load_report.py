"""The load report: the diagnosis on workloads with a known bottleneck, shares that add up,
profiler output, plots and MLflow artifacts."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.app import run_job
from orchestrator.diagnose import diagnose
from orchestrator.load_report import SHARE_TOLERANCE

MEASURE = ["trainer.warmup_steps=2", "trainer.window_steps=2"]  # many short windows: a robust median


def report_of(run_dir):
    return json.loads((run_dir / "load_report.json").read_text())


def test_read_latency_is_input_bound(make_cfg, tmp_path):
    cfg = make_cfg("experiment=input_bound", "data.read_latency_ms=3", "data.args.blur_passes=1",
                   "trainer.max_steps=14", *MEASURE)
    result = run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "input-bound" == result["bottleneck"]
    assert any("data.num_workers from 0 to 2" in a for a in rep["diagnosis"]["advice"])
    md = (tmp_path / "load_report.md").read_text()
    assert "**input-bound**" in md and "raise data.num_workers" in md
    client = MlflowClient(cfg.tracking.uri)
    names = {a.path for a in client.list_artifacts(result["mlflow_run_id"])}
    assert {"load_report.json", "load_report.md", "timeline.png", "breakdown.png"} <= names
    assert client.get_run(result["mlflow_run_id"]).data.tags["diagnosis"] == "input-bound"


def test_tiny_compute_many_parameters_on_two_ranks_is_communication_bound(make_cfg, tmp_path):
    cfg = make_cfg("experiment=comm_heavy", "backend=ddp", "parallelism.nproc_per_node=2", "trainer.max_steps=30",
                   *MEASURE)
    run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "communication-bound", rep["job"]
    assert any("trainer.accumulation_steps from 1 to 4" in a for a in rep["diagnosis"]["advice"])
    assert len(rep["per_rank"]) == 2 and rep["imbalance"]["straggler_rank"] in (0, 1)


def test_transformer_is_compute_bound_and_profiled(make_cfg, tmp_path):
    cfg = make_cfg("experiment=transformer_lm", "data.batch_size=8", "trainer.max_steps=20", "trainer.profile_steps=2",
                   *MEASURE)
    result = run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "compute-bound", rep["job"]
    # warmup and profiled steps are not measured, nor the step that follows the profiler's teardown
    assert result["measured_steps"] == 20 - 2 - 2 - 1 and result["warmup"]["after"] == "profiler"
    ops = rep["profile"]["top_ops"]
    assert len(ops) == 15 and any(op["name"].startswith("aten::") and op["input_shapes"] not in ("", "[]") for op in ops)
    times = [op["self_cpu_ms"] for op in ops]
    assert times == sorted(times, reverse=True) and times[0] > 0  # the top by self time (CPU here)
    assert (tmp_path / "ranks" / "trace_rank0.json").stat().st_size > 1000
    names = {a.path for a in MlflowClient(cfg.tracking.uri).list_artifacts(result["mlflow_run_id"], "traces")}
    assert names == {"traces/trace_rank0.json"}
    # the shares add up to the measured step time, within the stated tolerance
    for ratio in rep["share_check"]["phase_sum_over_step_time"].values():
        assert ratio == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    for r in rep["per_rank"]:
        assert sum(r["shares"].values()) == pytest.approx(1.0, abs=SHARE_TOLERANCE)


def test_memory_bound_when_the_device_is_nearly_full(make_cfg):
    cfg = make_cfg("data.batch_size=64")
    job = {"data_wait_frac": 0.5, "h2d_frac": 0.0, "comm_frac": 0.0, "compute_frac": 0.5, "optimizer_frac": 0.0,
           "peak_mem_mb": 950.0, "world_size": 1, "per_rank": [{"device": "cuda:0"}]}
    d = diagnose(job, cfg, device_mem_mb=1000.0)
    assert d.verdict == "memory-bound"
    assert d.advice[0].startswith("lower data.batch_size to 32 and raise trainer.accumulation_steps to 2")
    assert diagnose(job, cfg, device_mem_mb=4000.0).verdict == "input-bound"
