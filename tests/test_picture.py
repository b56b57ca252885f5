"""The tuning picture (tune/picture.py): its circled pick is the trial best.yaml holds, the floor
decides it, and pruned, refused, confirmed and baseline trials are marked. In-process, no training."""

from __future__ import annotations

import re

import optuna
from PIL import Image

from orchestrator.schema import Objective, TuneConfig
from orchestrator.tune.picture import FILE
from orchestrator.tune.report import write_outputs
from orchestrator.tune.rules import best_trials


def add(study, values, util, thr, lo, hi, **extra):
    study.add_trial(optuna.trial.create_trial(value=1 + util, user_attrs={
        "values": values, "utilization": util, "throughput": thr, "throughput_lo": lo, "throughput_hi": hi,
        "utilization_lo": util - 0.02, "utilization_hi": util + 0.02, **extra}))


def floor_study():
    """Trial 1 is the busiest but far below the floor (0.9 x 1000/s); trial 2 is the busiest within
    it; trial 3 is fastest; trial 4 would be busier still but trains one step per epoch (refused);
    trial 5 was pruned."""
    study = optuna.create_study(direction="maximize")
    add(study, {"data.batch_size": 32}, 0.50, 600.0, 560, 640, baseline=True)
    add(study, {"data.batch_size": 8}, 0.95, 300.0, 280, 320)  # the highest utilization: below the floor
    add(study, {"data.batch_size": 64}, 0.70, 950.0, 930, 970)
    add(study, {"data.batch_size": 128}, 0.40, 1000.0, 980, 1020)
    add(study, {"data.batch_size": 512}, 0.99, 1100.0, 1000, 1200, steps_per_epoch=1)
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs={
        "values": {"data.batch_size": 4}, "last_window_throughput": 150.0, "last_window_utilization": 0.9}))
    return study


def test_the_pictures_pick_is_best_yaml_s_under_the_floor(tmp_path):
    study, t = floor_study(), TuneConfig(objective=Objective.utilization, throughput_floor=0.9)
    best = best_trials(study, t)
    summary = write_outputs(study, best, t=t, out_dir=tmp_path, name="floor", storage="sqlite:///x.db", overrides=[],
                            echo=False)
    yaml_pick = int(re.search(r"^# Best trial (\d+) ", (tmp_path / "tuned" / "best.yaml").read_text(), re.M).group(1))
    png = Image.open(tmp_path / FILE)
    assert png.size[0] >= 700 and str(tmp_path / FILE) in summary["artifacts"]
    assert int(png.text["pick"]) == yaml_pick == summary["best"]["number"] == 2  # the floor decided, not utilization
    assert png.text["pick"] != "1" and png.text["pick"] != "4"


def test_the_picture_marks_every_kind_of_trial(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = {}
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        saved["legend"] = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        saved["floor"] = [line.get_xdata()[0] for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    study = floor_study()
    study.set_user_attr("confirmed", {"2": {"utilization": 0.72, "utilization_lo": 0.7, "utilization_hi": 0.74,
                                            "throughput": 940.0, "throughput_lo": 930.0, "throughput_hi": 950.0},
                                      "3": {"utilization": 0.41, "utilization_lo": 0.39, "utilization_hi": 0.43,
                                            "throughput": 1000.0, "throughput_lo": 990.0, "throughput_hi": 1010.0}})
    t = TuneConfig(objective=Objective.utilization, throughput_floor=0.9)
    from orchestrator.tune.picture import write_picture

    write_picture(study, best_trials(study, t), t, tmp_path)
    legend = " | ".join(saved["legend"])
    for word in ("refused", "confirmed", "baseline", "measured", "pruned", "throughput floor", "the pick: trial 2"):
        assert word in legend, legend
    assert saved["floor"] == [0.9 * 1000.0]  # from the confirmed fastest
