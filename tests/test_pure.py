"""Pure pieces of the job runner, tested without launching anything: the event tail, the
world-size check, the pool key, and the resume rules."""

from __future__ import annotations

import json

import pytest

from orchestrator import checkpoint
from orchestrator.runtime.dist import check_world
from orchestrator.schema import flatten
from orchestrator.supervise import EventTail
from orchestrator.tune.pool import pool_key


def test_event_tail_waits_for_the_end_of_a_line(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    tail = EventTail(tmp_path)
    with open(ranks / "rank1.jsonl", "w") as f:
        f.write(json.dumps({"type": "log", "step": 1}) + "\n" + '{"type": "window", "st')
        f.flush()
        assert tail.poll() == [(1, {"type": "log", "step": 1})]  # the half-written line waits
        assert tail.poll() == []
        f.write('ep": 2}\n')
        f.flush()
        assert tail.poll() == [(1, {"type": "window", "step": 2})]
    (ranks / "rank0.jsonl").write_text('{"type": "start"}\n')
    assert tail.poll() == [(0, {"type": "start"})]  # files that appear later are read from the start


def test_world_size_check(make_cfg):
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2")
    check_world(cfg, 2)
    with pytest.raises(RuntimeError, match="the launcher started 3 ranks, the config asks for 2"):
        check_world(cfg, 3)
    check_world(make_cfg("backend=single", "parallelism.nproc_per_node=4"), 1)  # one process, whatever nproc says


def test_pool_key_changes_only_with_what_needs_new_processes(make_cfg):
    base = pool_key(make_cfg("backend=ddp", "parallelism.nproc_per_node=2"))
    # a trial's knobs run on the same ranks
    assert pool_key(make_cfg("backend=ddp", "parallelism.nproc_per_node=2", "data.batch_size=64",
                             "data.num_workers=2", "trainer.accumulation_steps=4")) == base
    for other in (["backend=horovod", "parallelism.nproc_per_node=2"], ["backend=ddp", "parallelism.nproc_per_node=1"],
                  ["backend=ddp", "parallelism.nproc_per_node=2", "backend.dist_backend=gloo"]):
        assert pool_key(make_cfg(*other)) != base, other


def test_resume_rules(make_cfg):
    saved = make_cfg("trainer.max_steps=60", "data.read_latency_ms=0.5")
    same = make_cfg("trainer.max_steps=100", "trainer.checkpoint_every=7", "data.num_workers=2",
                    "data.read_latency_ms=0.5", "tracking.experiment=elsewhere")
    assert checkpoint.changed_keys(flatten(saved), flatten(same)) == []  # what may change did
    other = make_cfg("trainer.max_steps=60", "data.batch_size=64", "trainer.seed=3")
    assert checkpoint.changed_keys(flatten(saved), flatten(other)) == [  # data.args.seed follows trainer.seed
        ("data.args.seed", 0, 3), ("data.batch_size", 32, 64), ("data.read_latency_ms", 0.5, 0.0), ("trainer.seed", 0, 3)]
    # finished after 60 steps of a 128-step epoch: more steps continue, the same limits do not
    t = saved.trainer
    assert not checkpoint.trains_further(t, t, 60, 128)
    assert checkpoint.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, 128)
    assert not checkpoint.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, 60)  # the epoch ran out
    assert checkpoint.trains_further(t, make_cfg("trainer.max_steps=0", "trainer.epochs=2").trainer, 60, 60)
    assert checkpoint.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, None)  # epoch length unknown


def test_handoff_cost_is_measured_once_per_size_class(tmp_path, monkeypatch):
    from orchestrator import costs

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(costs, "measure_handoff", lambda nbytes, bs: calls.append((nbytes, bs)) or 0.002)
    assert costs.handoff_s(100_000, 32)["seconds"] == 0.002
    assert costs.handoff_s(120_000, 32)["seconds"] == 0.002  # the same power-of-two size class: cached
    assert calls == [(131072, 32)] and (tmp_path / "costs.json").exists()
    costs.handoff_s(1_000_000, 32)
    assert calls[-1] == (1048576, 32)


def test_measured_handoff_is_a_real_cost():
    from orchestrator.costs import measure_handoff

    assert 0 < measure_handoff(32 * 4000, 32, batches=10) < 1.0  # a worker costs something, and not seconds


def test_the_floors_hold():
    """import-linter's contracts (pyproject.toml, [tool.importlinter]): measure/ at the bottom, pure;
    the analysis over it; the rank side never reaching up; the parent and the tuner reading
    measurement from measure/; no circles between the modules of a package."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
