"""`python -m orchestrator` as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import run_cli


@pytest.mark.slow  # 13 s; test_progress's run (a pty) and make setup's default job run the CLI too
def test_cli_runs_a_job(tmp_path, mlflow_uri):
    out = run_cli(["trainer.max_steps=6", "measure.warmup_steps=1", "measure.window_steps=2",
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
    assert "python -m orchestrator mode=tune experiment=input_bound" in help_.stdout  # a study, not only runs
    assert "python -m orchestrator.runs" in help_.stdout
    job = run_cli(["--cfg", "job", "backend=ddp", "data.batch_size=64"])
    assert job.returncode == 0
    assert "batch_size: 64" in job.stdout and "name: ddp" in job.stdout


def _read_only_dir(tmp_path):
    """A directory this user cannot write: chmod 555, or for root (who writes anyway) sysfs."""
    if os.geteuid() == 0:
        return "/sys/kernel"
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    return str(path)


# every case: one line on stderr, exit 2, nothing launched ({run} is the case's run dir)
BAD_INPUT = [
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
    (["trainer.amp=maybe"], "error: trainer.amp: invalid value 'maybe'; allowed: true, false"),
    (["data.batch_size=[1,2"], "error: data.batch_size: malformed override 'data.batch_size=[1,2'; "
                               "expected data.batch_size=<an integer>"),
    (["model=custom", "model._target_=tests.custom_task.Net"],
     "error: model.args.width: required by tests.custom_task.Net and not given; set it, e.g. +model.args.width=..."),
    (["model=custom", "model._target_=tests.custom_task.not_a_module"],
     "error: model._target_: tests.custom_task.not_a_module returned int, not a torch.nn.Module"),
    (["backend=horovod", "parallelism.hostfile={run}/nowhere.txt"],
     "error: parallelism.hostfile: {run}/nowhere.txt does not exist; allowed: a file of 'host slots=N' lines"),
    (["hydra.run.dir={file}"], "error: hydra.run.dir: {file} is a file, not a directory; allowed:"),
    (["hydra.run.dir={ro}"], "error: hydra.run.dir: cannot write {ro}/"),
    # a password in every URL form: masked on the line and in every file (SECRET below)
    (["tracking.uri=http://user:S3c/retXY@127.0.0.1:9"],
     "error: tracking.uri: the password in http://user:***@127.0.0.1:9 holds '/', where the driver ends the password; "
     "allowed: the password percent-encoded (/ as %2F)"),
    (["mode=tune", "tune.storage=postgresql+psycopg://u:S3cr@tXY@127.0.0.1:1/db"],
     "error: tune.storage: the password in postgresql+psycopg://u:***@127.0.0.1:1/db holds '@'"),
    (["mode=tune", "tune.storage=postgresql+psycopg://u@127.0.0.1:1/db?password=S3crQ"],
     "error: tune.storage: malformed override 'tune.storage=postgresql+psycopg://u@127.0.0.1:1/db?password=***'"),
    (["mode=tune", "tune.storage='postgresql+psycopg://u:S3cr%40tXY@127.0.0.1:1/db?password=S3crQ'"],
     "error: tune.storage: cannot use postgresql+psycopg://u:***@127.0.0.1:1/db?password=*** (psycopg.OperationalError)"),
    # the model's arguments, built on the meta device before launch
    (["model.args.in_features=-5"], "error: model.args: tasks.models.Linear(in_features=-5, out_features=10) cannot be "
                                    "built: RuntimeError: Trying to create tensor with negative dimension -5"),
    (["model.args.in_features=abc"], "error: model.args: tasks.models.Linear(in_features='abc', out_features=10) cannot "
                                     "be built: TypeError: "),
    # odd overrides: no key, no value (refused before Hydra makes a run dir: NO_RUN_DIR)
    (["=5"], "error: malformed override '=5': no key before '='; expected <key>=<value>"),
    (["parallelism.master_addr="], "error: parallelism.master_addr: empty value in 'parallelism.master_addr='; "
                                   "allowed: a value, null"),
    (["parallelism.master_addr=''"], "error: parallelism.master_addr: empty; allowed: a host name or address"),
    (["backend=ddp", "parallelism.nproc_per_node=4096"],
     "error: parallelism.nproc_per_node: 4096 ranks on this machine's "),
    (["mode=tune", "tune.space.accumulation_steps.low=nan"],
     "error: tune.space.accumulation_steps.low: must be a finite number, got nan"),
    (["trainer.resume={run}/nowhere"], "error: trainer.resume: '{run}/nowhere' is not a run directory"),
]
NO_RUN_DIR = ("=5", "parallelism.master_addr=", "trainer.resume={run}/nowhere")
SECRET = "S3c"  # in every password above


@pytest.mark.parametrize("args, expected", BAD_INPUT, ids=[" ".join(a)[:60] for a, _ in BAD_INPUT])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, expected):
    where = {"run": str(tmp_path / "x"), "file": str(tmp_path / "a-file")}
    (tmp_path / "a-file").write_text("")
    if any("{ro}" in a for a in args):
        where["ro"] = _read_only_dir(tmp_path)
    raw, args = args, [a.format(**where) for a in args]
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), where["run"])
    out = run_cli(args + [f"hydra.run.dir={run_dir}", "tracking.enabled=false"])
    assert out.returncode == 2, (args, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected.format(**where)), out.stderr
    assert not (Path(run_dir) / "ranks").exists()  # nothing launched
    if set(NO_RUN_DIR) & set(raw):
        assert not Path(run_dir).exists()  # refused before Hydra made it
    assert SECRET not in out.stdout + out.stderr and leaks(tmp_path, SECRET) == []


def test_cli_empty_dataset_is_one_clear_line(tmp_path):
    """A dataset of 0 items is found by the rank that builds it: one line naming the factory."""
    out = run_cli(["data=custom", "data._target_=tests.custom_task.make_dataset", "+data.args.items=0", "model=custom",
                   "model._target_=tests.custom_task.Net", "+model.args.width=4", "tracking.enabled=false",
                   f"hydra.run.dir={tmp_path}"])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: job failed: rank 0 failed: data._target_: tests.custom_task.make_dataset "
                               "returned a dataset of 0 items"), lines


@pytest.mark.parametrize("args, expected", [
    (["model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=2"],
     r"error: job failed: rank 0 failed in forward \(\S+/tasks/faults.py:\d+\): RuntimeError: injected failure on rank 0 "
     r"at forward 2 \(traceback in ranks/rank0.err\) \(run dir: \S+\)$"),
    (["model.loss=model"], r"error: job failed: rank 0 failed: model.loss=model: the batch is a list of 2 item\(s\) and the "
                           r"model is called as model\(\*batch\), but Linear.forward\(x\) does not take 2 argument\(s\); "),
    (["data.batch_size=8192"], r"error: job failed: rank 0 failed: data.batch_size: 8192 is more than the dataset's 4096 "
                               r"items give each of the 1 rank\(s\) with data.drop_last=True; allowed: at most 4096"),
], ids=["user-code", "model-loss", "batch-over-dataset"])
def test_cli_a_rank_failure_is_one_line_naming_the_rank(tmp_path, mlflow_uri, args, expected):
    """What fails in the rank (the user's code, a batch the loss cannot take, a dataset smaller
    than a batch) is one line naming the rank, the function and the error, printed once; a
    traceback stays in the rank's file."""
    import re

    out = run_cli([*args, "trainer.max_steps=5", f"tracking.uri={mlflow_uri}", f"hydra.run.dir={tmp_path}"])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1 and re.match(expected, lines[0]), out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    if "traceback in" in lines[0]:
        assert "RuntimeError: injected failure" in (tmp_path / "ranks" / "rank0.err").read_text()


@pytest.mark.parametrize("args, expected", [
    (["trainer.lr=1e30", "trainer.max_steps=30"],
     r"error: rank 0 diverged at step \d+: the loss is \S+, over 1000 x the first logged loss \(\S+\); lower trainer.lr "
     r"or turn off trainer.amp; no checkpoint was written before it \(run dir: \S+\)$"),
    (["model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=5", "+model.args.nan=true",
      "trainer.checkpoint_every=2", "trainer.max_steps=30", "measure.noise_scale=false"],  # one forward a step
     r"error: rank 0 diverged at step 6: the loss is nan \(not finite\); lower trainer.lr or turn off trainer.amp; "
     r"the last good checkpoint, step 2, is kept: \S+/checkpoints/step_00000002.pt \(run dir: \S+\)$"),
], ids=["exploding", "nan"])
def test_cli_a_diverged_run_ends_diverged_in_one_line(tmp_path, args, expected):
    """A loss that explodes (lr=1e30) or turns NaN mid-run: result.json DIVERGED, exit 4, one line
    naming the step, the loss and the last good checkpoint, which is kept."""
    import re

    out = run_cli([*args, "tracking.enabled=false", f"hydra.run.dir={tmp_path}"])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 4 and len(lines) == 1 and re.match(expected, lines[0]), out.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "DIVERGED"
    kept = re.search(r"is kept: (\S+)", lines[0])
    assert kept is None or Path(kept.group(1)).exists()


@pytest.mark.parametrize("limit, args, code, expected", [
    (100, [], 2, "error: hydra.run.dir: cannot write {run} (File too large; "),  # Hydra's first record
    (30000, ["trainer.checkpoint_every=10"], 1,
     "error: job failed: rank 0 failed: {run}/checkpoints/step_00000010.pt: cannot write (File too large; "),
], ids=["at-start", "checkpoint"])
def test_cli_a_full_disk_is_one_line_naming_the_file(tmp_path, limit, args, code, expected):
    """A disk that fills (here: a file-size limit, EFBIG as ENOSPC) is one line naming the file and
    the free space; no temporary file is left, and a run that started ends FAILED in result.json."""
    run = tmp_path / "run"
    out = run_cli(["trainer.max_steps=20", *args, "tracking.enabled=false", f"hydra.run.dir={run}"],
                  file_size_limit=limit)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code and len(lines) == 1 and lines[0].startswith(expected.format(run=run)), out.stderr
    assert " free there)" in lines[0] and "Traceback" not in out.stdout + out.stderr
    assert not list(tmp_path.rglob("*.tmp"))
    if code == 1:
        assert json.loads((run / "result.json").read_text())["status"] == "FAILED"


def leaks(root, secret: str) -> list:
    """Every file under `root` that holds `secret`."""
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_passwords_in_store_urls_are_masked_everywhere(tmp_path):
    """A password in tune.storage or tracking.uri is in no file the run writes (its records,
    .hydra/, the sweep's, the MLflow store and artifacts) and in no message."""
    from mlflow.tracking import MlflowClient

    secret = "Pw-only-in-the-url-7"
    store = f"sqlite:///{tmp_path}/mlflow.db"
    out = run_cli(["-m", "trainer.max_steps=4", "measure.warmup_steps=1", "measure.window_steps=2",
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
                                          "mlp_accumulation, transformer_lm, variable_length_lm"),
                           ("model", "convnet, custom, linear, linear_regression, many_small, mlp, seq_lm, transformer"),
                           ("data", "custom, dummy, images, random_classification, regression, small_features, tokens, "
                                    "var_tokens"),
                           ("backend", "ddp, dp, fsdp, horovod, single")]:
        out = run_cli([f"{group}=nope", f"hydra.run.dir={tmp_path / group}"])
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and lines == [f"error: {group}: unknown choice 'nope'; allowed: {options}"], out.stderr
        assert not (tmp_path / group).exists()  # nothing launched, no run dir
