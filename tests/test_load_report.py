"""The load report: the diagnosis on workloads with a known bottleneck, shares that add up,
profiler output, plots and MLflow artifacts."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.app import run_job
from orchestrator.diagnose import STRAGGLER_SPREAD, diagnose
from orchestrator.load_report import SHARE_TOLERANCE
from orchestrator.merge import load_rank_results

MEASURE = ["measure.warmup_steps=2", "measure.window_steps=2"]  # many short windows over the measured time


def report_of(run_dir):
    return json.loads((run_dir / "load_report.json").read_text())


def test_read_latency_is_input_bound(make_cfg, tmp_path):
    cfg = make_cfg("experiment=input_bound", "sim.read_latency_ms=3", "data.args.blur_passes=1",
                   "trainer.max_steps=14", *MEASURE)
    result = run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "input-bound" == result["bottleneck"]
    assert rep["status"] == "FINISHED" == result["status"]  # the report records how the run ended
    # 32 reads of 3 ms per batch dwarf a worker hand-off: workers first, with the evidence; reads
    # that wait cost no CPU, so the job model asks for more workers than the 2 cores
    first = rep["diagnosis"]["moves"][0]
    assert first["set"]["data.num_workers"] > 2 and "hand-off" in first["why"] and "mostly waits" in first["why"]
    md = (tmp_path / "load_report.md").read_text()
    assert "**input-bound**" in md and "data.num_workers=" in md
    client = MlflowClient(cfg.tracking.uri)
    names = {a.path for a in client.list_artifacts(result["mlflow_run_id"])}
    assert {"load_report.json", "load_report.md", "timeline.png", "breakdown.png"} <= names
    assert client.get_run(result["mlflow_run_id"]).data.tags["diagnosis"] == "input-bound"


def test_tiny_compute_many_parameters_on_two_ranks_is_communication_bound(make_cfg, tmp_path):
    cfg = make_cfg("experiment=comm_heavy", "backend=ddp", "parallelism.nproc_per_node=2", "trainer.max_steps=30",
                   *MEASURE)
    run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "communication-bound", rep["job"]
    # memory has room: a 4x batch first (measured in bench_trials' grid: b32 a1 8,651/s vs b8 a4 4,982/s),
    # then 4x accumulation at the same memory
    first, second = rep["diagnosis"]["moves"][:2]
    assert first["set"] == {"data.batch_size": 32} and second["set"] == {"trainer.accumulation_steps": 4}
    assert all("the global batch grows from 16 to 64" in m["why"] for m in (first, second))
    assert len(rep["per_rank"]) == 2
    imb = rep["imbalance"]
    own = {r.rank: r.step_time_s - r.phase_s["comm"] for r in load_rank_results(tmp_path)}  # own work per step
    assert imb["slowest_rank"] == max(own, key=own.__getitem__)
    assert (imb["straggler_rank"] is not None) == (imb["own_time_spread"] > STRAGGLER_SPREAD)


def test_transformer_is_compute_bound_and_profiled(make_cfg, tmp_path):
    cfg = make_cfg("experiment=transformer_lm", "data.batch_size=8", "trainer.max_steps=20", "measure.profile_steps=2",
                   *MEASURE)
    result = run_job(cfg, tmp_path, echo=False)
    rep = report_of(tmp_path)
    assert rep["diagnosis"]["verdict"] == "compute-bound", rep["job"]
    # warmup and profiled steps are not measured, nor the step that follows the profiler's teardown
    assert result["measured_steps"] == 20 - 2 - 2 - 1 and result["warmup"]["after"] == "profiler"
    ops = rep["profile"]["top_ops"]
    assert len(ops) == 15 and any(op["name"].startswith("aten::") and op["input_shapes"] not in ("", "[]") for op in ops)
    times = [op["self_cpu_ms"] for op in ops]
    assert times == sorted(times, reverse=True) and times[0] > 0  # the top by self time (CPU here)
    assert (tmp_path / "ranks" / "trace_rank0.json").stat().st_size > 1000
    names = {a.path for a in MlflowClient(cfg.tracking.uri).list_artifacts(result["mlflow_run_id"], "traces")}
    assert names == {"traces/trace_rank0.json"}
    # the shares add up to the measured step time, within the stated tolerance
    for ratio in rep["share_check"]["phase_sum_over_step_time"].values():
        assert ratio == pytest.approx(1.0, abs=SHARE_TOLERANCE)
    for r in rep["per_rank"]:  # each share is its phase's part of the step's wall time
        for phase, share in r["shares"].items():
            assert share == pytest.approx(r["phase_s"][phase] / r["step_time_s"], abs=SHARE_TOLERANCE), phase


def test_memory_bound_when_the_device_is_nearly_full(make_cfg):
    cfg = make_cfg("data.batch_size=64")
    job = {"data_wait_frac": 0.5, "h2d_frac": 0.0, "comm_frac": 0.0, "compute_frac": 0.5, "optimizer_frac": 0.0,
           "peak_mem_mb": 950.0, "world_size": 1, "per_rank": [{"device": "cuda:0"}]}
    d = diagnose(job, cfg, device_mem_mb=1000.0)
    assert d.verdict == "memory-bound"
    assert d.moves[0].set == {"data.batch_size": 32, "trainer.accumulation_steps": 2}  # the same global batch
    assert diagnose(job, cfg, device_mem_mb=4000.0, handoff=lambda b, n: {"seconds": 1e-3, "source": "test"}).verdict \
        == "input-bound"


@pytest.mark.parametrize("state_mb, fsdp_first", [(800.0, True), (100.0, False), (None, False)])
def test_memory_bound_ddp_is_advised_to_shard(make_cfg, state_mb, fsdp_first):
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2")
    job = {"comm_frac": 0.1, "compute_frac": 0.9, "peak_mem_mb": 950.0, "world_size": 2,
           "per_rank": [{"device": "cuda:0", "model_state_mb": state_mb}]}
    moves = [m.set for m in diagnose(job, cfg, device_mem_mb=1000.0).moves]
    assert moves.index({"backend.name": "fsdp"}) == (0 if fsdp_first else 1)
    fsdp = make_cfg("backend=fsdp", "parallelism.nproc_per_node=2")  # already sharded: not advised again
    assert {"backend.name": "fsdp"} not in [m.set for m in diagnose(job, fsdp, device_mem_mb=1000.0).moves]


def test_communication_bound_fsdp_is_advised_fewer_gathers_then_hsdp(make_cfg):
    job = {"comm_frac": 0.5, "compute_frac": 0.5, "peak_mem_mb": 100.0, "world_size": 4, "step_time_s": 0.1,
           "per_rank": [{"device": "cpu"}]}
    nodes = ["backend=fsdp", "parallelism.nnodes=2", "parallelism.nproc_per_node=2", "parallelism.master_port=29500"]
    d = diagnose(job, make_cfg(*nodes), device_mem_mb=1000.0)
    assert d.verdict == "communication-bound" and "all-gathers" in d.reason
    assert [m.set for m in d.moves] == [{"backend.reshard_after_forward": False}, {"parallelism.shard_size": 2},
                                        {"data.batch_size": 128}]
    kept = diagnose(job, make_cfg(*nodes, "backend.reshard_after_forward=false", "parallelism.shard_size=2"),
                    device_mem_mb=1000.0)
    assert [m.set for m in kept.moves] == [{"data.batch_size": 128}]  # HSDP already: no accumulation either


def _input_bound(step_ms: float, wait_share: float, item_bytes: int = 4000) -> dict:
    return {"data_wait_frac": wait_share, "h2d_frac": 0.0, "comm_frac": 0.0, "compute_frac": 1 - wait_share,
            "optimizer_frac": 0.0, "peak_mem_mb": 100.0, "world_size": 1, "step_time_s": step_ms / 1000,
            "item_bytes": item_bytes, "per_rank": [{"device": "cpu"}]}


def HANDOFF_1MS(batch_bytes: int, batch_size: int) -> dict:
    return {"seconds": 1e-3, "source": "test"}


@pytest.mark.parametrize("workers, step_ms, wait_share, expected", [
    # in-memory data, 0.25 ms steps (the default job): building a batch is cheaper than handing it
    # over from a worker, so workers would slow it down -> a larger batch first
    (0, 0.25, 0.5, {"data.batch_size": 128}),
    # 12 ms of reads per batch against a 1 ms hand-off: workers, enough to cover the wait
    (0, 16.0, 0.75, {"data.num_workers": 3, "data.persistent_workers": True}),
    # workers already, and the wait is about one hand-off: more workers cannot help
    (2, 2.0, 0.6, {"data.batch_size": 128}),
    # workers that do not keep up with slow reads: more of them (capped at tune.max_workers)
    (2, 20.0, 0.5, {"data.num_workers": 4, "data.persistent_workers": True}),
])
def test_input_advice_weighs_the_worker_handoff(make_cfg, workers, step_ms, wait_share, expected):
    extra = [f"data.num_workers={workers}"] if workers else []
    cfg = make_cfg(*extra, "tune.max_workers=4")
    d = diagnose(_input_bound(step_ms, wait_share), cfg, device_mem_mb=None, handoff=HANDOFF_1MS)
    assert d.verdict == "input-bound" and d.moves[0].set == expected, d.moves
    assert "ms" in d.moves[0].why  # the evidence: measured times, not a rule of thumb


def _rank(rank: int, step_ms: float, comm_ms: float) -> dict:
    phases = {"comm": comm_ms / 1000}
    return {"rank": rank, "steps": 10, "measured_steps": 8, "utilization": 0.5, "utilization_source": "cpu-time",
            "throughput": 100.0, "step_time_s": step_ms / 1000, "phase_s": phases, "data_wait_frac": 0.1,
            "h2d_frac": 0.0, "compute_frac": 0.6, "comm_frac": comm_ms / step_ms, "optimizer_frac": 0.1,
            "other_frac": 0.0, "peak_mem_mb": 100.0 + rank, "warmup_excluded": True}


def test_merge_names_a_straggler_only_past_the_threshold():
    from orchestrator.measure.results import RankResult
    from orchestrator.merge import merge as merge_typed, summary_rows

    def merge(ranks):
        return merge_typed([RankResult.from_dict(r) for r in ranks]).to_dict()

    # equal step times (they wait for each other); rank 1 waits less in the all-reduce: more own work
    close = merge([_rank(0, 10.0, 2.0), _rank(1, 10.0, 1.7)])  # own work 8.0 vs 8.3 ms: 3.6%
    assert close["imbalance"]["slowest_rank"] == 1 and close["imbalance"]["straggler_rank"] is None
    assert not any(k.startswith("imbalance") for k, _ in summary_rows(close))
    far = merge([_rank(0, 10.0, 4.0), _rank(1, 10.0, 0.5)])  # 6.0 vs 9.5 ms: 37%
    assert far["imbalance"]["straggler_rank"] == 1
    assert abs(far["imbalance"]["own_time_spread"] - 3.5 / 9.5) < 1e-9
    assert ("imbalance / straggler", "36.8% / rank 1") in summary_rows(far)
    assert far["throughput"] == 200.0 and far["peak_mem_mb"] == 101.0 and far["measured_steps"] == 8


def test_the_loader_override_says_its_prefetch_and_a_command_to_paste(tmp_path):
    """tuned/loader.yaml: torch's default queue depth said as the report says it (2, not null),
    and a "Use:" line that is a whole command: the run's own overrides, not those it replaces."""
    import shlex

    import yaml

    from orchestrator.load_report import write_loader_override

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
        ["experiment=input_bound", "trainer.loader_autotune=true", "data.num_workers=0", "hydra.run.dir=/x"]))
    path = write_loader_override({"initial": {"num_workers": 0, "prefetch_factor": None},
                                  "final": {"num_workers": 4, "prefetch_factor": None}, "events": []}, tmp_path)
    text = path.read_text()
    assert yaml.safe_load(text) == {"data": {"num_workers": 4, "prefetch_factor": 2}}
    use = next(line for line in text.splitlines() if line.startswith("# Use: "))[len("# Use: "):]
    args = shlex.split(use)
    assert args[1:] == ["-m", "orchestrator", "--config-dir", str(tmp_path), "experiment=input_bound", "+tuned=loader"]


def test_the_summary_says_what_utilization_and_the_phase_shares_count():
    """'utilization 26.9%' beside 'compute 94.3%' read as a contradiction: each row says what it counts."""
    from orchestrator.merge import summary_rows

    rows = dict(summary_rows({"utilization": 0.269, "utilization_source": "cpu-time", "compute_frac": 0.943,
                              "comm_frac": 0.0, "optimizer_frac": 0.01}))
    assert rows["utilization"] == "26.9% (cpu-time: the loop thread's CPU time in compute + optimizer over wall time)"
    assert rows["compute / comm / optimizer (of step time)"].startswith("94.3% / 0.0% / 1.0%")
