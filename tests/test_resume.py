"""Long runs: checkpoints, interrupts (SIGTERM to the parent, SIGKILL to a rank), resume, and
nothing lost or left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from orchestrator import checkpoint
from orchestrator.tune.rules import counted

from .conftest import ROOT, job_processes, run_cli

# ~15 ms per step on 2 ranks: long enough to be interrupted mid-way
SLOW = ["data.args.size=2048", "data.batch_size=8", "sim.read_latency_ms=2", "trainer.lr=0.05",
        "trainer.max_steps=60", "trainer.checkpoint_every=10", "measure.warmup_steps=1", "measure.window_steps=5"]


def cli(args, run_dir, mlflow_uri):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={run_dir}",
                             f"tracking.uri={mlflow_uri}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_checkpoint(run_dir: Path, step: int, proc, timeout=120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        latest = run_dir / "checkpoints" / "latest"
        if latest.exists() and int(latest.read_text().split("_")[1]) >= step:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise TimeoutError(f"no checkpoint at step {step}")


def rank_process(run_dir: Path, rank: int):
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if "orchestrator.rank" in cmd and str(run_dir) in cmd:
                env = p.environ()
                if env.get("HOROVOD_RANK", env.get("RANK")) == str(rank):
                    return p
        except psutil.Error:
            pass
    return None


def reference_model(tmp_path, backend, mlflow_uri) -> dict:
    ref = cli([f"backend={backend}", "parallelism.nproc_per_node=2", *SLOW], tmp_path / "ref", mlflow_uri)
    out = ref.communicate(timeout=180)[0]
    assert ref.returncode == 0, out
    return torch.load(tmp_path / "ref" / "model.pt")


@pytest.mark.parametrize("backend, how", [pytest.param("ddp", "sigterm-parent", marks=pytest.mark.slow),  # 45 s
                                          pytest.param("horovod", "sigkill-rank", marks=pytest.mark.slow),
                                          pytest.param("fsdp", "sigkill-rank", marks=pytest.mark.slow)])  # 39 s
def test_interrupted_run_resumes_to_the_same_model(tmp_path, mlflow_uri, backend, how):
    run_dir = tmp_path / "run"
    job = cli([f"backend={backend}", "parallelism.nproc_per_node=2", *SLOW], run_dir, mlflow_uri)
    wait_for_checkpoint(run_dir, 20, job)
    if how == "sigterm-parent":
        job.send_signal(signal.SIGTERM)
    else:
        rank_process(run_dir, 1).kill()
    out = job.communicate(timeout=60)[0]
    time.sleep(0.5)
    assert not job_processes(run_dir), [p.cmdline() for p in job_processes(run_dir)]
    result = json.loads((run_dir / "result.json").read_text())
    client = MlflowClient(mlflow_uri)
    if how == "sigterm-parent":
        assert job.returncode == 143, out
        # one line, then the command that resumes it; no launcher traceback
        assert "Traceback" not in out, out
        assert f"trainer.resume={run_dir}" in out.split("error: terminated (SIGTERM)")[1], out
        assert result["status"] == "KILLED" and client.get_run(result["mlflow_run_id"]).info.status == "KILLED"
    else:
        assert job.returncode == 1, out
        assert result["status"] == "FAILED" and client.get_run(result["mlflow_run_id"]).info.status == "FAILED"
    ckpt = checkpoint.find_latest(run_dir)
    stopped_at = checkpoint.meta_of(ckpt)["step"]
    assert 20 <= stopped_at < 60 and checkpoint.meta_of(ckpt)["mlflow_run_id"] == result["mlflow_run_id"]

    resumed = cli([f"backend={backend}", "parallelism.nproc_per_node=2", *SLOW, f"trainer.resume={run_dir}"],
                  tmp_path / "resume-invocation", mlflow_uri)
    out = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out
    assert f"resuming {run_dir} from step {stopped_at}" in out
    final = json.loads((run_dir / "result.json").read_text())
    assert final["status"] == "FINISHED" and final["steps"] == 60
    run = client.get_run(final["mlflow_run_id"])
    assert final["mlflow_run_id"] == result["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["resumed_from_step"] == str(stopped_at)
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == 60  # steps continue
    assert (run_dir / "attempts" / "1" / "ranks").is_dir()  # the interrupted attempt's files are kept
    assert json.loads((run_dir / "attempts" / "1" / "result.json").read_text())["status"] == result["status"]
    assert not (tmp_path / "resume-invocation").exists()  # a resume runs in the run it continues

    want = reference_model(tmp_path, backend, mlflow_uri)
    got = torch.load(run_dir / "model.pt")
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), k


SHORT_RUN = ["trainer.max_steps=12", "trainer.checkpoint_every=5", "measure.warmup_steps=1", "measure.window_steps=2",
             "sim.read_latency_ms=0.2"]


@pytest.mark.slow  # kept out of the suite's 10 minutes (make test-slow)
def test_finished_run_is_never_rewritten_and_continues_only_when_raised(tmp_path, mlflow_uri):
    run_dir = tmp_path / "run"
    first = run_cli([*SHORT_RUN, f"tracking.uri={mlflow_uri}", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    recorded = (run_dir / "result.json").read_bytes()
    run_id = json.loads(recorded)["mlflow_run_id"]
    client = MlflowClient(mlflow_uri)
    tags = client.get_run(run_id).data.tags
    assert checkpoint.meta_of(checkpoint.find_latest(run_dir))["step"] == 12  # the end is a checkpoint too

    # the same command again, resuming: nothing to do, nothing touched, no new run dir
    again = run_cli([*SHORT_RUN, f"tracking.uri={mlflow_uri}", f"trainer.resume={run_dir}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"nothing to resume: {run_dir} finished at step 12" in again.stdout
    assert (run_dir / "result.json").read_bytes() == recorded
    assert client.get_run(run_id).data.tags == tags and client.get_run(run_id).info.status == "FINISHED"
    assert not (tmp_path / "outputs").exists() and not (run_dir / "attempts").exists()

    # a key the checkpoint fixed, changed: refused in one line naming it; records untouched
    changed = run_cli([*SHORT_RUN[:-1], f"tracking.uri={mlflow_uri}", f"trainer.resume={run_dir}"], cwd=tmp_path)
    assert changed.returncode == 2
    lines = [x for x in changed.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "sim.read_latency_ms (0.2 -> 0.0)" in lines[0], changed.stderr
    assert lines[0].startswith("error: trainer.resume: a resume continues the same run")
    assert (run_dir / "result.json").read_bytes() == recorded and not (tmp_path / "outputs").exists()

    # raised max_steps: continues in its own run dir, the earlier attempt's records kept
    more = run_cli(["trainer.max_steps=20", *SHORT_RUN[1:], f"tracking.uri={mlflow_uri}", f"trainer.resume={run_dir}"],
                   cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert f"run dir: {run_dir}" in more.stdout and f"resuming {run_dir} from step 12" in more.stdout
    assert f"load report: {run_dir / 'load_report.md'}" in more.stdout.replace("\n", "")
    final = json.loads((run_dir / "result.json").read_text())
    assert final["status"] == "FINISHED" and final["steps"] == 20 and final["mlflow_run_id"] == run_id
    assert (run_dir / "attempts" / "1" / "result.json").read_bytes() == recorded
    assert not (tmp_path / "outputs").exists()


def test_half_written_checkpoint_is_never_picked(tmp_path):
    for step in (10, 20):
        checkpoint.save(tmp_path, step, {"model": {"w": torch.ones(3) * step}}, {"step": step})
    newest = tmp_path / "checkpoints" / "step_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:50])  # killed mid-write (had it not been atomic)
    (tmp_path / "checkpoints" / "step_00000030.pt.tmp").write_bytes(b"partial")
    picked = checkpoint.find_latest(tmp_path)
    assert picked is not None and picked.name == "step_00000010.pt"
    assert torch.equal(checkpoint.load(picked)["model"]["w"], torch.ones(3) * 10)


def test_incomplete_sharded_checkpoint_is_never_picked(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in (10, 20):
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoint.save(tmp_path, step, {"rng": None}, {"step": step}, sharded=(model, opt))
    d = tmp_path / "checkpoints"
    assert checkpoint.find_latest(tmp_path) == d / "step_00000020.pt" and not list(d.glob("*.tmp"))
    (d / "step_00000020.dcp" / "__0_0.distcp").unlink()  # a rank's part is missing (or on another machine)
    picked = checkpoint.find_latest(tmp_path)
    assert picked == d / "step_00000010.pt"
    fresh = torch.nn.Linear(4, 2)
    checkpoint.load_sharded(picked, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    assert torch.equal(fresh.weight, torch.full((2, 4), 10.0))


def test_resume_rejects_bad_input(make_cfg, tmp_path):
    from orchestrator.app import run_job
    from orchestrator.schema import ConfigError

    with pytest.raises(ConfigError, match="trainer.resume: '/nope' is not a run directory; allowed: a run dir or latest"):
        run_job(make_cfg("trainer.resume=/nope"), tmp_path / "a", echo=False)
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        run_job(make_cfg(f"trainer.resume={tmp_path}"), tmp_path / "b", echo=False)
    checkpoint.save(tmp_path / "two", 5, {}, {"step": 5, "world_size": 2})
    with pytest.raises(ConfigError, match="written by 2 ranks and this job has 1"):
        run_job(make_cfg(f"trainer.resume={tmp_path / 'two'}"), tmp_path / "c", echo=False)


def test_the_resume_decision_is_one_typed_answer(make_cfg, tmp_path):
    """resume.decide: start fresh, resume from a checkpoint (in the run dir it continues), or
    refuse with one line (a wrong config: ConfigError; a finished run trained no further:
    NothingToResume); it touches nothing, and preflight raises its refusal before any run dir is made."""
    from orchestrator.checks import preflight
    from orchestrator.resume import NothingToResume, Refuse, ResumeFrom, StartFresh, decide
    from orchestrator.schema import ConfigError, to_yaml

    fresh = decide(make_cfg(), tmp_path / "new")
    assert isinstance(fresh, StartFresh) and fresh.run_dir == tmp_path / "new" and not (tmp_path / "new").exists()
    refused = decide(make_cfg("trainer.resume=/nope"), tmp_path / "new")
    assert refused == Refuse("trainer.resume: '/nope' is not a run directory; allowed: a run dir or latest")
    assert isinstance(refused.error(), ConfigError)

    run = tmp_path / "run"
    checkpoint.save(run, 8, {}, {"step": 8, "world_size": 1, "mlflow_run_id": "abc"})
    (run / "config.yaml").write_text(to_yaml(make_cfg("trainer.max_steps=8")))
    resumed = decide(make_cfg("trainer.max_steps=8", f"trainer.resume={run}"), tmp_path / "new")
    assert isinstance(resumed, ResumeFrom) and resumed.run_dir == run.resolve() and resumed.step == 8
    assert resumed.checkpoint["mlflow_run_id"] == "abc"
    (run / "result.json").write_text(json.dumps({"status": "FINISHED", "steps": 8, "steps_per_epoch": 128}))
    done = decide(make_cfg("trainer.max_steps=8", f"trainer.resume={run}"), tmp_path / "new")
    assert isinstance(done, Refuse) and done.finished and done.line.startswith(f"nothing to resume: {run.resolve()} ")
    assert isinstance(done.error(), NothingToResume)
    changed = decide(make_cfg("trainer.max_steps=9", "data.batch_size=64", f"trainer.resume={run}"), tmp_path / "new")
    assert isinstance(changed, Refuse) and not changed.finished and "data.batch_size (32 -> 64)" in changed.line
    with pytest.raises(NothingToResume):
        preflight(make_cfg("trainer.max_steps=8", f"trainer.resume={run}"), tmp_path / "new")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "result.json"]
    assert not (tmp_path / "new").exists()


def test_a_resume_logs_no_loss_point_twice(make_cfg, tmp_path):
    """The steps a resume redoes (after its checkpoint, up to where the failed attempt got) were
    logged by that attempt: MLflow's loss history holds each step once."""
    from orchestrator.app import JobFailed, run_job

    args = ["model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=9", "trainer.max_steps=12",
            "trainer.checkpoint_every=5"]
    with pytest.raises(JobFailed):
        run_job(make_cfg(*args), tmp_path, echo=False)  # logs steps 1-8, checkpoints step 5, fails at 9
    result = run_job(make_cfg(*args, f"trainer.resume={tmp_path}"), tmp_path, echo=False)  # steps 6-12: 7 forwards
    history = MlflowClient(make_cfg().tracking.uri).get_metric_history(result["mlflow_run_id"], "loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, 13)), steps


def test_a_checkpoint_without_its_json_sidecar_is_read_from_the_pt(make_cfg, tmp_path):
    """The .pt holds the metadata too: a lost or damaged sidecar does not hide an intact checkpoint."""
    from orchestrator.resume import ResumeFrom, decide

    checkpoint.save(tmp_path / "run", 5, {}, {"step": 5, "world_size": 1})
    checkpoint.save(tmp_path / "run", 10, {}, {"step": 10, "world_size": 1})
    (tmp_path / "run" / "checkpoints" / "step_00000010.json").unlink()
    (tmp_path / "run" / "checkpoints" / "step_00000005.json").write_text("{trunc")
    assert checkpoint.find_latest(tmp_path / "run").name == "step_00000010.pt"
    decision = decide(make_cfg(f"trainer.resume={tmp_path / 'run'}"), tmp_path / "elsewhere")
    assert isinstance(decision, ResumeFrom) and decision.step == 10
    assert decision.run_dir == (tmp_path / "run").resolve() and decision.cfg.trainer.resume == str(decision.run_dir)
    assert checkpoint.good_before(tmp_path / "run", 10).name == "step_00000005.pt"


@pytest.mark.slow
def test_interrupted_study_resumes_without_losing_trials(tmp_path, mlflow_uri):
    args = ["mode=tune", "tune.n_trials=4", "tune.study_name=interrupt-me", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
            "measure.warmup_steps=1", "measure.trial_steps=20", "measure.window_steps=10", "tune.pruner=none",
            "measure.rel_precision=0", "tune.confirm_top=0",
            "tune.space.num_workers.high=0", "tune.space.batch_size.high=16", "sim.read_latency_ms=1",
            "tune.global_batch=free"]
    first = cli(args, tmp_path / "first", mlflow_uri)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    end = time.monotonic() + 120
    while time.monotonic() < end:  # interrupt once two trials are done and a third is running
        try:
            trials = optuna.load_study(study_name="interrupt-me", storage=storage).trials
        except KeyError:
            trials = []
        done = sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        if done >= 2 and any(t.state == optuna.trial.TrialState.RUNNING for t in trials):
            break
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    out = first.communicate(timeout=60)[0]
    assert first.returncode == 143, out
    assert not job_processes(tmp_path / "first")
    trials = optuna.load_study(study_name="interrupt-me", storage=storage).trials
    interrupted = [t for t in trials if t.user_attrs.get("interrupted")]
    assert len(interrupted) == 1 and interrupted[0].state == optuna.trial.TrialState.FAIL
    completed_before = {t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(completed_before) >= 2

    second = cli(args, tmp_path / "second", mlflow_uri)
    out = second.communicate(timeout=180)[0]
    assert second.returncode == 0, out
    trials = optuna.load_study(study_name="interrupt-me", storage=storage).trials
    assert counted(trials) == 4 and all(t.state.is_finished() for t in trials)
    assert completed_before <= {t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert os.path.exists(tmp_path / "second" / "trials.csv")


def test_resume_skips_an_unreadable_record(make_cfg, tmp_path, capsys):
    """A result.json left empty (a full disk, before records were written atomically) does not
    block the resume: it is skipped with a one-line note."""
    from orchestrator.resume import ResumeFrom, decide
    from orchestrator.schema import to_yaml

    run_dir = tmp_path / "run"
    checkpoint.save(run_dir, 5, {}, {"step": 5, "world_size": 1})
    (run_dir / "config.yaml").write_text(to_yaml(make_cfg()))
    (run_dir / "result.json").write_text("")
    decision = decide(make_cfg(f"trainer.resume={run_dir}"), tmp_path / "elsewhere")
    assert isinstance(decision, ResumeFrom) and decision.run_dir == run_dir.resolve() and decision.step == 5
    notes = [line for line in capsys.readouterr().out.splitlines() if "result.json" in line]
    assert len(notes) == 1 and "unreadable" in notes[0] and str(run_dir.resolve() / "result.json") in notes[0]


def test_a_diverging_run_checkpoints_only_checked_weights(make_cfg, tmp_path):
    """The weights diverge between logged steps (checkpoint_every < log_every): a checkpointed
    step's loss is checked too, so the run ends DIVERGED before a checkpoint of exploded weights,
    and names the last good one, which is kept."""
    from orchestrator.app import JobDiverged, run_job

    cfg = make_cfg("experiment=linear_regression", "trainer.lr=10", "trainer.log_every=100",
                   "trainer.checkpoint_every=1", "trainer.max_steps=30")
    with pytest.raises(JobDiverged) as info:
        run_job(cfg, tmp_path, echo=False)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "DIVERGED" and result["error"] == str(info.value)
    assert re.match(r"^rank 0 diverged at step (\d+): the loss is \S+, over 1000 x the first logged loss .*; "
                    r"the last good checkpoint, step \d+, is kept: \S+step_\d+\.pt$", str(info.value)), info.value
    kept = sorted((tmp_path / "checkpoints").glob("step_*.pt"))
    assert kept and all(torch.isfinite(v).all() for p in kept for v in checkpoint.load(p)["model"].values())
    good = re.search(r"kept: (\S+)", str(info.value)).group(1)
    assert Path(good).exists() and Path(good) in kept


def test_checkpoint_signal_stops_at_a_checkpoint(make_cfg, tmp_path, monkeypatch):
    """trainer.checkpoint_signal, rank side: the rank's own signal stops the run after the next
    step, the parent's request file within SIGNAL_CHECK_EVERY steps, each at a checkpoint written
    once (a step the periodic checkpoint also saves is not written twice)."""
    from orchestrator.rundir import checkpoint_request_path
    from orchestrator.runtime import hooks
    from orchestrator.runtime.dist import Adapter
    from orchestrator.runtime.loop import SIGNAL_CHECK_EVERY, train

    def run(run_dir, *overrides):
        cfg = make_cfg("trainer.max_steps=20", "data.args.size=2048", *overrides)
        adapter = Adapter(cfg)
        adapter.setup()
        return train(cfg, adapter, ckpt_dir=run_dir)

    monkeypatch.setattr(hooks, "_signalled", [10])  # as rank.py's handler does
    res = run(tmp_path / "a")
    assert res.steps == 1 and res.meter["stopped_by"] == "checkpoint_signal"
    assert checkpoint.meta_of(checkpoint.find_latest(tmp_path / "a"))["step"] == 1
    monkeypatch.setattr(hooks, "_signalled", [])

    checkpoint_request_path(tmp_path / "b").parent.mkdir()
    checkpoint_request_path(tmp_path / "b").write_text("USR1\n")
    saved: list = []
    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda run_dir, step, *a, **k: saved.append(step) or real(run_dir, step, *a, **k))
    res = run(tmp_path / "b", "trainer.checkpoint_every=5")
    assert res.steps == SIGNAL_CHECK_EVERY and saved == [5, 10] and res.meter["stopped_by"] == "checkpoint_signal"
    res = run(tmp_path / "b", "trainer.checkpoint_signal=none")
    assert res.steps == 20 and res.meter["stopped_by"] == "steps"  # off: the request is not read


@pytest.mark.slow  # 35 s: two CLI runs
def test_checkpoint_signal_to_the_parent_stops_and_resumes(tmp_path, mlflow_uri):
    """kill -USR1 of the orchestrator (outside SLURM): the rank checkpoints and stops, exit 3,
    result.json CHECKPOINTED, the MLflow run KILLED with the resume command printed; the resume
    continues the same MLflow run to the full step count."""
    run_dir = tmp_path / "run"
    args = [*SLOW, "trainer.max_steps=100"]
    job = cli(args, run_dir, mlflow_uri)
    wait_for_checkpoint(run_dir, 10, job)
    job.send_signal(signal.SIGUSR1)
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 3, out
    first = json.loads((run_dir / "result.json").read_text())
    step = first["checkpointed_at_step"]
    assert first["status"] == "CHECKPOINTED" and 10 < step < 100 and first["steps"] == step and not first["requeue"]
    assert checkpoint.meta_of(checkpoint.find_latest(run_dir))["step"] == step
    assert f"SIGUSR1: checkpointed at step {step} and stopped" in out and f"trainer.resume={run_dir}" in out, out
    client = MlflowClient(mlflow_uri)
    assert client.get_run(first["mlflow_run_id"]).info.status == "KILLED"
    assert not (run_dir / "checkpoint.request").exists()
    resumed = cli([*args, f"trainer.resume={run_dir}"], tmp_path / "unused", mlflow_uri)
    out = resumed.communicate(timeout=180)[0]
    assert resumed.returncode == 0, out
    final = json.loads((run_dir / "result.json").read_text())
    run = client.get_run(final["mlflow_run_id"])
    assert final["status"] == "FINISHED" and final["steps"] == 100 and final["mlflow_run_id"] == first["mlflow_run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == str(step)
