"""One answer everywhere: what Optuna's own readers (optuna.load_study, study.best_trial,
optuna-dashboard) see of a study is the product's pick, in the objective's units."""

from __future__ import annotations

import json
import sys

import optuna
import pytest

from orchestrator.schema import Objective
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
    assert "=False" not in summary["rerun_overrides"] and "=True" not in summary["rerun_overrides"]  # Hydra's words
    assert f"trial {pick['number']}" in study.user_attrs["pick_note"]
    if study.best_trial.number != pick["number"]:
        assert "Optuna's best_trial" in study.user_attrs["pick_note"]
    from optuna_dashboard import get_note  # optuna-dashboard's note says the same

    assert get_note(study).startswith(f"### The product's pick: trial {pick['number']}\n")
    done = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE]
    assert done
    # MLflow says the same: the pick's row tagged, its confirmed figure under one name on its row and
    # the study's, the study's description naming it, shares in percent
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["mlflow.note.content"].startswith(f"**Pick: trial {pick['number']}**")
    assert parent.data.tags["pick_trial"] == str(pick["number"])
    row = client.get_run(next(tr.user_attrs["mlflow_run_id"] for tr in done if tr.number == pick["number"]))
    assert row.data.tags["pick"] == "true" and row.data.tags["best"] == "true"
    assert row.data.metrics["utilization_pct"] == pytest.approx(100 * row.data.metrics["utilization"], abs=0.01)
    if pick["confirmed"]:
        assert row.data.metrics["confirmed_throughput"] == pytest.approx(parent.data.metrics["throughput"])
        assert row.data.metrics["confirmed_utilization_pct"] == pytest.approx(100 * pick["utilization"], abs=0.01)
    # the pick's own advice is checked against the study, and its rerun names the study
    report = (tmp_path / "trials" / f"{pick['number']:04d}" / "load_report.md").read_text()
    assert "## Against the study" in report and f"pick of study '{summary['study_name']}'" in report
    assert f"tuned_study: {summary['study_name']}" in (tmp_path / "tuned" / "best.yaml").read_text()
    for move in summary["pick_advice"]["moves"]:  # no advice leads to a config a trial measured
        target = {**pick["values"], **move["set"]}
        assert not any(tr.user_attrs["values"]["data.batch_size"] == target["data.batch_size"]
                       and tr.number != pick["number"] for tr in done if set(move["set"]) == {"data.batch_size"})
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


def test_optuna_dashboards_notes_name_the_pick_and_why_its_best_trial_differs(make_cfg, monkeypatch):
    """optuna-dashboard shows Optuna's best_trial (trial 0) as its "Best Trial": the study's note names
    the pick (trial 1) in user units, its figures, the rule and why trial 0 is not it; trial 1's note
    says it is the pick. A note the user wrote is kept; recording again replaces only the product's."""
    from optuna_dashboard import get_note, save_note

    t = make_cfg("mode=tune").tune
    study = optuna.create_study(direction="maximize")
    for values, util, thr in (({"data.batch_size": 32, "data.num_workers": 0}, 0.40, 100.0),
                              ({"data.batch_size": 64, "data.num_workers": 2, "trainer.accumulation_steps": 2},
                               0.30, 200.0)):
        study.add_trial(optuna.trial.create_trial(
            value=utilization_score(util, thr, 100.0, t.throughput_floor),
            user_attrs={"values": values, "utilization": util, "throughput": thr, "lr": 0.01}))
    save_note(study, "my own words")
    for _ in range(2):
        record_pick(study, best_trials(study, t), t)
    note = get_note(study)
    assert note.startswith("### The product's pick: trial 1\n")
    assert "batch size 64, 2 DataLoader workers, accumulation 2, learning rate 0.01" in note
    assert "utilization 30.0%, samples/s 200.0" in note and "within 0.95 of the fastest" in note
    assert "\"Best Trial\", trial 0, is not the pick" in note
    assert note.count("### The product's pick") == 1 and note.endswith("---\n\nmy own words")
    trial = optuna.Trial(study, study.trials[1]._trial_id)
    assert get_note(trial).startswith("### This trial is the study's pick\n") and "batch size 64" in get_note(trial)
    assert get_note(optuna.Trial(study, study.trials[0]._trial_id)) == ""

    # without optuna-dashboard the pick is recorded all the same, and no note is written
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)
    bare = optuna.create_study(direction="maximize")
    bare.add_trial(study.trials[1])
    assert record_pick(bare, best_trials(bare, t), t)["trial"] == 0
    assert not [k for k in bare._storage.get_study_system_attrs(bare._study_id) if k.startswith("dashboard:")]


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


def test_the_picks_advice_agrees_with_the_study(tmp_path):
    """The pick's diagnosis advised num_workers=8 (measured by trial 2, not picked) and batch 2048
    (past the study's 16-512): the first is dropped with the trial that measured it, the second kept
    saying it goes past the study; a move on a knob the study did not tune is kept as it was."""
    from orchestrator.tune.advise import AGAINST, check_moves, load_and_agree

    pick = (1, {"data.batch_size": 64, "data.num_workers": 4}, {"throughput": 420.9, "utilization": 0.11})
    trials = [(0, {"data.batch_size": 16, "data.num_workers": 0}, {"throughput": 48.5, "utilization": 0.30}), pick,
              (2, {"data.batch_size": 64, "data.num_workers": 8}, {"throughput": 431.0, "utilization": 0.05}),
              (3, {"data.batch_size": 512, "data.num_workers": 8}, {"throughput": 400.0, "utilization": 0.04})]
    moves = [{"set": {"data.num_workers": 8}, "why": "the step waits on input"},
             {"set": {"data.batch_size": 2048}, "why": "twice the batch fits"},
             {"set": {"trainer.amp": True}, "why": "tensor cores"}]
    kept, dropped = check_moves(moves, pick, trials, "s", "the busiest config within 0.95 of the fastest")
    assert [m["set"] for m in kept] == [{"data.batch_size": 2048}, {"trainer.amp": True}]
    assert "past what study 's' measured (data.batch_size 16-512)" in kept[0]["why"]
    assert kept[1]["why"] == "tensor cores"
    assert len(dropped) == 1 and dropped[0].startswith("not data.num_workers=8: study 's' measured it as trial 2")
    assert "picked trial 1" in dropped[0] and "within 0.95 of the fastest" in dropped[0]

    # the rerun of best.yaml reads the study by its tags
    storage = f"sqlite:///{tmp_path}/o.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    for number, values, figs in trials:
        study.add_trial(optuna.trial.create_trial(value=figs["utilization"], user_attrs={"values": values, **figs}))
    study.set_user_attr("pick", {"trial": 1, "rule": "the busiest config within 0.95 of the fastest"})
    diagnosis = {"verdict": "input-bound", "reason": "r", "advice": ["data.num_workers=8: the step waits on input",
                                                                     "a note"], "moves": moves[:1]}
    checked = load_and_agree(diagnosis, "s", storage)
    assert checked["moves"] == [] and checked["advice"][0] == "a note"
    assert checked["advice"][1].startswith("not data.num_workers=8: study 's' measured it as trial 2")
    assert load_and_agree(diagnosis, "gone", storage) == diagnosis  # a study it cannot read: as measured
    assert AGAINST.startswith("## ")

    # the rerun's own run dir: its load_report.md gains the study's check, the console's advice agrees
    from orchestrator.tune.advise import rerun_advice

    (tmp_path / "rerun").mkdir()
    (tmp_path / "rerun" / "result.json").write_text(json.dumps({"diagnosis": diagnosis}))
    (tmp_path / "rerun" / "load_report.md").write_text("# Load report\n")
    assert rerun_advice(tmp_path / "rerun", "s", storage)["advice"] == checked["advice"]
    assert AGAINST in (tmp_path / "rerun" / "load_report.md").read_text()
    assert rerun_advice(tmp_path / "rerun", "gone", storage) is None


def test_the_console_says_what_the_floor_rule_did_at_the_pick(make_cfg):
    """Trial 0 is busier (30.3%) but 20% slower than the fastest: the pick (11.1%, within the
    floor) is said in one line with the busier trial the floor left out."""
    from orchestrator.tune.report import floor_line

    t = make_cfg("mode=tune").tune
    study = optuna.create_study(direction="maximize")
    for util, thr in ((0.303, 400.0), (0.111, 495.0), (0.05, 500.0)):
        study.add_trial(optuna.trial.create_trial(value=util, user_attrs={
            "values": {"data.batch_size": 32}, "utilization": util, "throughput": thr}))
    best = best_trials(study, t)
    assert best[0].number == 1
    line = floor_line(study, best, t)
    assert line.startswith("[tune] picked trial 1, the busiest config within 0.95 of the fastest samples/s: "
                           "utilization 11.1% at 495.0/s (the fastest, trial 2, 500.0/s)")
    assert "trial 0 (30.3% at 0.80x)" in line and "\n" not in line


def test_a_study_made_with_the_old_score_keeps_its_scale_when_resumed(make_cfg):
    """A study told 1 + utilization before the score was in utilization's unit keeps adding 1 for
    its new trials (the sampler compares like with like); a new study adds nothing."""
    from orchestrator.tune.answer import OLD_UTILIZATION_NAME, name_objectives, score_offset

    t = make_cfg("mode=tune").tune
    old = optuna.create_study(direction="maximize")
    old.add_trial(optuna.trial.create_trial(value=1.3, user_attrs={"utilization": 0.3, "throughput": 100.0}))
    assert score_offset(old, t) == 1.0 and old.user_attrs["score_offset"] == 1.0
    name_objectives(old, t)
    assert old.metric_names == [OLD_UTILIZATION_NAME]
    new = optuna.create_study(direction="maximize")
    assert score_offset(new, t) == 0.0
    new.add_trial(optuna.trial.create_trial(value=0.3, user_attrs={"utilization": 0.3, "throughput": 100.0}))
    assert score_offset(new, t) == 0.0  # recorded when the study was opened


def test_lines_held_by_a_trial_that_raised_are_said_and_the_study_speaks_again(make_cfg, tmp_path, capsys,
                                                                              monkeypatch):
    from orchestrator.tune.study import StudyFailed, Tuner

    tuner = Tuner(make_cfg("mode=tune", "tune.n_trials=1", "tune.confirm_top=0",
                           f"tune.storage=sqlite:///{tmp_path}/o.db"), tmp_path / "run", echo=True)

    def failing(study, trial, parent):
        tuner.held = []
        tuner._say("[tune] after trial 0: a proposal")
        raise StudyFailed("the study's database failed")

    monkeypatch.setattr(tuner, "_run_trial", failing)
    with pytest.raises(StudyFailed):
        tuner.run()
    out = capsys.readouterr().out
    assert "[tune] after trial 0: a proposal" in out and "[tune] MLflow:" in out  # nothing swallowed after it


@pytest.mark.parametrize("objective", [o.value for o in Objective])
def test_every_objective_has_its_rule_in_words(make_cfg, objective):
    """The pick's rule is said for every objective (a goodput study's pick raised KeyError), and
    says which figures judged it."""
    from orchestrator.tune.answer import rule_words

    words = rule_words(make_cfg(f"tune.objective={objective}").tune)
    assert words and "\n" not in words
    if objective != "both":
        assert words.endswith("judged on the confirmed figures")
        assert rule_words(make_cfg(f"tune.objective={objective}", "tune.confirm_top=0").tune).endswith(
            "judged on each trial's own figures")

