"""Composition and validation: every shipped preset composes; every bad input is one clear line."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import pytest
from hydra.core.global_hydra import GlobalHydra

from orchestrator.compose import compose_config
from orchestrator.errors import format_error
from orchestrator.schema import BackendName, Config, ConfigError, Loss, flatten, load_config, to_config, to_yaml

from .conftest import CONF, compose_dict


def config_error(overrides):
    """The one-line message the CLI would print for `overrides` (compose or validation)."""
    try:
        to_config(compose_dict(overrides))
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:  # Hydra compose errors, formatted as the CLI formats them
        return format_error(exc, Config)
    raise AssertionError(f"{overrides} was accepted")


def test_compose_config_is_the_cli_config_and_leaves_hydra_clear():
    """The helper the tests and the benchmarks share: overrides applied, validated, and Hydra's
    global state left clear for the next composition (or the CLI's)."""
    cfg = compose_config(["data.batch_size=7", "experiment=input_bound"])
    assert cfg.data.batch_size == 7 and cfg.sim.read_latency_ms > 0  # the experiment's own setting
    assert not GlobalHydra.instance().is_initialized()
    with pytest.raises(ConfigError, match="data.batch_size"):
        compose_config(["data.batch_size=0"])


def test_default_is_the_linear_classifier_of_article_000():
    cfg = to_config(compose_dict([]))
    assert cfg.model._target_ == "tasks.models.Linear"
    assert cfg.model.args == {"in_features": 1000, "out_features": 10}
    assert cfg.model.loss is Loss.cross_entropy
    assert cfg.data.batch_size == 32
    assert cfg.backend.name is BackendName.single
    assert cfg.tracking.uri == "sqlite:///outputs/mlflow.db"
    assert cfg.data.args["seed"] == cfg.trainer.seed  # interpolation resolved


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes(name):
    cfg = to_config(compose_dict([f"experiment={name}"]))
    assert cfg.model._target_.startswith("tasks.")


@pytest.mark.parametrize("backend", ["single", "dp", "ddp", "fsdp", "horovod"])
def test_backends_compose(backend):
    cfg = to_config(compose_dict([f"backend={backend}"]))
    assert cfg.backend.name.value == backend


def test_names_later_issues_rely_on():
    cfg = to_config(compose_dict([
        "data.batch_size=8", "data.num_workers=2", "data.pin_memory=true", "data.prefetch_factor=4",
        "data.persistent_workers=true", "trainer.accumulation_steps=3", "trainer.max_steps=7", "trainer.epochs=2",
        "trainer.lr=0.5", "trainer.amp=true", "trainer.seed=3", "parallelism.nproc_per_node=2",
        "parallelism.nnodes=1", "backend=ddp", "tracking.experiment=x",
    ]))
    assert (cfg.data.batch_size, cfg.data.num_workers, cfg.data.prefetch_factor) == (8, 2, 4)
    assert (cfg.trainer.accumulation_steps, cfg.trainer.max_steps, cfg.trainer.epochs) == (3, 7, 2)
    assert cfg.data.args["seed"] == 3
    assert cfg.parallelism.world_size == 2


@pytest.mark.parametrize("overrides, expected", [
    (["data.foo=1"], "data.foo: unknown key in data; allowed: _target_, args, batch_size"),
    (["+foo=1"], "foo: unknown key in config; allowed: mode, model, data"),
    (["data.batch_size=abc"], "data.batch_size: 'abc' is not a valid Integer"),
    (["data.batch_size=0"], "data.batch_size: must be an integer >= 1, got 0"),
    (["data.num_workers=-1"], "data.num_workers: must be an integer >= 0, got -1"),
    (["trainer.accumulation_steps=0"], "trainer.accumulation_steps: must be an integer >= 1, got 0"),
    (["backend=foo"], "backend: unknown choice 'foo'; allowed: ddp, dp, fsdp, horovod, single"),
    (["model=bar"], "model: unknown choice 'bar'; allowed: convnet, custom, linear"),
    (["backend.device=tpu"], "backend.device: invalid value 'tpu'; allowed: auto, cpu, cuda"),
    (["mode=walk"], "mode: invalid value 'walk'; allowed: run, tune"),
    (["trainer.checkpoint_signal=TERM"], "trainer.checkpoint_signal: invalid value 'TERM'; allowed: USR1, USR2, none"),
    (["tracking.uri=file:///tmp/mlruns"], "tracking.uri: unsupported 'file:///tmp/mlruns'; allowed schemes: sqlite"),
    (["tracking.uri=./mlruns"], "tracking.uri: unsupported './mlruns'"),
    (["model._target_=nope.Model"], "model._target_: cannot import 'nope.Model'"),
    (["+model.args.bogus=3"], "model.args.bogus: not an argument of tasks.models.Linear; allowed: in_features, out_features"),
    (["+data.args.bogus=3"], "data.args.bogus: not an argument of tasks.datasets.random_classification"),
    (["data.prefetch_factor=2"], "data.prefetch_factor: only applies with data.num_workers > 0"),
    (["parallelism.nnodes=2", "parallelism.master_port=29500"], "parallelism.nnodes: backend=single runs one process"),
    (["backend=ddp", "parallelism.nnodes=2"], "parallelism.master_port: set a fixed port when nnodes > 1"),
    (["backend=ddp", "parallelism.nnodes=2", "parallelism.node_rank=2", "parallelism.master_port=29500"],
     "parallelism.node_rank: must be in 0..1"),
    (["backend=horovod", "parallelism.hosts='a:2,b'"], "parallelism.hosts: expected 'host:slots,host:slots'"),
    (["backend=horovod", "parallelism.hosts=a:2,b:2"],
     "parallelism.hosts: a value with commas must be quoted, e.g. \"parallelism.hosts='a:2,b:2'\""),
    (["model=custom"], "model._target_: required, and no value was given; set it, e.g. model._target_=mypkg.nets.Net"),
    (["model._target_=tests.custom_task.Net", "+model.args.width=8"],
     "model.args.in_features: not an argument of tests.custom_task.Net; allowed: width"),
    (["model._target_=mypkg.nets.Net"], "model._target_: cannot import 'mypkg.nets.Net' (No module named 'mypkg'); "
                                        "make its package importable"),
    (["backend=ddp", "parallelism.hosts='a:2'"], "parallelism.hosts / parallelism.hostfile: apply to backend=horovod"),
    (["trainer.lr=0"], "trainer.lr: must be > 0"),
    (["tune.objective=speed"], "tune.objective: invalid value 'speed'; allowed: utilization, throughput, mfu, tokens, goodput, both"),
    (["tune.lr_scaling=cubic"], "tune.lr_scaling: invalid value 'cubic'; allowed: auto, linear, sqrt, adascale, none"),
    (["tune.space.batch_size.type=nah"], "tune.space.batch_size.type: Invalid value 'nah'"),
    (["+tune.space.x={kee: data.batch_size}"], "tune.space.x.kee: Key 'kee' not in 'ParamSpec'"),
    (["tune.throughput_floor=0"], "tune.throughput_floor: must be in (0, 1]"),
    (["tune.run_noise=1.5"], "tune.run_noise: must be in [0, 1)"),
    (["trainer.memory_cap_mb=-1"], "trainer.memory_cap_mb: must be >= 0"),
    (["measure.rel_precision=1.5"], "measure.rel_precision: must be in [0, 1)"),
    (["tune.confirm_top=-1"], "tune.confirm_top: must be >= 0"),
    (["measure.min_measure_s=3", "measure.max_measure_s=1"], "measure.max_measure_s: must be 0 (no cap) or >= measure.min_measure_s"),
    (["measure.window_s=-1"], "measure.window_s: must be >= 0 seconds"),
    (["backend=ddp", "backend.fp16_compression=true"], "backend.fp16_compression: applies to backend=horovod only"),
    (["parallelism.shard_size=-1"], "parallelism.shard_size: must be >= 0 (0 = all ranks), got -1"),
    (["backend=fsdp", "backend.shard_min_params=0"], "backend.shard_min_params: must be >= 1, got 0"),
    (["backend=fsdp", "backend.shard_modules=[nn.Linear]"], "backend.shard_modules: 'nn.Linear' is not a class name"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip: must be >= 0 (0 = off), got -1"),
    (["backend=ddp", "parallelism.balance=fast"], "parallelism.balance: invalid value 'fast'; allowed: even, speed"),
    (["parallelism.balance=speed"], "parallelism.balance: speed splits the batch between ranks, and backend=single"),
    (["trainer.amp=maybe"], "trainer.amp: invalid value 'maybe'; allowed: true, false"),
    (["data.batch_size=[1,2"], "data.batch_size: malformed override 'data.batch_size=[1,2'; expected data.batch_size=<an integer>"),
    (["data.batch_size=abc"], "data.batch_size: 'abc' is not a valid Integer; allowed: an integer"),
    (["data.prefetch_factor=x"], "data.prefetch_factor: 'x' is not a valid Integer; allowed: an integer, or null"),
    (["backend=fsdp", "backend.shard_modules=3"], "backend.shard_modules: invalid value '3'; allowed: a list like [a,b]"),
    (["model=custom", "model._target_=tests.custom_task.Net"],
     "model.args.width: required by tests.custom_task.Net and not given; set it, e.g. +model.args.width=..."),
    (["data=custom", "data._target_=tests.custom_task.make_dataset"],
     "data.args.items: required by tests.custom_task.make_dataset and not given"),
])
def test_bad_input_is_one_clear_line(overrides, expected):
    msg = config_error(overrides)
    assert "\n" not in msg
    assert msg.startswith(expected), msg


def test_resolved_yaml_round_trips(tmp_path):
    cfg = to_config(compose_dict(["experiment=mlp_accumulation", "backend=ddp", "parallelism.nproc_per_node=2"]))
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert "${" not in path.read_text()  # resolved: ranks never interpolate
    assert load_config(str(path)) == cfg


def test_flatten_gives_scalar_params():
    flat = flatten(to_config(compose_dict([])))
    assert flat["data.batch_size"] == 32
    assert flat["backend.name"] == "single"
    assert flat["model.args.in_features"] == 1000
    assert all(not isinstance(v, dict) for v in flat.values())


def test_non_finite_floats_are_refused():
    for override, field in [("trainer.lr=inf", "trainer.lr"), ("trainer.timeout_s=inf", "trainer.timeout_s"),
                            ("sim.read_latency_ms=inf", "sim.read_latency_ms"),
                            ("tune.space.batch_size.high=inf", "tune.space.batch_size.high")]:
        with pytest.raises(ConfigError) as info:
            to_config(compose_dict([override]))
        assert str(info.value).startswith(f"{field}: must be a finite number, got inf"), (override, str(info.value))
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^trainer.lr: must be > 0, got nan$"):  # nan fails every range check
        to_config(compose_dict(["trainer.lr=nan"]))


def test_written_config_is_what_omegaconf_writes():
    """config.yaml and the MLflow params come from `plain`, a fast stand-in for OmegaConf's own
    conversion of the typed config: the same keys, values and enums, passwords masked."""
    from omegaconf import OmegaConf

    from orchestrator.schema import shown

    cfg = to_config(compose_dict([
        "experiment=transformer_lm", "backend=ddp", "tune.storage=postgresql+psycopg://u:pw@h/db",
        "+tune.space.fp16={key: backend.fp16_compression, type: categorical, choices: [false, true]}",
        "+tags.team=vision", "+tags.ratio='1e-3'"]))
    ours = OmegaConf.create(to_yaml(cfg))
    assert ours == OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(shown(cfg))))
    assert "pw@" not in to_yaml(cfg) and ours.tune.storage == "postgresql+psycopg://u:***@h/db"
    assert flatten(cfg)["backend.name"] == "ddp" and flatten(cfg)["tune.space.fp16.choices"] == "[False, True]"


def test_applied_values_are_checked_on_either_path():
    """space.apply replaces typed fields directly when it can, else converts and checks through
    to_config: the same config, and the same one-line refusals, either way."""
    from orchestrator.tune import space

    cfg = to_config(compose_dict(["backend=ddp", "parallelism.nproc_per_node=2"]))
    values = {"data.batch_size": 64, "data.num_workers": 2, "trainer.accumulation_steps": 2,
              "data.prefetch_factor": None, "measure.window_s": 1}  # an int for a float field
    assert space._replaced(cfg, values) is not None  # typed: replaced
    assert space._replaced(cfg, {**values, "measure.window_s": "1"}) is None  # a string: converted and checked
    assert space.apply(cfg, values) == space.apply(cfg, {**values, "measure.window_s": "1"})
    for bad, line in [({"data.batch_size": 0}, "data.batch_size: must be an integer >= 1"),
                      ({"data.batch_size": "x"}, "data.batch_size: 'x' is not a valid Integer"),
                      ({"data.bogus": 1}, "data.bogus: unknown key in data"),
                      ({"tune.throughput_floor": 2}, "tune.throughput_floor: must be in (0, 1]")]:
        with pytest.raises(ConfigError, match=r"^" + line.replace("(", r"\(").replace("[", r"\[")):
            space.apply(cfg, bad)


@pytest.mark.parametrize("override", [
    "data.collate_fn={_target_:torch.utils.data.default_collate}",  # the form docs/running.md gives
    "+data.collate_fn={_target_:torch.utils.data.default_collate}",
    "++data.collate_fn={_target_:torch.utils.data.default_collate}",
    "+data.collate_fn._target_=torch.utils.data.default_collate",
])
def test_a_collate_function_is_given_on_the_command_line_over_null(override):
    """data=custom has collate_fn: null; a mapping given on the command line replaces it."""
    cfg = to_config(compose_dict(["data=custom", "data._target_=tests.custom_task.make_dataset", "+data.args.items=64",
                                  override]))
    assert cfg.data.collate_fn == {"_target_": "torch.utils.data.default_collate"}


@pytest.mark.parametrize("override", ["model.loss={_target_:torch.nn.functional.cross_entropy}",
                                      "++model.loss={_target_:torch.nn.functional.cross_entropy}"])
def test_a_loss_mapping_is_given_on_the_command_line_over_a_name(override):
    cfg = to_config(compose_dict([override]))
    assert cfg.model.loss == {"_target_": "torch.nn.functional.cross_entropy"}


@dataclasses.dataclass
class Node:
    collate_fn: Optional[Dict[str, str]] = None


def test_a_plain_exception_out_of_omegaconf_is_one_line():
    """OmegaConf raising a plain AttributeError (a mapping merged over a null Optional[Dict] node)
    reaches the user as one line naming the key."""
    from omegaconf import OmegaConf

    from orchestrator.errors import config_library_error

    with pytest.raises(AttributeError) as info:
        OmegaConf.update(OmegaConf.structured(Node), "collate_fn", {"_target_": "pkg.collate"}, merge=True)
    line = config_library_error(info.value)
    assert line is not None and "\n" not in line and line.startswith("collate_fn: this override could not be applied")
    assert config_library_error(AttributeError("ours")) is None  # not out of OmegaConf: left as it is
