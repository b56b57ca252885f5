"""tune.objective=tokens: a study that maximizes real tokens/s, padding
excluded, for dict batches with an attention_mask; every place the objective is named follows it.
A batch without a mask refuses the trial at its first batch, and the study stops there."""

from __future__ import annotations

import re

import optuna
import pytest
from mlflow.tracking import MlflowClient

from orchestrator.measure.results import JobResult, RankResult
from orchestrator.merge import merge
from orchestrator.schema import ConfigError, Objective, TuneConfig
from orchestrator.tune.report import write_outputs
from orchestrator.tune.rules import (best_trials, confirm_candidates, improves, ranked, separation,
                                     stale_streak)

from .test_batches import SEQ, trained

TOKENS = TuneConfig(objective=Objective.tokens, confirm_top=3)


# sequences cut to a length (tests.custom_task.cut_collate): the knob where tokens/s and samples/s part
CUT = ["data.collate_fn._target_=tests.custom_task.cut_collate", "+data.collate_fn.args.keep=48"]


def add(study, keep, thr, tokens, lo, hi, util=0.5, **extra):
    study.add_trial(optuna.trial.create_trial(value=tokens, user_attrs={
        "values": {"data.collate_fn.args.keep": keep}, "utilization": util, "throughput": thr,
        "throughput_lo": 0.97 * thr, "throughput_hi": 1.03 * thr, "utilization_lo": util - 0.02,
        "utilization_hi": util + 0.02, "tokens_per_s": tokens, "tokens_per_s_lo": lo, "tokens_per_s_hi": hi,
        "padding_frac": 0.0, **extra}))


def tokens_study():
    """Short samples go fastest in samples/s (trial 0) and carry the fewest tokens; trial 1 moves
    the most real tokens/s; trial 2 is close behind it, within its noise."""
    study = optuna.create_study(direction="maximize")
    add(study, 4, 3000.0, 12000.0, 11500, 12500)
    add(study, 48, 900.0, 43200.0, 42000, 44400)
    add(study, 32, 1300.0, 41600.0, 40000, 43200)
    return study


def test_the_ranking_follows_real_tokens_per_second(tmp_path, monkeypatch):
    """Best, order, confirmation, separation, patience, the report's files and the picture's
    axis: by real tokens/s, not samples/s (trial 0 is fastest in samples/s)."""
    import matplotlib.figure

    from orchestrator.tune import report
    from orchestrator.tune.picture import write_picture

    study = tokens_study()
    assert [tr.number for tr in ranked(study, TOKENS)] == [1, 2, 0]
    assert best_trials(study, TOKENS)[0].number == 1
    assert best_trials(study, TuneConfig(objective=Objective.throughput))[0].number == 0  # samples/s would pick the short ones
    # trial 2's tokens/s interval reaches the leader's: confirmed beside it; trial 0's does not (its
    # samples/s interval lies above the leader's, which does not matter here)
    assert [tr.number for tr in confirm_candidates(study, TOKENS)] == [1, 2]
    sep = separation(study, TOKENS)
    assert sep == {"winner": 1, "runner_up": 2, "figure": "tokens_per_s", "separated": False, "confirmed": False}
    a = {tr.number: tr.user_attrs for tr in study.trials}
    assert improves(a[1], a[0], TOKENS) and not improves(a[2], a[1], TOKENS) and not improves(a[0], a[1], TOKENS)
    assert stale_streak(study, TOKENS) == (1, 1)  # trial 2 did not beat trial 1 by more than its noise
    # re-measured side by side, trial 2 moves more real tokens: the confirmed figures decide
    study.set_user_attr("confirmed", {
        "1": {"utilization": 0.5, "throughput": 890.0, "tokens_per_s": 42700.0, "tokens_per_s_lo": 42400.0,
              "tokens_per_s_hi": 43000.0},
        "2": {"utilization": 0.5, "throughput": 1370.0, "tokens_per_s": 43800.0, "tokens_per_s_lo": 43500.0,
              "tokens_per_s_hi": 44100.0}})
    assert best_trials(study, TOKENS)[0].number == 2
    assert separation(study, TOKENS)["separated"] is True

    labels = {}
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        labels["x"] = fig.axes[0].get_xlabel()
        labels["pick_x"] = max(coll.get_offsets()[0][0] for coll in fig.axes[0].collections
                               if coll.get_label().startswith("the pick"))
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    # Optuna's own plots (seconds: parameter importances) are not the objective's: the picture only
    monkeypatch.setattr(report, "_plots", lambda study, best, out_dir, t, say=print: [str(write_picture(study, best, t, out_dir))])
    best = best_trials(study, TOKENS)
    summary = write_outputs(study, best, t=TOKENS, out_dir=tmp_path, name="tok", storage="sqlite:///x.db",
                            overrides=[], echo=True)
    assert summary["objective"] == "tokens" and summary["best"]["number"] == 2
    assert summary["best"]["tokens_per_s"] == 43800.0  # the confirmed figure
    assert "objective tokens" in (tmp_path / "tuned" / "best.yaml").read_text()
    header = (tmp_path / "trials.csv").read_text().splitlines()[0].split(",")
    assert {"tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi", "padding_frac", "confirmed_tokens_per_s"} <= set(header)
    assert labels["x"] == "real tokens/s (padding excluded)" and labels["pick_x"] == pytest.approx(43800.0)


def test_the_pruner_and_the_confirmation_read_real_tokens(make_cfg, tmp_path, monkeypatch):
    """A trial fast in samples/s whose windows move far fewer real tokens than the best trial's
    interval is pruned on its tokens, with the reason in those words; confirmation runs combine
    their real tokens/s estimates."""
    from orchestrator.tune import launch as launch_module  # the tuner launches its runs through launch.run_job_result
    from orchestrator.tune.study import Tuner

    cfg = make_cfg(*SEQ, "mode=tune", "tune.objective=tokens", "tune.pruner=interval", "tune.confirm_top=3",
                   f"tune.storage=sqlite:///{tmp_path}/o.db", *CUT)
    tuner = Tuner(cfg, tmp_path, echo=False)
    study = tokens_study()
    trial = study.ask()
    pruned = {"flag": False}
    monitor = tuner._monitor(study, trial, pruned)
    stops = [monitor(i, {"throughput": 5000.0 + i, "utilization": 0.5, "tokens_per_s": 20000.0 + 100 * i})
             for i in range(4)]
    assert stops == [False, False, False, True]
    assert pruned["reason"].startswith("real tokens/s 20150.0/s over 4 windows") and "trial 1's 42000.0/s" in pruned["reason"]
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def measured(mean, spread):
        return {"mean": mean, "rel_se": spread / mean, "interval": [mean - 3 * spread, mean + 3 * spread], "windows": 4,
                "measured_s": 0.4}

    runs = []

    def run_job(cfg, run_dir, **kwargs):  # each confirmation run: trial 2 moves more real tokens than trial 1
        keep = cfg.data.collate_fn["args"].get("keep")
        runs.append(keep)
        return {"estimate": measured(1000.0, 10.0), "utilization_estimate": measured(0.5, 0.01),
                "tokens_estimate": measured(44000.0 if keep == 32 else 42500.0, 100.0)}

    monkeypatch.setattr(launch_module, "run_job_result", lambda *a, **kw: JobResult.from_dict(run_job(*a, **kw)))
    tuner._confirm(study, None)
    # trials 1 and 2 (trial 0 cannot win on tokens), 4 rounds: 44,000 and 42,500 real tokens/s are
    # within the noise of whole runs (tune.run_noise) after 2; with it off, 2 rounds settle them
    assert sorted(runs) == [32] * 4 + [48] * 4
    got = study.user_attrs["confirmed"]
    assert set(got) == {"1", "2"} and got["2"]["tokens_per_s"] == pytest.approx(44000.0)
    assert got["2"]["tokens_per_s_lo"] < 44000.0 < got["2"]["tokens_per_s_hi"]
    assert best_trials(study, tuner.t)[0].number == 2
    runs.clear()
    study.set_user_attr("confirmed", {})
    quiet = Tuner(make_cfg(*SEQ, "mode=tune", "tune.objective=tokens", "tune.confirm_top=3", "tune.run_noise=0",
                           f"tune.storage=sqlite:///{tmp_path}/o.db", *CUT), tmp_path / "quiet", echo=False)
    quiet._confirm(study, None)
    assert sorted(runs) == [32, 32, 48, 48]


def test_a_batch_without_a_mask_is_refused_at_its_first_batch(make_cfg):
    """The trial's rank says it in one line at the first batch; a masked batch trains and counts."""
    with pytest.raises(ConfigError, match=r"^tune.objective=tokens: the batch is a list of 2 item\(s\), with no "
                                          r"'attention_mask' tensor to count its real tokens by"):
        trained(make_cfg("mode=tune", "tune.objective=tokens", "trainer.max_steps=2"))
    res = trained(make_cfg(*SEQ, "mode=tune", "tune.objective=tokens"))
    assert res.meter["tokens_per_s"] > 0


def test_the_jobs_tokens_estimate_sums_the_ranks_windows():
    """Window i's real tokens/s is the ranks' tokens over their window's time, summed; its estimate
    over windows has a 95% interval (what a trial is judged by)."""
    def rank(r, tokens):
        wins = [{"index": i, "warmup": False, "partial": False, "wall_s": 0.5, "samples": 10, "throughput": 20.0,
                 "utilization": 0.5, "tokens": t, "padded_tokens": 2 * t} for i, t in enumerate(tokens)]
        return {"rank": r, "steps": 4, "measured_steps": 4, "utilization": 0.5, "utilization_source": "cpu-time",
                "throughput": 20.0, "step_time_s": 0.1, "phase_s": {"comm": 0.0}, "peak_mem_mb": 1.0,
                "data_wait_frac": 0, "h2d_frac": 0, "compute_frac": 1, "comm_frac": 0, "optimizer_frac": 0,
                "other_frac": 0, "tokens_per_s": sum(tokens) / 2.0, "padding_frac": 0.5, "windows_detail": wins}

    job = merge([RankResult.from_dict(rank(0, [100, 110, 90, 100])), RankResult.from_dict(rank(1, [200, 200, 210, 190]))]).to_dict()
    est = job["tokens_estimate"]
    assert est["mean"] == pytest.approx(job["tokens_per_s"]) == pytest.approx(600.0)
    lo, hi = est["interval"]
    assert lo < 600.0 < hi and est["windows"] == 4


def _cut_space(tmp_path, *extra):
    from .test_tune import SHORT

    return [*SEQ, *(o for o in SHORT if not o.startswith("tune.confirm_top")), "data.args.min_len=48", "data.args.max_len=48", "model.args.max_len=48",
            "model.args.d_model=32", "data.batch_size=8", *CUT, "tune.objective=tokens", f"tune.storage=sqlite:///{tmp_path}/o.db",
            "tune.sampler=grid", "tune.baseline=false", "tune.space.batch_size.type=categorical",
            "tune.space.batch_size.choices=[8]", "tune.space.num_workers.high=0", "~tune.space.accumulation_steps",
            "~tune.space.prefetch_factor", "~tune.space.pin_memory", *extra]


@pytest.mark.slow  # ~20 s: two trials launched (a kept-alive rank), the grid of a truncation length
def test_a_tokens_study_picks_the_most_real_tokens_per_second(make_cfg, tmp_path, mlflow_uri):
    """Sequences of 48 tokens cut to 4 or to 48 (no padding either way): the short ones go faster
    in samples/s, the long ones move more real tokens/s, and the study picks those."""
    from orchestrator.tune.study import run_study

    from .test_tune import study_of

    cfg = make_cfg(*_cut_space(tmp_path, "tune.n_trials=2", "tune.confirm_top=2",
                               "+tune.space.keep={key: data.collate_fn.args.keep, type: categorical, choices: [4, 48]}"))
    summary = run_study(cfg, tmp_path, echo=False)
    done = {t.user_attrs["values"]["data.collate_fn.args.keep"]: t for t in study_of(summary).trials
            if t.state == optuna.trial.TrialState.COMPLETE}
    assert set(done) == {4, 48}
    for keep, tr in done.items():
        a = tr.user_attrs
        assert tr.value == a["tokens_per_s"]  # the study's score is real tokens/s
        assert a["tokens_per_s"] == pytest.approx(keep * a["throughput"], rel=1e-6) and a["padding_frac"] == 0
        assert a["tokens_per_s_lo"] < a["tokens_per_s"] < a["tokens_per_s_hi"]
    assert done[4].user_attrs["throughput"] > done[48].user_attrs["throughput"]  # samples/s would pick keep=4
    assert summary["best"]["values"]["data.collate_fn.args.keep"] == 48
    # the pick's figures: its confirmation runs' when the two trials' intervals overlapped (a loaded
    # machine), else its own
    conf = study_of(summary).user_attrs.get("confirmed") or {}
    assert summary["best"]["tokens_per_s"] == max((conf.get(str(t.number)) or t.user_attrs)["tokens_per_s"]
                                                  for t in done.values())
    assert "keep: 48" in (tmp_path / "tuned" / "best.yaml").read_text()
    metrics = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["best_tokens_per_s"] == pytest.approx(summary["best"]["tokens_per_s"])


# ~8.5 s (one trial launched, refused at its first batch, before any measuring): in the default suite
@pytest.mark.slow  # 9 s: a study; the rank's refusal is test_a_batch_without_a_mask_is_refused_at_its_first_batch
def test_a_study_of_batches_without_a_mask_stops_at_the_first_trial(make_cfg, tmp_path):
    from orchestrator.tune.study import StudyFailed, run_study

    from .test_tune import SHORT

    cfg = make_cfg(*SHORT, "tune.objective=tokens", "tune.n_trials=3", f"tune.storage=sqlite:///{tmp_path}/o.db",
                   "tune.space.num_workers.high=0")
    with pytest.raises(StudyFailed, match=r"^tune.objective=tokens: trial 0 was refused at its first batch: the batch "
                                          r"is a list of 2 item\(s\), with no 'attention_mask'"):
        run_study(cfg, tmp_path, echo=False)
    summary = re.search(r'"study_name": "([^"]+)"', (tmp_path / "summary.json").read_text()).group(1)
    trials = optuna.load_study(study_name=summary, storage=f"sqlite:///{tmp_path}/o.db").trials
    assert [t.state.name for t in trials] == ["FAIL"]
    assert "tune.objective=tokens: the batch is a list of 2 item(s)" in trials[0].user_attrs["error"]
