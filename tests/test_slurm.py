"""Runs, sweeps and studies on a real SLURM: a 2-node cluster on this machine (tests/slurm.py).
Its two nodes share this machine's cores, so the tests run one SLURM job at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from mlflow.tracking import MlflowClient

from orchestrator import slurm
from orchestrator.launch import build_launch
from orchestrator.schema import ConfigError

from .conftest import ROOT
from .slurm import SlurmCluster, skip_reason
from .test_distributed import WORKLOAD, reference_params

needs_slurm = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

ALLOC = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1,n2", "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "n1"}


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster().start()
    yield c
    c.stop()


def sbatch(cluster: SlurmCluster, tmp_path: Path, args: list, sbatch_args: tuple = ("--nodes=2", "--exclusive"),
           timeout: float = 300) -> tuple:
    """`python -m orchestrator ARGS` as the batch script of a SLURM job; waits for it. (returncode, output)"""
    out = tmp_path / "job.out"
    cmd = " ".join([sys.executable, "-m", "orchestrator", *[f"'{a}'" for a in args]])
    done = cluster.run("sbatch", "--wait", *sbatch_args, f"--output={out}", f"--chdir={ROOT}", "--wrap", cmd,
                       timeout=timeout, check=False)
    cluster.wait_idle()
    return done.returncode, (out.read_text() if out.exists() else "") + done.stderr


def test_allocation_resolves_and_refuses_in_one_line(make_cfg, tmp_path):
    said: list = []
    cfg = slurm.resolve(make_cfg("backend=ddp"), ALLOC, say=said.append)
    p = cfg.parallelism
    assert (p.launcher.value, p.nnodes, p.nproc_per_node, cfg.world_size) == ("slurm", 2, 1, 2)
    assert len(said) == 1 and "SLURM job 7 spans 2 nodes" in said[0]  # auto says it picked slurm
    ln = build_launch(cfg, tmp_path, environ=ALLOC)
    cmd = ln.cmd
    assert ln.death_signal == signal.SIGTERM  # srun forwards it to the step's tasks on every node
    srun_end = cmd.index("--unbuffered")
    assert cmd[0].endswith("srun") and {"--nodes=2", "--ntasks-per-node=1", "--nodelist=n1,n2", "--overlap"} <= set(cmd[:srun_end])
    assert "--rdzv-backend=c10d" in cmd and any(a.startswith("--rdzv-endpoint=n1:") for a in cmd)
    assert not any(a.startswith(("--node-rank", "--master-addr")) for a in cmd)
    one = slurm.resolve(make_cfg("backend=single"), ALLOC, say=said.append)
    assert one.world_size == 1 and "--nodelist=n1" in build_launch(one, tmp_path, environ=ALLOC).cmd
    # a one-node job under auto, and launcher=local, stay on this machine
    assert slurm.resolve(make_cfg("backend=ddp"), {**ALLOC, "SLURM_JOB_NODELIST": "n1"}).parallelism.launcher.value == "auto"
    assert slurm.resolve(make_cfg("backend=ddp", "parallelism.launcher=local"), ALLOC).parallelism.nnodes == 1
    gpus = slurm.resolve(make_cfg("backend=ddp"), {**ALLOC, "SLURM_GPUS_ON_NODE": "2"}, say=said.append)
    assert gpus.parallelism.nproc_per_node == 2  # GPUs per node where the job holds GPUs
    for overrides, env, field in ((["parallelism.launcher=slurm"], {}, "parallelism.launcher"),
                                  (["backend=ddp", "parallelism.nproc_per_node=3"], ALLOC, "parallelism.nproc_per_node"),
                                  (["backend=ddp", "parallelism.nnodes=3", "parallelism.master_port=1234"], ALLOC,
                                   "parallelism.nnodes")):
        with pytest.raises(ConfigError) as err:
            slurm.resolve(make_cfg(*overrides), env, say=said.append)
        assert str(err.value).startswith(field + ":") and "\n" not in str(err.value) and "allowed" in str(err.value)
    with pytest.raises(ConfigError, match="^parallelism.launcher: slurm takes the nodes"):
        make_cfg("parallelism.launcher=slurm", "parallelism.nnodes=2", "parallelism.node_rank=1",
                 "parallelism.master_port=5")


@pytest.mark.slow
@needs_slurm
def test_two_node_ddp_under_srun_equals_one_process(cluster, make_cfg, mlflow_uri, tmp_path):
    run_dir = tmp_path / "run"
    code, out = sbatch(cluster, tmp_path, ["backend=ddp", *WORKLOAD, "measure.warmup_steps=1", "measure.window_steps=2",
                                           "trainer.log_every=1", f"tracking.uri={mlflow_uri}", f"hydra.run.dir={run_dir}"])
    assert code == 0, out + cluster.logs()
    assert "spans 2 nodes: launching on them with srun" in out
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "FINISHED" and result["world_size"] == 2 and result["steps"] == 6
    assert len({r["param_digest"] for r in result["per_rank"]}) == 1
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]
    assert len(ranks) == 2 and {r["rank"] for r in ranks} == {0, 1}
    got = torch.load(run_dir / "model.pt")
    want = reference_params(make_cfg, 1)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())
    run = MlflowClient(mlflow_uri).get_run(result["mlflow_run_id"])  # one run, node 0's, as on one machine
    assert (run.data.tags["world_size"], run.data.tags["nnodes"], run.data.params["parallelism.launcher"]) == ("2", "2", "slurm")
    assert run.info.status == "FINISHED" and "rank1/throughput" in run.data.metrics


@pytest.mark.slow
@needs_slurm
def test_submitit_sweep_ddp_and_horovod_on_two_nodes(cluster, mlflow_uri, tmp_path):
    """hydra/launcher=submitit_slurm: each sweep job a SLURM job of 2 nodes, its ranks over both;
    one sweep id, the final table and sweep_summary.json; exit 1 as the allocation refuses 3 ranks per node."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2", "hydra.launcher.cpus_per_task=2",
            "hydra.launcher.array_parallelism=1", "hydra.launcher.timeout_min=10", "backend=ddp,horovod",
            "parallelism.nproc_per_node=1,3", *WORKLOAD, "measure.warmup_steps=1", "measure.window_steps=2",
            f"tracking.uri={mlflow_uri}", f"hydra.sweep.dir={sweep}"]
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **cluster.env})
    cluster.wait_idle()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "error: 2 of 4 sweep jobs did not finish" in out and f"sweep {sweep}" in out  # the final table
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    status = {r["overrides"].split(" parallelism.nproc_per_node=")[0] + f" x{r['overrides'].split('nproc_per_node=')[1][0]}":
              r["status"] for r in rows}
    assert status == {"backend=ddp x1": "FINISHED", "backend=ddp x3": "INVALID",
                      "backend=horovod x1": "FINISHED", "backend=horovod x3": "INVALID"}, rows
    client = MlflowClient(mlflow_uri)
    runs = [client.get_run(r["mlflow_run_id"]) for r in rows if r["status"] == "FINISHED"]
    assert {r.data.tags["sweep_id"] for r in runs} == {str(sweep)}
    assert [(r.data.tags["backend"], r.data.tags["world_size"], r.data.tags["nnodes"]) for r in runs] == \
        [("ddp", "2", "2"), ("horovod", "2", "2")]
    invalid = json.loads((sweep / "1" / "result.json").read_text())["error"]
    assert invalid.startswith("parallelism.nproc_per_node: 3 ranks per node and SLURM job") and "\n" not in invalid


TUNE = ["mode=tune", "measure.warmup_steps=2", "measure.trial_steps=8", "measure.window_steps=4", "tune.pruner=none",
        "measure.rel_precision=0", "tune.confirm_top=0", "tune.patience=0", "tune.space.batch_size.high=32",
        "tune.space.num_workers.high=0", "tune.global_batch=free"]


def test_journal_study_lock_and_the_rules_of_workers(tmp_path):
    """journal:/// is Optuna's JournalStorage with owned trials; its count lock excludes another
    holder; SQLite is refused for workers on several nodes; tune.workers needs the SLURM launcher."""
    import threading

    import optuna

    from orchestrator.stores import resolve_uri
    from orchestrator.tune.storage import check_shared, journal_path, study_lock, study_storage
    from orchestrator.tune.workers import SUBMITIT_SLURM, check_launcher

    url = resolve_uri(f"journal:///{os.path.relpath(tmp_path / 'j' / 'study.log')}")
    assert url == f"journal:///{tmp_path}/j/study.log" and journal_path(url) == tmp_path / "j" / "study.log"
    study = optuna.create_study(study_name="s", storage=study_storage(url))
    trial = study.ask()
    assert optuna.load_study(study_name="s", storage=study_storage(url)).trials[trial.number].user_attrs["owner"]
    order: list = []
    def other_holder() -> None:
        with study_lock(url, "s"):
            order.append("other")

    with study_lock(url, "s"):
        other = threading.Thread(target=other_holder)
        other.start()
        other.join(timeout=1.0)
        order.append("holder")
    other.join(timeout=10)
    assert order == ["holder", "other"]  # the other waited for the lock
    with pytest.raises(ConfigError, match=r"^tune.storage: SQLite .* allowed: journal:///"):
        check_shared(f"sqlite:///{tmp_path}/o.db", machines=True)
    assert check_shared(f"sqlite:///{tmp_path}/o.db", machines=False) is None  # a local file: no warning
    assert check_shared(url, machines=True) is None
    check_launcher({"_target_": SUBMITIT_SLURM}, 2)
    with pytest.raises(ConfigError, match=r"^tune.workers: 2 workers run as a SLURM job array; add hydra/launcher=submitit_slurm"):
        check_launcher({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 2)


@pytest.mark.slow
@needs_slurm
def test_study_of_two_workers_runs_exactly_n_trials(cluster, mlflow_uri, tmp_path):
    """tune.workers=2: a SLURM job array of 2 tuner workers sharing one journal study; the command
    follows them and ends with the study's table and best.yaml; exactly n trials in Optuna and MLflow."""
    import optuna

    from orchestrator.tune.rules import counted
    from orchestrator.tune.storage import study_storage

    journal = f"journal:///{tmp_path}/study.log"
    args = [*TUNE, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", "tune.workers=2", "tune.n_trials=4",
            "tune.study_name=two", f"tune.storage={journal}", f"tracking.uri={mlflow_uri}", f"hydra.run.dir={tmp_path}/run"]
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **cluster.env})
    cluster.wait_idle()
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "2 workers submitted as SLURM job array" in out and "workers alive 2" in out and "4/4 done" in out
    assert (tmp_path / "run" / "tuned" / "best.yaml").exists() and "rerun it:" in out
    study = optuna.load_study(study_name="two", storage=study_storage(f"journal:///{tmp_path}/study.log"))
    assert counted(study.trials) == 4 and all(t.state.is_finished() for t in study.trials)
    owners = {t.user_attrs["owner"] for t in study.trials}
    assert len(owners) == 2  # both workers ran trials
    runs = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("orchestrator").experiment_id],
        "tags.study_name = 'two'")
    trial_runs = [r for r in runs if "trial" in r.data.tags and "confirm_of" not in r.data.tags]
    assert sorted(int(r.data.tags["trial"]) for r in trial_runs) == [t.number for t in study.trials if counted([t])]


def _job_of(pid: int) -> str:
    """The SLURM job (array task: <array>_<i>) a process of this machine runs in."""
    env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"


def cut_a_worker(cluster, mlflow_uri, tmp_path, *action: str) -> tuple:
    """A study of 2 workers, 4 trials; once a worker runs a trial (after the baseline),
    `action <its array job>` (scancel, scontrol requeue). (output, returncode, that job, the trial, the study)"""
    import time

    import optuna
    from optuna.trial import TrialState

    from orchestrator.tune.storage import study_storage

    journal = f"journal:///{tmp_path}/study.log"
    args = [*TUNE, "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", "tune.workers=2", "tune.n_trials=4",
            "tune.study_name=cut", f"tune.storage={journal}", f"tracking.uri={mlflow_uri}", f"hydra.run.dir={tmp_path}/run",
            "sim.read_latency_ms=1"]
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **cluster.env})
    job, trial = None, None
    deadline = time.monotonic() + 300
    while job is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            study = optuna.load_study(study_name="cut", storage=study_storage(journal))
            running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.number > 0]
        except (KeyError, OSError):
            running = []
        if running:
            trial = running[0]
            job = _job_of(int(trial.user_attrs["owner"].split(":")[1]))
            cluster.run(*action, job)
        time.sleep(0.2)
    out = proc.communicate(timeout=600)[0]
    cluster.wait_idle()
    assert job is not None, out
    return out, proc.returncode, job, trial, optuna.load_study(study_name="cut", storage=study_storage(journal))


def assert_nothing_lost(study, trial, tmp_path, job: str, own_log: bool = True) -> None:
    from optuna.trial import TrialState

    from orchestrator.tune.rules import counted

    cut = study.trials[trial.number]
    assert cut.state == TrialState.FAIL and cut.user_attrs.get("interrupted") is True, cut
    assert counted(study.trials) == 4 and all(t.state.is_finished() for t in study.trials)
    assert sum(bool(t.user_attrs.get("interrupted")) for t in study.trials) == 1
    if not own_log:
        return
    # recorded by the worker itself on SLURM's SIGTERM (not only reclaimed later by the other
    # worker, which on another host could not tell that the owner is gone)
    log = next((tmp_path / "run" / "workers").glob(f"{job}/{job}_0_log.out")).read_text()
    assert f"[tune] trial {trial.number} interrupted" in log, log[-3000:]


@pytest.mark.slow
@needs_slurm
def test_scancel_of_a_worker_mid_trial_loses_nothing(cluster, mlflow_uri, tmp_path):
    """scancel of one worker while it runs a trial: that trial is recorded interrupted (not
    counted), the other worker finishes the count, the command ends 0 naming the cancelled worker."""
    out, code, job, trial, study = cut_a_worker(cluster, mlflow_uri, tmp_path, "scancel")
    assert code == 0, out
    assert f"[tune] worker {job}: left no result" in out
    assert_nothing_lost(study, trial, tmp_path, job)


@pytest.mark.slow
@needs_slurm
def test_a_requeued_worker_rejoins_the_study(cluster, mlflow_uri, tmp_path):
    """scontrol requeue (as a preemption does) of a worker mid-trial: its trial is recorded
    interrupted, the job runs again and its tuner rejoins the same study; the count is exact."""
    out, code, job, trial, study = cut_a_worker(cluster, mlflow_uri, tmp_path, "scontrol", "requeue")
    assert code == 0, out
    assert_nothing_lost(study, trial, tmp_path, job, own_log=False)  # the job's log starts again on requeue
    assert study.user_attrs["workers"] == 3  # the two workers, then the requeued one joined again
    assert "workers alive 2" in out


def test_checkpoint_signal_tasks_and_the_requeued_run_dir(make_cfg, tmp_path, monkeypatch):
    """The srun task ignores trainer.checkpoint_signal (SLURM signals every process of a step: the
    torchrun agent must live) and runs its module with its arguments; a requeued job
    (SLURM_RESTART_COUNT >= 1) resumes the run dir its earlier start used, and only that one."""
    import signal

    from orchestrator import checkpoint
    from orchestrator.__main__ import resume_requeued
    from orchestrator.attempts import clear_stale_request
    from orchestrator.finish import mlflow_status
    from orchestrator.measure.results import JobResult
    from orchestrator.rundir import checkpoint_request_path, write_json

    cfg = slurm.resolve(make_cfg("backend=ddp"), ALLOC, say=lambda _: None)
    assert cfg.trainer.checkpoint_signal.signum == signal.SIGUSR1
    cmd = build_launch(cfg, tmp_path, environ=ALLOC).cmd
    program = slurm.task_program(cfg, "torch.distributed.run")
    assert cmd[cmd.index("--unbuffered") + 1:][:len(program)] == program and str(int(signal.SIGUSR1)) in program
    off = slurm.resolve(make_cfg("backend=ddp", "trainer.checkpoint_signal=none"), ALLOC, say=lambda _: None)
    assert slurm.task_program(off, "torch.distributed.run")[1:] == ["-m", "torch.distributed.run"]
    (tmp_path / "selfsignal.py").write_text(
        "import os, signal, sys, time\nos.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(0.1)\nprint('alive', sys.argv[1:])\n")
    done = subprocess.run([*program[:-1], "selfsignal", "--x", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "alive ['--x', '1']", done.stderr
    assert slurm.job_field("JobId=9 JobName=wrap Requeue=1 Restarts=0 BatchFlag=1 Reboot=0", "Requeue") == "1"
    assert slurm.job_field("JobId=9 Requeue=0", "BatchFlag") == ""

    run_dir = tmp_path / "run"
    checkpoint.save(run_dir, 10, {}, {"step": 10, "world_size": 2})
    write_json(run_dir / "job.json", {"mlflow_run_id": "r", "slurm_job_id": "42"})
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    argv = ["backend=ddp", f"hydra.run.dir={run_dir}"]
    assert resume_requeued(argv, env) == [*argv, f"trainer.resume={run_dir}"]
    for other in ({**env, "SLURM_RESTART_COUNT": "0"}, {**env, "SLURM_JOB_ID": "43"}, {"SLURM_RESTART_COUNT": "1"}):
        assert resume_requeued(argv, other) == argv  # a first start, another job's run, no job
    for given in ([*argv, "trainer.resume=elsewhere"], ["-m", *argv], [*argv, "mode=tune"],
                  ["backend=ddp", f"hydra.run.dir={tmp_path / 'fresh'}"]):
        assert resume_requeued(given, env) == given  # the user's own resume, a sweep, a study, no checkpoint
    monkeypatch.chdir(tmp_path)  # a run dir Hydra named by the time: outputs/slurm/<job id>.json names it
    assert resume_requeued(["backend=ddp"], env) == ["backend=ddp"]
    slurm.note_run_dir(str(run_dir), env)
    assert resume_requeued(["backend=ddp"], env) == ["backend=ddp", f"trainer.resume={run_dir}"]

    # a request an earlier process left would stop the new attempt at once: removed; a new one stays
    request = checkpoint_request_path(run_dir)
    request.write_text("SIGUSR1\n")
    os.utime(request, (0, 0))
    clear_stale_request(run_dir)
    assert not request.exists()
    request.write_text("SIGUSR1\n")
    clear_stale_request(run_dir)
    assert request.exists()
    def job(status: str, requeue: Optional[str]) -> JobResult:
        out = JobResult(status=status)
        out.requeue = requeue
        return out

    assert [mlflow_status(job(s, q)) for s, q in (("CHECKPOINTED", "42"), ("CHECKPOINTED", None),
                                                  ("FINISHED", None))] == ["SCHEDULED", "KILLED", "FINISHED"]


# ~25 ms a step on 2 ranks (the data's read latency), 200 steps in one epoch of each rank's 256
REQUEUE_WORKLOAD = ["data.args.size=4096", "data.batch_size=8", "trainer.lr=0.1", "trainer.momentum=0.9",
                    "trainer.max_steps=200"]


def first_logged_step(run_dir: Path, at_least: int, timeout_s: float = 300) -> None:
    """Until rank 0 logged a step >= `at_least` (the job runs: training is under way)."""
    import time

    events = run_dir / "ranks" / "rank0.jsonl"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if events.exists():
            steps = [json.loads(line).get("step", 0) for line in events.read_text().splitlines()
                     if line.strip().endswith("}") and '"type": "log"' in line]
            if steps and max(steps) >= at_least:
                return
        time.sleep(0.1)
    raise TimeoutError(f"rank 0 logged no step >= {at_least} in {timeout_s:g} s")


@pytest.mark.slow
@needs_slurm
@pytest.mark.parametrize("to", ["batch", "steps"])
def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster, make_cfg, mlflow_uri, tmp_path, to):
    """sbatch --requeue --signal=[B:]USR1@<s>: SLURM's warning before the time limit (sent here
    mid-run by scancel --signal=USR1, which delivers it as the time limit does: --batch to the batch
    shell, which exec-ed the orchestrator; else to the job's steps, its ranks) makes the ranks
    checkpoint at one step and stop; the job requeues itself, runs again with the same command and
    resumes that run (same run dir, one MLflow run, resumed_from_step) to the full step count, with
    the parameters of an uninterrupted run."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    args = ["backend=ddp", *REQUEUE_WORKLOAD, "sim.read_latency_ms=3", "measure.warmup_steps=1",
            "measure.window_steps=5", "trainer.log_every=5", f"tracking.uri={mlflow_uri}", f"hydra.run.dir={run_dir}"]
    cmd = " ".join(["exec", sys.executable, "-m", "orchestrator", *[f"'{a}'" for a in args]])
    warning = "--signal=B:USR1@60" if to == "batch" else "--signal=USR1@60"
    job = cluster.run("sbatch", "--parsable", "--nodes=2", "--exclusive", "--requeue", warning, "--time=10",
                      f"--output={log}", "--open-mode=append", f"--chdir={ROOT}", "--wrap", cmd).stdout.strip().split(";")[0]
    try:
        first_logged_step(run_dir, 20)
        cluster.run("scancel", "--signal=USR1", *(["--batch"] if to == "batch" else []), job)
        cluster.wait_idle(timeout_s=480)  # SLURM holds a requeued job ~2 min before it runs again (its BeginTime)
    finally:
        out = log.read_text() if log.exists() else ""
    first = json.loads((run_dir / "attempts" / "1" / "result.json").read_text())
    step = first["checkpointed_at_step"]
    assert first["status"] == "CHECKPOINTED" and first["requeue"] == job and 20 <= step < 200, out
    assert f"SIGUSR1: checkpointed at step {step} and stopped; SLURM job {job} requeued" in out, out
    assert f"SLURM job {job} runs again (SLURM_RESTART_COUNT=1): resuming its run {run_dir}" in out, out
    assert f"resuming {run_dir} from step {step}" in out, out
    final = json.loads((run_dir / "result.json").read_text())
    assert final["status"] == "FINISHED" and final["steps"] == 200 and final["world_size"] == 2, out
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("orchestrator").experiment_id], f"tags.run_dir = '{run_dir}'")
    assert [r.info.run_id for r in runs] == [final["mlflow_run_id"]] == [first["mlflow_run_id"]]  # one MLflow run
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["resumed_from_step"] == str(step)
    assert max(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")) == 200
    # 200 steps at lr 0.1, momentum 0.9: two ranks' float32 sums vs one process's drift to ~1e-4;
    # one step lost or repeated (a wrong resume point, data order or momentum) moves a weight by ~0.1
    got = torch.load(run_dir / "model.pt")
    want = reference_params(make_cfg, 1, *REQUEUE_WORKLOAD)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-3), (k, (got[k] - want[k]).abs().max())
