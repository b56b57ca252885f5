"""A whole job through `run_job` (ranks in subprocesses): result.json, MLflow contents, faults."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.app import JobFailed, run_job
from orchestrator.schema import ConfigError

RESULT_KEYS = {"status", "utilization", "utilization_source", "throughput", "data_wait_frac", "comm_frac",
               "peak_mem_mb", "per_rank", "mlflow_run_id"}


def mlflow_run(cfg, run_id):
    return MlflowClient(cfg.tracking.uri).get_run(run_id)


def test_job_writes_result_and_mlflow_run(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=12", "tracking.experiment=test-job")
    result = run_job(cfg, tmp_path, echo=False)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert RESULT_KEYS <= on_disk.keys()
    assert on_disk["status"] == "FINISHED" and on_disk["steps"] == 12
    assert on_disk["utilization_source"] == "cpu-busy" and 0 < on_disk["utilization"] <= 1
    assert len(on_disk["per_rank"]) == 1 and RESULT_KEYS - {"status", "per_rank", "mlflow_run_id"} <= on_disk["per_rank"][0].keys()
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "model.pt").exists()
    assert result["mlflow_run_id"] == on_disk["mlflow_run_id"]

    run = mlflow_run(cfg, result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["data.batch_size"] == "32"
    assert run.data.params["model._target_"] == "tasks.models.Linear"
    tags = run.data.tags
    assert (tags["backend"], tags["world_size"], tags["utilization_source"], tags["device"]) == ("single", "1", "cpu-busy", "cpu")
    for key in ("utilization", "throughput", "data_wait_frac", "comm_frac", "peak_mem_mb"):
        assert key in run.data.metrics, key
    client = MlflowClient(cfg.tracking.uri)
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in loss][:3] == [1, 2, 3] and len(loss) == 12  # log_every=1
    assert len(client.get_metric_history(run.info.run_id, "throughput")) >= 5  # one per window
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "result.json"} <= artifacts


def test_training_error_marks_run_failed(make_cfg, tmp_path):
    cfg = make_cfg("model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=2", "trainer.max_steps=5")
    with pytest.raises(JobFailed) as info:
        run_job(cfg, tmp_path, echo=False)
    result = info.value.result
    assert result["status"] == "FAILED"
    assert "injected failure on rank 0" in result["error"]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "FAILED"
    assert mlflow_run(cfg, result["mlflow_run_id"]).info.status == "FAILED"


def test_bad_tracking_uri_launches_nothing(make_cfg, tmp_path):
    cfg = make_cfg("tracking.uri=http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="tracking.uri: no MLflow server answers at http://127.0.0.1:9"):
        run_job(cfg, tmp_path, echo=False)
    assert not (tmp_path / "ranks").exists() and not (tmp_path / "result.json").exists()


def test_no_run_left_running(make_cfg):
    cfg = make_cfg()
    client = MlflowClient(cfg.tracking.uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    assert not client.search_runs(exps, "attributes.status = 'RUNNING'")
