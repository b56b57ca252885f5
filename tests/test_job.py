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
    assert on_disk["utilization_source"] == "cpu-time" and 0 < on_disk["utilization"] <= 1
    assert len(on_disk["per_rank"]) == 1 and RESULT_KEYS - {"status", "per_rank", "mlflow_run_id"} <= on_disk["per_rank"][0].keys()
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "model.pt").exists()
    assert result["mlflow_run_id"] == on_disk["mlflow_run_id"]

    run = mlflow_run(cfg, result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["data.batch_size"] == "32"
    assert run.data.params["model._target_"] == "tasks.models.Linear"
    tags = run.data.tags
    assert (tags["backend"], tags["world_size"], tags["utilization_source"], tags["device"]) == ("single", "1", "cpu-time", "cpu")
    for key in ("utilization", "throughput", "data_wait_frac", "comm_frac", "peak_mem_mb", "mfu"):
        assert key in run.data.metrics, key
    assert 0 < on_disk["mfu"] <= 1 and on_disk["per_rank"][0]["mfu"] == on_disk["mfu"]
    assert on_disk["nvml_util"] is None and on_disk["nvml_util_source"].startswith("absent")  # a CPU run
    client = MlflowClient(cfg.tracking.uri)
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in loss][:3] == [1, 2, 3] and len(loss) == 12  # log_every=1
    # the windows' one point (they measured milliseconds: LiveLog pools a second's), then the summary's
    assert [m.step for m in client.get_metric_history(run.info.run_id, "throughput")][-1] == 12
    assert len(client.get_metric_history(run.info.run_id, "throughput")) == 2
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


def test_no_run_left_running(make_cfg, tmp_path):
    """Whatever way a job ends (finished, failed, stopped by its monitor), its MLflow run is closed."""
    from orchestrator.app import JobStopped

    common = ["tracking.experiment=left-running", "trainer.max_steps=8"]
    run_job(make_cfg(*common), tmp_path / "ok", echo=False)
    with pytest.raises(JobFailed):
        run_job(make_cfg(*common, "model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=2"),
                tmp_path / "failed", echo=False)
    with pytest.raises(JobStopped):
        run_job(make_cfg(*common, "trainer.max_steps=400", "sim.read_latency_ms=1"), tmp_path / "stopped", echo=False,
                monitor=lambda window, job: True)
    client = MlflowClient(make_cfg().tracking.uri)
    runs = client.search_runs([client.get_experiment_by_name("left-running").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED", "KILLED"]


def test_devices_this_machine_lacks_are_refused_before_launch(make_cfg, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for overrides, expected in [
        (["backend.device=cuda"], "backend.device: cuda requested but torch.cuda.is_available() is False; allowed here"),
        (["backend=ddp", "parallelism.nproc_per_node=2", "backend.dist_backend=nccl"],
         "backend.dist_backend: nccl needs CUDA devices; allowed on CPU: gloo, auto"),
    ]:
        with pytest.raises(ConfigError) as info:
            run_job(make_cfg(*overrides), tmp_path / "x", echo=False)
        assert str(info.value).startswith(expected) and "\n" not in str(info.value)
        assert not (tmp_path / "x" / "ranks").exists()  # nothing launched


@pytest.mark.parametrize("outcome, reported, expected", [
    (dict(returncode=0), 2, ("FINISHED", "")),
    (dict(returncode=0), 1, ("FAILED", "only 1 of 2 ranks reported a result")),
    (dict(returncode=-15, stopped=True), 0, ("KILLED", "stopped by the monitor (pruned)")),
    (dict(returncode=-9, timed_out=True), 0, ("FAILED", "timed out after trainer.timeout_s=5s")),
    (dict(returncode=-9, over_memory="process 7 used 90 MB > trainer.memory_cap_mb=50"), 0,
     ("FAILED", "out of memory: process 7 used 90 MB > trainer.memory_cap_mb=50")),
    (dict(returncode=1, failed_rank=1), 1, ("FAILED", "rank 1 failed")),
    (dict(returncode=3), 0, ("FAILED", "launcher exited with code 3")),
])
def test_outcome_classification(outcome, reported, expected):
    from orchestrator.finish import classify
    from orchestrator.supervise import Outcome

    assert classify(Outcome(**outcome), reported, 2, 5.0) == expected


def test_own_model_and_data_without_inherited_args(make_cfg, tmp_path):
    """docs/running.md's promise: model=custom / data=custom start from empty args, so a plain signature
    (no **kwargs) takes exactly the arguments given."""
    cfg = make_cfg("model=custom", "model._target_=tests.custom_task.Net", "+model.args.width=8", "data=custom",
                   "data._target_=tests.custom_task.make_dataset", "+data.args.items=64", "data.batch_size=8",
                   "trainer.max_steps=6")
    assert cfg.model.args == {"width": 8} and cfg.data.args == {"items": 64}
    result = run_job(cfg, tmp_path, echo=False)
    assert result["status"] == "FINISHED" and result["steps"] == 6


def test_full_disk_fails_the_run_in_one_line_and_keeps_no_empty_record(make_cfg, tmp_path, monkeypatch):
    """The run dir's disk fills up while the parent writes result.json: the write leaves no empty
    or half-written file, the MLflow run ends FAILED (not RUNNING), and the error is one line
    naming the file and the cause."""
    import errno
    import os
    from pathlib import Path

    real = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if self.name.startswith("result.json"):
            self.open("w").close()  # what a full disk leaves of a file written in place
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    cfg = make_cfg("trainer.max_steps=4", "tracking.experiment=full-disk")
    with pytest.raises(JobFailed) as info:
        run_job(cfg, tmp_path, echo=False)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "result.json") in message, message
    assert "No space left on device" in message
    assert not (tmp_path / "result.json").exists() and not list(tmp_path.glob("*.tmp"))
    result = info.value.result
    assert result["status"] == "FAILED" and mlflow_run(cfg, result["mlflow_run_id"]).info.status == "FAILED"


def test_the_summary_names_its_run_dir_on_one_line(capsys, tmp_path):
    """Piped, a run's summary keeps its run dir whole: a table's title wraps at the table's width
    (a 2-column summary split a 60-character path over three lines)."""
    from orchestrator.app import print_summary

    run_dir = tmp_path / ("a-long-run-dir-name-" * 6)
    print_summary({"status": "FINISHED", "backend": "single", "world_size": 1, "steps": 2}, run_dir)
    assert f"run {run_dir}" in capsys.readouterr().out.splitlines()
