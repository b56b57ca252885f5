"""Validation in every run and training to a target loss (orchestrator/runtime/evaluate.py): the
loss over the validation set is that of one process over the same items and weights on every
backend, the held-out items are fixed and disjoint from the training items, trainer.target_loss
stops the run and records what it took, the evaluations' time stays out of the measured windows,
a study's trials evaluate nothing, and bad values are one line before launch."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from torch.utils.data import TensorDataset

from orchestrator.app import run_job
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.evaluate import held_out
from orchestrator.runtime.loop import build_dataset, build_model, train
from orchestrator.runtime.meter import StepMeter
from orchestrator.measure.phases import COMPUTE, DATA
from orchestrator.schema import ConfigError
from tasks.metrics import accuracy
from tasks.sequences import pad_collate


try:
    import horovod.torch  # noqa: F401

    HOROVOD = True
except ImportError:
    HOROVOD = False

# 1030 items, 103 held out: 52 + 51 over two ranks, batches of 16 with a short last one
CLASSIFY = ["data.args.size=1030", "data.args.features=32", "model.args.in_features=32", "data.batch_size=16",
            "trainer.max_steps=6", "data.val_fraction=0.1", "trainer.eval_every=3",
            "trainer.val_metric={_target_:tasks.metrics.accuracy}"]


def direct_classification(cfg, weights: dict) -> tuple:
    """(loss, accuracy) of one process over the whole held-out set at once."""
    _, val = held_out(build_dataset(cfg), cfg.data.val_fraction)
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.stack([val[i][1] for i in range(len(val))])
    model = build_model(cfg)
    model.load_state_dict(weights)
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), accuracy(out, (x, y)).item()


@pytest.mark.parametrize("backend", [pytest.param("dp", marks=pytest.mark.slow), "ddp", "fsdp", pytest.param("horovod", marks=[pytest.mark.slow, pytest.mark.skipif(
    not HOROVOD, reason="horovod is not installed")])])  # horovod: in test-slow (horovodrun's start)
def test_val_loss_over_ranks_is_one_process_over_the_set(make_cfg, tmp_path, backend):
    cfg = make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", *CLASSIFY)
    result = run_job(cfg, tmp_path, echo=False)
    assert result["status"] == "FINISHED" and result["steps"] == 6
    assert [e["step"] for e in result["evals"]] == [3, 6]  # every eval_every steps, and the end's
    loss, acc = direct_classification(cfg, torch.load(tmp_path / "model.pt"))
    assert result["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert result["val_metrics"]["accuracy"] == pytest.approx(acc, abs=1e-6)
    world = result["world_size"]  # dp: one process
    assert result["evals"][0]["samples"] == 3 * 16 * world  # global samples before the evaluation
    assert result["steps_per_epoch"] == (927 // world) // 16  # the training set is the rest of the items


def test_dict_batches_with_a_collate_and_a_val_dataset(make_cfg, tmp_path):
    """ddp, the shipped variable-length example (dict batches, a padding collate, the model's own
    loss: a mean over sequences) with a validation dataset of its own, 37 items over 2 ranks."""
    val_args = {"size": 37, "min_len": 8, "max_len": 64, "vocab": 128, "seed": 7}
    cfg = make_cfg("experiment=variable_length_lm", "backend=ddp", "parallelism.nproc_per_node=2",
                   "trainer.max_steps=4", "model.args.d_model=16",
                   "data.val={_target_:tasks.sequences.VariableLengthTokens,args:{size:37,min_len:8,max_len:64,"
                   "vocab:128,seed:7}}", "trainer.val_metric={_target_:tasks.metrics.accuracy,args:{shift:true}}")
    result = run_job(cfg, tmp_path, echo=False)
    assert result["status"] == "FINISHED" and [e["step"] for e in result["evals"]] == [4]
    from tasks.sequences import VariableLengthTokens

    ds = VariableLengthTokens(**val_args)
    batch = pad_collate([ds[i] for i in range(len(ds))])
    model = build_model(cfg)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert result["val_loss"] == pytest.approx(out["loss"].item(), rel=1e-5)
    assert result["val_metrics"]["accuracy"] == pytest.approx(accuracy(out, batch, shift=True).item(), abs=1e-5)


def test_held_out_items_are_fixed_and_disjoint(make_cfg):
    data = TensorDataset(torch.arange(500))
    torch.manual_seed(123)  # the split's generator is its own: the global seed changes nothing
    train_a, val_a = held_out(data, 0.2)
    torch.manual_seed(321)
    train_b, val_b = held_out(data, 0.2)
    assert val_a.indices == val_b.indices and len(val_a) == 100 and len(train_a) == 400
    assert set(train_a.indices).isdisjoint(val_a.indices) and set(train_a.indices) | set(val_a.indices) == set(range(500))
    assert val_a.indices != list(range(100))  # drawn, not the first items
    # two configs of a study with different seeds hold out the same items
    sets = [held_out(build_dataset(make_cfg(f"trainer.seed={s}", "data.args.size=300")), 0.1)[1] for s in (0, 1)]
    assert sets[0].indices == sets[1].indices
    # the training run reads only the training items: a study's trial (mode=tune) too, which evaluates nothing
    cfg = make_cfg("mode=tune", "data.args.size=320", "data.val_fraction=0.25", "trainer.eval_every=2",
                   "trainer.max_steps=4")
    res = train(cfg, Adapter(cfg))
    assert res.steps_per_epoch == 240 // 32 and "evals" not in res.meter and "val_loss" not in res.meter


def test_target_loss_on_validation_stops_the_run(make_cfg, tmp_path):
    common = ["experiment=linear_regression", "data.val_fraction=0.2", "trainer.eval_every=2", "trainer.max_steps=40",
              "trainer.lr=0.05"]
    full = run_job(make_cfg(*common), tmp_path / "full", echo=False)
    losses = [(e["step"], e["val_loss"]) for e in full["evals"]]
    assert losses[0][1] > losses[-1][1]  # it learns
    target = losses[len(losses) // 2][1]
    first = next(step for step, loss in losses if loss <= target)
    result = run_job(make_cfg(*common, f"trainer.target_loss={target}"), tmp_path / "to_target", echo=False)
    assert result["target_reached"] is True and result["stopped_by"] == "target_loss"
    assert result["steps"] == first < 40 and result["evals"][-1]["step"] == first  # no second evaluation at the end
    assert result["time_to_target_s"] == result["evals"][-1]["wall_s"] > 0
    assert result["samples_to_target"] == first * 32
    assert result["time_to_target_s"] <= result["time_s"]["train"]
    run = MlflowClient(make_cfg().tracking.uri).get_run(result["mlflow_run_id"])
    history = MlflowClient(make_cfg().tracking.uri).get_metric_history(result["mlflow_run_id"], "val/loss")
    assert [m.step for m in history] == [e["step"] for e in result["evals"]]
    assert run.data.metrics["time_to_target_s"] == pytest.approx(result["time_to_target_s"])
    # out of reach: the run trains to its end and says so
    never = run_job(make_cfg(*common, "trainer.target_loss=-1", "trainer.max_steps=6"), tmp_path / "never", echo=False)
    assert never["target_reached"] is False and never["steps"] == 6 and "time_to_target_s" not in never


@pytest.mark.parametrize("backend", ["single", "ddp"])
def test_target_loss_on_the_training_loss(make_cfg, tmp_path, backend):
    """Without validation the target is on the training loss averaged over each log interval (and
    the ranks, which stop at the same step)."""
    result = run_job(make_cfg(f"backend={backend}", "parallelism.nproc_per_node=2", "trainer.log_every=4",
                              "trainer.max_steps=20", "trainer.target_loss=1e9"), tmp_path, echo=False)
    world = result["world_size"]
    assert result["target_reached"] is True and result["steps"] == 4 and result["stopped_by"] == "target_loss"
    assert result["samples_to_target"] == 4 * 32 * world and result["time_to_target_s"] > 0
    assert "evals" not in result and all(r["steps"] == 4 for r in result["per_rank"])


def test_evaluation_time_is_out_of_the_windows(make_cfg, tmp_path):
    """A slow evaluation (a metric of 20 ms a batch, 13 batches an evaluation, 4 of them) lies
    between measured steps: the windows' time and the evaluations' add up to no more than the
    loop's wall time (counted in the windows too, it would be counted twice)."""
    result = run_job(make_cfg("data.args.size=2000", "data.val_fraction=0.2", "trainer.eval_every=5",
                              "trainer.max_steps=20", "measure.window_steps=4",
                              "trainer.val_metric={_target_:tests.custom_task.slow_accuracy}"), tmp_path, echo=False)
    assert [e["step"] for e in result["evals"]] == [5, 10, 15, 20]
    assert result["eval_s"] >= 4 * 13 * 0.02
    from orchestrator.merge import load_rank_results

    windows = load_rank_results(tmp_path)[0].windows_detail
    assert sum(w.steps for w in windows) == 20  # every step is in a window
    assert sum(w.wall_s for w in windows) + result["eval_s"] <= result["time_s"]["train"]
    assert 0 < result["eval_frac"] < 1


def test_meter_pause_keeps_its_time_and_marks_out():
    meter = StepMeter(torch.device("cpu"), window_steps=2, warmup_steps=0)
    meter.start()
    meter.mark(COMPUTE)
    assert meter.end_step(8).warmup  # the first step: the warmup
    meter.mark(DATA)
    meter.mark(COMPUTE)
    assert meter.end_step(8) is None
    meter.pause()
    time.sleep(0.2)
    meter.mark(COMPUTE)  # what FSDP's collectives in an evaluation's forward mark: dropped
    meter.resume()
    meter.mark(DATA)
    meter.mark(COMPUTE)
    win = meter.end_step(8)
    meter.close()
    assert win.steps == 2 and not win.warmup
    assert sum(win.phases_s.values()) < 0.2 and win.wall_s < 0.2
    assert win.wall_s == pytest.approx(sum(win.phases_s.values()), abs=1e-3)


@pytest.mark.parametrize("override, field", [
    ("data.val_fraction=1.0", "data.val_fraction:"),
    ("data.val_fraction=-0.1", "data.val_fraction:"),
    ("data.val={_target_:tasks.datasets.random_regression}", "data.val / data.val_fraction:"),  # with val_fraction
    ("trainer.eval_every=-1", "trainer.eval_every:"),
    ("trainer.target_loss=nan", "trainer.target_loss:"),
    ("trainer.val_metric={_target_:tasks.metrics.nope}", "trainer.val_metric._target_:"),
    ("trainer.val_metric={_target_:tasks.metrics.accuracy,args:{bogus:1}}", "trainer.val_metric.args.bogus:"),
    ("trainer.val_metric=3", "trainer.val_metric:"),
])
def test_bad_validation_values_are_one_line(make_cfg, override, field):
    with pytest.raises(ConfigError) as err:
        make_cfg("data.val_fraction=0.1", override)
    msg = str(err.value)
    assert field in msg and "\n" not in msg, msg


@pytest.mark.parametrize("overrides, field", [
    (["trainer.eval_every=5"], "trainer.eval_every: needs a validation set"),
    (["trainer.val_metric={_target_:tasks.metrics.accuracy}"], "trainer.val_metric: needs a validation set"),
    (["data.val={_target_:nope.data.make}"], "data.val._target_: cannot import"),
    (["data.val={_target_:tasks.datasets.random_regression,args:{bogus:1}}"], "data.val.args.bogus:"),
    (["data.val=5"], "data.val: expected"),
])
def test_validation_knobs_need_their_set(make_cfg, overrides, field):
    with pytest.raises(ConfigError) as err:
        make_cfg(*overrides)
    assert field in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_run_stopped_at_its_target_is_not_told_to_raise_its_steps():
    from orchestrator.merge import measurement_warning

    result = {"steps": 50, "measured_steps": 45, "estimate": {"windows": 2}, "steps_per_epoch": 32, "epochs": 2,
              "warmup": {"steps": 5}}
    assert "raise trainer.max_steps" in measurement_warning(result)
    said = measurement_warning({**result, "stopped_by": "target_loss"})
    assert "reached trainer.target_loss after 50 steps" in said and "raise" not in said


def test_with_loader_workers_the_meter_warms_up_again_after_an_evaluation(make_cfg, tmp_path):
    """The training loader's workers refill their queue during an evaluation: the steps after it
    read batches made ahead, so the meter warms up again (as after the profiler)."""
    result = run_job(make_cfg("data.args.size=1200", "data.val_fraction=0.1", "trainer.eval_every=8",
                              "trainer.max_steps=16", "data.num_workers=1"), tmp_path, echo=False)
    assert [e["step"] for e in result["evals"]] == [8, 16] and math.isfinite(result["val_loss"])
    assert [w["why"] for w in result["warmup"]["rewarmed"]] == ["eval"]


def test_a_sweeps_table_shows_validation_where_a_job_evaluated(tmp_path, capsys):
    import json

    from omegaconf import OmegaConf

    from orchestrator.sweep import SweepSummary

    for job, extra in (("0", {"val_loss": 0.25, "time_to_target_s": 3.5}), ("1", {})):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- trainer.lr=0.{job}1\n")
        (tmp_path / job / "result.json").write_text(json.dumps({"status": "FINISHED", "world_size": 1, **extra}))
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    out = capsys.readouterr().out
    assert "val loss" in out and "to target s" in out and "0.25" in out and "3.5" in out
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert rows[0]["val_loss"] == 0.25 and rows[1]["val_loss"] is None


def test_a_fraction_that_holds_out_nothing_is_one_line(make_cfg, tmp_path):
    """The dataset's size is known where it is built: the rank names it, in one line."""
    from orchestrator.app import JobFailed

    with pytest.raises(JobFailed) as err:
        run_job(make_cfg("data.val_fraction=0.0001", "data.args.size=512"), tmp_path, echo=False)
    assert str(err.value) == ("rank 0 failed: data.val_fraction: 0.0001 of the dataset's 512 items holds out 0; "
                              "allowed: a fraction that holds out at least 1 item and keeps at least 1")


@pytest.mark.parametrize("backend", ["single", pytest.param("fsdp", marks=pytest.mark.slow)])  # fsdp: 29 s
def test_evaluations_leave_training_as_it_was(make_cfg, tmp_path, backend):
    """A run trains to the same weights with or without evaluations: they draw nothing from the
    RNG training reads (dropout here), and under FSDP leave its sharded state as they found it."""
    common = [f"backend={backend}", "parallelism.nproc_per_node=2", "experiment=transformer_lm", "model.args.d_model=32",
              "model.args.n_heads=2", "model.args.n_layers=1", "model.args.seq_len=16", "+model.args.dropout=0.2",
              "data.args.seq_len=16", "data.args.size=256", "trainer.max_steps=6"]
    plain = run_job(make_cfg(*common), tmp_path / "plain", echo=False)
    evaluated = run_job(make_cfg(*common, "trainer.eval_every=2", "data.val={_target_:tasks.datasets.SyntheticTokens,"
                                 "args:{size:40,seq_len:16,seed:3}}"), tmp_path / "evaluated", echo=False)
    assert [e["step"] for e in evaluated["evals"]] == [2, 4, 6]
    assert evaluated["per_rank"][0]["param_digest"] == plain["per_rank"][0]["param_digest"]


def test_with_loader_workers_the_evaluations_share_one_set_of_workers_that_ends_with_the_run(make_cfg, monkeypatch):
    """Workers started anew at each evaluation cost more than the evaluation on a small model: the
    run's evaluations read one loader whose workers persist between them, and end with the run."""
    import psutil

    from orchestrator.runtime import evaluate as evaluate_mod

    built, pids = [], set()
    real = evaluate_mod.DataLoader

    class Watched(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            built.append(kwargs["num_workers"])
            super().__init__(*args, **kwargs)

        def __iter__(self):
            it = super().__iter__()
            pids.update(w.pid for w in getattr(it, "_workers", []))
            return it

    monkeypatch.setattr(evaluate_mod, "DataLoader", Watched)
    cfg = make_cfg("data.args.size=1200", "data.val_fraction=0.1", "trainer.eval_every=4", "trainer.max_steps=12",
                   "data.num_workers=2", "tracking.enabled=false")
    adapter = Adapter(cfg)
    adapter.setup()
    res = train(cfg, adapter)
    assert [e["step"] for e in res.meter["evals"]] == [4, 8, 12]
    assert built == [2] and len(pids) == 2  # one loader, two workers, for three evaluations
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
