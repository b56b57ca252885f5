"""The benchmarks as a package: every `bench/bench_*.py` imports as `bench.<name>` from the
repository root with nothing added to sys.path or PYTHONPATH, the zoo's `_target_`s resolve there,
and a zoo task's ranks (subprocesses in the same working directory) import it too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
                          "trainer.warmup_steps=1", "trainer.window_steps=2", "trainer.save_model=false",
                          "+data.args.size=256"])
    result = run_job(cfg, tmp_path / "run", echo=False, plots=False)
    assert result["status"] == "FINISHED" and result["steps"] == 4
