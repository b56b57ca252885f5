"""`python -m orchestrator.runs`: the store's runs, studies and sweeps without the UI; bad options
are one line naming the option (exit 2). The records are written as the product writes them
(tracking.Tracker), without training."""

from __future__ import annotations

import json

from orchestrator.runs import main
from orchestrator.schema import TrackingConfig
from orchestrator.tracking import Tracker


def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(TrackingConfig(uri=uri, experiment="look"))
    tracker.check()
    job = tracker.sibling()
    job.start("single x1 Linear", {}, {"run_kind": "job", "backend": "single", "world_size": "1",
                                       "run_dir": str(tmp_path / "job")})
    job.log_metrics([("throughput", 1234.5, 10), ("utilization", 0.5, 10), ("mfu", 0.02, 10)])
    job.set_tags({"verdict": "input-bound"})
    job.end("FINISHED")
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    (study_dir / "summary.json").write_text(json.dumps({
        "best": {"number": 3}, "rerun_overrides": "data.num_workers=4", "rerun": "python -m orchestrator +tuned=best"}))
    parent = tracker.sibling()
    pid = parent.start("tune s", {}, {"mode": "tune", "run_kind": "study", "study_name": "s", "run_dir": str(study_dir)})
    for n in range(2):
        trial = tracker.sibling()
        trial.start(f"trial {n}", {}, {"run_kind": "trial", "trial": str(n), "study_name": "s"}, parent_run_id=pid)
        trial.end("FINISHED")
    parent.log_metrics([("best_throughput", 999.0, 0), ("best_utilization", 0.75, 0)])
    parent.end("FINISHED")
    for n, status in enumerate(("FINISHED", "FAILED")):
        swept = tracker.sibling()
        swept.start(f"sweep job {n}", {}, {"run_kind": "job", "sweep_id": "outputs/multirun/x", "sweep_job": str(n)})
        swept.log_metrics([("throughput", 100.0 + n, 1)])
        swept.end(status)
    return uri, tracker


def test_runs_lists_jobs_studies_and_sweeps(tmp_path, capsys):
    uri, tracker = store(tmp_path)
    assert main(["--uri", uri, "--experiment", "look"]) == 0
    out = capsys.readouterr().out
    job = next(line for line in out.splitlines() if "single x1 Linear" in line)
    assert all(w in job for w in ("FINISHED", "single x1", "1234.5", "50.0%", "2.0%", "input-bound", str(tmp_path / "job")))
    study = next(line for line in out.splitlines() if "│ s " in line)
    assert all(w in study for w in ("FINISHED", "│ 2 ", "999.0", "75.0%"))
    assert "s: best trial 3: data.num_workers=4" in out and "  rerun it: python -m orchestrator +tuned=best" in out
    sweep = next(line for line in out.splitlines() if "outputs/multirun/x" in line)
    assert "│ 2 " in sweep and "1 FAILED, 1 FINISHED" in sweep and "sweep job 1 (101.0/s)" in sweep
    assert "sweep job" not in job and "trial 0" not in out  # trials and sweep jobs are not listed as runs
    assert main(["--uri", uri, "--links", "http://127.0.0.1:5000"]) == 0
    assert f"  look: {tracker.runs_url('http://127.0.0.1:5000')}" in capsys.readouterr().out.splitlines()


def test_runs_refuses_bad_options_in_one_line(tmp_path, capsys):
    uri, _ = store(tmp_path)
    capsys.readouterr()
    for args, said in ((["--uri", uri, "--experiment", "nope"], "error: --experiment: 'nope' is not in"),
                       (["--uri", f"sqlite:///{tmp_path}/none.db"], f"error: --uri: no MLflow store at {tmp_path}/none.db"),
                       (["--uri", uri, "--last", "0"], "error: --last: must be an integer >= 1, got 0")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1, err
    assert main(["--uri", uri, "--experiment", "nope"]) == 2
    assert "allowed: Default, look" in capsys.readouterr().err


def test_runs_takes_the_store_as_every_other_command_does(tmp_path, capsys):
    """`tracking.uri=` and `tracking.experiment=` (Hydra's form) as well as --uri and --experiment."""
    uri, _ = store(tmp_path)
    capsys.readouterr()
    assert main([f"tracking.uri={uri}", "tracking.experiment=look"]) == 0
    out = capsys.readouterr().out
    assert "experiment 'look'" in out and "s: best trial 3" in out
    assert main([f"tracking.uri={uri}", "trainer.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trainer.max_steps=3: not an option of this command; allowed: tracking.uri=...")
    assert err.count("\n") == 1
