"""Many machines, one study: tuner processes sharing a study on a real PostgreSQL, an MLflow server
backed by the same PostgreSQL, bad storage URLs, and the database restarted mid-study."""

from __future__ import annotations

import subprocess
import sys
import time

import optuna
import pytest
from mlflow.tracking import MlflowClient

from orchestrator.schema import ConfigError
from orchestrator.tune.rules import counted
from orchestrator.tune.study import run_study

from .conftest import ROOT, job_processes, mlflow_ui, run_cli
from .pg import PASSWORD, PostgresServer, pg_bin

pytestmark = pytest.mark.skipif(pg_bin() is None, reason="PostgreSQL is not installed (make setup installs it)")

TUNE = ["mode=tune", "measure.warmup_steps=2", "measure.trial_steps=8", "measure.window_steps=4", "tune.pruner=none",
        "measure.rel_precision=0", "tune.confirm_top=0", "tune.patience=0",
        "tune.space.batch_size.high=32", "tune.space.num_workers.high=0"]


@pytest.fixture(scope="module")
def pg():
    server = PostgresServer(["optuna", "mlflow"])
    yield server
    server.stop()


def tuners(n: int, args: list, tmp_path, tag: str) -> list:
    return [subprocess.Popen([sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={tmp_path}/{tag}{i}"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]


@pytest.mark.slow
def test_four_tuners_one_postgres_study_and_mlflow_server(pg, tmp_path):
    with mlflow_ui(pg.url("mlflow"), tmp_path / "artifacts", tmp_path / "ui.log") as url:
        args = [*TUNE, "tune.n_trials=12", "tune.study_name=shared", f"tune.storage={pg.url('optuna')}",
                f"tracking.uri={url}", "tracking.experiment=pg-study"]
        procs = tuners(4, args, tmp_path, "p")
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
        assert PASSWORD not in "".join(outs)  # the storage URL is shown with its password masked
        study = optuna.load_study(study_name="shared", storage=pg.url("optuna"))
        assert counted(study.trials) == 12 and all(t.state.is_finished() for t in study.trials)
        numbers = [t.number for t in study.trials]
        assert len(numbers) == len(set(numbers))  # none counted twice
        client = MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name("pg-study").experiment_id])
        parents = {r.info.run_id for r in runs if r.data.tags.get("mode") == "tune"}
        assert len(parents) == 4
        launched = {t.user_attrs["mlflow_run_id"] for t in study.trials if t.user_attrs.get("mlflow_run_id")}
        nested = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents
                  and "confirm_of" not in r.data.tags}
        assert launched == set(nested)  # every trial's nested run, under a study's parent run
        assert all(r.info.status != "RUNNING" for r in runs)


def test_bad_storage_is_one_line_before_any_trial(pg, make_cfg, tmp_path):
    for storage, expected in [
        (pg.url("optuna", password="wrong"), "password authentication failed"),
        (f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:1/optuna", "127.0.0.1"),
    ]:
        with pytest.raises(ConfigError) as info:
            run_study(make_cfg(*TUNE, f"tune.storage={storage}"), tmp_path, echo=False)
        message = str(info.value)
        assert message.startswith("tune.storage: cannot use postgresql+psycopg://postgres:***@127.0.0.1:"), message
        assert expected in message and "\n" not in message and PASSWORD not in message
        assert not (tmp_path / "trials").exists()


@pytest.mark.slow  # 30 s; a server restart mid-study
def test_database_restart_mid_study_loses_nothing(pg, tmp_path, mlflow_uri):
    storage = pg.url("optuna")
    args = [*TUNE, "tune.n_trials=6", "tune.study_name=restart", f"tune.storage={storage}",
            f"tracking.uri={mlflow_uri}", "sim.read_latency_ms=0.3"]
    procs = tuners(2, args, tmp_path, "r")
    end = time.monotonic() + 180
    while time.monotonic() < end:
        try:
            done = sum(t.state == optuna.trial.TrialState.COMPLETE
                       for t in optuna.load_study(study_name="restart", storage=storage).trials)
        except KeyError:
            done = 0
        if done >= 2:
            break
        time.sleep(0.2)
    pg.restart()
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):  # each went on, or stopped saying what to do
        assert p.returncode == 0 or "the study's database failed" in out, out
    before = {t.number for t in optuna.load_study(study_name="restart", storage=storage).trials
              if t.state == optuna.trial.TrialState.COMPLETE}
    again = tuners(1, args, tmp_path, "again")[0]
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    trials = optuna.load_study(study_name="restart", storage=storage).trials
    assert counted(trials) == 6 and all(t.state.is_finished() for t in trials)
    assert before <= {t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert not any(job_processes(tmp_path / f"r{i}") for i in range(2))


@pytest.mark.slow  # 40 s: a real study on PostgreSQL three ways; test_cli's masking test greps a run dir in the suite
def test_store_passwords_stay_out_of_records_and_command_lines(pg, tmp_path):
    """The password of tune.storage is in no file of the study's run dir (trials' config.yaml,
    .hydra/, summary.json), not in the MLflow store and its artifacts, not in the output; a tuner
    can take it from the environment instead (PGPASSWORD, or ${oc.env:VAR} in the URL); the MLflow
    server of scripts/ui.sh has no password on its command line."""
    import psutil

    from .test_cli import leaks

    store = f"sqlite:///{tmp_path}/mlflow.db"
    common = [*TUNE, "tune.study_name=secret", f"tracking.uri={store}", "tracking.experiment=secret"]
    nopw = pg.url("optuna").replace(f":{PASSWORD}@", "@")
    for n, storage, env in [
        (2, pg.url("optuna"), {}),  # in the URL, as given
        (3, nopw, {"PGPASSWORD": PASSWORD}),  # libpq's own variable
        (4, pg.url("optuna", password="${oc.env:OPTUNA_DB_PASSWORD}"), {"OPTUNA_DB_PASSWORD": PASSWORD}),
    ]:
        out = run_cli([*common, f"tune.n_trials={n}", f"tune.storage={storage}", f"hydra.run.dir={tmp_path / str(n)}"],
                      timeout=300, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert PASSWORD not in out.stdout + out.stderr
        assert (tmp_path / str(n) / "trials").exists()
    assert leaks(tmp_path, PASSWORD) == []
    study = optuna.load_study(study_name="secret", storage=pg.url("optuna"))
    assert counted(study.trials) == 4

    with mlflow_ui(pg.url("mlflow"), tmp_path / "artifacts", tmp_path / "ui.log"):
        shown = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        assert [c for c in shown if PASSWORD in c] == []
    assert PASSWORD not in (tmp_path / "ui.log").read_text()
