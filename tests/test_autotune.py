"""Loader autotune (trainer.loader_autotune): a switch keeps the epoch's position (the same
samples in the same order, single process and 2 DDP ranks), and a latency jump is answered with
more workers, recorded as events (result, load report, override file, MLflow)."""

from __future__ import annotations


import pytest
from mlflow.tracking import MlflowClient

from orchestrator.app import run_job
from orchestrator.runtime import autotune
from orchestrator.runtime.autotune import LoaderSettings, LoaderTuner
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.loop import EventLog, train
from orchestrator.schema import ConfigError


RECORDED = ["model._target_=tests.custom_task.RecordingLinear", "data.args.size=240", "data.batch_size=8",
            "trainer.epochs=3", "trainer.lr=0.1", "trainer.momentum=0.9"]


def ids(path) -> list:
    return path.read_text().split()


def test_forced_switches_keep_the_order_and_the_result(make_cfg, tmp_path, monkeypatch):
    """Switches mid-epoch, at an epoch's last batch and back to no workers: the model trains on the
    same samples in the same order as an untouched run, and ends with the same parameters."""
    plan = {4: LoaderSettings(2), 9: LoaderSettings(1, 3), 30: LoaderSettings(2, 1), 47: LoaderSettings(0)}

    def forced(self, step, job):  # rank 0's decision, whatever the measurement says
        return plan.get(step)

    monkeypatch.setattr(LoaderTuner, "_decide", forced)
    runs = {}
    for name, extra in (("plain", []), ("tuned", ["trainer.loader_autotune=true", "trainer.loader_autotune_every=1"])):
        (tmp_path / name).mkdir()
        cfg = make_cfg(*RECORDED, f"+model.args.record_dir={tmp_path / name}",
                       *extra)
        a = Adapter(cfg)
        a.setup()
        runs[name] = train(cfg, a, EventLog(None))
    assert runs["tuned"].steps == runs["plain"].steps == 90  # 30 steps an epoch: step 30 ends one
    assert runs["tuned"].meter["loader_autotune"]["final"] == {"num_workers": 0, "prefetch_factor": None}
    assert ids(tmp_path / "tuned" / "rank0.txt") == ids(tmp_path / "plain" / "rank0.txt")
    assert len(set(ids(tmp_path / "plain" / "rank0.txt")[:240])) == 240  # one epoch: every sample once
    assert runs["tuned"].param_digest == runs["plain"].param_digest


def test_checkpoints_keep_the_loader_settings_and_a_resume_continues_with_them(make_cfg, tmp_path, monkeypatch):
    from orchestrator import checkpoint

    monkeypatch.setattr(LoaderTuner, "_decide", lambda self, step, job: LoaderSettings(2, 3) if step == 3 else None)
    tuned = ["data.args.size=240", "data.batch_size=8", "trainer.checkpoint_every=5", "trainer.loader_autotune=true",
             "trainer.loader_autotune_every=1"]
    a = Adapter(make_cfg(*tuned, "trainer.max_steps=10"))
    a.setup()
    train(a.cfg, a, EventLog(None), ckpt_dir=tmp_path)
    latest = checkpoint.find_latest(tmp_path)
    assert checkpoint.meta_of(latest)["loader"] == {"num_workers": 2, "prefetch_factor": 3}
    res = train(make_cfg(*tuned, "trainer.max_steps=20"), a, EventLog(None), ckpt_dir=tmp_path, resume=latest)
    start = res.meter["loader_autotune"]["events"][0]
    assert (start["action"], start["step"], start["num_workers"], start["prefetch_factor"]) == ("start", 10, 2, 3)
    assert res.meter["warmup"]["queue_micro_batches"] == 6  # the resumed loader's 2 workers x 3


def sampler_order(cfg, rank: int, world: int, steps: int) -> list:
    """The first feature of each sample rank `rank` trains on in `steps` steps, from the
    DistributedSampler itself: epoch after epoch, whole batches (drop_last)."""
    from torch.utils.data import DistributedSampler

    from tasks.datasets import random_classification

    x = random_classification(**cfg.data.args).x  # type: ignore[attr-defined]
    b, out, epoch = cfg.data.batch_size, [], 0
    while len(out) < steps * b:
        sampler = DistributedSampler(range(len(x)), world, rank, shuffle=True, seed=cfg.trainer.seed, drop_last=True)
        sampler.set_epoch(epoch)
        order = list(sampler)
        out += order[:len(order) // b * b]
        epoch += 1
    return [repr(float(x[i, 0])) for i in out[:steps * b]]


@pytest.mark.perf
@pytest.mark.slow  # 22 s; the 1-rank autotune tests stay
def test_latency_jump_gets_more_workers_on_2_ranks_in_the_same_order(make_cfg, tmp_path, mlflow_uri):
    """2 DDP ranks; at step 30 reading an item starts to take 3 ms. The autotuned run ends with more
    workers and says when and why; each rank trained on its own shard's samples in the sampler's
    order, nothing twice or skipped across the switches, and ended with the parameters of the same
    run without autotune."""
    same = ["backend=ddp", "parallelism.nproc_per_node=2", *RECORDED, "trainer.epochs=40", "trainer.max_steps=300",
            "data.args.size=512", "measure.window_steps=8", "measure.warmup_steps=1", "trainer.log_every=20",
            "sim.latency_jump_at=30", "sim.latency_after_ms=3", "tune.max_workers=4"]
    cfg = make_cfg(*same, f"+model.args.record_dir={tmp_path}", "trainer.loader_autotune=true",
                   "trainer.loader_autotune_every=10")
    result = run_job(cfg, tmp_path / "run", echo=False, plots=False)
    # the untouched run: no latency (it changes the speed, not the samples), so it takes seconds
    (tmp_path / "plain").mkdir()
    plain = run_job(make_cfg(*same, "sim.latency_after_ms=0", f"+model.args.record_dir={tmp_path / 'plain'}",
                             "tracking.enabled=false"), tmp_path / "plain_run", echo=False, plots=False)
    assert plain["per_rank"][0]["param_digest"] == result["per_rank"][0]["param_digest"]
    for rank in (0, 1):
        assert ids(tmp_path / f"rank{rank}.txt") == ids(tmp_path / "plain" / f"rank{rank}.txt")
    tuned = result["loader_autotune"]
    assert tuned["initial"]["num_workers"] == 0 and tuned["final"]["num_workers"] > 0, tuned
    kept = [e for e in tuned["events"] if e["action"] == "keep" and e["num_workers"] > e["from_workers"]]
    assert kept and kept[0]["step"] > 30 and kept[0]["throughput_after"] > kept[0]["throughput_before"] + kept[0]["noise"]
    tried = next(e for e in tuned["events"] if e["action"] == "try")
    assert tried["step"] > 30 and "input-bound" in tried["reason"] and "hand" in tried["reason"]
    for rank in (0, 1):
        assert ids(tmp_path / f"rank{rank}.txt") == sampler_order(cfg, rank, 2, 300)
    assert len({r["param_digest"] for r in result["per_rank"]}) == 1
    run_dir = tmp_path / "run"
    report = (run_dir / "load_report.md").read_text()
    assert "## Loader autotune" in report and f"| {kept[0]['step']} |" in report
    override = (run_dir / "tuned" / "loader.yaml").read_text()
    assert override.startswith("# @package _global_") and f"num_workers: {tuned['final']['num_workers']}" in override
    client = MlflowClient(mlflow_uri)
    workers = [m.value for m in client.get_metric_history(result["mlflow_run_id"], "loader/num_workers")]
    assert workers[0] == 0 and tuned["final"]["num_workers"] in workers
    assert client.get_metric_history(result["mlflow_run_id"], "loader/prefetch_factor")


def judge(kind: str, base: list, trial: list):
    """A tuner in the middle of a trial, fed `trial` windows; what its turn decides."""
    events = []
    cfg_stub = type("C", (), {"trainer": type("T", (), {"loader_autotune_every": 10, "memory_cap_mb": 0})()})()
    tuner = LoaderTuner(cfg_stub, LoaderSettings(4), rank=0, world_size=1, device="cpu", item_bytes=4000,
                        emit=events.append)
    tuner.trial = autotune.Trial(LoaderSettings(2), LoaderSettings(4), kind, autotune.estimate(base), "test")
    tuner.throughputs = list(trial)
    return tuner._judge(100), events


@pytest.mark.parametrize("kind, trial, outcome", [
    ("up", [150, 160, 155, 158], "keep"),  # far above the noise
    ("up", [101, 99, 102, 98], "revert"),  # no gain, and the noise is narrow: decided
    ("up", [130, 80, 125, 75], None),  # within a wide noise: measured further
    ("up", [130, 80, 125, 75] * 3, "revert"),  # still within it after TRIAL_WINDOWS: reverted
    ("down", [100, 99, 101, 100], "keep"),  # no loss beyond a narrow noise: fewer workers kept
    ("down", [60, 61, 59, 60], "revert"),  # a clear loss
])
def test_a_trial_is_kept_only_beyond_the_noise(kind, trial, outcome):
    got, events = judge(kind, [100, 98, 103, 99, 101], trial)
    assert (events[-1]["action"] if events else None) == outcome
    assert got == (LoaderSettings(2) if outcome == "revert" else None)
    if outcome == "revert":
        assert "not tried again for 40 steps" in events[-1]["reason"]


def test_autotune_options_are_checked(make_cfg):
    with pytest.raises(ConfigError, match="trainer.loader_autotune_every: must be an integer >= 1"):
        make_cfg("trainer.loader_autotune_every=0")
    with pytest.raises(ConfigError, match="trainer.loader_autotune: a study measures fixed loader settings"):
        make_cfg("trainer.loader_autotune=true", "mode=tune")
    with pytest.raises(ConfigError, match="trainer.loader_autotune: not with parallelism.balance=speed"):
        make_cfg("trainer.loader_autotune=true", "parallelism.balance=speed", "backend=ddp", "parallelism.nproc_per_node=2")
    with pytest.raises(ConfigError, match="sim.latency_after_ms: applies with sim.latency_jump_at > 0"):
        make_cfg("sim.latency_after_ms=3")
    with pytest.raises(ConfigError, match="sim.latency_jump_at: must be a step >= 0"):
        make_cfg("sim.latency_jump_at=-1")
