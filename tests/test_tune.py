"""mode=tune: real trials through run_job, the objective, failures, resume, sharing, MLflow."""

from __future__ import annotations

import json
from dataclasses import replace
import os
import re
import shlex
import subprocess
import sys

import optuna
import pytest
from mlflow.tracking import MlflowClient

from orchestrator.measure.results import JobResult
from orchestrator.schema import ConfigError
from orchestrator.tune.rules import counted, utilization_score
from orchestrator.tune.space import SearchSpace
from orchestrator.tune.study import run_study

from .conftest import ROOT

# trials measured to 10% in 0.1-0.6 s; no confirmation runs (the workers study below has them)
SHORT = ["mode=tune", "measure.warmup_steps=2", "measure.window_steps=4", "measure.window_s=0.05", "measure.rel_precision=0.1",
         "measure.min_measure_s=0.1", "measure.max_measure_s=0.6", "tune.confirm_top=0", "tune.pruner=none",
         "tune.extend_edges=false", "tune.global_batch=free"]


def study_of(summary) -> optuna.Study:
    return optuna.load_study(study_name=summary["study_name"], storage=summary["storage"])


@pytest.fixture(scope="module")
def workers_study(tmp_path_factory, mlflow_uri):
    """Input-bound images with 3 ms reads per sample: DataLoader workers are what matters."""
    from .conftest import TINY, compose_dict
    from orchestrator.schema import to_config

    run_dir = tmp_path_factory.mktemp("tune-workers")
    cfg = to_config(compose_dict(TINY + [
        f"tracking.uri={mlflow_uri}", "tracking.experiment=tune-tests", "experiment=input_bound",
        "sim.read_latency_ms=3", "data.args.blur_passes=1", *SHORT, "tune.n_trials=5", "tune.confirm_top=2",
        f"tune.storage=sqlite:///{run_dir}/optuna.db",
        "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[16]",
        "tune.space.accumulation_steps.high=1", "tune.max_workers=4",
    ]))
    return cfg, run_dir, run_study(cfg, run_dir, echo=False)


@pytest.mark.perf
def test_tuned_workers_beat_the_default(workers_study):
    cfg, run_dir, summary = workers_study
    assert summary["status"] == "FINISHED" and summary["n_trials"] == 5
    base, best = summary["baseline"], summary["best"]
    assert base["values"]["data.num_workers"] == 0  # trial 0 is the config as given
    assert best["values"]["data.num_workers"] > 0
    assert best["utilization"] > base["utilization"] and best["throughput"] > base["throughput"]
    # the gain reported over the config as given was measured side by side with it
    vs = summary["versus_baseline"]
    assert vs["baseline"] == base["number"] and vs["side_by_side"] and str(base["number"]) in summary["confirmed"]
    assert vs["throughput_ratio_lo"] > 1
    # best.yaml is a Hydra override file that reruns the job with the tuned knobs
    best_yaml = run_dir / "tuned" / "best.yaml"
    assert best_yaml.read_text().startswith("# @package _global_")
    out = subprocess.run([sys.executable, "-m", "orchestrator", "--config-dir", str(run_dir), "--cfg", "job",
                          "experiment=input_bound", "+tuned=best"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and f"num_workers: {best['values']['data.num_workers']}" in out.stdout
    # the rerun line starts with the interpreter that ran the study, not a bare `python`
    assert os.path.abspath(shlex.split(summary["rerun"])[0]) == os.path.abspath(sys.executable)
    assert {"trials.csv", "summary.json", "optimization_history.png", "parallel_coordinate.png"} <= {
        p.name for p in run_dir.iterdir()}
    assert 0 < summary["trial_overhead"]["median"] < 1
    # trials measured to a precision, with their estimate and interval recorded
    for tr in study_of(summary).trials:
        a = tr.user_attrs
        if tr.state == optuna.trial.TrialState.COMPLETE:
            assert a["stopped_by"] in ("precision", "max_measure_s") and a["windows"] >= 2
            assert a["stopped_by"] == "max_measure_s" or (a["windows"] >= 4 and a["rel_se"] <= 0.1)
            # the cap waits for a second window: every trial has an interval
            assert a["throughput_lo"] <= a["throughput"] <= a["throughput_hi"]
            assert 0.1 <= a["measured_s"] < 0.6 + 1.0  # min_measure_s .. max_measure_s plus one window
    # where the study's time went: its parts add up to its wall time
    share = summary["measured_share"]
    assert set(share["spent"]) == {"measuring", "warmup", "rest_of_loops", "setup", "launch", "tuner"}
    assert share["spent"]["measuring"] == pytest.approx(share["measured_s"], abs=0.01)
    assert share["spent"]["warmup"] > 0 and share["spent"]["launch"] > 0 and share["spent"]["setup"] > 0
    assert sum(share["spent"].values()) == pytest.approx(share["wall_s"], rel=0.05)
    header = (run_dir / "trials.csv").read_text().splitlines()[0].split(",")
    assert {"throughput_lo", "throughput_hi", "rel_se", "windows", "measured_s", "confirmed_throughput"} <= set(header)
    # the pick was re-measured, and is made from those figures; or nothing else could overtake it
    if summary["best"]["confirmed"]:
        assert best["throughput"] == summary["confirmed"][str(best["number"])]["throughput"]
    else:
        from orchestrator.tune.rules import ranked
        lead, second = (tr.user_attrs for tr in ranked(study_of(summary), cfg.tune)[:2])
        assert second["throughput_hi"] < lead["throughput_lo"] and second["utilization_hi"] < lead["utilization_lo"]
        assert summary["separation"]["separated"] is True and not summary["separation"]["confirmed"]


def test_every_trial_is_a_nested_mlflow_run(workers_study):
    cfg, run_dir, summary = workers_study
    client = MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["mode"] == "tune"
    exp = parent.info.experiment_id
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 5 and all(c.data.tags["run_kind"] == "trial" for c in children)
    # the confirmation runs are nested under the trial they re-measure
    confirms = client.search_runs([exp], f"tags.study_name = '{summary['study_name']}' and tags.run_kind = 'confirm'")
    by_run = {c.info.run_id: c.data.tags["trial"] for c in children}
    assert all(by_run[c.data.tags["mlflow.parentRunId"]] == c.data.tags["confirm_of"] for c in confirms)
    assert len(confirms) >= 2 if summary["best"]["confirmed"] else not confirms
    for child in children:
        assert child.data.tags["trial_state"] == "COMPLETE" and child.info.status == "FINISHED"
        assert {"data.batch_size", "data.num_workers", "trainer.accumulation_steps"} <= child.data.params.keys()
        metrics = child.data.metrics
        assert {"utilization", "throughput", "data_wait_frac", "comm_frac", "peak_mem_mb", "wall_s", "throughput_estimate",
                "measured_windows", "measured_s"} <= metrics.keys()
        assert metrics["measured_windows"] < 2 or {"throughput_lo", "throughput_hi", "throughput_rel_se"} <= metrics.keys()
    best = [c for c in children if c.data.tags.get("best") == "true"]
    assert len(best) == 1 and best[0].data.params["data.num_workers"] == str(summary["best"]["values"]["data.num_workers"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best.yaml", "trials.csv", "summary.json", "optimization_history.png"} <= artifacts
    assert "best_utilization" in parent.data.metrics
    judged = summary["confirmed"][str(summary["best"]["number"])] if summary["best"]["confirmed"] else summary["best"]
    assert parent.data.metrics["best_throughput"] == pytest.approx(judged["throughput"])


@pytest.mark.perf
@pytest.mark.slow  # a study of its own, 9-21 s
def test_smaller_batch_that_wastes_work_does_not_win(make_cfg, tmp_path):
    # transformer with 1 ms reads: batch 1 keeps the step busier by wall time (less efficient
    # kernels: more CPU per sample too) but moves fewer samples per second than batch 64
    cfg = make_cfg("experiment=transformer_lm", "sim.read_latency_ms=1", *SHORT, "tune.n_trials=4",
                   "tune.baseline=false", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
                   "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[1,64]",
                   "tune.space.num_workers.high=0", "tune.space.accumulation_steps.high=1")
    summary = run_study(cfg, tmp_path, echo=False)
    trials = {t.user_attrs["values"]["data.batch_size"]: t.user_attrs for t in study_of(summary).trials
              if t.state == optuna.trial.TrialState.COMPLETE}
    assert set(trials) == {1, 64}, "both batch sizes must have been tried"
    small, large = trials[1], trials[64]
    assert small["busy_frac"] > large["busy_frac"]  # the premise: busier by wall time
    assert small["throughput"] < 0.95 * large["throughput"]
    assert summary["best"]["values"]["data.batch_size"] == 64


@pytest.mark.slow  # a study of its own, 9-21 s
def test_mfu_objective_picks_the_highest_mfu(make_cfg, tmp_path):
    cfg = make_cfg(*SHORT, "tune.n_trials=3", "tune.objective=mfu", "tune.baseline=false",
                   f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.type=categorical",
                   "tune.space.batch_size.choices=[8,64]", "tune.space.num_workers.high=0",
                   "tune.space.accumulation_steps.high=1")
    summary = run_study(cfg, tmp_path, echo=False)
    done = [t for t in study_of(summary).trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and all(0 < t.user_attrs["mfu"] <= 1 and t.value == t.user_attrs["mfu"] for t in done)
    assert summary["best"]["mfu"] == max(t.user_attrs["mfu"] for t in done)


def test_utilization_score_ranks_like_the_final_rule():
    assert utilization_score(0.3, 100, 100, 0.95) > utilization_score(0.9, 80, 100, 0.95)
    assert utilization_score(0.5, 96, 100, 0.95) > utilization_score(0.3, 100, 100, 0.95)
    assert utilization_score(0.9, 50, 100, 0.95) < utilization_score(0.9, 80, 100, 0.95)


@pytest.mark.slow  # a study of its own, 9-21 s
def test_crashing_and_oom_trials_fail_and_the_study_goes_on(make_cfg, tmp_path):
    cfg = make_cfg("model._target_=tasks.faults.FailingLinear", *SHORT, "tune.n_trials=6", "tune.max_failure_rate=1",
                   f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.baseline=false",
                   "tune.space.batch_size.high=32", "tune.space.num_workers.high=0",
                   "+tune.space.crash={key: model.args.fail_at, type: categorical, choices: [2, 100000]}",
                   "+tune.space.oom={key: trainer.memory_cap_mb, type: categorical, choices: [0, 30]}")
    summary = run_study(cfg, tmp_path, echo=False)
    assert summary["status"] == "FINISHED" and summary["n_trials"] == 6
    trials = study_of(summary).trials
    oom = {}  # fail_at -> (batch, trial) that ran out of memory so far under the cap: no batch as large is
    for t in trials:  # launched after at the same other knobs (the cap and fail_at)
        v = t.user_attrs["values"]
        ceiling = min(oom.get(v["model.args.fail_at"], []), default=None)
        if ceiling and v["trainer.memory_cap_mb"] == 30 and v["data.batch_size"] >= ceiling[0]:
            assert t.user_attrs["over_memory_of"] == ceiling[1] and t.state == optuna.trial.TrialState.PRUNED
            continue
        if "duplicate_of" in t.user_attrs:  # a re-proposed config: not launched again
            continue
        if v["trainer.memory_cap_mb"] == 30:
            oom.setdefault(v["model.args.fail_at"], []).append((v["data.batch_size"], t.number))
        should_fail = v["model.args.fail_at"] == 2 or v["trainer.memory_cap_mb"] == 30
        assert (t.state == optuna.trial.TrialState.FAIL) == should_fail, (v, t.state, t.user_attrs.get("error"))
        if v["trainer.memory_cap_mb"] == 30:
            assert t.user_attrs["error"].startswith("out of memory")
        elif v["model.args.fail_at"] == 2:
            assert "rank 0 failed" in t.user_attrs["error"]


def test_a_study_of_a_plain_runs_config_is_refused_before_any_trial(make_cfg, tmp_path):
    """Composed without mode=tune, measure.*'s nulls took a plain run's defaults: its trials would
    measure a fixed 20 steps in one window, not to the trials' precision."""
    with pytest.raises(ValueError, match=r"^a study's config is composed with mode=tune .* got mode=run$"):
        run_study(make_cfg("tune.n_trials=1", f"tune.storage=sqlite:///{tmp_path}/optuna.db"), tmp_path, echo=False)
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "trials.csv").exists()


@pytest.mark.slow  # a study of its own, 9-21 s
def test_failure_rate_stops_the_study(make_cfg, tmp_path):
    from orchestrator.tune.study import StudyFailed

    cfg = make_cfg("model._target_=tasks.faults.FailingLinear", "+model.args.fail_at=1", *SHORT, "tune.n_trials=5",
                   "tune.max_failure_rate=0.5", f"tune.storage=sqlite:///{tmp_path}/optuna.db")
    with pytest.raises(StudyFailed, match=r"2 of 2 trials failed \(> tune.max_failure_rate=0.5\)"):
        run_study(cfg, tmp_path, echo=False)
    assert (tmp_path / "trials.csv").exists()  # what was recorded is kept


@pytest.mark.slow  # a study of its own, 9-21 s
def test_resume_adds_up(make_cfg, tmp_path, capsys):
    common = [*SHORT, "tune.study_name=resume-me", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
              "tune.space.batch_size.high=32", "tune.space.num_workers.high=0"]
    first = run_study(make_cfg(*common, "tune.n_trials=2"), tmp_path / "a", echo=False)
    second = run_study(make_cfg(*common, "tune.n_trials=4"), tmp_path / "b", echo=False)
    trials = study_of(second).trials
    assert first["n_trials"] == 2 and second["n_trials"] == 4 and counted(trials) == 4
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1
    assert all(t.state.is_finished() for t in trials)
    # one MLflow run for the study across its calls: the first one's, reopened
    assert second["mlflow_run_id"] == first["mlflow_run_id"] == study_of(second).user_attrs["mlflow_run_id"]
    client = MlflowClient(make_cfg().tracking.uri)
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["run_kind"] == "study"
    assert len(client.search_runs([parent.info.experiment_id], "tags.study_name = 'resume-me' and tags.mode = 'tune'")) == 1
    assert len(client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")) == 4
    # once more with the same total: nothing to run, it says so, and makes nothing
    capsys.readouterr()
    third = run_study(make_cfg(*common, "tune.n_trials=4"), tmp_path / "c", echo=True)
    out = capsys.readouterr().out
    assert third["status"] == "NOTHING TO RUN" and third["mlflow_run_id"] == first["mlflow_run_id"]
    assert not (tmp_path / "c" / "summary.json").exists() and not (tmp_path / "c" / "trials").exists()
    assert client.get_run(first["mlflow_run_id"]).info.end_time == parent.info.end_time  # not reopened
    assert third["n_trials"] == 4 and len(study_of(third).trials) == len(trials)
    assert "already has 4 counted trials (tune.n_trials=4): nothing to run" in out
    assert "tune.n_trials=8" in out
    assert f"[tune] its best: trial {second['best']['number']}; rerun it: {second['rerun']}" in out
    assert "num_workers [0, 0]" in out and "0.0" not in out.split("space:")[1].splitlines()[0]


@pytest.mark.slow  # 37 s; test_tune_faults checks the duplicate rule in 6
def test_tuners_started_together_on_fresh_stores_share_one_study(tmp_path):
    """A job scheduler starts workers at the same moment: on fresh SQLite stores (Optuna and
    MLflow) every one of them must come up, and together they run exactly n_trials."""
    optuna_url, mlflow_url = f"sqlite:///{tmp_path}/optuna.db", f"sqlite:///{tmp_path}/mlflow.db"
    args = [sys.executable, "-m", "orchestrator", *SHORT, "tune.n_trials=6", "tune.study_name=shared",
            f"tune.storage={optuna_url}", "tune.space.batch_size.high=32", "tune.space.num_workers.high=0",
            f"tracking.uri={mlflow_url}"]
    procs = [subprocess.Popen(args + [f"hydra.run.dir={tmp_path}/p{i}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    study = optuna.load_study(study_name="shared", storage=optuna_url)
    assert counted(study.trials) == 6 and all(t.state.is_finished() for t in study.trials)
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    launched = [t for t in study.trials if "mlflow_run_id" in t.user_attrs]
    per_process = [len(list((tmp_path / f"p{i}" / "trials").glob("*"))) if (tmp_path / f"p{i}" / "trials").exists()
                   else 0 for i in range(4)]
    assert sum(per_process) == len(launched)  # no trial ran twice
    configs = [json.dumps(t.params, sort_keys=True) for t in launched]
    assert len(set(configs)) == len(configs)  # nor one config in two tuners at once (the duplicate check)
    client = MlflowClient(mlflow_url)
    runs = client.search_runs([client.get_experiment_by_name("orchestrator").experiment_id])
    parents = {r.info.run_id for r in runs if r.data.tags.get("mode") == "tune"}
    assert len(parents) == 4  # one study run per tuner process
    assert {r.info.run_id for r in runs} >= parents | {t.user_attrs["mlflow_run_id"] for t in launched}
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents]
    assert len(nested) == len(launched)  # every trial's nested run is there
    assert all(r.info.status != "RUNNING" for r in runs)


@pytest.mark.slow  # 19 s of four processes
def test_runs_started_together_on_a_fresh_tracking_db(tmp_path):
    mlflow_url = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-m", "orchestrator", "trainer.max_steps=6", "measure.warmup_steps=1",
                               "measure.window_steps=2", f"tracking.uri={mlflow_url}", f"hydra.run.dir={tmp_path}/r{i}"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    ids = {json.loads((tmp_path / f"r{i}" / "result.json").read_text())["mlflow_run_id"] for i in range(3)}
    client = MlflowClient(mlflow_url)
    assert len(ids) == 3 and all(client.get_run(i).info.status == "FINISHED" for i in ids)
    assert len(client.search_experiments(filter_string="name = 'orchestrator'")) == 1


def test_global_batch_holds_the_model_math(make_cfg, tmp_path):
    cfg = make_cfg(*SHORT, "tune.n_trials=4", "tune.global_batch=64", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
                   "tune.space.num_workers.high=0")
    summary = run_study(cfg, tmp_path, echo=False)
    for t in study_of(summary).trials:
        v = t.user_attrs["values"]
        assert v["data.batch_size"] * v["trainer.accumulation_steps"] == 64


@pytest.mark.parametrize("overrides, expected", [
    (["~tune.space.batch_size", "~tune.space.num_workers", "~tune.space.accumulation_steps", "~tune.space.prefetch_factor",
      "~tune.space.pin_memory"], "tune.space: empty"),
    (["tune.sampler=grid"], "tune.sampler: grid has "),
    (["tune.sampler=grid", "+tune.space.lr={key: trainer.lr, type: float, low: 0.001, high: 0.1}"],
     "tune.sampler: grid needs countable dimensions; tune.space.lr is a float range"),
    (["tune.patience=-1"], "tune.patience: must be >= 0 (0 = off), got -1"),
    (["tune.space.batch_size.low=1024"], "tune.space.batch_size: low (1024) > high (512)"),
    (["tune.space.batch_size.low=0"], "tune.space.batch_size.low: powers of two start at 1"),
    (["tune.space.batch_size.type=int", "tune.space.batch_size.low=0"],
     "tune.space.batch_size: 0 is not valid: data.batch_size: must be an integer >= 1"),
    (["+tune.space.nope={key: data.nope, type: int, low: 1, high: 2}"], "tune.space.nope.key: 'data.nope' is not a config key"),
    (["tune.space.accumulation_steps.high=null"], "tune.space.accumulation_steps.high: required"),
    (["tune.global_batch=100", "tune.space.batch_size.low=64"], "tune.global_batch: 100 cannot be reached"),
])
def test_bad_space_is_rejected_before_any_trial(make_cfg, tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as info:
        run_study(make_cfg(*SHORT, f"tune.storage=sqlite:///{tmp_path}/optuna.db", *overrides), tmp_path, echo=False)
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "trials").exists()


def test_backend_name_is_a_categorical_of_one_world_size(make_cfg):
    base = ["backend=ddp", "parallelism.nproc_per_node=2"]
    space = SearchSpace(make_cfg(*base, "+tune.space.backend={key: backend.name, type: categorical, choices: [ddp, fsdp]}"))
    assert next(d for d in space.dims if d.key == "backend.name").choices == ["ddp", "fsdp"]
    with pytest.raises(ConfigError, match=r"^tune.space.backend: 'single' runs 1 process\(es\), the base config 2"):
        SearchSpace(make_cfg(*base, "+tune.space.backend={key: backend.name, type: categorical, choices: [ddp, single]}"))


@pytest.mark.slow  # a study of its own, 9-21 s
def test_sweep_runs_every_job_and_summarizes(tmp_path, mlflow_uri):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "-m", "trainer.max_steps=4", "measure.warmup_steps=1",
         "model._target_=tasks.models.Linear,tasks.faults.FailingLinear", f"tracking.uri={mlflow_uri}",
         "tracking.experiment=sweep-test", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1  # one job failed; the other still ran
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["FINISHED", "FAILED"]
    assert rows[0]["world_size"] == 1 and re.search(r"┃ job ┃ overrides .*┃ world size ┃", out.stdout)
    assert "1 of 2 sweep jobs did not finish" in out.stderr
    client = MlflowClient(mlflow_uri)
    runs = [client.get_run(r["mlflow_run_id"]) for r in rows]
    assert len({r.data.tags["sweep_id"] for r in runs}) == 1


def test_a_trial_completed_by_another_tuner_while_the_pick_is_ranked_is_not_a_key_error(monkeypatch):
    """Tuners of a shared study: another process completes a trial between ranked()'s reads of the
    study (its figures, then the trials that may be the pick). The ranking is of the trials it read."""
    import orchestrator.tune.rules as rules
    from orchestrator.schema import Objective, TuneConfig

    study = optuna.create_study(direction="maximize")
    for util, thr in ((0.5, 100.0), (0.6, 110.0), (0.9, 300.0)):
        study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
            "values": {"w": int(thr)}, "utilization": util, "throughput": thr, "throughput_lo": 0.9 * thr,
            "throughput_hi": 1.1 * thr, "utilization_lo": util - 0.02, "utilization_hi": util + 0.02}))
    completed, reads = rules.completed, []

    def racing(s):  # the first read misses the trial another process is completing
        reads.append(1)
        return completed(s)[:2] if len(reads) == 1 else completed(s)
    monkeypatch.setattr(rules, "completed", racing)
    assert [tr.number for tr in rules.ranked(study, TuneConfig(objective=Objective.utilization))] == [1, 0]
    assert len(reads) >= 2


def test_the_pick_comes_from_the_confirmed_figures():
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import best_trials, confirm_candidates, ranked, separation

    study = optuna.create_study(direction="maximize")

    def add(number_values, util, thr, lo, hi):
        study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
            "values": number_values, "utilization": util, "throughput": thr, "throughput_lo": lo,
            "throughput_hi": hi, "utilization_lo": util - 0.02, "utilization_hi": util + 0.02}))

    add({"w": 0}, 0.50, 100.0, 90, 110)
    add({"w": 2}, 0.90, 300.0, 250, 350)  # a lucky short measurement
    add({"w": 4}, 0.85, 290.0, 270, 310)
    add({"w": 8}, 0.80, 280.0, 260, 300)
    t = TuneConfig(objective=Objective.utilization, confirm_top=2)
    assert [tr.number for tr in confirm_candidates(study, t)] == [1, 2]  # the fastest is among them
    # a runner-up below the leader on both intervals cannot win: not re-measured, and a lone leader
    # needs no confirmation at all
    lone = optuna.create_study(direction="maximize")
    for tr in study.trials[:2]:
        lone.add_trial(tr)
    assert [tr.number for tr in confirm_candidates(lone, t)] == [1]
    assert best_trials(study, t)[0].number == 1
    # re-measured side by side, trial 1 was luck: the pick follows the confirmed figures
    study.set_user_attr("confirmed", {
        "1": {"utilization": 0.70, "utilization_lo": 0.66, "utilization_hi": 0.74, "throughput": 240.0,
              "throughput_lo": 230.0, "throughput_hi": 250.0},
        "2": {"utilization": 0.84, "utilization_lo": 0.82, "utilization_hi": 0.86, "throughput": 288.0,
              "throughput_lo": 280.0, "throughput_hi": 296.0}})
    assert best_trials(study, t)[0].number == 2
    assert [tr.number for tr in ranked(study, t)][:2] == [2, 1]  # confirmed ones first
    sep = separation(study, t)
    assert sep["winner"] == 2 and sep["runner_up"] == 1 and sep["figure"] == "throughput"  # 1 is below the floor
    assert sep["separated"] is True and sep["confirmed"]
    study.set_user_attr("confirmed", {**study.user_attrs["confirmed"], "1": {
        "utilization": 0.83, "utilization_lo": 0.80, "utilization_hi": 0.85, "throughput": 286.0,
        "throughput_lo": 276.0, "throughput_hi": 296.0}})
    sep = separation(study, t)
    assert sep["figure"] == "utilization" and sep["separated"] is False  # within the noise of each other


def test_the_users_config_is_confirmed_beside_the_pick():
    """The baseline trial (the config as given) joins the confirmation of a pick that is not it, so
    the gain the summary reports is measured side by side; there it is the reference, picked only
    when it beats the pick beyond the noise; a baseline that leads alone needs no confirmation."""
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import best_trials, confirm_candidates, versus_baseline

    def study_with(*rows):
        study = optuna.create_study(direction="maximize")
        for util, thr, lo, hi, base in rows:
            study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
                "values": {"thr": thr}, "utilization": util, "throughput": thr, "throughput_lo": lo,
                "throughput_hi": hi, "utilization_lo": util - 0.02, "utilization_hi": util + 0.02,
                **({"baseline": True} if base else {})}))
        return study

    t = TuneConfig(objective=Objective.utilization, confirm_top=2)
    study = study_with((0.50, 100.0, 90, 110, True), (0.90, 300.0, 280, 320, False))
    assert [tr.number for tr in confirm_candidates(study, t)] == [1, 0]
    vs = versus_baseline(study, t)
    assert vs["best"] == 1 and vs["baseline"] == 0 and vs["throughput_ratio"] == pytest.approx(3.0)
    assert not vs["side_by_side"]
    study.set_user_attr("confirmed", {  # side by side the first trial's lead was smaller
        "1": {"utilization": 0.85, "utilization_lo": 0.82, "utilization_hi": 0.88, "throughput": 240.0,
              "throughput_lo": 230.0, "throughput_hi": 250.0},
        "0": {"utilization": 0.55, "throughput": 120.0, "throughput_lo": 110.0, "throughput_hi": 130.0}})
    vs = versus_baseline(study, t)
    assert vs["side_by_side"] and vs["throughput_ratio"] == pytest.approx(2.0)
    assert 1.0 < vs["throughput_ratio_lo"] < 2.0 < vs["throughput_ratio_hi"]
    assert vs["baseline_utilization"] == pytest.approx(0.55)
    # measured beside the pick, the user's config is the reference, not one more arm of the contest:
    # a lucky run within the noise (faster, so the pick fell under its floor) does not win ...
    lucky = {"utilization": 0.55, "throughput": 255.0, "throughput_lo": 235.0, "throughput_hi": 275.0}
    study.set_user_attr("confirmed", {**study.user_attrs["confirmed"], "0": lucky})
    assert best_trials(study, t)[0].number == 1
    # ... one that beats the pick beyond the noise does
    study.set_user_attr("confirmed", {**study.user_attrs["confirmed"], "0": {
        **lucky, "throughput": 400.0, "throughput_lo": 380.0, "throughput_hi": 420.0}})
    assert best_trials(study, t)[0].number == 0
    lone = study_with((0.90, 300.0, 280, 320, True), (0.50, 100.0, 90, 110, False))
    assert [tr.number for tr in confirm_candidates(lone, t)] == [0]


def test_a_busier_trial_just_below_the_floor_is_confirmed():
    """A smaller batch measured at 0.92 of the fastest (its interval reaching the floor) with more
    utilization than the leader: the short trial put it under the floor, the confirmation decides.
    Its chance of keeping up makes it the runner-up by the expected score, ahead of a trial about as
    fast as the leader but less busy; one far below the floor, or one less busy than the leader,
    is not re-measured."""
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import confirm_candidates

    study = optuna.create_study(direction="maximize")
    for b, util, thr, lo, hi in ((64, 0.20, 1000.0, 950, 1050), (32, 0.19, 990.0, 940, 1040),
                                 (16, 0.33, 920.0, 860, 980), (8, 0.40, 600.0, 560, 640), (4, 0.10, 930.0, 870, 990)):
        study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
            "values": {"b": b}, "utilization": util, "throughput": thr, "throughput_lo": lo, "throughput_hi": hi,
            "utilization_lo": util - 0.02, "utilization_hi": util + 0.02}))
    t = TuneConfig(objective=Objective.utilization, confirm_top=2)
    assert [tr.number for tr in confirm_candidates(study, t)] == [0, 2]


def test_a_busier_trial_that_may_not_keep_up_loses_to_one_that_does():
    """The utilization objective's pick is its expected score: a trial 2% busier than the fastest,
    measured just inside the 0.95 floor but with an interval reaching far below it, keeps up only
    about half the time, and then trains 11% slower; the fastest wins. Measured as precisely as
    the fastest, the busier one keeps up for certain and wins."""
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import best_trials, expected_scores

    def study_of(busier_lo, busier_hi):
        study = optuna.create_study(direction="maximize")
        for util, thr, lo, hi in ((0.58, 1000.0, 990.0, 1010.0), (0.60, 955.0, busier_lo, busier_hi)):
            study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
                "values": {"b": thr}, "utilization": util, "throughput": thr, "throughput_lo": lo,
                "throughput_hi": hi, "utilization_lo": util - 0.01, "utilization_hi": util + 0.01}))
        return study

    t = TuneConfig(objective=Objective.utilization, confirm_top=2)
    assert best_trials(study_of(800.0, 1110.0), t)[0].number == 0
    assert best_trials(study_of(953.0, 957.0), t)[0].number == 1
    # without intervals the figures are exact: the point rule (the busiest within the floor)
    exact = [{"utilization": 0.58, "throughput": 1000.0}, {"utilization": 0.60, "throughput": 955.0},
             {"utilization": 0.90, "throughput": 900.0}]
    assert expected_scores(exact, 0.95) == [0.58 / 0.60, 1.0, 0.9]
    # an interval on throughput alone (the bench's references): utilization is exact in every draw
    mixed = [{**f, "throughput_lo": 0.999 * f["throughput"], "throughput_hi": 1.001 * f["throughput"]} for f in exact]
    assert [round(x, 3) for x in expected_scores(mixed, 0.95)] == [0.967, 1.0, 0.9]


def test_a_much_busier_trial_that_may_keep_up_is_worth_its_chance():
    """The zoo's storage_1: 32-sample batches 1.5x busier than 64-sample ones, measured 5% slower
    with intervals of +-13%, keep up about half the time. Kept up, they are the pick and the larger
    batch scores 0.68 of them; fallen just under the floor, they still move 0.9 of its samples. The
    expected score weighs both: the busier one is the pick (a score capped at the busiest sure keeper's
    could never prefer it)."""
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import best_trials, expected_scores

    study = optuna.create_study(direction="maximize")
    figs = [{"utilization": 0.19, "throughput": 4900.0, "throughput_lo": 4260.0, "throughput_hi": 5540.0},
            {"utilization": 0.28, "throughput": 4650.0, "throughput_lo": 4050.0, "throughput_hi": 5250.0}]
    for f in figs:
        f.update(utilization_lo=f["utilization"] - 0.01, utilization_hi=f["utilization"] + 0.01)
        study.add_trial(optuna.trial.create_trial(value=1 + f["utilization"], user_attrs={"values": {}, **f}))
    assert best_trials(study, TuneConfig(objective=Objective.utilization))[0].number == 1
    large, small = expected_scores(figs, 0.95)
    assert 0.7 < large < small < 1.0
    assert expected_scores(figs, 0.95) == [large, small]  # seeded: the same figures score alike


@pytest.mark.perf
def test_guided_search_follows_the_job_model(make_cfg, tmp_path):
    """The baseline (no workers, 3 ms reads per sample) waits on its reads: the job model fitted to
    it predicts that sleeping workers pay beyond the 2 cores, and its proposal runs next, with the
    prediction and what it rests on as the reason."""
    common = ["experiment=input_bound", "sim.read_latency_ms=3", "data.args.blur_passes=1", *SHORT,
              "tune.n_trials=2", "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[16]",
              "tune.space.accumulation_steps.high=1", "tune.max_workers=8"]
    cfg = make_cfg(*common, f"tune.storage=sqlite:///{tmp_path}/optuna.db")
    summary = run_study(cfg, tmp_path, echo=False)
    first, second = study_of(summary).trials[:2]
    assert first.user_attrs["proposed_by"] == "baseline" and first.user_attrs["verdict"] == "input-bound"
    assert first.user_attrs["input_cost"]["data_wall_s"] > 2.5e-3  # the reads, per item
    assert second.user_attrs["proposed_by"] == "model"
    assert second.user_attrs["reason"].startswith("the job model predicts") and "loader wait" in second.user_attrs["reason"]
    assert second.user_attrs["values"]["data.num_workers"] > 2  # beyond the cores: the workers mostly sleep
    rows = (tmp_path / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("number,state,proposed_by") and ",model," in rows[2]
    tpe = run_study(make_cfg(*common, f"tune.storage=sqlite:///{tmp_path}/tpe.db", "tune.sampler=tpe"),
                    tmp_path / "tpe", echo=False)
    assert all(t.user_attrs["proposed_by"] not in ("model", "diagnosis") for t in study_of(tpe).trials)


def test_a_diagnosis_chain_climbs_while_it_pays(make_cfg, tmp_path):
    """A proposed trial that beat its proposer proposes the next move (batch 16 -> 32 -> 64); one
    that did not ends the chain (no batch 128)."""
    from orchestrator.tune.proposals import Proposals

    cfg = make_cfg("mode=tune", "tune.global_batch=free",
                   "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[16,32,64,128]",
                   "tune.space.num_workers.high=0", "tune.space.accumulation_steps.high=1", "tune.n_trials=10")
    space, storage = SearchSpace(cfg), f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=storage, study_name="chain", direction="maximize")
    proposals = Proposals(space, cfg.tune, storage, "chain", lambda line: None)
    study.enqueue_trial(space.params_of({"data.batch_size": 16}), user_attrs={"proposed_by": "baseline"})

    def run(batch: int, throughput: float, to: int) -> bool:
        """Run the next queued trial with these figures; its compute-bound diagnosis moves to batch `to`."""
        trial = study.ask()
        assert space.sample(trial)["data.batch_size"] == batch
        for k, v in {"throughput": throughput, "utilization": 0.9, "throughput_hi": throughput * 1.02}.items():
            trial.set_user_attr(k, v)
        study.tell(trial, throughput)
        move = {"verdict": "compute-bound", "moves": [{"set": {"data.batch_size": to}, "why": "a larger batch"}]}
        proposals.diagnosis(study, trial, {"data.batch_size": batch}, move)
        return any(t.state.name == "WAITING" for t in study.get_trials(deepcopy=False))

    assert run(16, 100.0, 32)  # the baseline proposes
    assert run(32, 150.0, 64)  # beat its proposer (100 +- 2%): climbs on
    assert not run(64, 151.0, 128)  # within 32's noise: the chain ends
    chain = study.get_trials(deepcopy=False)
    assert [t.user_attrs.get("parent") for t in chain] == [None, 0, 1]


def test_a_trial_carries_its_owner_from_birth_and_orphans_are_known(tmp_path):
    """The owner is written with the trial (a fresh one) or as it leaves the queue (an enqueued
    one), so a tuner that dies between ask() and its first write leaves no trial that looks alive."""
    from datetime import timedelta

    from orchestrator.rundir import process_tag as owner
    from orchestrator.tune.storage import ORPHAN_AFTER_S, orphaned, study_storage

    study = optuna.create_study(storage=study_storage(f"sqlite:///{tmp_path}/s.db"))
    study.enqueue_trial({"x": 1.0})
    queued, fresh = study.ask(), study.ask()
    stored = {t.number: t.user_attrs.get("owner") for t in optuna.load_study(
        study_name=study.study_name, storage=f"sqlite:///{tmp_path}/s.db").trials}
    assert stored == {queued.number: owner(), fresh.number: owner()}

    trial = study.trials[fresh.number]
    assert not orphaned(trial)  # this process is alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    trial.user_attrs["owner"] = f"{owner().rpartition(':')[0]}:{dead.stdout.strip()}"
    assert orphaned(trial)
    trial.user_attrs["owner"] = f"another-host:{dead.stdout.strip()}"
    assert not orphaned(trial)  # cannot be checked from here
    del trial.user_attrs["owner"]
    assert not orphaned(trial)  # just created, its owner not written yet
    assert orphaned(trial, now=trial.datetime_start + timedelta(seconds=ORPHAN_AFTER_S + 1))


def test_the_space_samples_ordinals_and_knobs_that_need_workers_only_with_workers(make_cfg):
    """pow2 as an exponent and numeric choices by rank (the sampler sees their order); prefetch
    only when the trial has workers; pin_memory left out without a GPU; the grid counts configs."""
    from orchestrator.tune.space import SearchSpace

    space = SearchSpace(make_cfg("mode=tune", "tune.global_batch=free", "tune.max_workers=3",
                                 "tune.space.accumulation_steps.type=categorical",
                                 "tune.space.accumulation_steps.choices=[4,1,2]"))
    assert "pin_memory" in space.left_out and all(d.name != "pin_memory" for d in space.dims)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        values = space.sample(trial)
        dists = trial.distributions
        assert isinstance(dists["batch_size_log2"], optuna.distributions.IntDistribution)
        assert (dists["batch_size_log2"].low, dists["batch_size_log2"].high) == (3, 9)  # 8 .. 512
        assert values["data.batch_size"] == 2 ** trial.params["batch_size_log2"]
        assert values["trainer.accumulation_steps"] == [1, 2, 4][trial.params["accumulation_steps_rank"]]
        has_workers = values["data.num_workers"] > 0
        assert ("prefetch_factor" in trial.params) == has_workers
        assert (values["data.prefetch_factor"] is None) == (not has_workers)
        assert space.params_of(values) == trial.params  # a point enqueued back is the same trial
        seen.add(has_workers)
        study.tell(trial, 0.0)
    assert seen == {True, False}
    gp = optuna.create_study(sampler=optuna.samplers.GPSampler(seed=0, n_startup_trials=2))  # tune.sampler=gp
    for i in range(4):
        trial = gp.ask()
        values = space.sample(trial)
        gp.tell(trial, float(values["data.batch_size"]))
    assert all(t.state.name == "COMPLETE" for t in gp.trials)
    # 7 batch sizes x 3 accumulations x (1 point without workers + 3 worker counts x 8 prefetch depths)
    assert space.grid_size() == 7 * 3 * (1 + 3 * 8)
    no_workers = SearchSpace(make_cfg("mode=tune", "tune.global_batch=free", "tune.space.num_workers.high=0"))
    assert "prefetch_factor" in no_workers.left_out and no_workers.grid_size() == 7 * 8
    # a move the diagnosis proposes lands on the nearest value of the space on its way
    snap = space.snap
    assert snap("data.num_workers", 0, 2) == 2 and snap("data.num_workers", 1, 8) == 3  # the top of [0, 3]
    assert snap("data.num_workers", 3, 8) is None and snap("data.batch_size", 512, 1024) is None
    assert snap("trainer.accumulation_steps", 1, 3) == 4 and snap("trainer.accumulation_steps", 2, 3) == 4
    assert snap("trainer.accumulation_steps", 4, 1) == 1 and snap("data.batch_size", 64, 48) == 32


def test_patience_counts_trials_that_do_not_beat_the_best_by_more_than_its_noise():
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import stale_streak

    study = optuna.create_study(direction="maximize")

    def add(util, thr, noise=0.02, state=optuna.trial.TrialState.COMPLETE):
        attrs = {"utilization": util, "throughput": thr, "utilization_lo": util - noise, "utilization_hi": util + noise,
                 "throughput_lo": thr * 0.95, "throughput_hi": thr * 1.05}
        study.add_trial(optuna.trial.create_trial(state=state, value=1 + util if state.name == "COMPLETE" else None,
                                                  user_attrs=attrs if state.name == "COMPLETE" else {}))

    t = TuneConfig(objective=Objective.utilization)
    add(0.50, 100.0)
    assert stale_streak(study, t) == (0, 0)
    add(0.51, 100.0)  # within the best's noise: no improvement, but the bar moves up to it
    add(0.40, 100.0)
    add(0.0, 0.0, state=optuna.trial.TrialState.PRUNED)
    assert stale_streak(study, t) == (3, 1)
    add(0.60, 100.0)  # beyond the noise
    assert stale_streak(study, t) == (0, 4)
    add(0.30, 140.0)  # much faster: trial 4 is now below the floor of it, a real improvement
    assert stale_streak(study, t) == (0, 5)


@pytest.mark.slow  # a study of its own, 9-21 s
def test_grid_runs_every_point_once_and_patience_ends_a_flat_study(make_cfg, tmp_path, capsys):
    small = [*SHORT, f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.num_workers.high=0",
             "tune.space.batch_size.high=16", "tune.space.accumulation_steps.high=1", "tune.baseline=false"]
    grid = run_study(make_cfg(*small, "tune.sampler=grid", "tune.n_trials=3"), tmp_path / "grid", echo=False)
    points = sorted((t.user_attrs["values"]["data.batch_size"], t.user_attrs["values"]["trainer.accumulation_steps"])
                    for t in study_of(grid).trials if "duplicate_of" not in t.user_attrs)
    assert points == [(8, 1), (16, 1)] and grid["n_trials"] == 2 and grid["stopped"]["by"] == "covered"
    # a knob that does not change speed: nothing beats the first trial by more than its noise for long
    flat = run_study(make_cfg(*small, "~tune.space.batch_size", "~tune.space.accumulation_steps",
                              "+tune.space.seed={key: trainer.seed, type: int, low: 1, high: 50}",
                              "tune.n_trials=12", "tune.patience=2", "tune.sampler=random"), tmp_path / "flat")
    out = capsys.readouterr().out
    assert flat["stopped"]["by"] == "patience" and flat["stopped"]["streak"] == 2 and flat["n_trials"] < 12
    assert "[tune] stopped early: 2 trials in a row did not beat trial" in out
    assert json.loads((tmp_path / "flat" / "summary.json").read_text())["stopped"]["by"] == "patience"


@pytest.mark.slow  # a study of its own, 9-21 s
def test_a_best_on_the_edge_widens_the_space_and_says_so(make_cfg, tmp_path, capsys, monkeypatch):
    """40 ms sleeping reads per sample (320 ms per batch of 8 per worker, no transform): the best
    is input-bound at the most workers the space allows (a read sleeps 320 ms a batch: no load on the
    machine makes that compute-bound); the study widens num_workers (up to its cap, 3 here) and
    tries the step."""
    from orchestrator.tune import proposals

    monkeypatch.setattr(proposals, "workers_cap", lambda space: 3)  # 4 x the cores of a rank elsewhere
    cfg = make_cfg("experiment=input_bound", "sim.read_latency_ms=40", "data.args.blur_passes=0", *SHORT,
                   "tune.extend_edges=true", "tune.n_trials=4", "tune.sampler=grid", "tune.max_workers=2",
                   "tune.baseline=false", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
                   "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[8]",
                   "tune.space.accumulation_steps.high=1", "~tune.space.prefetch_factor")
    summary = run_study(cfg, tmp_path)
    out = capsys.readouterr().out
    trials = study_of(summary).trials
    edge = [t for t in trials if t.user_attrs.get("proposed_by") == "edge"]
    two = next(t for t in trials if t.user_attrs["values"]["data.num_workers"] == 2 and "verdict" in t.user_attrs)
    seen = [(t.number, t.user_attrs["values"]["data.num_workers"], t.user_attrs.get("verdict")) for t in trials]
    assert two.user_attrs["verdict"] == "input-bound", seen
    assert len(edge) == 1 and edge[0].user_attrs["values"]["data.num_workers"] == 3, seen
    assert "is input-bound at num_workers=2, the top of the space" in edge[0].user_attrs["reason"]
    assert study_of(summary).user_attrs["extended"] == {"num_workers": 3}
    assert "widened num_workers to [0, 3], trying num_workers=3" in out
    if summary["edges"]:  # the best on the new edge, still input-bound: the cap is said
        assert summary["edges"][0]["capped"].startswith("data.num_workers=3 is the most") and "[tune] edge: " in out
    rows = (tmp_path / "trials.csv").read_text().splitlines()
    assert "global_batch" in rows[0] and "prune_reason" in rows[0] and ",edge," in "\n".join(rows)


def test_the_edge_rules(make_cfg):
    """Which verdict opens which edge, the next step and its caps, and a single value left alone."""
    from orchestrator.tune.edges import apply_extensions, edges_of, next_step
    from orchestrator.tune.space import SearchSpace

    space = SearchSpace(make_cfg("mode=tune", "tune.global_batch=free",
                                 "tune.max_workers=2", "tune.space.batch_size.high=64"))

    def trial(number, verdict, error="", per_epoch=100, **values):
        v = {"data.batch_size": 64, "data.num_workers": 2, "trainer.accumulation_steps": 8, **values}
        return optuna.trial.create_trial(value=1.0, user_attrs={"values": v, "verdict": verdict, "error": error,
                                                                "steps_per_epoch": per_epoch})

    dims = {d.key: d for d in space.dims}
    assert [e.key for e in edges_of(trial(0, "input-bound"), space)] == ["data.num_workers"]
    assert [e.key for e in edges_of(trial(0, "compute-bound"), space)] == ["data.batch_size"]
    assert [e.key for e in edges_of(trial(0, "communication-bound"), space)] == ["trainer.accumulation_steps"]
    assert edges_of(trial(0, "input-bound", **{"data.num_workers": 1}), space) == []  # not on the top
    assert next_step(dims["data.num_workers"], trial(0, "input-bound"), [], workers_cap=8) == {"value": 3}
    assert next_step(dims["data.num_workers"], trial(0, "input-bound"), [], workers_cap=2) == {
        "capped": "data.num_workers=2 is the most a study tries (4 x the CPU cores of a rank)"}
    assert next_step(dims["data.batch_size"], trial(0, "compute-bound"), [], 8) == {"value": 128}
    assert "trains 2 steps per epoch" in next_step(dims["data.batch_size"], trial(0, "compute-bound", per_epoch=2),
                                                    [], 8)["capped"]
    oom = trial(1, "-", error="out of memory: ...", **{"data.batch_size": 128})
    assert "ran out at a larger batch" in next_step(dims["data.batch_size"], trial(0, "compute-bound"), [oom], 8)["capped"]
    apply_extensions(space, {"batch_size": 128, "num_workers": 3})
    assert max(dims["data.batch_size"].extremes()) == 128 and dims["data.num_workers"].extremes() == [0, 3]
    fixed = SearchSpace(make_cfg("mode=tune", "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[64]"))
    assert edges_of(trial(0, "compute-bound"), fixed) == []  # a single value: the user fixed it

@pytest.mark.slow  # a study of its own, 9-21 s
def test_global_batch_is_said_and_a_one_step_epoch_is_not_picked(make_cfg, tmp_path, capsys):
    """Batch 64 of a 64-sample dataset trains one optimizer step per epoch: not a pick, whatever it
    measures; the pick changes the base config's global batch (32), and the summary says by how much."""
    cfg = make_cfg(*SHORT, "data.args.size=64", "tune.n_trials=3", "tune.sampler=grid",
                   f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.type=categorical",
                   "tune.space.batch_size.choices=[8,16,64]", "tune.space.accumulation_steps.high=1",
                   "tune.space.num_workers.high=0")
    summary = run_study(cfg, tmp_path)
    out = capsys.readouterr().out
    gb = {t.user_attrs["values"]["data.batch_size"]: t.user_attrs for t in study_of(summary).trials}
    assert {b: a["global_batch"] for b, a in gb.items()} == {8: 8, 16: 16, 64: 64}
    assert gb[64]["steps_per_epoch"] == 1 and gb[8]["steps_per_epoch"] == 8
    assert summary["refused"] == [{"trial": next(n for n, t in enumerate(study_of(summary).trials)
                                                 if t.user_attrs["values"]["data.batch_size"] == 64),
                                   "global_batch": 64, "steps_per_epoch": 1}]
    assert summary["best"]["values"]["data.batch_size"] in (8, 16)
    note = summary["global_batch"]
    assert note["base"] == 32 and note["best"] == summary["best"]["values"]["data.batch_size"]
    assert "hold it with tune.global_batch=32" in note["note"] and "[tune] global batch: " in out
    assert "allow with tune.allow_large_global_batch=true" in out
    assert "# Note: the best trains a global batch of" in (tmp_path / "tuned" / "best.yaml").read_text()


@pytest.mark.slow  # 22 s: a study, then its rerun line
def test_the_rerun_line_trains_and_measures(tmp_path):
    """The study's printed rerun line, run as printed: the rerun's result has figures."""
    study_dir, rerun_dir = tmp_path / "study", tmp_path / "rerun"
    args = [sys.executable, "-m", "orchestrator", *SHORT, "measure.warmup_steps=1", "tune.n_trials=2",
            "tune.space.num_workers.high=0", "tune.space.batch_size.high=16", "tune.space.accumulation_steps.high=1",
            f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tracking.enabled=false", f"hydra.run.dir={study_dir}"]
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True)
    rerun = shlex.split(json.loads((study_dir / "summary.json").read_text())["rerun"])
    out = subprocess.run([*rerun, f"hydra.run.dir={rerun_dir}"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((rerun_dir / "result.json").read_text())
    assert result["status"] == "FINISHED" and result["throughput"] > 0 and result["utilization"] is not None
    assert "measure.warmup_steps=1" in rerun and not any(a.startswith(("mode=", "tune.")) for a in rerun)
    assert not any(a.startswith(("measure.rel_precision=", "measure.max_measure_s=")) for a in rerun)  # the trials' stop rule


@pytest.mark.slow  # a study of its own, 9-21 s
def test_a_pruned_trial_shows_its_last_window_and_the_pruners_reason(make_cfg, tmp_path, capsys):
    """Slow reads (2 ms per sample) make a config 10x slower: once 3 trials completed, the median
    pruner stops such a trial at its second window, and says with which figures and why."""
    cfg = make_cfg(*SHORT, "tune.pruner=median", "tune.sampler=grid", "tune.n_trials=8", "tune.baseline=false",
                   f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.type=categorical",
                   "tune.space.batch_size.choices=[32]", "tune.space.num_workers.high=0",
                   "tune.space.accumulation_steps.high=4",
                   "+tune.space.read={key: sim.read_latency_ms, type: categorical, choices: [0.0, 2.0]}")
    summary = run_study(cfg, tmp_path)
    out = capsys.readouterr().out
    pruned = [t for t in study_of(summary).trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [t.state.name for t in study_of(summary).trials]
    for t in pruned:
        a = t.user_attrs
        assert a["last_window_throughput"] > 0 and 0 <= a["last_window_utilization"] <= 1
        assert "below the median" in a["prune_reason"] and "of earlier trials at that window" in a["prune_reason"]
        assert f"[tune] trial {t.number:3d} PRUNED" in out and a["prune_reason"].split(";")[0] in out
        run = MlflowClient(cfg.tracking.uri).get_run(a["mlflow_run_id"])
        assert run.data.tags["prune_reason"] == a["prune_reason"]
        assert run.info.status == "FINISHED" and run.data.tags["trial_state"] == "PRUNED"  # stopped on purpose
    assert summary["pruning"]["pruned"] == len(pruned) and summary["pruning"]["saved_s"] >= 0
    assert "[tune] pruning (median) stopped" in out


def test_unnamed_studies_started_together_are_two_studies(make_cfg, tmp_path, monkeypatch):
    """Two studies without tune.study_name started in the same second get names of their own."""
    from datetime import datetime

    from orchestrator.tune import study
    from orchestrator.tune.study import Tuner

    class SameSecond(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, 0)

    monkeypatch.setattr(study, "datetime", SameSecond)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = Tuner(make_cfg(*SHORT, f"tune.storage={storage}", "trainer.lr=0.1"), tmp_path / "a", echo=False)
    second = Tuner(make_cfg(*SHORT, f"tune.storage={storage}", "trainer.lr=0.5", "tune.space.batch_size.high=32"),
                   tmp_path / "b", echo=False)
    assert first.name != second.name
    first._study(), second._study()
    assert len(optuna.get_all_study_names(storage)) == 2


def test_resuming_a_study_with_another_space_is_refused(make_cfg, tmp_path):
    from orchestrator.tune.study import Tuner

    common = [*SHORT, "tune.study_name=one-space", f"tune.storage=sqlite:///{tmp_path}/optuna.db"]
    Tuner(make_cfg(*common), tmp_path / "a", echo=False)._study()
    Tuner(make_cfg(*common, "tune.n_trials=30"), tmp_path / "b", echo=False)._study()  # the same space: resumes
    with pytest.raises(ConfigError) as info:
        Tuner(make_cfg(*common, "tune.space.batch_size.high=32", "~tune.space.prefetch_factor"), tmp_path / "c",
              echo=False)._study()
    message = str(info.value)
    assert "\n" not in message and message.startswith("tune.space: study 'one-space' was made with another space"), message
    assert "batch_size" in message and "prefetch_factor" in message and "tune.study_name" in message


def test_confirmation_goes_on_while_the_pick_is_within_the_noise():
    """After its planned rounds, the confirmation measures again the leader and the candidates that
    may still beat it: a busier trial whose throughput may or may not keep up with the floor, and the
    fastest while the leader may fall below its floor. Settled figures stop it."""
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import open_contest

    def fig(util, thr, thr_half, util_half=0.01):
        return {"utilization": util, "utilization_lo": util - util_half, "utilization_hi": util + util_half,
                "throughput": thr, "throughput_lo": thr - thr_half, "throughput_hi": thr + thr_half}

    t = TuneConfig(objective=Objective.utilization)
    # zoo storage_1: b32 (busier) measured at 0.96 of b64, its interval straddling the 0.95 floor
    near = {"3": fig(0.22, 6600.0, 100.0), "4": fig(0.32, 6340.0, 250.0), "5": fig(0.20, 6500.0, 100.0)}
    assert open_contest(near, t) == [4, 3]  # leader first (the busier one), then the fastest
    # the same, measured precisely: b32 keeps up for certain and is busier beyond the noise
    settled = {"3": fig(0.22, 6600.0, 30.0), "4": fig(0.32, 6500.0, 30.0), "5": fig(0.20, 6500.0, 30.0)}
    assert open_contest(settled, t) == []
    # far below the floor: b32 cannot keep up, whatever its utilization
    below = {"3": fig(0.22, 6600.0, 30.0), "4": fig(0.32, 5000.0, 100.0)}
    assert open_contest(below, t) == []
    # throughput objective: overlapping intervals are open, separated ones are not
    tt = TuneConfig(objective=Objective.throughput)
    assert open_contest({"1": fig(0.2, 1000.0, 50.0), "2": fig(0.2, 960.0, 50.0)}, tt) == [1, 2]
    assert open_contest({"1": fig(0.2, 1000.0, 10.0), "2": fig(0.2, 900.0, 10.0)}, tt) == []
    assert open_contest({"1": fig(0.2, 1000.0, 10.0)}, t) == []


def test_the_memory_ceiling_holds_the_batch_that_ran_out_whatever_its_workers(make_cfg, tmp_path):
    """The zoo's memory_cap: batch 512 runs out of memory at 0 workers and accumulation 2, and a
    diagnosis that proposes batch 512 at 2 workers and accumulation 1 is held back: the same
    micro-batch does not fit with other workers. A memory-bound batch (it ran) stays launchable,
    larger ones do not; another memory cap has its own ceiling."""
    from orchestrator.tune.proposals import Proposals

    cfg = make_cfg("mode=tune", "tune.global_batch=free",
                   "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[64,128,256,512]",
                   "+tune.space.cap={key: trainer.memory_cap_mb, type: categorical, choices: [0, 300]}")
    space, storage = SearchSpace(cfg), f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=storage, study_name="mem", direction="maximize")
    proposals = Proposals(space, cfg.tune, storage, "mem", lambda line: None)

    def trial(values: dict, **attrs) -> None:
        tr = study.ask()
        tr.set_user_attr("values", {"data.num_workers": 0, "trainer.accumulation_steps": 1, **values})
        for k, v in attrs.items():
            tr.set_user_attr(k, v)
        study.tell(tr, state=optuna.trial.TrialState.FAIL)

    capped = {"trainer.memory_cap_mb": 300}
    assert proposals.memory_ceiling(study, capped) is None
    trial({"data.batch_size": 512, "trainer.accumulation_steps": 2, **capped}, error="out of memory: rss 412 MB")
    ceiling = proposals.memory_ceiling(study, {"data.batch_size": 512, "data.num_workers": 2, **capped})
    assert ceiling is not None and ceiling[0] == 512 and "ran out of memory at batch 512" in ceiling[2]
    assert proposals.memory_ceiling(study, {"trainer.memory_cap_mb": 0}) is None  # no cap: its own ceiling
    trial({"data.batch_size": 128, **capped}, verdict="memory-bound")
    assert proposals.memory_ceiling(study, capped)[0] == 129  # 128 ran: only larger batches are held back
    candidates = proposals._candidates(study, capped)
    assert candidates and {c["data.batch_size"] for c in candidates} == {64, 128}


def test_a_batch_the_measured_memory_puts_over_the_limit_is_not_launched(make_cfg, tmp_path):
    """The zoo's memory_cap (limit 850 MB): batch 128 read 495 MB on ranks that started at 310 MB,
    so batch 512 needs about 1,044 MB and is not launched (a launch would cost a trial of the
    budget). From one trial the activations are its peak over its memory before the first step; from
    two batch sizes or more, a line through their peaks. A batch that ran is never held back."""
    from orchestrator.tune.memory import first_over, memory_record
    from orchestrator.tune.proposals import Proposals

    def mem(peak: float, start: float = 310.0) -> dict:
        return {"peak_mb": peak, "start_mb": start, "state_mb": 2.2, "limit_mb": 850.0}

    b, why = first_over([(128, mem(495.0))])
    assert b == 377 and "over the 850 MB limit" in why  # (850 - 312.2) / ((495 - 312.2) / 128) = 376.6
    b, _ = first_over([(64, mem(428.0)), (128, mem(495.0)), (256, mem(612.0))])  # the line: 371 MB + 0.94 an item
    assert 256 < b < 512
    assert first_over([(128, mem(495.0)), (512, mem(840.0))])[0] > 512  # 512 ran
    assert first_over([(64, mem(700.0)), (128, mem(495.0))]) is None  # 64's reading puts 128 over, and 128 ran
    assert first_over([(128, mem(300.0))]) is None  # nothing grows with the batch
    result = {"per_rank": [{"peak_mem_mb": 495.0, "start_mem_mb": 310.0, "model_state_mb": 2.2, "device_mem_mb": 850.0},
                           {"peak_mem_mb": 400.0, "start_mem_mb": 300.0, "model_state_mb": 2.2, "device_mem_mb": 850.0}]}
    assert memory_record(result["per_rank"]) == mem(495.0)  # the rank with the largest peak
    assert memory_record(result["per_rank"], workers=2) is None  # on CPU its peak holds the workers' memory too
    on_gpu = [{**r, "mem_source": "cuda-allocator"} for r in result["per_rank"]]
    assert memory_record(on_gpu, workers=2) == mem(495.0)  # the allocator's peak is the rank's own
    assert memory_record([{"peak_mem_mb": 495.0, "model_state_mb": 2.2}]) is None  # an older result

    cfg = make_cfg("mode=tune", "tune.global_batch=free",
                   "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[64,128,256,512]",
                   "tune.space.num_workers.high=0")
    space, storage = SearchSpace(cfg), f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=storage, study_name="mem", direction="maximize")
    proposals = Proposals(space, cfg.tune, storage, "mem", lambda line: None)
    tr = study.ask()
    tr.set_user_attr("values", {"data.batch_size": 128, "data.num_workers": 0, "trainer.accumulation_steps": 1})
    tr.set_user_attr("memory", mem(495.0))
    study.tell(tr, 0.5)
    ceiling = proposals.memory_ceiling(study, {"data.batch_size": 512})
    assert ceiling is not None and ceiling[0] == 377 and ceiling[1] == tr.number
    assert {c["data.batch_size"] for c in proposals._candidates(study, {})} == {64, 128, 256}  # the job model's


def test_intervals_carry_the_noise_of_whole_runs():
    """The zoo's comm_ddp: b64 w0 a4 and b64 w1 a4 read 2,067 and 3,052 samples/s in trials whose
    window intervals do not overlap, so unwidened the second would be picked with no confirmation
    (long runs: 2,656 and 2,410). Widened by tune.run_noise, the intervals overlap and both are confirmed; the
    mean of several runs is widened less; a one-window figure gets an interval."""
    from orchestrator.measure.stats import with_run_noise
    from orchestrator.schema import Objective, TuneConfig
    from orchestrator.tune.rules import confirm_candidates

    t = TuneConfig(objective=Objective.utilization)
    figs = [{"throughput": 2067.0, "throughput_lo": 1853.0, "throughput_hi": 2281.0, "utilization": 0.424,
             "utilization_lo": 0.40, "utilization_hi": 0.45},
            {"throughput": 3052.0, "throughput_lo": 2829.0, "throughput_hi": 3276.0, "utilization": 0.632,
             "utilization_lo": 0.61, "utilization_hi": 0.65}]

    def candidates(widen: float) -> list:
        study = optuna.create_study(direction="maximize")
        for f in figs:
            study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"values": {}, **with_run_noise(f, widen)}))
        return [tr.number for tr in confirm_candidates(study, t)]

    assert candidates(0.0) == [1]  # the windows alone: a lone leader
    assert candidates(t.run_noise) == [1, 0]
    one, four = with_run_noise(figs[0], 0.1), with_run_noise(figs[0], 0.1, runs=4)
    assert one["throughput_lo"] < four["throughput_lo"] < figs[0]["throughput_lo"]
    assert one["throughput"] == figs[0]["throughput"] and with_run_noise(figs[0], 0.0) == figs[0]
    bare = with_run_noise({"throughput": 100.0, "utilization": 0.5}, 0.1)
    assert bare["throughput_lo"] == pytest.approx(100 - 1.96 * 10) and bare["utilization_hi"] == pytest.approx(0.5 + 1.96 * 0.05)


def test_confirmation_runs_are_compared_within_their_rounds():
    """The candidates of a confirmation round run one after another on the machine as it was then:
    the zoo's already_best can read its three configs 17-31% under their means together in one round. Here
    the last two rounds ran 30% slower, and only the leader and the third candidate were measured in
    them (rounds past the planned ones measure only those still in contest): on its runs' median
    the leader (1,000/s) would read 850/s, under the runner-up's 950/s, measured only in the fast
    rounds. Within rounds the leader stays ahead by its 5%."""
    from orchestrator.measure.results import Estimate
    from orchestrator.tune.confirm import ConfirmRun, combined

    pace = {0: 1.0, 1: 1.0, 2: 0.7, 3: 0.7}

    def result(thr, r):
        return ConfirmRun(r, JobResult(estimate=Estimate(thr, 0.02, (0.96 * thr, 1.04 * thr), 6, 1.0),
                                       utilization_estimate=Estimate(0.5, 0.01, (0.49, 0.51), 6, 1.0)))

    runs = {0: [result(1000.0 * pace[r], r) for r in range(4)], 1: [result(950.0, r) for r in range(2)],
            2: [result(900.0 * pace[r], r) for r in range(4)]}
    out = combined(runs, run_noise=0.1)
    assert out["0"]["throughput"] / out["1"]["throughput"] == pytest.approx(1000 / 950)
    assert out["2"]["throughput"] / out["1"]["throughput"] == pytest.approx(900 / 950)
    assert out["0"]["runs"] == 4 and out["0"]["utilization"] == pytest.approx(0.5)  # a share: not rescaled


def batch_study(rows, workers, util_half):
    """A study of completed trials, one per (batch size, utilization, samples/s) in `rows`, with
    `workers` loader workers each, throughput within +-10% and utilization within +-`util_half`."""
    study = optuna.create_study(direction="maximize")
    for b, util, thr in rows:
        study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
            "values": {"data.batch_size": b, "data.num_workers": workers}, "utilization": util, "throughput": thr,
            "throughput_lo": 0.9 * thr, "throughput_hi": 1.1 * thr, "utilization_lo": util - util_half,
            "utilization_hi": util + util_half}))
    return study


def test_a_confirmation_run_the_host_slowed_is_left_out(make_cfg, tmp_path, monkeypatch):
    """The zoo's storage_5 with something else taking CPU for the first 12 s of the confirmation:
    the three runs measured then read 283-456/s, busy 0.40-0.45 (the loop thread spinning while its
    intra-op thread waits for a core), against 1,396-1,481/s and 0.04-0.11 in the other rounds.
    Kept, they would put the busier b16 configs' figures 20% under the b64 ones the disturbance
    spared, and the pick would be b64 w8 a1 (utilization 0.039 in steady state, b16 w8 a2's
    0.109). Left out, every config keeps up and the busiest is the pick; the study says which runs."""
    from orchestrator.tune import report
    from orchestrator.tune import launch as launch_module  # the tuner launches its runs through launch.run_job_result
    from orchestrator.tune.rules import best_trials, confirmed
    from orchestrator.tune.study import Tuner

    study = batch_study(((64, 0.04, 1430.0), (16, 0.11, 1420.0)), workers=8, util_half=0.01)
    tuner = Tuner(make_cfg("mode=tune", "tune.confirm_top=2", f"tune.storage=sqlite:///{tmp_path}/o.db"),
                  tmp_path, echo=False)
    said, launches = [], []
    monkeypatch.setattr(tuner, "_say", said.append)

    def measured(mean, rel):
        return {"mean": mean, "rel_se": rel, "interval": [mean * (1 - 2 * rel), mean * (1 + 2 * rel)], "windows": 30,
                "measured_s": 4.0}

    def run_job(cfg, run_dir, **kwargs):
        launches.append(cfg.data.batch_size)
        if launches.count(16) == 1 and cfg.data.batch_size == 16:  # b16's first run, the host busy elsewhere
            return {"estimate": measured(283.0, 0.05), "utilization_estimate": measured(0.45, 0.05)}
        thr, util = {64: (1430.0, 0.04), 16: (1420.0, 0.11)}[cfg.data.batch_size]
        return {"estimate": measured(thr, 0.01), "utilization_estimate": measured(util, 0.02)}

    monkeypatch.setattr(launch_module, "run_job_result", lambda *a, **kw: JobResult.from_dict(run_job(*a, **kw)))
    tuner._confirm(study, None)
    assert confirmed(study)["1"]["left_out"] == 1 and "left_out" not in confirmed(study)["0"]
    assert confirmed(study)["1"]["throughput"] == pytest.approx(1420.0)
    assert best_trials(study, tuner.t)[0].number == 1  # b16: as fast, busier
    assert any("trial 1 in round 1 read 283.0/s" in line for line in said)
    summary = report.write_outputs(study, best_trials(study, tuner.t), t=tuner.t, out_dir=tmp_path / "out",
                                   name="left_out", storage="sqlite:///x.db", overrides=[], echo=False)
    assert list(summary["confirm_left_out"]) == ["1-0"]


def test_a_config_whose_confirmation_fails_is_not_the_pick(make_cfg, tmp_path, monkeypatch):
    """The zoo's memory_cap: b256 with 2 workers completes its trial just under the memory cap, then
    runs out of memory in confirmation. It gets no more rounds, its figures are not confirmed, it is
    never the pick though its trial led, and the summary says why."""
    from orchestrator.app import JobFailed
    from orchestrator.tune import report
    from orchestrator.tune import launch as launch_module  # the tuner launches its runs through launch.run_job_result
    from orchestrator.tune.rules import best_trials, confirmed, failed_confirmation
    from orchestrator.tune.study import Tuner

    study = batch_study(((64, 0.90, 1000.0), (256, 0.95, 1040.0), (128, 0.80, 900.0)), workers=2, util_half=0.05)
    tuner = Tuner(make_cfg("mode=tune", "tune.confirm_top=3", f"tune.storage=sqlite:///{tmp_path}/o.db"),
                  tmp_path, echo=False)
    assert best_trials(study, tuner.t)[0].number == 1  # on its trial's figures, b256 leads
    runs = []

    def measured(mean, spread):
        return {"mean": mean, "rel_se": spread / mean, "interval": [mean - 2 * spread, mean + 2 * spread],
                "windows": 4, "measured_s": 0.4}

    def run_job(cfg, run_dir, **kwargs):
        runs.append(cfg.data.batch_size)
        if cfg.data.batch_size == 256:
            raise JobFailed("out of memory: process 11 used 854 MB > trainer.memory_cap_mb=850", {})
        thr = {64: 1000.0, 128: 900.0}[cfg.data.batch_size]
        return {"estimate": measured(thr, 10.0), "utilization_estimate": measured(0.9, 0.01)}

    monkeypatch.setattr(launch_module, "run_job_result", lambda *a, **kw: JobResult.from_dict(run_job(*a, **kw)))
    tuner._confirm(study, None)
    assert runs.count(256) == 1 and runs.count(64) >= 2  # no second round for the one that failed
    assert set(confirmed(study)) == {"0", "2"} and failed_confirmation(study)["1"].startswith("out of memory")
    assert best_trials(study, tuner.t)[0].number == 0
    assert not tuner._confirmation_due(study)  # a resumed study does not confirm them again
    summary = report.write_outputs(study, best_trials(study, tuner.t), t=tuner.t, out_dir=tmp_path / "out", name="oom",
                                   storage="sqlite:///x.db", overrides=[], echo=True)
    assert summary["confirm_failed"]["1"].startswith("out of memory") and summary["best"]["number"] == 0
    # every candidate failing in its first round ends the confirmation, with none confirmed
    monkeypatch.setattr(launch_module, "run_job_result", lambda cfg, run_dir, **kw: (_ for _ in ()).throw(JobFailed("crash", {})))
    study.set_user_attr("confirmed", {})
    study.set_user_attr("confirm_failed", {})
    tuner._confirm(study, None)
    assert confirmed(study) == {} and set(failed_confirmation(study)) == {"0", "1", "2"}


def test_among_configs_as_promising_the_model_tries_the_busiest_first(make_cfg, tmp_path):
    """The zoo's storage_5 after 5 trials: b16 w8 a2 and b16 w8 a1 may both reach ~2,380/s (their
    tops 0.4% apart), a1 predicted 1.4x busier. The utilization objective measures a1 next; the
    throughput objective the higher top; a top well below the best's is not pulled up by utilization."""
    from orchestrator.jobmodel import Prediction
    from orchestrator.schema import Objective
    from orchestrator.tune.proposals import Proposals

    cfg = make_cfg("mode=tune")
    space, storage = SearchSpace(cfg), f"sqlite:///{tmp_path}/s.db"
    a2 = (Prediction(1517.0, 0.29, 0.152, "loader"), {"data.batch_size": 16, "data.num_workers": 8,
                                                      "trainer.accumulation_steps": 2})
    a1 = (Prediction(1510.0, 0.29, 0.212, "loader"), {**a2[1], "trainer.accumulation_steps": 1})
    slow = (Prediction(900.0, 0.29, 0.9, "loader"), {**a2[1], "data.num_workers": 2})
    done = [{"throughput": 1546.0, "utilization": 0.04}]
    util = Proposals(space, cfg.tune, storage, "u", lambda line: None)
    assert util._next([a2, a1, slow], done)[1] is a1[1]
    thr = Proposals(space, replace(cfg.tune, objective=Objective.throughput), storage, "t", lambda line: None)
    assert thr._next([a2, a1, slow], done)[1] is a2[1]
