"""Users' own training code: batches of any structure, a collate function, a model
that returns its loss, a loss of one's own; the shipped example (experiment=variable_length_lm)
on every backend matches one process over the same global batches."""

from __future__ import annotations

import collections

import pytest
import torch
from mlflow.tracking import MlflowClient

from orchestrator.app import run_job
from orchestrator.merge import load_rank_results
from orchestrator.runtime.batch import Feed, loss_of, to_device
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.loop import EventLog, build_dataset, build_loader, train
from orchestrator.schema import ConfigError
from tasks.sequences import CausalLM, pad_collate

from .test_distributed import reference_params

# the example, shrunk: sequences of 4..12 tokens, a 1-layer LM of width 16
SEQ = ["experiment=variable_length_lm", "data.args.size=64", "data.args.min_len=4", "data.args.max_len=12",
       "data.args.vocab=32", "model.args.vocab=32", "model.args.d_model=16", "model.args.max_len=12",
       "data.batch_size=4", "trainer.max_steps=4", "trainer.lr=0.01"]


def trained(cfg):
    a = Adapter(cfg)
    a.setup()
    return train(cfg, a, EventLog(None))


def test_nested_batches_move_whole_and_keep_their_types():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": torch.zeros(2, 3), "nested": [Pair(torch.ones(2), 5), (torch.zeros(2, 1), "tag")],
             "ordered": collections.OrderedDict(m=torch.ones(2, 4))}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"].is_meta and moved["nested"][0].x.is_meta and moved["nested"][1][0].is_meta
    assert type(moved["nested"][0]) is Pair and moved["nested"][0].y == 5 and moved["nested"][1][1] == "tag"
    assert type(moved["ordered"]) is collections.OrderedDict and moved["ordered"]["m"].is_meta
    assert type(moved["nested"]) is list and type(moved["nested"][1]) is tuple


def test_batch_size_from_the_leading_dimension_or_batch_key(make_cfg):
    batch = {"meta": {"ids": torch.zeros(3)}, "input_ids": torch.zeros(5, 7)}
    assert Feed(make_cfg(*SEQ, "data.batch_key=null")).size(batch) == 3  # the first tensor, depth first
    assert Feed(make_cfg(*SEQ)).size(batch) == 5  # data.batch_key=input_ids
    with pytest.raises(ConfigError, match=r"^data.batch_key: 'ids' is not a key of the batch \(a dict with keys meta, "
                                          r"input_ids\)$"):
        Feed(make_cfg(*SEQ, "data.batch_key=ids")).size(batch)


def test_loss_taken_from_the_output_its_attribute_or_its_key():
    loss = torch.tensor(2.0)
    assert loss_of(loss) is loss and loss_of({"loss": loss, "logits": 0}) is loss
    assert loss_of(collections.namedtuple("Out", "loss logits")(loss, None)) is loss
    with pytest.raises(ConfigError, match=r"^model.loss=model: the model returned a dict \(keys logits\) with no loss"):
        loss_of({"logits": loss})


@pytest.mark.parametrize("overrides, message", [
    (["model.loss=cross_entropy"],  # a dict with labels: the model gets the other keys, returns a dict
     r"^model.loss=cross_entropy: the model returned a dict, not a tensor to take the loss of"),
    (["model.loss=mse", "data.collate_fn={_target_:tests.test_batches.unlabelled}"],
     r"^model.loss=mse: the batch is a dict with keys input_ids, attention_mask, no 'labels' to take the loss against"),
    (["model._target_=tests.test_batches.NoMask"],
     r"^data: the batch is a dict with keys input_ids, attention_mask, labels; the model is called as model\(\*\*batch\) "
     r"and NoMask.forward\(input_ids, labels\) takes no attention_mask$"),
])
def test_a_wrong_combination_is_one_line_from_the_first_batch(make_cfg, overrides, message):
    cfg = make_cfg(*SEQ, *overrides)
    with pytest.raises(ConfigError, match=message):
        trained(cfg)


def unlabelled(items, pad_id):
    batch = pad_collate(items, pad_id)
    del batch["labels"]
    return batch


class NoMask(CausalLM):
    def forward(self, input_ids, labels=None):  # noqa: D102 - takes no attention_mask
        return super().forward(input_ids, labels=labels)


@pytest.mark.parametrize("overrides, message", [
    (["model.loss=nope"], r"^model.loss: got 'nope'; allowed: cross_entropy, mse, model, or \{_target_: "),
    (["model.loss={_target_:tasks.sequences.smoothed_loss,args:{eps:0.1}}"],
     r"^model.loss.args.eps: not an argument of tasks.sequences.smoothed_loss; allowed: smoothing$"),
    (["model.loss={_target_:tests.test_batches.takes_nothing}"],
     r"^model.loss._target_: tests.test_batches.takes_nothing is called as takes_nothing\(output, batch, \*\*args\) "
     r"and takes 0 positional argument\(s\)$"),
    (["model.loss={_target_:tests.test_batches.weighted_loss}"],
     r"^model.loss.args.weight: required by tests.test_batches.weighted_loss and not given; set it, e.g. "
     r"\+model.loss.args.weight=\.\.\.$"),
    (["data.collate_fn={_target_:tasks.sequences.nope}"], r"^data.collate_fn._target_: cannot import"),
    (["data.collate_fn={_target_:tests.test_batches.needs_width}"],
     r"^data.collate_fn.args.width: required by tests.test_batches.needs_width and not given; set it, e.g. "
     r"\+data.collate_fn.args.width=\.\.\.$"),
    (["data.collate_fn={_target_:tests.test_batches.takes_nothing}"],
     r"^data.collate_fn._target_: tests.test_batches.takes_nothing is called as takes_nothing\(items, \*\*args\) and "
     r"takes 0 positional argument\(s\)$"),
    (["+data.collate_fn.nope=1"], r"^data.collate_fn: expected \{_target_: pkg.module.name, args: \{...\}\}, got "),
    (["model.loss=[1]"], r"^model.loss: got \[1\]; allowed: cross_entropy, mse, model, or "),
    (["data.batch_key=''"], r"^data.batch_key: must be a key of the batch"),
    (["+model.args.nope=1"],
     r"^model.args.nope: not an argument of tasks.sequences.CausalLM; allowed: vocab, d_model, n_heads, n_layers, "
     r"max_len$"),
])
def test_bad_targets_are_one_line_before_launch(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(*SEQ, *overrides)


def test_the_advice_for_a_missing_argument_holds(make_cfg):
    cfg = make_cfg(*SEQ, "model.loss={_target_:tests.test_batches.weighted_loss}", "+model.loss.args.weight=2",
                   "data.collate_fn={_target_:tests.test_batches.needs_width}", "+data.collate_fn.args.width=3")
    assert cfg.model.loss == {"_target_": "tests.test_batches.weighted_loss", "args": {"weight": 2}}
    assert cfg.data.collate_fn["args"] == {"pad_id": 0, "width": 3}


# the example's data.collate_fn.args (pad_id) stay: Hydra merges a mapping given on the command line
def needs_width(items, width, pad_id=0):
    return pad_collate(items, pad_id)


def weighted_loss(output, batch, weight):
    return output["loss"] * weight


def takes_nothing(*, pad_id=0):
    return None


def test_the_collate_function_makes_every_loader(make_cfg):
    """Padded dict batches, in the loader of every balance mode (the loader autotune's rebuilds
    keep the DataConfig, see test_loader_autotune_on_dict_batches)."""
    for balance in ("even", "speed"):  # speed: ShareSampler's batches of indices (built here for one rank)
        cfg = make_cfg(*SEQ, "backend=ddp", "parallelism.nproc_per_node=2", f"parallelism.balance={balance}")
        batch = next(iter(build_loader(cfg, build_dataset(cfg), Adapter(cfg))))
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape == mask.shape == labels.shape and ids.shape[0] == 4
        assert ((ids == 0) == (mask == 0)).all() and (labels[mask == 0] == -100).all()
        assert mask.sum(dim=1).max() == ids.shape[1]  # padded to the longest


def test_model_returned_loss_trains_and_accumulation_equals_one_large_batch(make_cfg):
    one = trained(make_cfg(*SEQ, "data.batch_size=8", "trainer.optimizer=sgd", "trainer.lr=0.5"))
    accum = trained(make_cfg(*SEQ, "data.batch_size=4", "trainer.accumulation_steps=2", "trainer.optimizer=sgd",
                             "trainer.lr=0.5"))
    assert one.steps == accum.steps == 4 and one.final_loss < one.first_loss
    for k, v in one.model.state_dict().items():
        assert torch.allclose(v, accum.model.state_dict()[k], atol=1e-5), k
    assert one.meter["flops_per_sample"] > 0  # the FLOP counter reads dict batches


def test_a_custom_loss_callable_gets_output_and_batch(make_cfg):
    base = trained(make_cfg(*SEQ, "trainer.max_steps=2"))
    custom = trained(make_cfg(*SEQ, "trainer.max_steps=2",
                              "model.loss={_target_:tests.test_batches.weighted_loss,args:{weight:3.0}}"))
    assert custom.first_loss == pytest.approx(3 * base.first_loss, rel=1e-5)  # fn(output, batch, weight=3)
    assert custom.param_digest != base.param_digest  # and its gradient is what trains


def test_loader_autotune_on_dict_batches(make_cfg, monkeypatch):
    """A switch to workers rebuilds the loader with the collate function; the run trains on."""
    from orchestrator.runtime.autotune import LoaderSettings, LoaderTuner

    monkeypatch.setattr(LoaderTuner, "_decide", lambda self, step, job: LoaderSettings(1) if step == 2 else None)
    plain = trained(make_cfg(*SEQ, "trainer.max_steps=6"))
    tuned = trained(make_cfg(*SEQ, "trainer.max_steps=6", "trainer.loader_autotune=true",
                             "trainer.loader_autotune_every=1"))
    assert tuned.meter["loader_autotune"]["final"]["num_workers"] == 1
    assert tuned.param_digest == plain.param_digest  # the same padded batches in the same order


# ddp with accumulation is the core check (~20 s); the others run with `make test-slow`
@pytest.mark.parametrize("backend, accum, balance", [
    ("ddp", 2, "even"),
    pytest.param("ddp", 1, "speed", marks=pytest.mark.slow),
    pytest.param("horovod", 2, "even", marks=pytest.mark.slow),
    pytest.param("fsdp", 2, "even", marks=pytest.mark.slow),
])
def test_the_example_on_every_backend_matches_one_process(make_cfg, tmp_path, backend, accum, balance):
    """Per-sequence mean losses: the ranks' average is the loss of one process over the same
    global batch, whatever each rank's padding (each pads to its own longest)."""
    workload = [*SEQ, "trainer.optimizer=sgd", "trainer.lr=0.5", "trainer.max_steps=3"]
    world = 2
    cfg = make_cfg(f"backend={backend}", f"parallelism.nproc_per_node={world}", *workload,
                   f"trainer.accumulation_steps={accum}", f"parallelism.balance={balance}")
    result = run_job(cfg, tmp_path, echo=False)
    assert result["status"] == "FINISHED" and result["steps"] == 3
    assert len({r["param_digest"] for r in result["per_rank"]}) == 1
    # real tokens/s summed over the ranks, the padding share of their totals: the report and MLflow
    ranks = load_rank_results(tmp_path)
    assert result["tokens_per_s"] == pytest.approx(sum(r.tokens_per_s for r in ranks))
    assert 0 < result["padding_frac"] < 1
    assert f"**Padding**: {100 * result['padding_frac']:.1f}% of the token positions computed were padding" in (
        tmp_path / "load_report.md").read_text()
    metrics = MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"]).data.metrics
    assert metrics["tokens_per_s"] == pytest.approx(result["tokens_per_s"])
    got = torch.load(tmp_path / "model.pt")
    want = reference_params(make_cfg, accum, *workload, world=world, b=4)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5), (k, (got[k] - want[k]).abs().max())


@pytest.mark.slow  # ~20 s: two trials launched; the trials' ranks run the loop the tests above check
def test_a_study_on_the_example(make_cfg, tmp_path):
    """Trials rebuild the loaders with the collate function, with and without workers."""
    import optuna

    from orchestrator.tune.study import run_study

    from .test_tune import SHORT, study_of

    cfg = make_cfg(*SEQ, *SHORT, "tune.n_trials=2", "tune.sampler=grid", "tune.baseline=false",
                   f"tune.storage=sqlite:///{tmp_path}/o.db", "tune.space.batch_size.type=categorical",
                   "tune.space.batch_size.choices=[8]", "tune.space.num_workers.high=1",
                   "~tune.space.accumulation_steps", "~tune.space.prefetch_factor", "~tune.space.pin_memory")
    summary = run_study(cfg, tmp_path, echo=False)
    done = [t for t in study_of(summary).trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2 and all(t.user_attrs["throughput"] > 0 for t in done)
    assert {t.user_attrs["values"]["data.num_workers"] for t in done} == {0, 1}
    assert summary["best"]["values"]["data.num_workers"] in (0, 1)


def test_tokens_per_second_exclude_the_padding(make_cfg):
    """Sequences of exactly 6 tokens padded to 8 (pad_collate's multiple_of): 25% padding, and
    real tokens/s is 6 x samples/s (the job's figures, report and MLflow: the ddp test below)."""
    res = trained(make_cfg(*SEQ, "data.args.min_len=6", "data.args.max_len=6", "+data.collate_fn.args.multiple_of=8",
                           "model.args.max_len=8"))
    assert res.meter["padding_frac"] == pytest.approx(0.25)
    assert res.meter["tokens_per_s"] == pytest.approx(6 * res.meter["throughput"])
    assert sum(w.padded_tokens for w in res.windows) == 8 * sum(w.tokens for w in res.windows) / 6
    plain = trained(make_cfg("trainer.max_steps=4"))  # (input, target) batches: no tokens to count
    assert plain.meter["tokens_per_s"] is None and plain.meter["padding_frac"] is None
