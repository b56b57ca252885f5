"""One answer everywhere: what Optuna's own readers (optuna.load_study, study.best_trial,
optuna-dashboard) see of a study is the product's pick, in the objective's units."""

from __future__ import annotations

import optuna
import pytest

from orchestrator.tune.answer import METRIC_NAMES, record_pick
from orchestrator.tune.rules import best_trials, utilization_score
from orchestrator.tune.study import run_study

from .test_tune import SHORT, study_of


@pytest.mark.slow  # a study of its own with confirmation runs, 15-40 s
def test_the_optuna_study_tells_the_pick_in_user_units(make_cfg, tmp_path):
    cfg = make_cfg(*[o for o in SHORT if not o.startswith(("tune.confirm_top", "tune.pruner"))], "tune.n_trials=3",
                   "tune.confirm_top=2", "tune.pruner=median", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
                   "tune.space.batch_size.low=8", "tune.space.batch_size.high=64", "tune.space.num_workers.high=0",
                   "tune.space.accumulation_steps.high=1")
    summary = run_study(cfg, tmp_path, echo=False)
    study = study_of(summary)  # Optuna's public API, as a user or the dashboard reads it
    assert study.metric_names == METRIC_NAMES[cfg.tune.objective]
    pick = summary["best"]
    assert study.user_attrs["pick_trial"] == pick["number"]
    assert study.user_attrs["pick"]["config"] == pick["values"]
    assert study.user_attrs["pick"]["figures"]["throughput"] == pytest.approx(pick["throughput"])
    assert study.user_attrs["pick"]["confirmed"] == pick["confirmed"]
    assert f"trial {pick['number']}" in study.user_attrs["pick_note"]
    if study.best_trial.number != pick["number"]:
        assert "Optuna's best_trial" in study.user_attrs["pick_note"]
    done = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE]
    assert done
    for tr in done:
        # the knobs in user units beside the sampler's exponent
        assert tr.user_attrs["data.batch_size"] == 2 ** tr.params["batch_size_log2"]
        # the value in utilization's unit for a trial that keeps up, negative below the floor
        assert tr.value <= 1.0
        assert tr.value == pytest.approx(tr.user_attrs["utilization"]) or tr.value < 0
        # intermediate values on the final value's scale
        assert all(-1.0 <= v <= 1.0 for v in tr.intermediate_values.values())


def test_the_pick_is_recorded_where_optunas_best_is_another_trial(make_cfg):
    """Trial 0 was told the highest value (scored against the best throughput seen when it ended);
    the study's rule picks trial 1 against the whole study: the study's attributes say the pick and why
    Optuna's best_trial differs."""
    t = make_cfg("mode=tune").tune
    study = optuna.create_study(direction="maximize")
    for values, util, thr in (({"data.batch_size": 32}, 0.40, 100.0), ({"data.batch_size": 64}, 0.30, 200.0)):
        study.add_trial(optuna.trial.create_trial(
            value=utilization_score(util, thr, 100.0, t.throughput_floor),
            user_attrs={"values": values, "utilization": util, "throughput": thr}))
    assert study.best_trial.number == 0
    best = best_trials(study, t)
    assert best[0].number == 1
    pick = record_pick(study, best, t)
    assert study.user_attrs["pick_trial"] == 1 and pick["config"] == {"data.batch_size": 64}
    assert "Optuna's best_trial, trial 0" in study.user_attrs["pick_note"]
    assert "within 0.95 of the fastest" in pick["rule"]


def test_the_utilization_score_is_in_utilizations_unit():
    assert utilization_score(0.3, 100, 100, 0.95) == pytest.approx(0.3)
    assert utilization_score(0.9, 80, 100, 0.95) == pytest.approx(-0.2)  # 20% of the samples/s lost


def test_what_a_trial_proposes_is_said_after_the_trials_own_line(make_cfg, tmp_path, capsys):
    import time

    from orchestrator.tune.study import TrialRecord, Tuner

    tuner = Tuner(make_cfg("mode=tune", f"tune.storage=sqlite:///{tmp_path}/o.db"), tmp_path, echo=True)
    tuner.held = []  # a trial is running
    tuner._say("[tune] after trial 1: the job model predicts 100/s at batch_size=64")
    assert capsys.readouterr().out == ""
    tuner._record(TrialRecord(1, "COMPLETE", {"data.batch_size": 32}), time.monotonic())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[tune] trial   1 COMPLETE") and lines[1].startswith("[tune] after trial 1:")
    tuner._say("[tune] between trials")
    assert capsys.readouterr().out == "[tune] between trials\n"
