"""The benchmarks as a package: every `bench/bench_*.py` imports as `bench.<name>` from the
repository root with nothing added to sys.path or PYTHONPATH, the zoo's `_target_`s resolve there,
and a zoo task's ranks (subprocesses in the same working directory) import it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.app import run_job
from orchestrator.compose import compose_config

from .conftest import ROOT

BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))


def test_every_benchmark_imports_from_the_root_without_path_edits():
    """One interpreter started in the root, PYTHONPATH unset: each module imports, and none of
    them changes sys.path or PYTHONPATH (the ranks of a job would inherit such a change)."""
    code = (
        "import importlib, json, os, sys\n"
        "path, env = list(sys.path), os.environ.get('PYTHONPATH')\n"
        f"for name in {BENCHES + ['lib', 'plain', 'zoo']!r}:\n"
        "    importlib.import_module('bench.' + name)\n"
        "print(json.dumps({'path': sys.path == path, 'env': os.environ.get('PYTHONPATH') == env}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"path": True, "env": True}


def test_zoo_targets_resolve_from_the_root():
    from bench.zoo import TASKS

    for name, spec in TASKS.items():
        cfg = compose_config([*spec["overrides"], "tracking.enabled=false"])  # imports each _target_
        assert cfg.model._target_.startswith("bench.zoo.tasks."), name


def test_a_zoo_task_runs_on_ranks_that_import_it_from_the_working_directory(tmp_path, monkeypatch):
    from bench.zoo import TASKS

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cfg = compose_config([*TASKS["storage_1"]["overrides"], "tracking.enabled=false", "trainer.max_steps=4",
                          "measure.warmup_steps=1", "measure.window_steps=2", "trainer.save_model=false",
                          "+data.args.size=256"])
    result = run_job(cfg, tmp_path / "run", echo=False, plots=False)
    assert result["status"] == "FINISHED" and result["steps"] == 4


def _grids():
    """(name, base overrides, grid space) of every grid the benchmarks measure and search."""
    from bench.bench_samplers import SPACES
    from bench.lib import WORKLOADS
    from bench.zoo import TASKS

    for name, spec in WORKLOADS.items():
        yield from ((f"{name} {kind}", spec["overrides"], spec[kind]) for kind in ("space", "quick"))
    yield "transformer_lm space", SPACES["transformer_lm"]["overrides"], SPACES["transformer_lm"]["space"]
    yield from ((f"zoo {name}", spec["overrides"], spec["space"]) for name, spec in TASKS.items())


def test_every_grid_point_is_a_point_of_the_space_the_benchmarks_search():
    """The benchmarks' studies search their whole grid (the global batch free, whatever the
    product's default) by the rule they score a pick by, and their jobs are measured as a study's
    trials are: each grid point becomes a trial's values, and those values are that point."""
    import itertools

    from bench.lib import KNOBS, point_of, space_overrides, values_of
    from orchestrator.schema import TRIAL_MEASURE, Objective
    from orchestrator.tune.launch import trial_config
    from orchestrator.tune.space import SearchSpace

    for name, overrides, space in _grids():
        cfg = compose_config([*overrides, "tracking.enabled=false", *space_overrides(space)])
        space_ = SearchSpace(cfg)
        assert space_.global_batch is None and cfg.tune.objective is Objective.utilization, name
        trial = trial_config(cfg, values_of(space_, next(itertools.product(*(space[k] for k in KNOBS)))))
        assert trial.measure.rel_precision == TRIAL_MEASURE["rel_precision"] > 0 and trial.trainer.max_steps == 0, name
        for p in itertools.product(*(space[k] for k in KNOBS)):
            assert point_of(values_of(space_, p)) == p, (name, p)


def test_the_zoo_default_study_is_scored_against_the_grid_points_that_train_its_global_batch():
    """bench_zoo's default-space study runs under the product's defaults (the user's global batch
    held): its pick is judged against the best of the grid points at that global batch only."""
    from bench.bench_zoo import grid_of, held_points
    from bench.zoo import TASKS
    from orchestrator.tune.space import SearchSpace

    steady = {p: {"throughput": 1.0, "utilization": 1.0} for p in grid_of(TASKS["storage_1"]["space"])}
    space = SearchSpace(compose_config([*TASKS["storage_1"]["overrides"], "tracking.enabled=false",
                                        "tune.global_batch=user"]))
    assert space.global_batch == 32  # the user's b32 a1, one rank
    assert sorted({(b, a) for b, _, a in held_points(space, steady)}) == [(16, 2), (32, 1)]
    ddp = SearchSpace(compose_config([*TASKS["comm_ddp"]["overrides"], "tracking.enabled=false",
                                      "tune.global_batch=user"]))
    steady = {p: {"throughput": 1.0, "utilization": 1.0} for p in grid_of(TASKS["comm_ddp"]["space"])}
    assert sorted({(b, a) for b, _, a in held_points(ddp, steady)}) == [(8, 2), (16, 1)]  # 2 ranks: 32 in all
    free = SearchSpace(compose_config([*TASKS["storage_1"]["overrides"], "tracking.enabled=false"]))
    assert free.global_batch is None and held_points(free, steady) == steady  # the default with sgd: free


def test_bench_warm_keeps_each_seed_and_reads_an_older_entry_as_seed_0(tmp_path, monkeypatch, capsys):
    """bench_warm's cache by task and seed: a task and seed cached is not run again, another seed
    adds to it, an entry without seeds (the older form, run with seed 0) reads as seed 0, and the
    table gives the median and the worst over the seeds."""
    from bench import bench_warm

    met = {"A_wall_s": 50.0, "D_wall_s": 50.0, "B_warm": {"match": "full"}, "C_warm": {"match": "job"},
           "B": {"trials": 2, "score": 0.99, "wall_s": 5.0}, "C": {"trials": 1, "score": 1.0, "wall_s": 3.0}}
    missed = {**met, "B": {"trials": None, "score": None, "wall_s": None}}
    cache = tmp_path / "bench_warm.json"
    cache.write_text(json.dumps({"short_epochs": missed}))
    ran = []
    monkeypatch.setattr(bench_warm, "one", lambda name, args, tmp: ran.append((name, args.seed)) or met)
    for seed in (1, 0, 1):
        monkeypatch.setattr(sys, "argv", ["bench_warm", "--only", "short_epochs", "--seed", str(seed),
                                          "--cache", str(cache)])
        assert bench_warm.main() == 1  # seed 0 missed B's target
    assert ran == [("short_epochs", 1)]  # seed 0 read from the older entry, seed 1 cached after its run
    assert json.loads(cache.read_text()) == {"short_epochs": {"seeds": {"0": missed, "1": met}}}
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("short_epochs"))
    assert row.split()[1:] == ["0,1", "50", "/", "50", "2", "/", "never", "10%", "/", "never", "full", "1", "/", "1",
                               "job", "1", "of", "2"]


def test_bench_target_evaluates_at_most_every_8_user_steps_and_counts_a_pick_of_your_config_as_yours(capsys):
    """bench_target's cadence: --evals-per-epoch an epoch but no closer than MIN_EVAL_STEPS of the
    user's steps, the same in samples at another global batch; a cached entry that evaluated closer
    is run again; a pick that is the user's own config counts 1.00 in the cells and checks (the user
    changes nothing), its measured rerun shown under "yours again"."""
    import argparse

    from bench import bench_target as bt

    assert bt.MIN_EVAL_STEPS == 8
    assert bt.evals_every({"steps_per_epoch": 100}, 4, 32, 32) == 25
    assert bt.evals_every({"steps_per_epoch": 7}, 4, 32, 32) == 8  # 7 // 4 = 1: an evaluation after every step
    assert bt.evals_every({"steps_per_epoch": 7}, 4, 64, 32) == 4  # twice the batch: the same samples apart
    assert bt.evals_every({"steps_per_epoch": 819}, 4, 8, 8) == 273  # 204 would miss the epochs' ends: 273 divides 819
    assert bt.evals_every({"steps_per_epoch": 819}, 4, 16, 8) == 102  # another batch: the samples apart
    args = argparse.Namespace(budget=4)
    user = {"reached": True, "time_s": 2.0, "evals": 160, "samples": 5120}  # every step of batch 32
    assert not bt.cached({"budget_epochs": 60, "user": user}, "short_epochs", args)
    assert bt.cached({"budget_epochs": 60, "user": {**user, "evals": 20}}, "short_epochs", args)
    yours = ["data.batch_size=32", "data.num_workers=2", "trainer.accumulation_steps=1"]  # short_epochs' own
    other = ["data.batch_size=16", "data.num_workers=3", "trainer.accumulation_steps=2"]
    seeds = {s: {"user": user, "noise_run": None,
                 "held": {"reached": True, "time_s": 2.0 / r, "pick": pick, "user_again": user},
                 "goodput": {"reached": True, "time_s": 2.0 / 1.1, "pick": other, "user_again": user}}
             for s, (r, pick) in enumerate([(0.7, yours), (1.2, other)])}
    assert bt.report({"short_epochs": seeds}, ["held", "goodput"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("short_epochs"))
    assert "1.10 / 1.00 (1 yours)" in row and "1.10 / 1.10" in row and " 0.70 " in row  # 0.70: the rerun, as measured
    assert "default (goodput)>=0.95:ok" in row and "goodput>=held:ok" in row
    seeds[1]["held"] = {**seeds[1]["goodput"], "time_s": 2.0 / 1.3}  # the same pick: one config, two reruns
    assert bt.report({"short_epochs": seeds}, ["held", "goodput"]) == 0  # goodput 1.10 < held 1.30 at seed 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("short_epochs"))
    assert "goodput>=held:ok" in row
    seeds[0]["held"] = {**seeds[0]["goodput"], "time_s": 2.0 / 1.2}  # held's pick at seed 0: other, 1.20
    seeds[0]["goodput"]["pick"] = ["data.batch_size=64"]  # another config than held's: its own 1.10 counts
    assert bt.report({"short_epochs": seeds}, ["held", "goodput"]) == 1
    assert "goodput>=held:NO" in capsys.readouterr().out


def test_bench_target_runs_a_changed_task_again_and_judges_each_seeds_noise_scale_at_its_own_weights(capsys):
    """A cached entry of an earlier version of its task (compute's items changed) is run again; the
    noise check compares each seed's late figure with the offline figure over its own steps (an
    entry whose offline figure was taken at the final weights only is not judged)."""
    import argparse

    from bench import bench_target as bt

    args = argparse.Namespace(budget=4)
    user = {"reached": True, "time_s": 2.0, "evals": 20, "samples": 5120}
    assert not bt.cached({"budget_epochs": 4, "uncapped": True, "user": user}, "compute", args)
    assert bt.cached({"budget_epochs": 4, "uncapped": True, "user": user, "task_version": 2}, "compute", args)
    assert bt.late_points(4) == [(2, 0.25), (3, 0.5), (4, 0.25)]
    assert [at for at, _ in bt.late_points(60)] == [30, 35, 40, 45, 50, 55, 60]
    assert sum(w for _, w in bt.late_points(60)) == pytest.approx(1.0) and bt.late_points(60)[1][1] == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="no whole epoch at half"):
        bt.late_points(5)
    points = [{"epochs": 2}]
    seeds = {0: {"user": user, "noise_run": 300.0, "noise_late": True, "noise_offline": 100.0, "noise_points": points,
                 "noise_late_lo": 150.0, "noise_late_hi": 900.0},
             1: {"user": user, "noise_run": 120.0, "noise_late": True, "noise_offline": 100.0, "noise_points": points,
                 "noise_late_lo": 60.0, "noise_late_hi": 300.0},
             2: {"user": user, "noise_run": 50.0, "noise_late": True, "noise_offline": 1000.0}}  # final weights only
    assert bt.report({"storage_1": seeds}, []) == 1  # per seed 3.0 and 1.2: median 2.1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("storage_1"))
    assert "2.10 (1.20-3.00)" in row and "noise within 2x (2 of 3 seeds with a late figure):NO" in row
    assert "offline in the run's 95% interval: 1 of 2" in row
    seeds[0]["noise_run"] = 150.0
    assert bt.report({"storage_1": seeds}, []) == 0
    assert "noise within 2x (2 of 3 seeds with a late figure):ok" in capsys.readouterr().out


def test_bench_noise_sim_finds_the_estimator_within_2x_where_the_noise_is_near_the_batch_and_not_far_above_it():
    """The run's own estimator on simulated halves with a known noise scale: at 3x the batch and 160
    pairs nearly every run is within 2x; at 30x the batch with 26 pairs few are (seeded: the same
    draws every time)."""
    import torch

    from bench.bench_noise_sim import one_run

    lam = torch.tensor([(i + 1) ** -1.5 for i in range(200)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    near = [one_run(160, 3, 32, lam, gen) for _ in range(20)]
    far = [one_run(26, 30, 32, lam, gen) for _ in range(20)]
    assert sum(r["within"] for r in near) >= 18
    assert sum(r["within"] for r in far) <= 6
    assert all(r["holds"] <= r["bounded"] for r in near + far)  # an interval holds the truth only where bounded
