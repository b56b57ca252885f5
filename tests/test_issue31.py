"""Issue 31's leftovers: a balanced job names no straggler for the items its shares gave each rank;
the loader autotune's last try is kept or reverted when the run ends; the default MLflow store is
the project's, wherever the command runs. In-process, no training."""

from __future__ import annotations

import types

import pytest

from orchestrator.runtime import autotune
from orchestrator.runtime.autotune import LoaderSettings, LoaderTuner


# -- the loader autotune's last try ------------------------------------------------------------
def tuner_mid_trial(trial_windows):
    """Rank 0's tuner with a step up from 2 to 4 workers on trial (the run switched to it), fed
    `trial_windows` at 4 workers."""
    cfg_stub = types.SimpleNamespace(trainer=types.SimpleNamespace(loader_autotune_every=10, memory_cap_mb=0))
    events: list = []
    tuner = LoaderTuner(cfg_stub, LoaderSettings(2), rank=0, world_size=1, device="cpu", item_bytes=4000,
                        emit=events.append)
    tuner.trial = autotune.Trial(LoaderSettings(2), LoaderSettings(4), "up",
                                 autotune.estimate([100, 98, 103, 99, 101]), "input-bound")
    tuner.record(0, "try", LoaderSettings(4), LoaderSettings(2), "input-bound", throughput_before=100.0)
    tuner.settings = LoaderSettings(4)
    tuner.throughputs = list(trial_windows)
    return tuner


@pytest.mark.parametrize("windows, action, workers, why", [
    ([150, 160, 155, 158], "keep", 4, "throughput rose by more than the noise"),  # measured better
    ([101, 99, 102, 98], "revert", 2, "throughput did not rise by more than the noise"),
    ([150, 160], "revert", 2, "too few windows to judge: 2 measured windows at it"),  # not measured enough
])
def test_the_last_try_is_kept_or_reverted_when_the_run_ends(tmp_path, windows, action, workers, why):
    from orchestrator.load_report import write_loader_override
    from orchestrator.runtime.hooks import LoaderAutotuneHook

    tuner = tuner_mid_trial(windows)
    out: dict = {}
    LoaderAutotuneHook(tuner, 10).summary(types.SimpleNamespace(adapter=types.SimpleNamespace(rank=0), step=97), out)
    tuned = out["loader_autotune"]
    last = tuned["events"][-1]
    assert last["action"] == action and last["step"] == 97
    assert last["reason"].startswith("the run ended during the trial") and why in last["reason"]
    assert tuned["final"]["num_workers"] == workers and tuner.trial is None
    text = write_loader_override(tuned, tmp_path).read_text()
    said = "kept" if action == "keep" else "reverted"
    assert f"# Its last try, num_workers=4, prefetch_factor=2 at step 0, was {said} at step 97: the run ended" in text
    assert f"num_workers: {workers}" in text


# -- the default MLflow store ------------------------------------------------------------------
def test_the_default_tracking_store_is_the_projects_from_any_directory(tmp_path, monkeypatch):
    """A job started from another folder logs to the project's outputs/mlflow.db (the checkout
    holding conf/, what `make ui` serves), and says `make ui`; an absolute store stays as given."""
    from orchestrator.schema import TrackingConfig
    from orchestrator.stores import sqlite_path
    from orchestrator.tracking import PROJECT, PROJECT_STORE, Tracker

    monkeypatch.chdir(tmp_path)
    assert (PROJECT / "conf" / "config.yaml").is_file() and (PROJECT / "scripts" / "ui.sh").is_file()
    tracker = Tracker(TrackingConfig())
    assert tracker.uri == f"sqlite:///{PROJECT}/outputs/mlflow.db" and sqlite_path(tracker.uri) == PROJECT_STORE
    tracker.experiment_id = "1"  # as check() leaves it
    assert "browse: `make ui`, then http://127.0.0.1:5000/#/experiments/1/runs" in tracker.where()
    own = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/own.db"))
    assert own.uri == f"sqlite:///{tmp_path}/own.db"
    own.experiment_id = "1"
    assert f"scripts/ui.sh 5000 sqlite:///{tmp_path}/own.db" in own.where()
