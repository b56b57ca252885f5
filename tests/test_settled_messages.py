"""What the product says once a run has settled: a balanced job names no straggler for the items
its shares gave each rank; the loader autotune's last try is kept or reverted when the run ends; the default MLflow store is
the project's, wherever the command runs. In-process, no training."""

from __future__ import annotations

import types

import pytest

from orchestrator.runtime import autotune
from orchestrator.runtime.autotune import LoaderSettings, LoaderTuner


# -- balance=speed: no straggler for the shares ---------------------------------------------------
def balanced_ranks(own_at_shares):
    """Two ranks of a balance=speed run: over the whole run rank 1's own work per step is 30% above
    rank 0's (its windows at the even split, where it was 2x slower, are in it); at the shares the
    run ended with (58% / 42%, 1.39x the even split) their own work per window is `own_at_shares`."""
    balance = {"mode": "speed", "tolerance": 0.1, "global_batch": 64, "sizes": [37, 27], "shares": [37 / 64, 27 / 64],
               "speeds": [2600.0, 1300.0], "step_time_s": 0.072, "even_step_time_s": 0.1, "even_step_time_source":
               "measured", "speedup": 1.39, "changes": 1, "history": [], "spent_s": 0.0,
               "own_window_s": own_at_shares, "windows_at_shares": 12}

    def rank(r, comm):
        return {"rank": r, "steps": 60, "measured_steps": 50, "utilization": 0.6, "utilization_source": "cpu-time",
                "throughput": 400.0, "step_time_s": 0.1, "phase_s": {"comm": comm}, "peak_mem_mb": 1.0,
                "data_wait_frac": 0, "h2d_frac": 0, "compute_frac": 0.7, "comm_frac": comm / 0.1,
                "optimizer_frac": 0, "other_frac": 0, "balance": balance, "windows_detail": []}

    return [rank(0, 0.03), rank(1, 0.0)]


def test_a_balanced_rank_is_no_straggler_for_its_smaller_share(tmp_path):
    from orchestrator.diagnose import straggler_note
    from orchestrator.load_report import balance_line
    from orchestrator.measure.results import RankResult
    from orchestrator.merge import merge as merge_typed, summary_rows

    def merge(ranks):
        return merge_typed([RankResult.from_dict(r) for r in ranks]).to_dict()

    job = merge(balanced_ranks([0.0700, 0.0686]))
    assert job["imbalance"]["own_time_spread"] == pytest.approx(0.3)  # the whole run's figure, kept
    assert job["imbalance"]["straggler_rank"] is None and straggler_note(job) is None
    rows = dict(summary_rows(job))
    assert "imbalance / straggler" not in rows
    assert rows["shares (balance=speed)"] == "58% / 42% (1.39x the even split); own work per window at these shares within 2.0%"
    assert balance_line(job["balance"]).endswith("; at these shares the ranks' own work per window is within 2% over 12 "
                                                 "windows (own-work samples/s 2600 / 1300)")
    # still uneven at the shares: named, in terms of them
    job = merge(balanced_ranks([0.0700, 0.0900]))
    assert job["imbalance"]["straggler_rank"] == 1
    assert straggler_note(job).startswith("rank 1 is a straggler at the balanced shares (58% / 42% of the global "
                                          "batch): its own work per window is 22% above the fastest rank's")
    assert dict(summary_rows(job))["imbalance / straggler"] == "22.2% / rank 1 at the balanced shares"
    # not measured at the shares (changed at the last exchange): not named from the mixed figure
    assert merge(balanced_ranks(None))["imbalance"]["straggler_rank"] is None


def test_the_balancer_reports_own_work_at_the_current_shares():
    from orchestrator.runtime.balance import Balancer, ShareSampler

    adapter = types.SimpleNamespace(world_size=2, rank=0, all_reduce_sum=list)
    b = Balancer(ShareSampler(64, 0, 2, 8, False, 0, False), adapter, tolerance=0.1)
    assert b.summary()["own_window_s"] is None and b.summary()["windows_at_shares"] == 0
    b.recent = [{"own": [0.07, 0.05], "samples": [9, 7], "drift": [1, 1]},
                {"own": [0.09, 0.07], "samples": [9, 7], "drift": [1, 1]}]
    assert b.summary()["own_window_s"] == pytest.approx([0.08, 0.06]) and b.summary()["windows_at_shares"] == 2


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


def test_the_default_study_storage_is_the_projects_from_any_directory(make_cfg, tmp_path, monkeypatch):
    """A study started from another folder is stored in the project's outputs/optuna.db, where a
    rerun by name from the project finds it; an absolute storage stays as given."""
    from orchestrator.stores import PROJECT
    from orchestrator.tune.study import Tuner

    monkeypatch.chdir(tmp_path)
    assert Tuner(make_cfg("mode=tune", "tracking.enabled=false", "tune.storage=sqlite:///outputs/optuna.db"),
                 tmp_path / "a", echo=False).storage == f"sqlite:///{PROJECT}/outputs/optuna.db"
    own = f"sqlite:///{tmp_path}/own.db"
    assert Tuner(make_cfg("mode=tune", "tracking.enabled=false", f"tune.storage={own}"), tmp_path / "b",
                 echo=False).storage == own
    assert not (tmp_path / "outputs").exists()
