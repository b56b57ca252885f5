"""Real 2-rank launches on CPU (gloo): DDP through torchrun, Horovod through horovodrun.

Horovod is part of the set-up, so these tests run for real in CI (no skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.utils.data import DistributedSampler, Sampler

from orchestrator.app import JobFailed, run_job
from orchestrator.diagnose import STRAGGLER_SPREAD
from orchestrator.runtime.balance import ShareSampler, split
from orchestrator.runtime.dist import Adapter, DDPAdapter, shard_units
from orchestrator.runtime.loop import build_dataset, train
from orchestrator.merge import load_rank_results

from .conftest import ROOT, free_port, job_processes

# the default job's linear model on a small dataset: 8 samples per rank per micro-step
WORKLOAD = ["data.args.size=256", "data.batch_size=8", "trainer.lr=0.1", "trainer.momentum=0.9",
            "trainer.max_steps=6", "trainer.epochs=3"]


class GlobalBatches(Sampler):
    """Yields, micro-step by micro-step, the union of what each rank's DistributedSampler gives."""

    def __init__(self, cfg, dataset, world: int, b: int) -> None:
        self.order: list = []
        per_rank = []
        for r in range(world):
            os.environ.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
            per_rank.append(list(DDPAdapter(cfg).sampler(dataset, True, cfg.trainer.seed, True)))
        for k in range(len(per_rank[0]) // b):
            for r in range(world):
                self.order += per_rank[r][k * b:(k + 1) * b]
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(var)

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def reference_params(make_cfg, accum: int, *workload: str, world: int = 2, b: int = 8, extra=()) -> dict:
    """One process training on the same global batches (world * b per micro-step)."""
    cfg = make_cfg(*(workload or WORKLOAD), f"trainer.accumulation_steps={accum}", f"data.batch_size={world * b}",
                   *extra)
    dataset = build_dataset(cfg)

    class OneProcess(Adapter):
        def sampler(self, ds, shuffle, seed, drop_last):
            return GlobalBatches(cfg, dataset, world, b)

    a = OneProcess(cfg)
    a.setup()
    res = train(cfg, a)
    assert res.epochs == 1  # GlobalBatches has no set_epoch: the runs compared stay within one epoch
    return res.model.state_dict()


@pytest.mark.parametrize("backend", ["ddp", "horovod"])
@pytest.mark.parametrize("accum", [1, 3])
def test_ranks_agree_and_match_one_process(make_cfg, tmp_path, backend, accum):
    cfg = make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", *WORKLOAD,
                   f"trainer.accumulation_steps={accum}")
    result = run_job(cfg, tmp_path)  # output shown by pytest if this fails
    assert result["status"] == "FINISHED" and result["world_size"] == 2 and result["steps"] == 6
    digests = {r["param_digest"] for r in result["per_rank"]}
    assert len(digests) == 1  # parameters identical on both ranks
    got = torch.load(tmp_path / "model.pt")
    want = reference_params(make_cfg, accum)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())
    # per-rank figures, imbalance, one MLflow run with per-rank metrics and tags
    assert {r["rank"] for r in result["per_rank"]} == {0, 1}
    imb = result["imbalance"]
    own = {r.rank: r.step_time_s - r.phase_s["comm"] for r in load_rank_results(tmp_path)}  # own work per step
    assert imb["slowest_rank"] == max(own, key=own.__getitem__)
    assert (imb["straggler_rank"] is not None) == (imb["own_time_spread"] > STRAGGLER_SPREAD)
    run = MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"])
    assert (run.data.tags["backend"], run.data.tags["world_size"], run.data.tags["nnodes"]) == (backend, "2", "1")
    assert "rank1/throughput" in run.data.metrics and "rank0/utilization" in run.data.metrics
    assert result["comm_frac"] > 0  # the all-reduce is measured


# fsdp: the linear layer sharded as its own unit (10 rows: 5 per rank), the global norm clipped
# (active: the gradients' norm starts above 0.5), and HSDP on 4 ranks in 2 groups of 2
@pytest.mark.parametrize("accum, world, shard", [(1, 2, 0), (3, 2, 0), pytest.param(1, 4, 2, marks=pytest.mark.slow)])
def test_fsdp_matches_one_process(make_cfg, tmp_path, accum, world, shard):
    fsdp = ["backend.shard_modules=[Linear]", "trainer.grad_clip=0.5", f"trainer.accumulation_steps={accum}"]
    cfg = make_cfg("backend=fsdp", f"parallelism.nproc_per_node={world}", f"parallelism.shard_size={shard}",
                   *WORKLOAD, *fsdp)
    result = run_job(cfg, tmp_path)
    assert result["status"] == "FINISHED" and result["world_size"] == world and result["steps"] == 6
    assert len({r["param_digest"] for r in result["per_rank"]}) == 1  # the gathered parameters agree
    got = torch.load(tmp_path / "model.pt")  # consolidated: plain tensors of the full shapes
    want = reference_params(make_cfg, accum, world=world, extra=fsdp)
    assert got.keys() == want.keys()
    for k in want:
        assert type(got[k]) is torch.Tensor and torch.allclose(got[k], want[k], atol=1e-5), k
    assert result["comm_frac"] > 0  # the all-gathers and reduce-scatters are measured


def test_fsdp_default_units_are_the_repeated_blocks():
    from tasks.models import ManySmallLayers, TinyTransformerLM

    with torch.device("meta"):
        lm = TinyTransformerLM(d_model=256, n_heads=4, n_layers=3)  # 0.8 M parameters per layer
        small = ManySmallLayers()
    # the layers, not the large attention (its out_proj never runs its own forward) nor the whole stack
    assert shard_units(lm, [], 500_000) == list(lm.blocks.layers)
    assert shard_units(lm, [], 10**9) == [] and shard_units(small, [], 1_000_000) == []  # the root alone
    named = shard_units(lm, ["TransformerEncoderLayer", "Linear"], 1)
    assert {id(m) for m in named} == {id(m) for m in lm.modules() if type(m).__name__ in ("TransformerEncoderLayer", "Linear")}
    for layer in lm.blocks.layers:  # children before their parents
        assert named.index(layer) > max(named.index(layer.linear1), named.index(layer.linear2))


def test_sampler_shards_are_disjoint_and_cover(make_cfg):
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2", "data.args.size=100")
    ds = build_dataset(cfg)
    shards = {}
    for r in range(2):
        os.environ.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))
        shards[r] = DDPAdapter(cfg).sampler(ds, True, 0, False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var)
    a, b = list(shards[0]), list(shards[1])
    assert not set(a) & set(b) and set(a) | set(b) == set(range(100))
    shards[0].set_epoch(1)
    assert list(shards[0]) != a  # set_epoch reshuffles


@pytest.mark.parametrize("world, drop_last", [(2, True), (3, False)])
def test_share_sampler_splits_the_even_global_batches(world, drop_last):
    """Whatever the shares and wherever they change, the ranks' pieces tile the even split's global
    micro-batches: every sample once per epoch, deterministic given the seed and the shares."""
    n, b = 103, 8
    even = [DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5, drop_last=drop_last)
            for r in range(world)]
    ranks = [ShareSampler(n, r, world, b, True, 5, drop_last) for r in range(world)]
    skewed = split(world * b, [3.0] + [1.0] * (world - 1))
    for epoch, change in ((0, 3), (1, 99)):  # 99: past the epoch's end; epoch 1 starts with the latest shares
        for s in even + ranks:
            s.set_epoch(epoch)
        shards = [list(s) for s in even]
        its = [iter(s) for s in ranks]
        seen, mine = [], [[] for _ in ranks]
        for k in range(len(ranks[0])):
            if k == change:
                for s in ranks:
                    s.set_sizes(skewed, change)
            pieces = [next(it) for it in its]
            if k < len(ranks[0]) - 1 or drop_last:  # (a short last micro-batch is split in proportion)
                assert [len(p) for p in pieces] == (skewed if k >= 3 or epoch else [b] * world)
            assert sorted(i for p in pieces for i in p) == sorted(i for sh in shards for i in sh[k * b:(k + 1) * b])
            seen += [i for p in pieces for i in p]
            for r, p in enumerate(pieces):
                mine[r].append(p)
        if drop_last:  # each sample at most once, all but the remainder of a global batch
            assert len(seen) == len(set(seen)) == len(ranks[0]) * world * b
        else:  # every sample; padding repeats a few, as DistributedSampler's does
            assert set(seen) == set(range(n))
    resumed = [ShareSampler(n, r, world, b, True, 5, drop_last, sizes=skewed) for r in range(world)]
    for s in resumed:
        s.set_epoch(1)
    assert [list(s) for s in resumed] == mine  # epoch 1 again, from the shares alone (a resume)
    assert split(10, [2.0, 1.0, 0.001]) == [6, 3, 1] and split(24, [1.0, 1.0]) == [12, 12]


# a rank 2x slower (SlowLinear sleeps 0.5 ms a sample, 1 ms on rank 1), global batch 24, one epoch
SLOW_RANK = ["model._target_=tasks.faults.SlowLinear", "data.args.size=2880", "data.batch_size=12", "trainer.lr=0.1",
             "trainer.momentum=0.9", "trainer.max_steps=60", "measure.window_steps=3"]


@pytest.mark.parametrize("backend, accum", [pytest.param("ddp", 2, marks=pytest.mark.slow), ("horovod", 1)])  # ddp: 17 s (a resume)
def test_balance_by_speed_is_exact_and_resumes_with_its_shares(make_cfg, tmp_path, backend, accum):
    args = [f"backend={backend}", "parallelism.nproc_per_node=2", "parallelism.balance=speed", *SLOW_RANK,
            f"trainer.accumulation_steps={accum}"]
    if backend == "ddp":  # stopped at step 30, resumed to 60: the checkpoint's shares carry on
        first = run_job(make_cfg(*args, "trainer.max_steps=30", "trainer.checkpoint_every=10"), tmp_path, echo=False)
        result = run_job(make_cfg(*args, f"trainer.resume={tmp_path}"), tmp_path / "unused", echo=False)
        assert result["balance"]["history"][0] == {"step": 30, "sizes": first["balance"]["sizes"],
                                                   "why": "resumed from the checkpoint"}
        assert all(h["step"] > 30 for h in result["balance"]["history"][1:])  # the run's steps, not the attempt's
    else:
        result = first = run_job(make_cfg(*args), tmp_path, echo=False)
    bal = result["balance"]
    assert result["status"] == "FINISHED" and result["steps"] == 60 and first["balance"]["changes"] >= 1, first["balance"]
    # 2:1 is 0.667 (16 of 24); a loaded machine adds the same time to both ranks and narrows the measured ratio
    assert 0.55 <= bal["shares"][0] <= 0.75, bal
    assert len({r["param_digest"] for r in result["per_rank"]}) == 1
    got = torch.load(tmp_path / "model.pt")
    want = reference_params(make_cfg, accum, *SLOW_RANK, b=12)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())
    run = MlflowClient(make_cfg().tracking.uri).get_run(result["mlflow_run_id"])
    assert run.data.metrics["rank0/share"] == bal["shares"][0]
    assert "shares" in (tmp_path / "load_report.md").read_text()


@pytest.mark.parametrize("backend", ["ddp", pytest.param("horovod", marks=pytest.mark.slow)])
def test_failing_rank_ends_the_job(make_cfg, tmp_path, backend):
    cfg = make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", "model._target_=tasks.faults.FailingLinear",
                   "+model.args.fail_rank=1", "+model.args.fail_at=4", "trainer.max_steps=50",
                   "data.num_workers=1")  # a DataLoader worker must not outlive its rank either
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as info:
        run_job(cfg, tmp_path, echo=False)
    assert time.monotonic() - t0 < 30
    result = info.value.result
    assert result["status"] == "FAILED"
    assert "rank 1 failed" in result["error"] and "injected failure on rank 1" in result["error"]
    assert not job_processes(tmp_path)
    assert MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"]).info.status == "FAILED"


@pytest.mark.parametrize("backend", ["ddp", pytest.param("horovod", marks=pytest.mark.slow)])
def test_rank_killed_by_a_signal_is_blamed_not_its_peer(make_cfg, tmp_path, monkeypatch, backend):
    """kill -9 of rank 1: rank 0's "connection reset by peer" follows it; the job names rank 1. And
    torchrun leaves no torchelastic_* folder in the temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the launcher's temp dir
    cfg = make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", "model._target_=tasks.faults.FailingLinear",
                   "+model.args.fail_rank=1", "+model.args.fail_at=4", "+model.args.signal=9", "trainer.max_steps=50")
    with pytest.raises(JobFailed) as info:
        run_job(cfg, tmp_path / "run", echo=False)
    error = info.value.result["error"]
    # rank 0 may or may not have noticed before the launcher ended it: its error follows, or none
    assert error.startswith("rank 1 failed") and "rank 1 was killed by SIGKILL (signal 9) and left no traceback" in error
    assert "rank 0 failed" not in error
    assert not list(temp.glob("torchelastic_*"))
    assert not job_processes(tmp_path)


@pytest.mark.slow  # 13 s of waiting for the timeout
def test_hung_rank_hits_the_timeout(make_cfg, tmp_path):
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2", "model._target_=tasks.faults.FailingLinear",
                   "+model.args.fail_rank=1", "+model.args.hang=true", "trainer.timeout_s=12")
    with pytest.raises(JobFailed, match="timed out after trainer.timeout_s=12s"):
        run_job(cfg, tmp_path, echo=False)
    assert not job_processes(tmp_path)


def test_dp_without_gpus_runs_on_one_device(make_cfg, tmp_path, capfd):
    result = run_job(make_cfg("backend=dp", "trainer.max_steps=4"), tmp_path)
    assert result["status"] == "FINISHED" and result["world_size"] == 1
    out = capfd.readouterr().out
    assert out.count("DataParallel runs on a single device") == 1


def _cli(args, run_dir, mlflow_uri):
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args, f"hydra.run.dir={run_dir}", f"tracking.uri={mlflow_uri}",
         "measure.warmup_steps=1", "measure.window_steps=2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_nodes_simulated_match_one_node(tmp_path, mlflow_uri):
    port = free_port()
    common = ["backend=ddp", *WORKLOAD]
    nodes = [_cli(common + ["parallelism.nnodes=2", "parallelism.nproc_per_node=1", f"parallelism.node_rank={r}",
                            f"parallelism.master_port={port}"], tmp_path / f"node{r}", mlflow_uri) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    one = _cli(common + ["parallelism.nproc_per_node=2"], tmp_path / "one", mlflow_uri)
    out = one.communicate(timeout=120)[0]
    assert one.returncode == 0, out
    two_nodes = torch.load(tmp_path / "node0" / "model.pt")
    one_node = torch.load(tmp_path / "one" / "model.pt")
    for k in one_node:
        assert torch.allclose(two_nodes[k], one_node[k], atol=1e-6), k
    node0 = json.loads((tmp_path / "node0" / "result.json").read_text())
    assert node0["world_size"] == 2 and {r["rank"] for r in node0["per_rank"]} == {0, 1}
    assert json.loads((tmp_path / "node1" / "result.json").read_text())["mlflow_run_id"] is None  # node 0 tracks
