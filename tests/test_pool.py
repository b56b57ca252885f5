"""tune.reuse_ranks: trials handed to kept-alive ranks give the same answers as relaunching,
a crashed trial gets fresh ranks, and nothing outlives the study."""

from __future__ import annotations

import json

import optuna
import pytest

from orchestrator.tune.study import run_study

from .conftest import job_processes

# trials measured to 10% in 0.1-0.6 s; no confirmation runs (the workers study below has them)
SHORT = ["mode=tune", "measure.warmup_steps=2", "measure.window_steps=4", "measure.window_s=0.05", "measure.rel_precision=0.1",
         "measure.min_measure_s=0.1", "measure.max_measure_s=0.6", "tune.confirm_top=0", "tune.pruner=none",
         "tune.baseline=false", "tune.extend_edges=false", "tune.global_batch=free"]


def trials_of(summary):
    return optuna.load_study(study_name=summary["study_name"], storage=summary["storage"]).trials


@pytest.mark.parametrize("backend", [pytest.param("single", marks=pytest.mark.slow), pytest.param("ddp", marks=pytest.mark.slow)])  # 17 s
def test_pool_and_relaunch_find_the_same_best(make_cfg, tmp_path, backend):
    # 3 ms reads per sample: 4 DataLoader workers are clearly better than none
    common = [f"backend={backend}", "parallelism.nproc_per_node=2", "experiment=input_bound",
              "sim.read_latency_ms=3", "data.args.blur_passes=1", *SHORT, "tune.n_trials=2",
              "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[16]",
              "tune.space.accumulation_steps.high=1", "tune.space.num_workers.type=categorical",
              "tune.space.num_workers.choices=[0,4]"]
    best = {}
    for reuse in (True, False):
        d = tmp_path / f"reuse-{reuse}"
        summary = run_study(make_cfg(*common, f"tune.reuse_ranks={reuse}", f"tune.storage=sqlite:///{d}/optuna.db"),
                            d, echo=False)
        assert summary["n_trials"] == 2
        best[reuse] = summary["best"]["values"]["data.num_workers"]
        pools = list((d / "pools").glob("pool*")) if (d / "pools").exists() else []
        assert len(pools) == (1 if reuse else 0)  # one set of ranks for the whole study, or none
        pids = {json.loads((p / "ranks" / "rank0.json").read_text())["pid"] for p in (d / "trials").iterdir()}
        assert len(pids) == (1 if reuse else 2)  # the same rank process ran both trials
        assert not job_processes(d)
    assert best[True] == best[False] == 4


@pytest.mark.slow  # 21 s
def test_crashed_trial_gets_fresh_ranks(make_cfg, tmp_path):
    # tpe: the guided search's job model proposes only among configs like the measured ones (the
    # baseline does not crash), so the crashing value would wait for a sampler trial
    cfg = make_cfg("model._target_=tasks.faults.FailingLinear", *SHORT, "tune.n_trials=5", "tune.max_failure_rate=1",
                   "tune.sampler=tpe",
                   f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.high=16",
                   "tune.space.num_workers.high=0",
                   "+tune.space.crash={key: model.args.fail_at, type: categorical, choices: [2, 100000]}")
    summary = run_study(cfg, tmp_path, echo=False)
    launched = [t for t in trials_of(summary) if "duplicate_of" not in t.user_attrs]
    states = [t.state.name for t in launched]
    assert summary["n_trials"] == 5 and "FAIL" in states and "COMPLETE" in states
    for t in launched:
        crashed = t.user_attrs["values"]["model.args.fail_at"] == 2
        assert (t.state == optuna.trial.TrialState.FAIL) == crashed, t.user_attrs
    # every failure ends its ranks; the next trial starts fresh ones
    fails_followed = sum(s == "FAIL" for s in states[:-1])
    assert len(list((tmp_path / "pools").glob("pool*"))) == 1 + fails_followed
    pids = [json.loads((tmp_path / "trials" / f"{t.number:04d}" / "ranks" / "rank0.json").read_text())["pid"]
            for t in launched if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(set(pids)) <= 1 + fails_followed
    assert not job_processes(tmp_path)


@pytest.mark.perf
def test_kept_alive_rank_reports_each_jobs_own_peak_memory(make_cfg, tmp_path):
    """A big job then a small one on the same ranks: the small one's peak is its own, not the
    process's lifetime peak (ru_maxrss) nor the big job's."""
    from orchestrator.app import run_job
    from orchestrator.tune.pool import RankPool

    def job(features: int):
        # 4096 x features float32 inputs: 160 MB at 10,000 features, nothing at 10
        return make_cfg("tracking.enabled=false", "trainer.max_steps=6", "trainer.save_model=false",
                        f"data.args.features={features}", f"model.args.in_features={features}")

    pool = RankPool(tmp_path / "pools")
    try:
        big = run_job(job(10_000), tmp_path / "big", echo=False, ranks=pool)
        small = run_job(job(10), tmp_path / "small", echo=False, ranks=pool)
        ranks = [json.loads((tmp_path / d / "ranks" / "rank0.json").read_text()) for d in ("big", "small")]
    finally:
        pool.close()
    assert ranks[0]["pid"] == ranks[1]["pid"] and pool.starts == 1  # one kept-alive rank ran both
    assert big["peak_mem_mb"] > small["peak_mem_mb"] + 120, (big["peak_mem_mb"], small["peak_mem_mb"])
    assert small["peak_mem_mb"] > 50 and small["per_rank"][0]["mem_source"] == "rss"
    assert not job_processes(tmp_path)


def test_a_lone_rank_out_of_memory_takes_the_next_job(make_cfg, tmp_path):
    """A job that runs out of memory on a pool of one rank (CUDA's allocator; trainer.memory_cap_mb
    counted in the rank) fails with that error, and the same process runs the next job: no new
    launch. Another failure still ends the rank."""
    from orchestrator.app import JobFailed, run_job
    from orchestrator.tune.pool import RankPool

    def job(*failing: str):
        model = ["model._target_=tasks.faults.FailingLinear", *failing] if failing else []
        return make_cfg("tracking.enabled=false", "trainer.max_steps=6", "trainer.save_model=false", *model)

    pool = RankPool(tmp_path / "pools")
    try:
        run_job(job(), tmp_path / "first", echo=False, ranks=pool)
        with pytest.raises(JobFailed) as failed:
            run_job(job("+model.args.oom=true", "+model.args.fail_at=2"), tmp_path / "oom", echo=False, ranks=pool)
        assert pool.alive()
        run_job(job(), tmp_path / "next", echo=False, ranks=pool)
        assert pool.starts == 1
        with pytest.raises(JobFailed):
            run_job(job("+model.args.fail_at=2"), tmp_path / "crash", echo=False, ranks=pool)
        assert not pool.alive()
    finally:
        pool.close()
    assert "CUDA out of memory" in failed.value.result["error"]
    assert (tmp_path / "oom" / "ranks" / "rank0.survived").exists()
    pids = [json.loads((tmp_path / d / "ranks" / "rank0.json").read_text())["pid"] for d in ("first", "next")]
    assert pids[0] == pids[1]
    assert not job_processes(tmp_path)


def test_only_running_out_of_memory_alone_is_survived():
    import torch

    from orchestrator.rank import survivable

    assert survivable(MemoryError("out of memory: ... > trainer.memory_cap_mb=850"), 1)
    assert survivable(torch.OutOfMemoryError("CUDA out of memory"), 1)
    assert not survivable(MemoryError("out of memory"), 2)  # a peer waits in a collective it left
    assert not survivable(RuntimeError("injected failure"), 1)


def test_kept_alive_ranks_end_when_their_tuner_is_killed(tmp_path):
    """SIGKILL leaves no chance to write the stop file: the ranks see their owner gone and exit."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    script = f"""
import time
from orchestrator.app import run_job
from orchestrator.tune.pool import RankPool
from tests.conftest import TINY, compose_dict
from orchestrator.schema import to_config
pool = RankPool({str(tmp_path / 'pools')!r})
cfg = to_config(compose_dict(TINY + ["tracking.enabled=false", "trainer.max_steps=3", "trainer.save_model=false"]))
run_job(cfg, {str(tmp_path / 'job')!r}, echo=False, ranks=pool)
print("ready", flush=True)
time.sleep(600)
"""
    tuner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert tuner.stdout.readline().strip() == "ready"
        def ranks():
            return [p for p in job_processes(tmp_path) if "orchestrator.rank" in " ".join(p.info["cmdline"])]

        assert ranks()  # the kept-alive rank waits for the next job
        os.kill(tuner.pid, signal.SIGKILL)
        tuner.wait()
        deadline = time.monotonic() + 20
        while ranks() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ranks()
    finally:
        tuner.kill()


def test_the_report_is_prepared_while_the_ranks_start_and_written_while_they_end(make_cfg, tmp_path, monkeypatch):
    """The report's imports (matplotlib, scikit-learn) come after the ranks were started and before
    the first trial is handed to them; the ranks exit while the study writes its report (summary,
    plots, MLflow), not before it."""
    import orchestrator.tune.report as report_mod
    import orchestrator.tune.study as study_mod
    from orchestrator.tune.pool import RankPool

    calls = []
    for name in ("release", "close", "prestart", "run"):
        original = getattr(RankPool, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, self.alive()))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(RankPool, name, spy)
    import_plotting = study_mod.import_plotting

    def plotting(n_trials):
        calls.append(("plotting", None))
        return import_plotting(n_trials)
    monkeypatch.setattr(study_mod, "import_plotting", plotting)
    write_outputs = report_mod.write_outputs  # the study's outcome (outcome.py) writes through report.write_outputs

    def report(*args, **kwargs):
        calls.append(("report", None))
        return write_outputs(*args, **kwargs)
    monkeypatch.setattr(report_mod, "write_outputs", report)
    cfg = make_cfg(*SHORT, "tune.n_trials=1", "tune.space.batch_size.type=categorical",
                   "tune.space.batch_size.choices=[16]", "tune.space.num_workers.high=0",
                   "tune.space.accumulation_steps.high=1", f"tune.storage=sqlite:///{tmp_path}/optuna.db")
    summary = run_study(cfg, tmp_path, echo=False)
    assert summary["n_trials"] == 1
    names = [n for n, _ in calls]
    assert names.index("prestart") < names.index("plotting") < names.index("run")
    assert names.index("release") < names.index("report") < len(names) - 1 - names[::-1].index("close")
    assert calls[names.index("release")][1]  # the ranks that ran the trial were still there to be asked
    assert not job_processes(tmp_path)
