"""`python -m orchestrator` as a user runs it, in a subprocess."""

from __future__ import annotations

import json

from .conftest import run_cli


def test_cli_runs_a_job(tmp_path, mlflow_uri):
    out = run_cli(["trainer.max_steps=6", "trainer.warmup_steps=1", "trainer.window_steps=2",
                   f"tracking.uri={mlflow_uri}", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr
    assert f"run dir: {tmp_path}" in out.stdout
    assert "utilization" in out.stdout and "FINISHED" in out.stdout  # the summary table
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "FINISHED" and result["steps"] == 6
    assert (tmp_path / ".hydra" / "config.yaml").exists()


def test_cli_help_and_cfg():
    help_ = run_cli(["--help"])
    assert help_.returncode == 0 and "backend: ddp, dp, fsdp, horovod, single" in help_.stdout
    groups = help_.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "schema" not in groups  # the schemas behind the groups are not options
    job = run_cli(["--cfg", "job", "backend=ddp", "data.batch_size=64"])
    assert job.returncode == 0
    assert "batch_size: 64" in job.stdout and "name: ddp" in job.stdout


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    for args, expected in [
        (["data.batch_size=0"], "error: data.batch_size: must be an integer >= 1, got 0"),
        (["backend=nope"], "error: backend: unknown choice 'nope'; allowed: ddp, dp, fsdp, horovod, single"),
        (["backend=fsdp", "parallelism.nproc_per_node=2", "experiment=transformer_lm", "backend.shard_modules=[Block]"],
         "error: backend.shard_modules: Block is no module class of tasks.models.TinyTransformerLM; allowed: Dropout, "
         "Embedding, LayerNorm, Linear, ModuleList, MultiheadAttention"),
        (["backend=fsdp", "parallelism.nproc_per_node=4", "parallelism.shard_size=3"],
         "error: parallelism.shard_size: 3 does not divide the world size 4 (nproc_per_node x nnodes); "
         "allowed: 0 (all ranks), 1, 2, 4"),
        (["data.nope=1"], "error: data.nope: unknown key in data; allowed:"),
        (["mode=tune", "tune.n_trials=0"], "error: tune.n_trials: must be >= 1, got 0"),
    ]:
        out = run_cli(args + [f"hydra.run.dir={tmp_path / 'x'}"])
        assert out.returncode == 2, (args, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(expected), out.stderr
        assert not (tmp_path / "x" / "ranks").exists()  # nothing launched


def test_cli_failed_job_shows_traceback(tmp_path, mlflow_uri):
    out = run_cli(["model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=2", "trainer.max_steps=5",
                   f"tracking.uri={mlflow_uri}", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "RuntimeError: injected failure on rank 0" in out.stderr
    assert "error: job failed: rank 0 failed" in out.stderr


def leaks(root, secret: str) -> list:
    """Every file under `root` that holds `secret`."""
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_passwords_in_store_urls_are_masked_everywhere(tmp_path):
    """A password in tune.storage or tracking.uri is in no file the run writes (its records,
    .hydra/, the sweep's, the MLflow store and artifacts) and in no message."""
    from mlflow.tracking import MlflowClient

    secret = "Pw-only-in-the-url-7"
    store = f"sqlite:///{tmp_path}/mlflow.db"
    out = run_cli(["-m", "trainer.max_steps=4", "trainer.warmup_steps=1", "trainer.window_steps=2",
                   f"tune.storage=postgresql+psycopg://u:{secret}@127.0.0.1:1/optuna", f"tracking.uri={store}",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert out.returncode == 0, out.stderr
    assert secret not in out.stdout + out.stderr
    assert leaks(tmp_path, secret) == []
    result = json.loads((tmp_path / "sweep" / "0" / "result.json").read_text())
    params = MlflowClient(store).get_run(result["mlflow_run_id"]).data.params
    assert params["tune.storage"] == "postgresql+psycopg://u:***@127.0.0.1:1/optuna"

    bad = run_cli([f"tracking.uri=http://u:{secret}@127.0.0.1:9", f"hydra.run.dir={tmp_path / 'bad'}"])
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: tracking.uri: no MLflow server answers at http://u:***@"), lines
    assert secret not in bad.stdout + bad.stderr and leaks(tmp_path, secret) == []


def test_cli_unknown_group_option_is_one_line_exit_2(tmp_path):
    """A typo in a group option never runs the default job: one line listing the options."""
    for group, options in [("experiment", "comm_heavy, input_bound, linear_classifier, linear_regression, "
                                          "mlp_accumulation, transformer_lm"),
                           ("model", "convnet, custom, linear, linear_regression, many_small, mlp, transformer"),
                           ("data", "custom, dummy, images, random_classification, regression, small_features, tokens"),
                           ("backend", "ddp, dp, fsdp, horovod, single")]:
        out = run_cli([f"{group}=nope", f"hydra.run.dir={tmp_path / group}"])
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and lines == [f"error: {group}: unknown choice 'nope'; allowed: {options}"], out.stderr
        assert not (tmp_path / group).exists()  # nothing launched, no run dir
