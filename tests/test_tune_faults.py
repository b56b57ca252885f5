"""Refused, interrupted and concurrent studies: a refusal changes nothing, an interrupted baseline
runs again, two tuners never launch one config at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient

from orchestrator import checkpoint
from orchestrator.schema import ConfigError, to_yaml
from orchestrator.tune.rules import counted
from orchestrator.tune.study import Tuner, run_study

from .conftest import free_port
from .test_tune import SHORT

SMALL = ["tune.space.batch_size.high=32", "tune.space.num_workers.high=0"]


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage)


def record_of(study: optuna.Study) -> tuple:
    """What a refused command must leave as it was: every trial's state and attributes, the study's."""
    return [(t.number, t.state, t.params, t.user_attrs) for t in study.trials], study.user_attrs


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def dead_tracking() -> str:
    return f"tracking.uri=http://127.0.0.1:{free_port()}"  # nothing listens there: refused at once


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_base_config_the_launch_refuses_creates_no_study(make_cfg, tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    cfg = make_cfg(*SHORT, "backend.device=cuda", "tune.study_name=no-cuda", f"tune.storage={storage}",
                   "tracking.experiment=refused-study")
    with pytest.raises(ConfigError) as info:
        run_study(cfg, tmp_path / "run", echo=False)
    assert "\n" not in str(info.value) and str(info.value).startswith("backend.device: cuda requested")
    assert not (tmp_path / "optuna.db").exists() or optuna.get_all_study_names(storage) == []
    exp = MlflowClient(cfg.tracking.uri).get_experiment_by_name("refused-study")
    assert exp is None or not MlflowClient(cfg.tracking.uri).search_runs([exp.experiment_id])


def test_a_study_refused_for_its_tracking_uri_changes_nothing(make_cfg, tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    common = [*SHORT, *SMALL, f"tune.storage={storage}"]
    Tuner(make_cfg(*common, "tune.study_name=kept"), tmp_path / "a", echo=False)._study()
    before = record_of(load(storage, "kept"))
    for name in ("kept", "new"):
        with pytest.raises(ConfigError, match="tracking.uri: no MLflow server answers"):
            run_study(make_cfg(*common, f"tune.study_name={name}", dead_tracking()), tmp_path / name, echo=False)
    assert record_of(load(storage, "kept")) == before  # no second baseline, the workers count as it was
    assert optuna.get_all_study_names(storage) == ["kept"]


def test_a_resume_refused_for_its_tracking_uri_changes_nothing(make_cfg, tmp_path, capsys):
    from orchestrator.app import run_job

    run_dir = tmp_path / "run"
    checkpoint.save(run_dir, 60, {}, {"step": 60, "world_size": 1})
    (run_dir / "config.yaml").write_text(to_yaml(make_cfg()))
    (run_dir / "ranks").mkdir()
    (run_dir / "ranks" / "rank0.json").write_text("{}")
    (run_dir / "result.json").write_text(json.dumps({"status": "KILLED", "steps": 60}))
    before = tree(run_dir)
    for _ in range(2):
        with pytest.raises(ConfigError, match="tracking.uri: no MLflow server answers"):
            run_job(make_cfg(f"trainer.resume={run_dir}", dead_tracking()), tmp_path / "other", echo=False)
    assert tree(run_dir) == before and not (tmp_path / "other").exists()
    assert "resuming" not in capsys.readouterr().out


def _killed_owner() -> str:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}"


def test_an_interrupted_baseline_runs_again(make_cfg, tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    common = [*SHORT, *SMALL, "tune.study_name=base-again", f"tune.storage={storage}", "tune.n_trials=1"]
    tuner = Tuner(make_cfg(*common), tmp_path / "a", echo=False)
    study = tuner._study()
    tuner._interrupted(study, study.ask())  # what Ctrl-C while the baseline runs records
    first = load(storage, "base-again").trials
    assert len(first) == 1 and first[0].user_attrs["interrupted"] and first[0].user_attrs["baseline"]
    summary = run_study(make_cfg(*common), tmp_path / "b", echo=False)
    assert summary["baseline"]["number"] == 1  # the one trial that ran
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["baseline"]["number"] == 1


def test_a_baseline_a_killed_tuner_left_running_is_queued_again(make_cfg, tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    common = [*SHORT, *SMALL, "tune.study_name=base-killed", f"tune.storage={storage}"]
    study = Tuner(make_cfg(*common), tmp_path / "a", echo=False)._study()
    study.ask().set_user_attr("owner", _killed_owner())  # its tuner died while the baseline ran
    Tuner(make_cfg(*common), tmp_path / "b", echo=False)._study()  # the rerun
    trials = load(storage, "base-killed").trials
    assert [(t.state.name, bool(t.user_attrs.get("interrupted")), t.user_attrs.get("baseline")) for t in trials] == [
        ("FAIL", True, True), ("WAITING", False, True)]
    assert trials[1].params == trials[0].params


def test_a_tuner_never_launches_a_config_another_tuner_is_running(make_cfg, tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    common = [*SHORT, *SMALL, "tune.study_name=twins", f"tune.storage={storage}", "tune.n_trials=2"]
    other = Tuner(make_cfg(*common), tmp_path / "other", echo=False)
    study = other._study()
    running = study.ask()  # another tuner took the baseline and is running it
    other.space.sample(running)
    study.enqueue_trial(running.params)  # and this tuner is proposed the same config
    run_study(make_cfg(*common), tmp_path / "a", echo=False)
    trials = load(storage, "twins").trials
    assert trials[1].state == optuna.trial.TrialState.PRUNED and trials[1].user_attrs["duplicate_of"] == 0
    assert not (tmp_path / "a" / "trials" / "0001").exists()
    launched = [t for t in trials if "mlflow_run_id" in t.user_attrs]
    assert launched and all(t.params != running.params for t in launched)


def test_a_trial_that_diverges_is_recorded_diverged_and_never_picked(make_cfg, tmp_path):
    """One trial's learning rate makes its loss explode: it ends DIVERGED (trials.csv, summary.json,
    its line), the study goes on, and the pick is the trial that trained."""
    space = ["~tune.space.batch_size", "~tune.space.num_workers", "~tune.space.accumulation_steps",
             "~tune.space.prefetch_factor", "~tune.space.pin_memory",
             "+tune.space.lr={key: trainer.lr, type: categorical, choices: [0.01, 1e30]}"]
    cfg = make_cfg(*SHORT, *space, "tune.sampler=grid", "tune.n_trials=2", f"tune.storage=sqlite:///{tmp_path}/optuna.db")
    summary = run_study(cfg, tmp_path / "run", echo=False)
    assert summary["states"].get("DIVERGED") == 1, summary["states"]
    assert summary["best"]["values"] == {"trainer.lr": 0.01}
    rows = (tmp_path / "run" / "trials.csv").read_text().splitlines()
    diverged = [row for row in rows if ",DIVERGED," in row]
    assert len(diverged) == 1 and "1e+30" in diverged[0] and "diverged at step" in diverged[0], rows


def test_a_full_disk_stops_a_study_in_one_line_keeping_its_trials_and_candidates(make_cfg, tmp_path, monkeypatch):
    """A write that fails for the host's disk says nothing of the config: the trial it hit is not
    counted (a rerun measures it), a confirmation it hit keeps its candidate, the study stops with
    one line saying so, its outputs are written, and a rerun finishes the count."""
    from orchestrator.app import RecordFailed
    from orchestrator.tune.study import StudyFailed

    full = "/x/result.json: cannot write (No space left on device; 0 B free there)"
    launch, launched = Tuner._launch, []

    def second_fills_the_disk(self, cfg, run_dir, **kwargs):
        launched.append(run_dir)
        if len(launched) == 2 or "confirm" in str(run_dir):
            raise RecordFailed(full, {"error": full})
        return launch(self, cfg, run_dir, **kwargs)

    monkeypatch.setattr(Tuner, "_launch", second_fills_the_disk)
    common = [*SHORT, *SMALL, "tune.study_name=full-disk", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
              "tune.n_trials=2"]
    with pytest.raises(StudyFailed) as info:
        run_study(make_cfg(*common), tmp_path / "a", echo=False)
    assert str(info.value) == (f"trial 1 could not write: {full}; the disk is the host's, not the config's: free some "
                               "space and rerun with tune.study_name=full-disk to finish")
    assert (tmp_path / "a" / "summary.json").exists()
    study = load(f"sqlite:///{tmp_path}/optuna.db", "full-disk")
    assert counted(study.trials) == 1 and study.trials[1].user_attrs["interrupted"]

    tuner = Tuner(make_cfg(*common), tmp_path / "b", echo=False)
    runs, failed = {0: [{"throughput": 1.0}]}, {}
    with pytest.raises(StudyFailed, match=r"^the confirmation of trial 0 could not write: "):
        tuner._confirm_run(study, study.trials[0], 1, None, 0, 2, runs, failed)
    assert failed == {} and runs == {0: [{"throughput": 1.0}]}  # still a candidate

    monkeypatch.setattr(Tuner, "_launch", launch)
    summary = run_study(make_cfg(*common), tmp_path / "c", echo=False)
    assert counted(load(f"sqlite:///{tmp_path}/optuna.db", "full-disk").trials) == 2 and summary["best"] is not None


def test_an_interrupted_study_says_its_pick_is_not_final_and_how_to_finish(make_cfg, tmp_path, monkeypatch, capsys):
    """Ctrl-C at trial 2 of 3: summary.json, best.yaml and the printed pick say the study was
    interrupted, how many trials the pick stands on, and the command that finishes it."""
    run_trial = Tuner._run_trial

    def interrupt_the_second(self, study, trial, parent):
        if trial.number == 1:
            raise KeyboardInterrupt
        return run_trial(self, study, trial, parent)

    monkeypatch.setattr(Tuner, "_run_trial", interrupt_the_second)
    cfg = make_cfg(*SHORT, *SMALL, "tune.study_name=cut", f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.n_trials=3")
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, tmp_path / "run", echo=True)
    said = ("interrupted with 1 of tune.n_trials=3 trials counted: the pick below stands on those alone; rerun the "
            "same command with tune.study_name=cut to finish")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"]["why"] == said and summary["stopped"]["counted"] == 1
    assert f"# Note: the study was {said}" in (tmp_path / "run" / "tuned" / "best.yaml").read_text()
    out = capsys.readouterr().out
    assert f"[tune] stopped early: {said}" in out and "[tune] best so far (not final: 1 of 3 trials): trial 0" in out


def test_tuners_sharing_a_study_confirm_once_and_report_one_pick(make_cfg, tmp_path, monkeypatch):
    """Two tuners of one study reach the confirmation while a third still runs a trial: the first
    to take the study's confirm lock waits for that trial, confirms; the other waits for it and
    finds nothing due: one confirmation, one pick."""
    import threading
    import time as clock

    storage = f"sqlite:///{tmp_path}/optuna.db"
    cfg = make_cfg(*SHORT, *SMALL, "tune.study_name=shared", f"tune.storage={storage}", "tune.confirm_top=2")
    study = Tuner(cfg, tmp_path / "x", echo=False)._study()
    for thr in (100.0, 101.0):  # two candidates within each other's noise
        study.add_trial(optuna.trial.create_trial(value=1.5, params={}, distributions={}, user_attrs={
            "values": {"thr": thr}, "utilization": 0.5, "throughput": thr, "throughput_lo": thr - 10,
            "throughput_hi": thr + 10, "utilization_lo": 0.48, "utilization_hi": 0.52}))
    running = study.ask()  # a third tuner's trial, still running (its owner: a live process, not this one)
    running.set_user_attr("owner", f"{socket.gethostname()}:{os.getppid()}")
    confirming: list = []

    def confirm(self, study, parent):
        from orchestrator.tune.rules import confirm_candidates

        if self._confirmation_due(study):
            confirming.append(running.number in {t.number for t in study.get_trials(
                states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL))})
            clock.sleep(1.0)
            study.set_user_attr("confirmed", {str(t.number): {} for t in confirm_candidates(study, self.t)})

    monkeypatch.setattr(Tuner, "_confirm_candidates", confirm)
    monkeypatch.setattr("orchestrator.tune.confirm.WAIT_FOR_TRIALS_S", 0.1)
    tuners = [Tuner(cfg, tmp_path / name, echo=False) for name in ("a", "b")]
    threads = [threading.Thread(target=t._confirm, args=(t._study(), None)) for t in tuners]
    for th in threads:
        th.start()
    clock.sleep(1.0)
    study.tell(running, state=optuna.trial.TrialState.FAIL)  # the third tuner's trial ends
    for th in threads:
        th.join(timeout=30)
    assert confirming == [True]  # once, after the running trial ended
