"""A run dir has one owner; what a dead owner leaves (ranks, MLflow runs) does not outlive it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from .conftest import ROOT, job_processes, run_cli

# long enough never to end by itself while a test looks at it (each test stops it)
ENDLESS = ["data.args.size=4096", "data.batch_size=8", "sim.read_latency_ms=2", "trainer.max_steps=100000", "trainer.epochs=1000",
           "measure.warmup_steps=1", "measure.window_steps=5", "trainer.log_every=1"]


def cli(args, run_dir, mlflow_uri):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={run_dir}",
                             f"tracking.uri={mlflow_uri}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(check, proc, timeout=90, what="") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise TimeoutError(what)


def logged_steps(run_dir: Path, rank: int = 0) -> int:
    path = run_dir / "ranks" / f"rank{rank}.jsonl"
    if not path.exists():
        return 0
    return sum('"type": "log"' in line or '"type":"log"' in line for line in path.read_text().splitlines())


def stop(proc) -> None:
    """End a job started by a test, whatever state it is in, and everything it started."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def kill_all(run_dir: Path) -> None:
    for p in job_processes(run_dir):
        try:
            p.kill()
        except psutil.Error:
            pass


def test_a_run_dir_has_one_owner_and_a_dead_owners_lock_is_taken_over(tmp_path, capsys):
    from orchestrator.rundir import RunDirOwned, own_run_dir, owned_by

    first = own_run_dir(tmp_path)
    with pytest.raises(RunDirOwned) as caught:
        own_run_dir(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and f"host {socket.gethostname()}, pid {os.getpid()}" in message
    assert owned_by(tmp_path)["pid"] == os.getpid()
    first.release()
    assert owned_by(tmp_path) is None
    again = own_run_dir(tmp_path)
    assert again.previous is None  # released: nothing to take over
    again.release()

    # an owner that dies without releasing (kill -9): its lock goes with it, its record stays
    dead = subprocess.run([sys.executable, "-c", "import os, sys; from orchestrator.rundir import own_run_dir; "
                           f"own_run_dir({str(tmp_path)!r}); print(os.getpid()); sys.stdout.flush(); os._exit(0)"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(dead.stdout.strip())
    assert owned_by(tmp_path) is None
    capsys.readouterr()
    taken = own_run_dir(tmp_path)
    assert taken.previous["pid"] == pid
    note = capsys.readouterr().out.strip()
    assert len(note.splitlines()) == 1 and f"pid {pid}" in note and "taking it over" in note
    taken.release()


def test_a_start_in_an_owned_run_dir_is_refused_before_anything_changes(make_cfg, tmp_path, capsys):
    from orchestrator.__main__ import refuse_if_owned
    from orchestrator.app import run_job
    from orchestrator.rundir import RunDirOwned, own_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    with own_run_dir(run_dir):
        with pytest.raises(SystemExit) as caught:  # the CLI: before Hydra writes .hydra/ there
            refuse_if_owned(["backend=single", f"hydra.run.dir={run_dir}"])
        assert caught.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {os.getpid()}" in err[0]
        with pytest.raises(RunDirOwned, match=f"pid {os.getpid()}"):
            run_job(make_cfg("backend=single", "trainer.max_steps=2"), run_dir, echo=False)
        assert sorted(p.name for p in run_dir.iterdir()) == ["owner.json", "ranks"]  # nothing moved or written
    refuse_if_owned(["backend=single", f"hydra.run.dir={run_dir}"])  # released: no refusal


@pytest.mark.slow  # kept out of the suite's 10 minutes (make test-slow)
def test_a_live_run_refuses_a_resume(tmp_path, mlflow_uri):
    run_dir = tmp_path / "run"
    job = cli(["backend=single", *ENDLESS, "trainer.checkpoint_every=5"], run_dir, mlflow_uri)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), job, what="no checkpoint")
        run_id = json.loads((run_dir / "job.json").read_text())["mlflow_run_id"]
        before = logged_steps(run_dir)
        out = run_cli(["backend=single", *ENDLESS, "trainer.checkpoint_every=5", f"tracking.uri={mlflow_uri}",
                       f"trainer.resume={run_dir}"], timeout=120)
        assert out.returncode == 2, out.stdout + out.stderr
        error = out.stderr.strip().splitlines()
        assert len(error) == 1 and f"host {socket.gethostname()}, pid {job.pid}" in error[0], out.stderr
        # nothing of the live run changed: its ranks/ in place and still written, no attempt archived,
        # its MLflow run neither reopened nor ended, no result.json written for it
        assert not (run_dir / "attempts").exists() and not (run_dir / "result.json").exists()
        wait_for(lambda: logged_steps(run_dir) > before, job, what="the live run stopped logging")
        run = MlflowClient(mlflow_uri).get_run(run_id)
        assert run.info.status == "RUNNING" and "resumed_from_step" not in run.data.tags
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=60)[0]
        assert job.returncode == 143, out
        assert json.loads((run_dir / "result.json").read_text())["status"] == "KILLED"
        assert not (run_dir / "owner.json").read_text()  # released at the end of the run
    finally:
        stop(job)
        kill_all(run_dir)


@pytest.mark.slow  # kept out of the suite's 10 minutes (make test-slow)
def test_ranks_end_with_their_parent_and_the_next_start_closes_its_run(tmp_path, mlflow_uri, make_cfg, capsys):
    """kill -9 of a ddp run's parent: torchrun and both ranks end within seconds; the next start in
    that dir takes the dead owner's lock over and closes its MLflow run FAILED, with a note."""
    from orchestrator.app import run_job

    run_dir = tmp_path / "run"
    job = cli(["backend=ddp", "parallelism.nproc_per_node=2", *ENDLESS], run_dir, mlflow_uri)
    try:
        wait_for(lambda: logged_steps(run_dir, 0) >= 1 and logged_steps(run_dir, 1) >= 1, job, what="no training")
        run_id = json.loads((run_dir / "job.json").read_text())["mlflow_run_id"]
        children = psutil.Process(job.pid).children(recursive=True)
        assert len([p for p in children if "orchestrator.rank" in " ".join(p.cmdline())]) >= 2
        job.kill()
        job.wait(timeout=10)
        end = time.monotonic() + 10
        while job_processes(run_dir) and time.monotonic() < end:
            time.sleep(0.2)
        assert not job_processes(run_dir), [p.cmdline() for p in job_processes(run_dir)]
        client = MlflowClient(mlflow_uri)
        assert client.get_run(run_id).info.status == "RUNNING"  # nobody left to end it

        capsys.readouterr()
        result = run_job(make_cfg("backend=single", "trainer.max_steps=2", *ENDLESS[:3]), run_dir, echo=False, plots=False)
        out = capsys.readouterr().out
        assert f"pid {job.pid}" in out and "taking it over" in out, out
        old = client.get_run(run_id)
        assert old.info.status == "FAILED" and f"pid {job.pid}" in old.data.tags["closed_note"]
        assert result["status"] == "FINISHED" and result["mlflow_run_id"] != run_id
        # the dead attempt's records are kept, saying how it ended
        assert json.loads((run_dir / "attempts" / "1" / "result.json").read_text())["status"] == "FAILED"
    finally:
        stop(job)
        kill_all(run_dir)


def test_a_dead_tuners_runs_are_closed_by_the_next_start(mlflow_uri):
    """The MLflow runs of a study (its parent run, trials, confirmations) carry their owner: those
    left RUNNING by a dead one are closed FAILED, with a note; a live owner's are left alone."""
    from orchestrator.rundir import owner_tag
    from orchestrator.schema import TrackingConfig
    from orchestrator.tracking import Tracker

    tracker = Tracker(TrackingConfig(uri=mlflow_uri, experiment="faults"))
    tracker.check()
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    dead = f"{socket.gethostname()}:{dead_pid}:{time.time() - 5:.2f}"
    ids = {}
    for name, owner in (("dead", dead), ("live", owner_tag()), ("other study", dead)):
        study = "other" if name == "other study" else "s1"
        ids[name] = tracker.sibling().start(name, {}, {"study_name": study, "owner": owner})
    closed = tracker.close_dead_runs("tags.study_name = 's1'", "the study was rerun")
    client = MlflowClient(mlflow_uri)
    assert closed == [ids["dead"]]
    assert client.get_run(ids["dead"]).info.status == "FAILED"
    assert dead_pid in client.get_run(ids["dead"]).data.tags["closed_note"]
    assert client.get_run(ids["live"]).info.status == "RUNNING"
    assert client.get_run(ids["other study"]).info.status == "RUNNING"


@pytest.mark.slow
def test_a_killed_tuners_ranks_end_and_its_rerun_closes_what_it_left(tmp_path, mlflow_uri):
    """kill -9 of a tuner mid-trial: its kept-alive ranks end; the rerun of the study reclaims the
    Optuna trial and closes the dead tuner's MLflow runs (its own and the trial's) FAILED."""
    import optuna

    storage = f"sqlite:///{tmp_path}/optuna.db"
    args = ["mode=tune", "backend=ddp", "parallelism.nproc_per_node=2", "tune.n_trials=1", "tune.study_name=killed",
            f"tune.storage={storage}", "tune.pruner=none", "measure.rel_precision=0", "tune.confirm_top=0",
            "measure.trial_steps=100000", "tune.space.num_workers.high=0", *ENDLESS[:3]]
    first = cli(args, tmp_path / "first", mlflow_uri)
    try:
        wait_for(lambda: any(logged_steps(d) for d in (tmp_path / "first" / "trials").glob("*")), first, timeout=120,
                 what="no trial training")
        first.kill()
        first.wait(timeout=10)
        end = time.monotonic() + 10
        while job_processes(tmp_path / "first") and time.monotonic() < end:
            time.sleep(0.2)
        assert not job_processes(tmp_path / "first"), [p.cmdline() for p in job_processes(tmp_path / "first")]
        client = MlflowClient(mlflow_uri)
        left = client.search_runs([client.get_experiment_by_name("orchestrator").experiment_id],
                                  "tags.study_name = 'killed' and attributes.status = 'RUNNING'")
        assert len(left) == 2  # the tuner's run and the trial's

        second = run_cli([*[a for a in args if not a.startswith("measure.trial_steps")], "measure.trial_steps=4",
                          "tune.n_trials=2", f"hydra.run.dir={tmp_path / 'second'}", f"tracking.uri={mlflow_uri}"],
                         timeout=300)
        assert second.returncode == 0, second.stdout + second.stderr
        for run in left:  # both closed FAILED; the study's parent run was then resumed by the rerun
            closed = client.get_run(run.info.run_id)
            assert f"pid {first.pid}" in closed.data.tags["closed_note"]
            study_run = closed.data.tags["run_kind"] == "study"
            assert closed.info.status == ("FINISHED" if study_run else "FAILED")
            assert ("resumed_at" in closed.data.tags) == study_run
        trials = optuna.load_study(study_name="killed", storage=storage).trials
        assert trials[0].user_attrs.get("interrupted") and trials[0].state == optuna.trial.TrialState.FAIL
    finally:
        stop(first)
        kill_all(tmp_path / "first")


def test_a_new_start_in_a_used_run_dir_does_not_read_the_last_jobs_error(make_cfg, tmp_path):
    """A job that failed left ranks/rank0.err; the next job started in that run dir (not a resume)
    finishes, and the failed job's rank files are kept under attempts/1/."""
    from orchestrator.app import JobFailed, run_job

    with pytest.raises(JobFailed):
        run_job(make_cfg("model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=2", "trainer.max_steps=5"),
                tmp_path, echo=False)
    result = run_job(make_cfg("trainer.max_steps=5"), tmp_path, echo=False)
    assert result["status"] == "FINISHED", result.get("error")
    assert "injected failure" in (tmp_path / "attempts" / "1" / "ranks" / "rank0.err").read_text()
    assert not (tmp_path / "ranks" / "rank0.err").exists()


def test_the_memory_cap_names_the_rank_that_passed_it(make_cfg, tmp_path):
    from orchestrator.app import JobFailed, run_job

    with pytest.raises(JobFailed) as info:
        run_job(make_cfg("trainer.memory_cap_mb=60", "trainer.max_steps=200"), tmp_path, echo=False)
    assert str(info.value).startswith("out of memory: rank 0 (pid "), info.value


def test_a_fresh_tracking_store_prints_nothing_on_stderr(tmp_path):
    """MLflow's INFO lines as it creates its tables are not the user's business."""
    out = run_cli(["trainer.max_steps=3", f"tracking.uri=sqlite:///{tmp_path}/fresh.db", f"hydra.run.dir={tmp_path / 'r'}"])
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
